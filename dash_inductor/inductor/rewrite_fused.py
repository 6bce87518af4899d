"""The joint-graph pass: SDPA that Inductor itself fused, swapped for dash.attention's ops.

Inductor's fuse_attention turns hand-written attention (matmul, scale, softmax, matmul) into SDPA
only on the joint graph, where the pre-grad pass (``rewrite_sdpa.py``) can no longer see it; so
do the SDPA calls inside ops that Dynamo keeps opaque (``nn.MultiheadAttention``). This pass
replaces each fused SDPA forward, and the fused backward that reads it, by ``dash.attention`` and
``dash.attention_backward``, with the backward choices (``config.CHOICES``) in force at compile
time. Imported when the pass first runs (``passes.py``), as ``rewrite_sdpa.py`` is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._inductor.pattern_matcher import MULTIPLE, CallFunctionVarArgs, Match, PatternMatcherPass
from torch._inductor.pattern_matcher import register_graph_pattern

from dash_inductor import config
from dash_inductor.library.op import check_schedule_allowed, op_options, unsupported_reason
from dash_inductor.inductor import unmatched
from dash_inductor.inductor.sites import (DECIDED, SDPA_PARAMS, disabled_reason,
                                          example_value, report_site)


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


def _call(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], val: Any,
          kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
    """A new call_function node with its fake value (the partitioner reads ``meta["val"]``)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def _joint_reason(bound: dict[str, Any], backwards: list[torch.fx.Node]) -> str | None:
    if isinstance(bound["dropout_p"], torch.fx.Node) or bound["dropout_p"] != 0.0:
        return (f"dropout_p={bound['dropout_p']} in a fused call: left to SDPA (its forward "
                f"and backward share SDPA's RNG state)")
    for backward in backwards:
        mask_grad = _output(backward, 3)
        if mask_grad is not None and mask_grad.users:
            return "the fused call's attn_bias needs a gradient"
    query, key = bound["query"].meta["val"], bound["key"].meta["val"]
    if bound["is_causal"] and query.shape[-2] != key.shape[-2]:
        return "a fused causal call with L != S (its diagonal alignment is backend-specific)"
    examples = {name: example_value(bound.get(name)) for name in SDPA_PARAMS if name in bound}
    return unsupported_reason(**examples)


fused_patterns = PatternMatcherPass(pass_name="dash_inductor_fused_sdpa")


@register_graph_pattern(CallFunctionVarArgs(list(_FUSED_FORWARD_MASK), users=MULTIPLE),
                        pass_dict=fused_patterns)
def _rewrite_fused_attention(match: Match, *args: Any, **kwargs: Any) -> None:
    """Swap one fused SDPA forward (and the backward reading it) for dash.attention's ops."""
    forward = match.nodes[0]
    bound = _bind_schema(forward)
    mask_name = _FUSED_FORWARD_MASK[forward.target]
    bound["attn_mask"] = bound.get(mask_name) if mask_name else None
    if DECIDED in forward.meta.get("custom", {}):
        return
    backwards = _fused_backwards(forward)
    tensors = [bound["query"], bound["key"], bound["value"], bound["attn_mask"]]
    vals = [example_value(t) for t in tensors]
    choices = config.choices()
    flags = (bool(bound["is_causal"]), bound["scale"], False)
    options = op_options(choices)
    sdpa_options = dict(scale=bound["scale"], enable_gqa=False, **options)
    reason = disabled_reason()
    if reason is None:
        try:  # decide and compute every fake value before touching the graph
            reason = _joint_reason(bound, backwards)
            if reason is None:
                with vals[0].fake_mode:
                    out_val, lse_val = torch.ops.dash.attention.default(*vals, 0.0, flags[0],
                                                                        **sdpa_options)
                    grad_vals = [torch.ops.dash.attention_backward.default(
                        example_value(b.args[0]), *vals[:3], out_val, lse_val, vals[3], *flags,
                        **options) for b in backwards]
        except Exception as error:  # never break the user's compile: keep SDPA and say why
            reason = f"dash.attention rejected the example inputs: {error}"
    report_site(forward, "joint", reason, choices)
    if reason is not None:
        return
    check_schedule_allowed(choices["schedule"])
    graph = forward.graph
    with graph.inserting_before(forward):
        call = _call(graph, torch.ops.dash.attention.default, (*tensors, 0.0, flags[0]),
                     (out_val, lse_val), sdpa_options)
        out = _call(graph, operator.getitem, (call, 0), out_val)
        lse = _call(graph, operator.getitem, (call, 1), lse_val)
    for backward, grad_val in zip(backwards, grad_vals):
        with graph.inserting_before(backward):
            grads = _call(graph, torch.ops.dash.attention_backward.default,
                          (backward.args[0], *tensors[:3], out, lse, tensors[3], *flags), grad_val,
                          options)
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


def joint(graph: torch.fx.Graph) -> None:
    """The joint-graph pass: report tagged softmax Inductor did not fuse, then swap fused SDPA."""
    unmatched.report_unfused_softmax(graph)
    fused_patterns.apply(graph)
