"""The Inductor pass that puts ``torch.ops.dash.attention`` in place of SDPA.

Why a pre-grad pass: it sees ``scaled_dot_product_attention`` as the user wrote it, before
AOTAutograd picks a backend, so one pattern covers every device, and AOTAutograd then traces the
op's own autograd. Why also a joint-graph pass: Inductor's fuse_attention turns hand-written
attention (matmul, scale, softmax, matmul) into SDPA only later, on the joint graph, where the
pre-grad pass can no longer see it; ``_rewrite_fused_attention`` swaps those fused calls for ours.

The decision is taken at compile time: the pass fires while
``torch.are_deterministic_algorithms_enabled()`` (strict or warn-only), or always, or never, as
``dash_inductor.config.rewrite`` says. The passes' ``uuid()`` carries that decision, so the FX graph
and AOTAutograd caches never serve a graph compiled under the other decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunctionVarArgs,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

from dash_inductor import config, library
from dash_inductor.library import unsupported_reason

log = logging.getLogger("dash_inductor")

#: SDPA's parameters in order; ``torch.nn.functional`` and ``aten`` spell them the same way.
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}
_DECIDED = "dash_inductor_decided"
_CONSTANT_PARAMS = ("dropout_p", "is_causal", "scale", "enable_gqa")


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """What the pass did with one attention call site, as ``explain()`` returns it."""

    site: str  #: where the call is in the user's code ("file:line in function"), or the node name
    call: str  #: the call that was seen, e.g. "torch.nn.functional.scaled_dot_product_attention"
    rewritten: bool
    reason: str | None  #: why it was left alone; None when rewritten
    graph: str  #: "pre-grad" (user's SDPA call) or "joint" (attention fused by Inductor)


_recorders: list[list[SiteReport]] = []
_explain_disabled: list[bool] = []
_logged: set[tuple[str, str, str | None]] = set()


def rewrite_enabled() -> bool:
    """Whether the pass would rewrite now, from ``config.rewrite`` and the determinism mode."""
    mode = config.get("rewrite")
    if mode == "off":
        return False
    return mode == "always" or torch.are_deterministic_algorithms_enabled()


def _disabled_reason() -> str | None:
    """Why the pass is not rewriting right now (it still reports sites while explain() runs)."""
    if _explain_disabled and _explain_disabled[-1]:
        return "dash_inductor is disabled (dash_inductor.disable() was called)"
    if not rewrite_enabled():
        return (f"dash_inductor.config.rewrite={config.get('rewrite')!r} and deterministic "
                f"algorithms are off")
    return None


def _site_of(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    if not frames:  # fuse_attention's replacements carry no stack trace
        return f"attention fused by Inductor (node {node.name})"
    path, line, function = frames[-1]
    return f"{path}:{line} in {function}"


def _report(node: torch.fx.Node, graph: str, reason: str | None) -> None:
    """Record the decision for explain(), and log it once per (site, call, reason)."""
    functional = node.target is F.scaled_dot_product_attention
    call = "torch.nn.functional.scaled_dot_product_attention" if functional else str(node.target)
    report = SiteReport(_site_of(node), call, reason is None, reason, graph)
    for recorder in _recorders:
        recorder.append(report)
    key = (report.site, report.call, reason)
    if key in _logged:
        return
    _logged.add(key)
    if reason is None:
        log.debug("dash_inductor: %s at %s rewritten to dash.attention", report.call, report.site)
    else:
        log.info("dash_inductor: %s at %s left as it is: %s", report.call, report.site, reason)


def _bind_sdpa(node: torch.fx.Node) -> tuple[dict[str, Any] | None, str | None]:
    """SDPA's arguments by name, defaults filled in, or why they cannot be read."""
    if len(node.args) > len(SDPA_PARAMS):
        return None, f"{len(node.args)} positional arguments, SDPA takes {len(SDPA_PARAMS)}"
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args))
    unknown = sorted(set(node.kwargs) - set(SDPA_PARAMS))
    if unknown:
        return None, f"unknown keyword arguments {unknown}"
    bound.update(node.kwargs)
    if any(name not in bound for name in SDPA_PARAMS[:3]):
        return None, "query, key or value is missing"
    return bound, None


def _example(value: Any) -> Any:
    """The example (fake) value behind an FX argument, or the argument itself if constant."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


def _sdpa_reason(bound: dict[str, Any]) -> str | None:
    """Why the op cannot take this SDPA call: first what the graph shows, then the op's own rules."""
    for name in _CONSTANT_PARAMS:
        if isinstance(bound[name], torch.fx.Node):
            return f"{name} is not a constant at compile time"
    if bound["dropout_p"] != 0.0:
        return (f"dropout_p={bound['dropout_p']}: dash.attention has no dropout (SDPA applies it "
                f"whenever dropout_p > 0, in training and in eval)")
    for name in ("query", "key", "value", "attn_mask"):
        if name == "attn_mask" and bound[name] is None:
            continue
        example = _example(bound[name])
        if not isinstance(example, torch.Tensor):
            return f"{name} has no example tensor in the graph (got {type(example).__name__})"
        if example.is_nested:
            return f"{name} is a nested tensor"
    return unsupported_reason(**{name: _example(bound[name]) for name in SDPA_PARAMS})


def _fake_outputs(bound: dict[str, Any]) -> Any:
    """Run the op on the example values (fake mode), to give the new nodes their metadata."""
    examples = [_example(bound[name]) for name in ("query", "key", "value", "attn_mask")]
    fake_mode = getattr(examples[0], "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return torch.ops.dash.attention.default(
            *examples, is_causal=bound["is_causal"], scale=bound["scale"],
            enable_gqa=bound["enable_gqa"])


_pre_grad_patterns = PatternMatcherPass(pass_name="dash_inductor_sdpa")


@register_graph_pattern(
    CallFunctionVarArgs([F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention],
                        users=MULTIPLE),
    pass_dict=_pre_grad_patterns)
def _rewrite_sdpa_call(match: Match, *args: Any, **kwargs: Any) -> None:
    """Replace one SDPA call by ``dash.attention(...)[0]`` if the op can take it, else report why."""
    node = match.nodes[0]
    bound, reason = _bind_sdpa(node)
    reason = _disabled_reason() or reason
    fake = None
    if reason is None:
        try:
            reason = _sdpa_reason(bound)
            fake = None if reason else _fake_outputs(bound)
        except Exception as error:  # never break the user's compile: keep SDPA and say why
            reason = f"dash.attention rejected the example inputs: {error}"
    _report(node, "pre-grad", reason)
    if reason is not None:
        # AOTAutograd carries meta["custom"] to the fused ops this call becomes, so the joint pass
        # leaves them alone too: a user's call is decided once, here.
        node.meta.setdefault("custom", {})[_DECIDED] = reason
        return
    graph = node.graph
    with graph.inserting_before(node):
        call = graph.call_function(
            torch.ops.dash.attention.default,
            (bound["query"], bound["key"], bound["value"], bound["attn_mask"]),
            {"is_causal": bound["is_causal"], "scale": bound["scale"],
             "enable_gqa": bound["enable_gqa"]})
        out = graph.call_function(operator.getitem, (call, 0))
    for new, value in ((call, fake), (out, fake[0])):
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        new.meta["example_value"] = value
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _as_passes(hook_value: Any) -> tuple[Callable[..., Any], ...]:
    """The passes held by an Inductor hook: None, one callable, or (2.13+) a list or tuple."""
    if hook_value is None:
        return ()
    if isinstance(hook_value, (list, tuple)):
        return tuple(hook_value)
    return (hook_value,)


class ChainedPass(CustomGraphPass):
    """One Inductor hook's pass: the pass(es) the hook held before, then ours.

    Holding the user's value unchanged (a callable, or a list on torch 2.13+) and calling it from
    here works on every supported torch, whether the hook takes one callable or a list, and
    ``uninstall()`` puts back exactly that value.
    """

    def __init__(self, hook: str, rewrite: Callable[[torch.fx.Graph], int]) -> None:
        self.hook = hook
        self.rewrite = rewrite
        self.chained: Any = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in _as_passes(self.chained):
            user_pass(graph)
        if rewrite_enabled() or _recorders:
            self.rewrite(graph)

    def uuid(self) -> Any:
        """Source hash plus the current decision; None (no caching) if a chained pass has no uuid."""
        chained = []
        for user_pass in _as_passes(self.chained):
            user_uuid = user_pass.uuid() if isinstance(user_pass, CustomGraphPass) else None
            if user_uuid is None:
                return None
            chained.append(user_uuid)
        return (self.hook, _SOURCE_HASH, rewrite_enabled(), tuple(chained))

    def __reduce__(self) -> tuple[Callable[[str], ChainedPass], tuple[str, Any]]:
        """Pickle by name, with the uuid alongside: some torch versions pickle Inductor's config
        (hooks included) into cache keys or for compile workers, and the pattern tables this
        object holds (ops with C++ handles) do not pickle."""
        return _installed_pass, (self.hook, self.uuid())

    @property
    def installed(self) -> bool:
        return getattr(inductor_config, self.hook) is self

    def install(self) -> None:
        if self.installed:
            return
        self.chained = getattr(inductor_config, self.hook)
        setattr(inductor_config, self.hook, self)

    def uninstall(self) -> None:
        if self.installed:
            setattr(inductor_config, self.hook, self.chained)
            self.chained = None


_aten = torch.ops.aten
#: The fused SDPA forward ops that fuse_attention's replacement can trace to, per backend, and
#: the schema name of their attention mask. Every one returns (out, logsumexp, ...).
_FUSED_FORWARD_MASK = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    _aten._scaled_dot_product_flash_attention.default: None,
    _aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    _aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
}
_FUSED_BACKWARD = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._scaled_dot_product_cudnn_attention_backward.default,
}


def _bind_schema(node: torch.fx.Node) -> dict[str, Any]:
    """An aten node's arguments by schema name, defaults filled in."""
    bound = {}
    for index, argument in enumerate(node.target._schema.arguments):
        if index < len(node.args) and not argument.kwarg_only:
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _output(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    return next((user for user in node.users
                 if user.target is operator.getitem and user.args[1] == index), None)


def _fused_backwards(forward: torch.fx.Node) -> list[torch.fx.Node]:
    """The fused backward nodes that read this forward's outputs (through getitem)."""
    readers = {reader: None for user in forward.users for reader in user.users
               if reader.target in _FUSED_BACKWARD}
    return list(readers)


def _call(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], val: Any) -> torch.fx.Node:
    """A new call_function node with its fake value (the partitioner reads ``meta["val"]``)."""
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _joint_reason(bound: dict[str, Any], backwards: list[torch.fx.Node]) -> str | None:
    if isinstance(bound["dropout_p"], torch.fx.Node) or bound["dropout_p"] != 0.0:
        return f"dropout_p={bound['dropout_p']}: dash.attention has no dropout"
    for backward in backwards:
        mask_grad = _output(backward, 3)
        if mask_grad is not None and mask_grad.users:
            return "the fused call's attn_bias needs a gradient"
    query, key = bound["query"].meta["val"], bound["key"].meta["val"]
    if bound["is_causal"] and query.shape[-2] != key.shape[-2]:
        return "a fused causal call with L != S (its diagonal alignment is backend-specific)"
    examples = {name: _example(bound.get(name)) for name in SDPA_PARAMS if name in bound}
    return unsupported_reason(**examples)


_joint_patterns = PatternMatcherPass(pass_name="dash_inductor_fused_sdpa")


@register_graph_pattern(CallFunctionVarArgs(list(_FUSED_FORWARD_MASK), users=MULTIPLE),
                        pass_dict=_joint_patterns)
def _rewrite_fused_attention(match: Match, *args: Any, **kwargs: Any) -> None:
    """Swap one fused SDPA forward (and the backward reading it) for dash.attention's ops."""
    forward = match.nodes[0]
    bound = _bind_schema(forward)
    mask_name = _FUSED_FORWARD_MASK[forward.target]
    bound["attn_mask"] = bound.get(mask_name) if mask_name else None
    if _DECIDED in forward.meta.get("custom", {}):
        return
    backwards = _fused_backwards(forward)
    tensors = [bound["query"], bound["key"], bound["value"], bound["attn_mask"]]
    vals = [_example(t) for t in tensors]
    flags = (bool(bound["is_causal"]), bound["scale"], False)
    reason = _disabled_reason()
    if reason is None:
        try:  # decide and compute every fake value before touching the graph
            reason = _joint_reason(bound, backwards)
            if reason is None:
                with vals[0].fake_mode:
                    out_val, lse_val = torch.ops.dash.attention.default(*vals, *flags)
                    grad_vals = [torch.ops.dash.attention_backward.default(
                        _example(b.args[0]), *vals[:3], out_val, lse_val, vals[3], *flags)
                        for b in backwards]
        except Exception as error:  # never break the user's compile: keep SDPA and say why
            reason = f"dash.attention rejected the example inputs: {error}"
    _report(forward, "joint", reason)
    if reason is not None:
        return
    graph = forward.graph
    with graph.inserting_before(forward):
        call = _call(graph, torch.ops.dash.attention.default, (*tensors, *flags), (out_val, lse_val))
        out = _call(graph, operator.getitem, (call, 0), out_val)
        lse = _call(graph, operator.getitem, (call, 1), lse_val)
    for backward, grad_val in zip(backwards, grad_vals):
        with graph.inserting_before(backward):
            grads = _call(graph, torch.ops.dash.attention_backward.default,
                          (backward.args[0], *tensors[:3], out, lse, tensors[3], *flags), grad_val)
            for index in range(3):
                if (old := _output(backward, index)) is not None:
                    old.replace_all_uses_with(
                        _call(graph, operator.getitem, (grads, index), grad_val[index]))
        _erase_with_outputs(backward)
    old_out = _output(forward, 0)
    if old_out is not None:
        old_out.replace_all_uses_with(out)
    _erase_with_outputs(forward)


def _erase_with_outputs(node: torch.fx.Node) -> None:
    for user in list(node.users):
        if user.target is operator.getitem and not user.users:
            node.graph.erase_node(user)
    if not node.users:
        node.graph.erase_node(node)


#: The pass's code and the op's schema/fake kernels/acceptance rules decide the rewritten graph.
_SOURCE_HASH = get_hash_for_files((__file__, library.__file__))
PRE_GRAD_PASS = ChainedPass("pre_grad_custom_pass", _pre_grad_patterns.apply)
JOINT_PASS = ChainedPass("joint_custom_post_pass", _joint_patterns.apply)


def _installed_pass(hook: str, uuid: Any = None) -> ChainedPass:
    """The module's pass for an Inductor hook (what a pickled ``ChainedPass`` loads as)."""
    return {PRE_GRAD_PASS.hook: PRE_GRAD_PASS, JOINT_PASS.hook: JOINT_PASS}[hook]


def install() -> None:
    """Put the passes into Inductor's hooks, chaining whatever the hooks held (idempotent)."""
    PRE_GRAD_PASS.install()
    JOINT_PASS.install()


def uninstall() -> None:
    """Take the passes out, restoring exactly what the hooks held before ``install()``."""
    PRE_GRAD_PASS.uninstall()
    JOINT_PASS.uninstall()


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[SiteReport]:
    """Compile ``fn`` afresh with Inductor, call it once on the arguments, and say per site
    whether its attention was rewritten to dash.attention, and if not, why.

    The compile runs under a fresh Inductor cache and with a backend of its own, so neither the
    FX graph cache nor an earlier ``torch.compile`` of ``fn`` hides the passes. The decision is the
    one a real compile would take now (it follows the determinism mode and ``config.rewrite``).
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_inductor_cache

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs)

    with recording() as records, fresh_inductor_cache(), _installed_for_reports():
        torch.compile(fn, backend=inductor)(*args, **kwargs)
    return records


@contextlib.contextmanager
def recording() -> Iterator[list[SiteReport]]:
    """Collect the report of every attention site compiled inside the block. While a block is
    open the installed passes run even with the rewrite off, to report why they leave sites."""
    records: list[SiteReport] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


@contextlib.contextmanager
def _installed_for_reports() -> Iterator[None]:
    """While explain() runs, let a disabled pass see (never rewrite) the sites it would have."""
    missing = [p for p in (PRE_GRAD_PASS, JOINT_PASS) if not p.installed]
    for chained_pass in missing:
        chained_pass.install()
    _explain_disabled.append(bool(missing))
    try:
        yield
    finally:
        _explain_disabled.pop()
        for chained_pass in missing:
            chained_pass.uninstall()
