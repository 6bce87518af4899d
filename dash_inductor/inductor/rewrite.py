"""The Inductor pass that puts ``torch.ops.dash.attention`` in place of SDPA.

Why a pre-grad pass: it sees ``scaled_dot_product_attention`` as the user wrote it, before
AOTAutograd picks a backend, so one pattern covers every device, and AOTAutograd then traces the
op's own autograd. Why also a joint-graph pass: Inductor's fuse_attention turns hand-written
attention (matmul, scale, softmax, matmul) into SDPA only later, on the joint graph, where the
pre-grad pass can no longer see it; ``rewrite_fused.py`` swaps those fused calls for ours.

The decision is taken at compile time: the pass fires while
``torch.are_deterministic_algorithms_enabled()`` (strict or warn-only), or always, or never, as
``dash_inductor.config.rewrite`` says, and the op calls it writes carry the backward choices
(``config.CHOICES``: schedule, kernel, ...) in force then. The passes' ``uuid()`` carries the
decision and those choices, so the FX graph and AOTAutograd caches never serve a graph compiled
under others.
"""

from __future__ import annotations

import contextlib
import operator
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

from dash_inductor import config
from dash_inductor.library import op as library
from dash_inductor.inductor import mha, rewrite_fused, sites, unmatched
from dash_inductor.library.op import op_options, unsupported_reason
from dash_inductor.inductor.rewrite_fused import fused_patterns
from dash_inductor.inductor.sites import (DECIDED, SDPA_PARAMS, SiteReport, disabled_reason,
                                          example_value, explain_disabled, recorders, recording,
                                          report_site, rewrite_enabled)

_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}
_CONSTANT_PARAMS = ("dropout_p", "is_causal", "scale", "enable_gqa")



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



def _sdpa_reason(bound: dict[str, Any]) -> str | None:
    """Why the op cannot take this SDPA call: first what the graph shows, then the op's own rules."""
    for name in _CONSTANT_PARAMS:
        if isinstance(bound[name], torch.fx.Node):
            return f"{name} is not a constant at compile time"
    for name in ("query", "key", "value", "attn_mask"):
        if name == "attn_mask" and bound[name] is None:
            continue
        example = example_value(bound[name])
        if not isinstance(example, torch.Tensor):
            return f"{name} has no example tensor in the graph (got {type(example).__name__})"
        if example.is_nested:
            return f"{name} is a nested tensor"
    return unsupported_reason(**{name: example_value(bound[name]) for name in SDPA_PARAMS})


def _op_args(bound: dict[str, Any], rng: Any = None) -> tuple[Any, ...]:
    """The rewritten call's positional arguments: SDPA's, in SDPA's order, then dropout's
    (seed, offset) where dropout_p > 0."""
    args = (bound["query"], bound["key"], bound["value"], bound["attn_mask"], bound["dropout_p"],
            bound["is_causal"])
    return args if rng is None else (*args, rng)


def _op_kwargs(bound: dict[str, Any], choices: dict[str, Any]) -> dict[str, Any]:
    """Its keyword-only arguments: SDPA's, then the choices baked in now."""
    return dict(scale=bound["scale"], enable_gqa=bound["enable_gqa"], **op_options(choices))


def _fake_outputs(bound: dict[str, Any], choices: dict[str, Any]) -> tuple[Any, Any]:
    """Run the ops on the example values (fake mode), to give the new nodes their metadata:
    (dropout's state or None, the op's outputs)."""
    examples = [example_value(arg) for arg in _op_args(bound)]
    fake_mode = getattr(examples[0], "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        rng = torch.ops.dash.dropout_rng.default(examples[0]) if bound["dropout_p"] else None
        return rng, torch.ops.dash.attention.default(*examples, rng, **_op_kwargs(bound, choices))


_pre_grad_patterns = PatternMatcherPass(pass_name="dash_inductor_sdpa")


@register_graph_pattern(
    CallFunctionVarArgs([F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention],
                        users=MULTIPLE),
    pass_dict=_pre_grad_patterns)
def _rewrite_sdpa_call(match: Match, *args: Any, **kwargs: Any) -> None:
    """Replace one SDPA call by ``dash.attention(...)[0]`` if the op can take it, else report why."""
    node = match.nodes[0]
    bound, reason = _bind_sdpa(node)
    reason = disabled_reason() or reason
    choices = config.choices()
    fake = None
    if reason is None:
        try:
            reason = _sdpa_reason(bound)
            fake = None if reason else _fake_outputs(bound, choices)
        except Exception as error:  # never break the user's compile: keep SDPA and say why
            reason = f"dash.attention rejected the example inputs: {error}"
    report_site(node, "pre-grad", reason, choices)
    if reason is not None:
        # AOTAutograd carries meta["custom"] to the fused ops this call becomes, so the joint pass
        # leaves them alone too: a user's call is decided once, here.
        node.meta.setdefault("custom", {})[DECIDED] = reason
        return
    graph = node.graph
    fake_rng, fake = fake
    with graph.inserting_before(node):
        rng = None  # dropout's (seed, offset): drawn per call, in program order
        if fake_rng is not None:
            rng = graph.call_function(torch.ops.dash.dropout_rng.default, (bound["query"],))
        call = graph.call_function(
            torch.ops.dash.attention.default, _op_args(bound, rng), _op_kwargs(bound, choices))
        out = graph.call_function(operator.getitem, (call, 0))
    for new, value in ((rng, fake_rng), (call, fake), (out, fake[0])):
        if new is None:
            continue
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        new.meta["example_value"] = value
    node.replace_all_uses_with(out)
    graph.erase_node(node)


@register_graph_pattern(CallFunctionVarArgs(F.multi_head_attention_forward, users=MULTIPLE),
                        pass_dict=_pre_grad_patterns)
def _mha_call(match: Match, *args: Any, **kwargs: Any) -> None:
    """An ``nn.MultiheadAttention`` call: with dropout in training, point it at ``mha.py``'s
    version, whose SDPA call dash makes; without, its fused SDPA reaches the joint pass; with
    no SDPA call at all, report why."""
    node = match.nodes[0]
    reason = unmatched.mha_reason(node)
    if reason is None and not mha.drops(node):
        return
    choices = config.choices()
    reason = reason or disabled_reason()
    report_site(node, "pre-grad", reason, choices)
    if reason is None:
        node.target = mha.multi_head_attention_forward
    else:
        node.meta.setdefault("custom", {})[DECIDED] = reason


def _pre_grad(graph: torch.fx.Graph) -> None:
    _pre_grad_patterns.apply(graph)
    unmatched.tag_softmax(graph)


def _joint(graph: torch.fx.Graph) -> None:
    unmatched.report_unfused_softmax(graph)
    fused_patterns.apply(graph)


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

    def __init__(self, hook: str, rewrite: Callable[[torch.fx.Graph], Any]) -> None:
        self.hook = hook
        self.rewrite = rewrite
        self.chained: Any = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in _as_passes(self.chained):
            user_pass(graph)
        if rewrite_enabled() or recorders:
            self.rewrite(graph)

    def uuid(self) -> Any:
        """Source hash, the current decision and the choices the pass bakes into the op calls;
        None (no caching) if a chained pass has no uuid."""
        chained = []
        for user_pass in _as_passes(self.chained):
            user_uuid = user_pass.uuid() if isinstance(user_pass, CustomGraphPass) else None
            if user_uuid is None:
                return None
            chained.append(user_uuid)
        return (self.hook, _SOURCE_HASH, rewrite_enabled(), tuple(config.choices().items()),
                tuple(chained))

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


#: The pass's code and the op's schema/fake kernels/acceptance rules decide the rewritten graph.
_SOURCE_HASH = get_hash_for_files(
    (__file__, sites.__file__, rewrite_fused.__file__, unmatched.__file__, library.__file__))
PRE_GRAD_PASS = ChainedPass("pre_grad_custom_pass", _pre_grad)
JOINT_PASS = ChainedPass("joint_custom_post_pass", _joint)


def _installed_pass(hook: str, uuid: Any = None) -> ChainedPass:
    """The module's pass for an Inductor hook (what a pickled ``ChainedPass`` loads as)."""
    return {PRE_GRAD_PASS.hook: PRE_GRAD_PASS, JOINT_PASS.hook: JOINT_PASS}[hook]


def install() -> None:
    """Put the passes into Inductor's hooks, chaining whatever the hooks held (idempotent), and
    have Dynamo trace nn.Transformer's mask canonicalisation without a graph break (for good)."""
    PRE_GRAD_PASS.install()
    JOINT_PASS.install()
    unmatched.canonical_mask_without_graph_break()


def uninstall() -> None:
    """Take the passes out, restoring exactly what the hooks held before ``install()``."""
    PRE_GRAD_PASS.uninstall()
    JOINT_PASS.uninstall()


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[SiteReport]:
    """Compile ``fn`` afresh with Inductor, call it once on the arguments, and say per site
    whether its attention was rewritten to dash.attention, and if not, why.

    The compile runs under a fresh Inductor cache and with a backend of its own, so neither the
    FX graph cache nor an earlier ``torch.compile`` of ``fn`` hides the passes; it runs Inductor's
    graph passes but not its code generation (the call runs the graph Dynamo captured). The
    decision is the one a real compile would take now (it follows the determinism mode and
    ``config.rewrite``).
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_inductor_cache

    def unused(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        return make_boxed_func(gm.forward)

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Inductor's graph passes, ours among them, run while compile_fx traces; its code
        # generation, the costliest part and one that decides nothing reported here, is skipped,
        # and the call runs the graph Dynamo captured.
        compile_fx(gm, example_inputs, inner_compile=unused)
        return gm.forward

    with recording() as records, fresh_inductor_cache(), _installed_for_reports():
        torch.compile(fn, backend=inductor)(*args, **kwargs)
    return records


@contextlib.contextmanager
def _installed_for_reports() -> Iterator[None]:
    """While explain() runs, let a disabled pass see (never rewrite) the sites it would have."""
    missing = [p for p in (PRE_GRAD_PASS, JOINT_PASS) if not p.installed]
    for chained_pass in missing:
        chained_pass.install()
    explain_disabled.append(bool(missing))
    try:
        yield
    finally:
        explain_disabled.pop()
        for chained_pass in missing:
            chained_pass.uninstall()
