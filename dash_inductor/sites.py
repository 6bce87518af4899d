"""What the rewrite passes decided per attention site: the reports, their logging, and when the
passes are allowed to rewrite at all. Shared by the pre-grad pass (``rewrite.py``) and the
joint-graph pass (``rewrite_fused.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
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
    call: str  #: the call that was seen, e.g. "torch.nn.functional.scaled_dot_product_attention"
    rewritten: bool
    reason: str | None  #: why it was left alone; None when rewritten
    graph: str  #: "pre-grad" (user's SDPA call) or "joint" (attention fused by Inductor)
    #: the backward schedule baked into the rewritten call ("auto": the launcher's rule); None if
    #: not rewritten. What actually ran is in ``dash_inductor.library.last_plans()``.
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


def _site_of(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    if not frames:  # fuse_attention's replacements carry no stack trace
        return f"attention fused by Inductor (node {node.name})"
    path, line, function = frames[-1]
    return f"{path}:{line} in {function}"


def report_site(node: torch.fx.Node, graph: str, reason: str | None,
                choices: dict[str, Any] | None = None) -> None:
    """Record the decision for explain(), and log it once per (site, call, reason, schedule,
    kernel). ``choices`` are the op arguments baked into a rewritten call."""
    functional = node.target is F.scaled_dot_product_attention
    call = "torch.nn.functional.scaled_dot_product_attention" if functional else str(node.target)
    baked = choices if reason is None and choices else {}
    report = SiteReport(_site_of(node), call, reason is None, reason, graph,
                        baked.get("schedule"), baked.get("kernel"))
    for recorder in recorders:
        recorder.append(report)
    key = (report.site, report.call, reason, report.schedule, report.kernel)
    if key in _logged:
        return
    _logged.add(key)
    if reason is None:
        log.debug("dash_inductor: %s at %s rewritten to dash.attention (schedule %r, kernel %r)",
                  report.call, report.site, report.schedule, report.kernel)
    else:
        log.info("dash_inductor: %s at %s left as it is: %s", report.call, report.site, reason)


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
