"""dash as a PyTorch flash-attention provider ("DASH" in ``torch.nn.attention``'s registry).

PyTorch (2.11 on; feature-detected, not version-checked) lets a library register kernels for the
flash backend of ``scaled_dot_product_attention``; ``activate_flash_attention_impl("DASH")`` then
puts ours in place of PyTorch's for CUDA tensors, eager and compiled alike. Importing
dash_inductor registers the provider and never activates it (PyTorch leaves that to the user).

Overridden: ``aten::_scaled_dot_product_flash_attention`` and its backward (SDPA's flash backend),
and ``varlen_attn``'s ops (``provider_varlen``). Dropout runs dash's: its (seed, offset) travels in
the op's ``philox_seed`` output to the backward. A call dash's op cannot take (a head dim it
lacks, the debug mask) runs PyTorch's kernel of the same op, taken before overriding it
(``kernel_support``), with the reason counted and logged. The backward's schedule and kernel path
are ``dash_inductor.config``'s at the call; a non-deterministic schedule is refused under
deterministic algorithms.
"""

from __future__ import annotations

import dataclasses
import logging
from types import ModuleType

import torch
from torch import Tensor

from dash_inductor.library.op import unsupported_reason

from dash_inductor.integrations import kernel_support, provider_varlen, routes

log = logging.getLogger("dash_inductor")

NAME = "DASH"
SDPA_FORWARD = "aten::_scaled_dot_product_flash_attention"
SDPA_BACKWARD = "aten::_scaled_dot_product_flash_attention_backward"


def registry() -> ModuleType | None:
    """``torch.nn.attention`` if this PyTorch has the flash-attention provider registry (and
    ``torch.library.get_kernel``, which the fallbacks need)."""
    import torch.nn.attention as api

    needed = ("register_flash_attention_impl", "activate_flash_attention_impl",
              "current_flash_attention_impl", "restore_flash_attention_impl")
    if not all(hasattr(api, name) for name in needed) or not hasattr(torch.library, "get_kernel"):
        return None
    return api


def missing_registry_message() -> str:
    return (f"torch {torch.__version__} has no flash-attention provider registry "
            f"(torch.nn.attention.register_flash_attention_impl and torch.library.get_kernel; "
            f"torch 2.11 on has them), so dash cannot be activated as SDPA's flash backend here. "
            f"torch.compile with dash_inductor's rewrite, dash_inductor.attention and "
            f"attn_implementation='dash' still work.")


def overridden() -> tuple[str, ...]:
    """The ops whose kernels activating "DASH" replaces in this torch."""
    ops = (SDPA_FORWARD, SDPA_BACKWARD)
    if provider_varlen.unavailable_reason() is None:
        ops += tuple(provider_varlen.KERNELS)
    return ops


def _gqa(query: Tensor, key: Tensor) -> bool:
    return key.shape[1] != query.shape[1]


def forward_reason(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, is_causal: bool,
                   return_debug_mask: bool, scale: float | None) -> str | None:
    """Why the provider's forward leaves this call to PyTorch's kernel (None: dash takes it)."""
    if return_debug_mask:
        return "return_debug_mask=True asks for the attention probabilities"
    return unsupported_reason(query, key, value, None, dropout_p, is_causal, scale,
                              _gqa(query, key))


def backward_reason(query: Tensor, key: Tensor, value: Tensor, logsumexp: Tensor,
                    dropout_p: float, is_causal: bool, scale: float | None) -> str | None:
    """As ``forward_reason``. A forward left to PyTorch only for its debug mask still has a
    valid (out, logsumexp) pair: FlashAttention-2's logsumexp has dash's shape and meaning."""
    shape = (*query.shape[:3],)
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    if logsumexp.dtype != dtype or tuple(logsumexp.shape) != shape:
        return (f"logsumexp of dtype {logsumexp.dtype} and shape {tuple(logsumexp.shape)} "
                f"(dash reads {dtype} {shape})")
    return unsupported_reason(query, key, value, None, dropout_p, is_causal, scale,
                              _gqa(query, key))


def sdpa_flash_forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
                       is_causal: bool = False, return_debug_mask: bool = False, *,
                       scale: float | None = None):
    """``aten::_scaled_dot_product_flash_attention`` on (B, H, L, E) tensors."""
    reason = forward_reason(query, key, value, dropout_p, is_causal, return_debug_mask, scale)
    routes.record("provider.forward", reason)
    if return_debug_mask and dropout_p and unsupported_reason(
            query, key, value, None, dropout_p, is_causal, scale, _gqa(query, key)) is None:
        raise ValueError("dash (the active flash-attention provider): return_debug_mask=True with "
                         "dropout_p > 0 would run PyTorch's forward with its own dropout mask, "
                         "which dash's backward cannot recompute; restore PyTorch's provider for "
                         "this call")
    if reason is not None:
        return kernel_support.call_original(
            SDPA_FORWARD, query.device, (query, key, value, dropout_p, is_causal,
                                         return_debug_mask), {"scale": scale})
    rng = torch.ops.dash.dropout_rng(query) if dropout_p else None
    out, lse = torch.ops.dash.attention(query, key, value, None, dropout_p, is_causal, rng,
                                        scale=scale, enable_gqa=_gqa(query, key),
                                        **kernel_support.options(query))
    seed = (torch.zeros((2,), dtype=torch.uint64, device=query.device) if rng is None
            else rng.view(torch.uint64))
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    max_q, max_k = query.shape[2], key.shape[2]
    return kernel_support.like(out, query), lse, None, None, max_q, max_k, seed, offset, debug


def sdpa_flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                        logsumexp: Tensor, cum_seq_q: Tensor | None, cum_seq_k: Tensor | None,
                        max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                        philox_seed: Tensor, philox_offset: Tensor, *,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv)."""
    reason = backward_reason(query, key, value, logsumexp, dropout_p, is_causal, scale)
    routes.record("provider.backward", reason)
    if reason is not None:
        return kernel_support.call_original(
            SDPA_BACKWARD, query.device,
            (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
             dropout_p, is_causal, philox_seed, philox_offset), {"scale": scale})
    rng = philox_seed.view(torch.int64) if dropout_p else None  # the forward's dash state
    dq, dk, dv = torch.ops.dash.attention_backward(
        grad_out, query, key, value, out, logsumexp, None, is_causal, scale, _gqa(query, key), rng,
        dropout_p=dropout_p, **kernel_support.options(query))
    return (kernel_support.like(dq, query), kernel_support.like(dk, key),
            kernel_support.like(dv, value))


@dataclasses.dataclass
class _Handle:
    """What the registry keeps while "DASH" is active; ``remove`` restores PyTorch's kernels."""

    libraries: list[torch.library.Library]
    dispatch_key: str

    def remove(self) -> None:
        for library in self.libraries:
            library._destroy()
        self.libraries.clear()
        kernel_support.forget(self.dispatch_key)


def _register_kernels(dispatch_key: str = "CUDA") -> _Handle:
    """Override the ops at ``dispatch_key`` (the registry's call: CUDA; the CPU tests: CPU)."""
    kernels = {SDPA_FORWARD: sdpa_flash_forward, SDPA_BACKWARD: sdpa_flash_backward}
    varlen_reason = provider_varlen.unavailable_reason()
    if varlen_reason is None:
        kernels.update(provider_varlen.KERNELS)
    else:
        log.info("dash_inductor: varlen_attn stays PyTorch's under %r: %s", NAME, varlen_reason)
    handle = _Handle([], dispatch_key)
    try:
        for name, kernel in kernels.items():
            kernel_support.take_original(name, dispatch_key)
            namespace, op = name.split("::")
            library = torch.library.Library(namespace, "IMPL", dispatch_key)
            handle.libraries.append(library)
            library.impl(op, kernel, dispatch_key)
    except Exception:
        handle.remove()
        raise
    return handle


def register() -> bool:
    """Put "DASH" in PyTorch's registry (not activated). False where there is no registry."""
    api = registry()
    if api is None:
        return False
    api.register_flash_attention_impl(NAME, register_fn=_register_kernels)
    return True


def active() -> bool:
    """Whether "DASH" is PyTorch's active flash-attention implementation."""
    api = registry()
    return api is not None and api.current_flash_attention_impl() == NAME
