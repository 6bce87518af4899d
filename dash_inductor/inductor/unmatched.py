"""Attention the passes cannot take because no SDPA call reaches them: reported, never rewritten;
and a graph break in PyTorch's own modules that hid SDPA from them, removed.

- ``nn.MultiheadAttention`` stays one node, ``F.multi_head_attention_forward``, in the pre-grad
  graph; with ``need_weights=True`` it computes the weights with bmm and softmax and calls no SDPA.
  The pre-grad pass reports it (with dropout in training it takes it: ``mha.py``).
- ``F._canonical_mask`` (the masks of ``nn.TransformerEncoderLayer`` and its kin) is traced
  without the graph break its deprecation warning caused, which hid the layer's SDPA call.
- Attention written as matmul and softmax (transformers' ``attn_implementation="eager"``) that
  Inductor does not fuse into SDPA never meets either pass. The pre-grad pass tags each softmax
  inside a module named like attention; AOTAutograd carries the tag to the softmax's decomposition,
  and the joint pass reports every tag still there and not on a fused attention op.
"""

from __future__ import annotations

import inspect
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from dash_inductor.inductor.sites import _site_of, call_name, report_unfused

#: ``node.meta["custom"]`` key of a softmax inside an attention module: (site, call, reason).
UNFUSED = "dash_inductor_unfused"
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_SOFTMAX_FUNCTIONS = (F.softmax, torch.softmax, torch.special.softmax)
#: Ops that hold attention in the joint graph: a tagged softmax that became one was fused.
_ATTENTION_OPS = ("scaled_dot_product", "dash.attention")


def mha_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """An ``F.multi_head_attention_forward`` call's arguments by name, defaults filled in."""
    try:
        bound = _MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def mha_reason(node: torch.fx.Node) -> str | None:
    """Why this ``F.multi_head_attention_forward`` call has no SDPA call to take, or None when it
    has one (taken in the joint pass, or with dropout by ``mha.py``)."""
    args = mha_arguments(node)
    if args is not None and args["need_weights"] is True:
        return ("need_weights=True: nn.MultiheadAttention then computes the attention weights "
                "with bmm and softmax and calls no SDPA; pass need_weights=False to get dash")
    return None


def _module_of(node: torch.fx.Node) -> tuple[str, type | str] | None:
    """The innermost module that made the call, as (path, class)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return stack[-1] if stack else None


def _is_softmax(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "softmax"
    return node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS


def tag_softmax(graph: torch.fx.Graph) -> None:
    """Tag the softmax calls made inside a module whose class is named like attention (no SDPA
    call there, or the pre-grad pass would have seen it) with what the joint pass reports."""
    for node in graph.nodes:
        module = _module_of(node) if _is_softmax(node) else None
        if module is None:
            continue
        owner, _, name = _class_path(module[1]).rpartition(".")
        if "attention" not in name.lower():
            continue
        if owner.startswith("transformers."):
            reason = (f"{name} runs transformers' eager attention (matmul and softmax, no SDPA "
                      f"call), which Inductor did not fuse into SDPA; load the model with "
                      f"attn_implementation='sdpa' (rewritten under torch.compile) or 'dash'")
        else:
            reason = (f"{name} computes attention with matmul and softmax, no SDPA call, and "
                      f"Inductor did not fuse it into SDPA; call scaled_dot_product_attention")
        site = f"{_site_of(node, 'pre-grad')} ({module[0]})"
        node.meta.setdefault("custom", {})[UNFUSED] = (site, call_name(node.target), reason)


def _class_path(cls: Any) -> str:
    """"module.Class" of an ``nn_module_stack`` entry (a class, or its path as a string)."""
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(cls)


def report_unfused_softmax(graph: torch.fx.Graph) -> None:
    """Report each tagged softmax that the joint graph still computes as a softmax."""
    tags: dict[tuple[str, str, str], bool] = {}
    for node in graph.nodes:
        tag = (node.meta.get("custom") or {}).get(UNFUSED)
        if tag is not None:
            fused = any(name in str(node.target) for name in _ATTENTION_OPS)
            tags[tuple(tag)] = tags.get(tuple(tag), False) or fused
    for (site, call, reason), fused in tags.items():
        if not fused:
            report_unfused(site, call, reason)


def _warn_once_traced(message: str) -> None:
    """Dynamo runs this while tracing (a constant result: see below), so the warning is given
    once per compile, not per call."""
    warnings.warn(message, UserWarning)


def _canonical_mask(mask: torch.Tensor | None, mask_name: str, other_type: torch.dtype | None,
                    other_name: str, target_type: torch.dtype,
                    check_other: bool = True) -> torch.Tensor | None:
    """``F._canonical_mask`` as Dynamo traces it: the same checks and result, and its
    mismatched-mask warning given at trace time, which breaks no graph."""
    if mask is None:
        return None
    floating = torch.is_floating_point(mask)
    if mask.dtype != torch.bool and not floating:
        raise AssertionError(f"only bool and floating types of {mask_name} are supported")
    if check_other and other_type is not None and mask.dtype != other_type:
        _warn_once_traced(f"Support for mismatched {mask_name} and {other_name} is deprecated. "
                          f"Use same type for both instead.")
    if floating:
        return mask
    return torch.zeros_like(mask, dtype=target_type).masked_fill_(mask, float("-inf"))


_polyfilled: list[bool] = []


def canonical_mask_without_graph_break(_dynamo: ModuleType) -> None:
    """Have Dynamo trace ``F._canonical_mask`` through the version above (once per process, when
    Dynamo is imported: telling Dynamo imports it, which takes seconds).

    ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.MultiheadAttention``
    canonicalise their masks with it, and it warns when a padding mask and an attention mask differ
    in type (PyTorch's tutorial passes a bool padding mask and a float causal mask). Dynamo cannot
    trace ``warnings.warn``: it broke the graph there and, the rest being PyTorch's own modules, ran
    the whole layer eagerly, SDPA included, where no pass sees it. A torch whose
    ``_canonical_mask`` has another signature keeps its own (registration refuses a mismatch).
    """
    original = getattr(F, "_canonical_mask", None)
    if _polyfilled or original is None:
        return
    _polyfilled.append(True)
    torch.compiler.assume_constant_result(_warn_once_traced)
    try:
        torch.compiler.substitute_in_graph(original)(_canonical_mask)
    except (TypeError, ValueError):
        pass
