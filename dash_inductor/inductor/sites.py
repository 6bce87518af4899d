"""What the rewrite passes decided per attention site: the reports, their logging, and when the
passes are allowed to rewrite at all. Shared by the pre-grad pass (``rewrite.py``) and the
joint-graph pass (``rewrite_fused.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import types
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from dash_inductor import config

log = logging.getLogger("dash_inductor")

#: SDPA's parameters in order; ``torch.nn.functional`` and ``aten`` spell them the same way.
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: ``node.meta["custom"]`` key marking a user's SDPA call the pre-grad pass left alone, so that the
#: joint pass leaves the fused ops it becomes alone too.
DECIDED = "dash_inductor_decided"


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """What the pass did with one attention call site, as ``explain()`` returns it."""

    site: str  #: where the call is in the user's code ("file:line in function"), or the node name
    #: the call that was seen, e.g. "torch.nn.functional.scaled_dot_product_attention",
    #: "torch.nn.functional.multi_head_attention_forward", or the softmax of attention without SDPA
    call: str
    rewritten: bool
    reason: str | None  #: why it was left alone; None when rewritten
    #: "pre-grad" (the user's SDPA or nn.MultiheadAttention call) or "joint" (attention fused by
    #: Inductor, or attention that reached the joint graph with no SDPA call)
    graph: str
    #: the backward schedule baked into the rewritten call ("auto": the launcher's rule); None if
    #: not rewritten. What actually ran is in ``dash_inductor.library.op.last_plans()``.
    schedule: str | None = None
    kernel: str | None = None  #: the kernel path baked into the rewritten call; None if not rewritten


#: The lists that open recording() blocks collect reports into.
recorders: list[list[SiteReport]] = []
#: One entry per running explain(): True when it installed passes that dash_inductor.disable() had
#: taken out (they may then report sites but never rewrite).
explain_disabled: list[bool] = []
_logged: set[tuple[str, str, str | None, str | None, str | None]] = set()


def rewrite_enabled() -> bool:
    """Whether the pass would rewrite now, from ``config.rewrite`` and the determinism mode."""
    mode = config.get("rewrite")
    if mode == "off":
        return False
    return mode == "always" or torch.are_deterministic_algorithms_enabled()


def disabled_reason() -> str | None:
    """Why the pass is not rewriting right now (it still reports sites while explain() runs)."""
    if explain_disabled and explain_disabled[-1]:
        return "dash_inductor is disabled (dash_inductor.disable() was called)"
    if not rewrite_enabled():
        mode = config.get("rewrite")
        if mode == "off":
            return "dash_inductor.config.rewrite='off'"
        return f"dash_inductor.config.rewrite={mode!r} and deterministic algorithms are off"
    return None


#: What the rewrite buys and costs on a CPU, said once (docs/rewrite.md has the measurement).
CPU_NOTE = ("on the CPU, dash.attention runs its PyTorch reference: reproducible run to run, and "
            "about 1.5x the time of PyTorch's own CPU attention, which is reproducible there "
            "too; dash_inductor.config.rewrite = 'off' keeps SDPA")
_cpu_noted: list[bool] = []


def note_device(device: torch.device) -> None:
    """Say once, at INFO, what rewriting a CPU site costs."""
    if device.type == "cpu" and not _cpu_noted:
        _cpu_noted.append(True)
        log.info("dash_inductor: %s", CPU_NOTE)


def _site_of(node: torch.fx.Node, graph: str) -> str:
    """"file:line in function" from the node's stack trace; without one, the module that made the
    call (``nn_module_stack``) and the node, labelled by what the node is."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    if frames:
        path, line, function = frames[-1]
        return f"{path}:{line} in {function}"
    modules = list((node.meta.get("nn_module_stack") or {}).values())
    where = (f"in {modules[-1][0]} ({getattr(modules[-1][1], '__name__', modules[-1][1])})"
             if modules else "no source location in the graph")
    if graph == "joint":  # fuse_attention's replacements carry no stack trace
        return f"attention fused by Inductor (node {node.name}, {where})"
    return f"node {node.name}, {where}"


def call_name(target: Any) -> str:
    """How a report names a call: functions by their public path (SDPA's is a builtin of
    ``torch._C._nn``), a method by its name, ops as they print."""
    if target is F.scaled_dot_product_attention:
        return "torch.nn.functional.scaled_dot_product_attention"
    if isinstance(target, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{target.__module__ or 'torch'}.{target.__name__}"
    return str(target)


def report_site(node: torch.fx.Node, graph: str, reason: str | None,
                choices: dict[str, Any] | None = None) -> None:
    """Record the decision for explain(), and log it once per (site, call, reason, schedule,
    kernel). ``choices`` are the op arguments baked into a rewritten call."""
    baked = choices if reason is None and choices else {}
    query = example_value(node.args[0] if node.args else node.kwargs.get("query"))
    if reason is None and isinstance(query, torch.Tensor):
        note_device(query.device)
    _record(SiteReport(_site_of(node, graph), call_name(node.target), reason is None, reason,
                       graph, baked.get("schedule"), baked.get("kernel")))


def report_unfused(site: str, call: str, reason: str) -> None:
    """Record attention that reached the joint graph without any SDPA call (never rewritten)."""
    _record(SiteReport(site, call, False, reason, "joint"))


def _record(report: SiteReport) -> None:
    for recorder in recorders:
        recorder.append(report)
    key = (report.site, report.call, report.reason, report.schedule, report.kernel)
    if key in _logged:
        return
    _logged.add(key)
    if report.rewritten:
        log.debug("dash_inductor: %s at %s rewritten to dash.attention (schedule %r, kernel %r)",
                  report.call, report.site, report.schedule, report.kernel)
    else:
        log.info("dash_inductor: %s at %s left as it is: %s", report.call, report.site,
                 report.reason)


def example_value(value: Any) -> Any:
    """The example (fake) value behind an FX argument, or the argument itself if constant."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


@contextlib.contextmanager
def recording() -> Iterator[list[SiteReport]]:
    """Collect the report of every attention site compiled inside the block. While a block is
    open the installed passes run even with the rewrite off, to report why they leave sites."""
    records: list[SiteReport] = []
    recorders.append(records)
    try:
        yield records
    finally:
        recorders.remove(records)
