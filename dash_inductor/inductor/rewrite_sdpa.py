"""The pre-grad pass's patterns: each SDPA call (and ``nn.MultiheadAttention`` call) the user wrote,
replaced by ``torch.ops.dash.attention`` where the op can take it, or reported with why not.

Imported by the pass when it first runs (``passes.py``), inside a compilation: Inductor's pattern
matcher imports its lowerings, which a program that never compiles should not pay for.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import (MULTIPLE, CallFunctionVarArgs, Match,
                                             PatternMatcherPass, register_graph_pattern)

from dash_inductor import config
from dash_inductor.inductor import mha, unmatched
from dash_inductor.library.op import op_options, unsupported_reason
from dash_inductor.inductor.sites import (DECIDED, SDPA_PARAMS, disabled_reason, example_value,
                                          report_site)

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


sdpa_patterns = PatternMatcherPass(pass_name="dash_inductor_sdpa")


@register_graph_pattern(
    CallFunctionVarArgs([F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention],
                        users=MULTIPLE),
    pass_dict=sdpa_patterns)
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
                        pass_dict=sdpa_patterns)
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


def pre_grad(graph: torch.fx.Graph) -> None:
    """The pre-grad pass: rewrite or report each call, then tag softmax without SDPA."""
    sdpa_patterns.apply(graph)
    unmatched.tag_softmax(graph)
