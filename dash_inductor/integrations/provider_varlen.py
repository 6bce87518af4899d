"""``torch.nn.attention.varlen.varlen_attn`` through the "DASH" provider.

``varlen_attn`` calls PyTorch's custom op ``torch_attn::_varlen_attn`` (autograd:
``torch_attn::_varlen_attn_backward``), whose kernels pick FlashAttention-2
(``aten::_flash_attention_forward`` with sequence offsets) or, from torch 2.14 on some GPUs,
cuDNN. The provider overrides those two ops' kernels, not the aten flash ops, so that every
backend choice is caught, the dense fallback's ``aten::_flash_attention_forward`` stays PyTorch's,
and no fallback can re-enter an override. The ops' arguments changed between torch 2.11 and 2.14
(2.13 added ``enable_gqa``, ``seqused_k``, ``block_table``, ``num_splits``); they are bound by
name from the installed schema, and any argument dash does not know that is not at its default
sends the call to PyTorch's kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from dash_inductor.library.op import unsupported_reason

from dash_inductor.integrations import kernel_support, routes

FORWARD = "torch_attn::_varlen_attn"
BACKWARD = "torch_attn::_varlen_attn_backward"
#: What dash reads of each op's arguments; a torch whose ops lack one of them is not overridden.
_READ = {
    FORWARD: ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
              "scale", "window_size"),
    BACKWARD: ("grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q",
               "max_k", "is_causal", "scale", "window_size"),
}
#: Arguments that do not change the result: GQA is read from the head counts, split-KV is a speed
#: knob (dash is batch invariant without it), the RNG state serves dropout, which varlen lacks.
_IGNORED = frozenset({"enable_gqa", "num_splits", "rng_state"})


def unavailable_reason() -> str | None:
    """Why this torch's ``varlen_attn`` cannot be routed to dash (None: it can)."""
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError as error:
        return f"this torch has no torch.nn.attention.varlen ({error})"
    for name, read in _READ.items():
        op = kernel_support.find_op(name)
        if op is None:
            return f"this torch has no op {name}"
        missing = sorted(set(read) - {argument.name for argument in op._schema.arguments})
        if missing:
            return f"{name} of this torch has no argument(s) {missing}"
    return None


def _gqa(query: Tensor, key: Tensor) -> bool:
    return key.shape[1] != query.shape[1]


def _as_dense(t: Tensor) -> Tensor:
    """(T, H, E) packed tokens as a (1, H, T, E) view, to ask ``unsupported_reason``."""
    return t.unsqueeze(0).transpose(1, 2)


def window(values: dict[str, Any]) -> tuple[int, int]:
    """FlashAttention's (left, right) window of the call: ``is_causal`` sets right to 0."""
    left, right = values["window_size"] if values["window_size"] is not None else (-1, -1)
    return int(left), 0 if values["is_causal"] else int(right)


def reason(name: str, values: dict[str, Any], changed: set[str]) -> str | None:
    """Why dash leaves this call of ``name`` (bound by ``kernel_support.bind``) to PyTorch."""
    unknown = sorted(changed - set(_READ[name]) - _IGNORED)
    if unknown:
        return f"{', '.join(unknown)} set: not supported by dash.varlen_attention"
    query, key, value = values["query"], values["key"], values["value"]
    if any(not isinstance(t, Tensor) or t.dim() != 3 for t in (query, key, value)):
        return "query, key and value must be packed (T, H, E) tensors"
    for side in ("cu_seq_q", "cu_seq_k"):
        offsets = values[side]
        if offsets is None:
            return f"{side}=None: dash.varlen_attention needs both offset tensors"
        if offsets.dtype not in (torch.int32, torch.int64):
            return f"{side} of dtype {offsets.dtype} (dash takes int32 or int64 offsets)"
    left, right = window(values)
    if min(left, right) < -1:
        return f"window_size ({left}, {right}) has a side below -1"
    dense = unsupported_reason(_as_dense(query), _as_dense(key), _as_dense(value), None, 0.0,
                               False, values["scale"], enable_gqa=_gqa(query, key))
    if dense is not None:
        return dense
    if name == BACKWARD:
        lse = values["lse"]
        shape = (query.shape[1], query.shape[0])
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        if lse.dtype != dtype or tuple(lse.shape) != shape:
            return (f"lse of dtype {lse.dtype} and shape {tuple(lse.shape)} (dash reads "
                    f"{dtype} {shape})")
    return None


def varlen_forward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_attn::_varlen_attn``: (out (Tq, Hq, Ev), logsumexp (Hq, Tq), rng_state), with the
    arguments of the installed torch's schema."""
    values, changed = kernel_support.bind(FORWARD, args, kwargs)
    why = reason(FORWARD, values, changed)
    routes.record("provider.varlen_forward", why)
    query, key = values["query"], values["key"]
    if why is not None:
        return kernel_support.call_original(FORWARD, query.device, args, kwargs)
    out, lse = torch.ops.dash.varlen_attention(
        query, key, values["value"], values["cu_seq_q"], values["cu_seq_k"], values["max_q"],
        values["max_k"], values["scale"], list(window(values)), _gqa(query, key),
        *kernel_support.choices(query))
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    return kernel_support.like(out, query), lse, rng_state


def varlen_backward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_attn::_varlen_attn_backward``: (dq, dk, dv), with the installed torch's arguments."""
    values, changed = kernel_support.bind(BACKWARD, args, kwargs)
    why = reason(BACKWARD, values, changed)
    routes.record("provider.varlen_backward", why)
    query, key, value = values["query"], values["key"], values["value"]
    if why is not None:
        return kernel_support.call_original(BACKWARD, query.device, args, kwargs)
    grads = torch.ops.dash.varlen_attention_backward(
        values["grad_out"], query, key, value, values["out"], values["lse"], values["cu_seq_q"],
        values["cu_seq_k"], values["max_q"], values["max_k"], values["scale"],
        list(window(values)), _gqa(query, key), *kernel_support.choices(query))
    return tuple(kernel_support.like(g, t)  # type: ignore[return-value]
                 for g, t in zip(grads, (query, key, value)))


#: op -> the kernel the provider registers for it.
KERNELS = {FORWARD: varlen_forward, BACKWARD: varlen_backward}
