"""dash as a PyTorch flash-attention provider ("DASH" in ``torch.nn.attention``'s registry).

PyTorch (2.13 has it; feature-detected, not version-checked) lets a library register kernels for
the flash backend of ``scaled_dot_product_attention``; ``activate_flash_attention_impl("DASH")``
then puts ours in place of FlashAttention-2's for CUDA tensors, eager and compiled alike. Importing
dash_inductor registers the provider and never activates it (PyTorch leaves that to the user).

Overridden: ``aten::_scaled_dot_product_flash_attention`` and its backward. A call dash's op cannot
take (dropout, a head dim it lacks, the debug mask) goes to PyTorch's FlashAttention-2 through
``aten::_flash_attention_forward`` / ``_backward``, which is what the native kernels call and
which we leave alone until dash has variable-length attention. The backward schedule is
``dash_inductor.config.schedule``; its default is deterministic and also dash's fastest.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
from torch import Tensor

from dash_inductor.library import unsupported_reason

from . import routes

NAME = "DASH"
#: aten ops whose CUDA kernels the provider replaces.
OVERRIDDEN = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")


def registry() -> ModuleType | None:
    """``torch.nn.attention`` if this PyTorch has the flash-attention provider registry."""
    import torch.nn.attention as api

    needed = ("register_flash_attention_impl", "activate_flash_attention_impl",
              "current_flash_attention_impl", "restore_flash_attention_impl")
    return api if all(hasattr(api, name) for name in needed) else None


def missing_registry_message() -> str:
    return (f"torch {torch.__version__} has no flash-attention provider registry "
            f"(torch.nn.attention.register_flash_attention_impl; torch 2.13 has it), so dash "
            f"cannot be activated as SDPA's flash backend here. torch.compile with "
            f"dash_inductor's rewrite, dash_inductor.attention and attn_implementation='dash' "
            f"still work.")


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


def _like(result: Tensor, like: Tensor) -> Tensor:
    """``result`` with the strides of ``torch.empty_like(like)``, which the meta kernels promise."""
    target = torch.empty_like(like)
    if target.stride() == result.stride():
        return result
    return target.copy_(result)


def sdpa_flash_forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
                       is_causal: bool = False, return_debug_mask: bool = False, *,
                       scale: float | None = None):
    """``aten::_scaled_dot_product_flash_attention`` on (B, H, L, E) tensors."""
    reason = forward_reason(query, key, value, dropout_p, is_causal, return_debug_mask, scale)
    routes.record("provider.forward", reason)
    max_q, max_k = query.shape[2], key.shape[2]
    if reason is not None:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out, lse, seed, offset, debug = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, max_q, max_k, dropout_p, is_causal, return_debug_mask,
            scale=scale)
        return out.transpose(1, 2), lse, None, None, max_q, max_k, seed, offset, debug
    out, lse = torch.ops.dash.attention(query, key, value, is_causal=is_causal, scale=scale,
                                        enable_gqa=_gqa(query, key))
    seed = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return _like(out, query), lse, None, None, max_q, max_k, seed, offset, debug


def sdpa_flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                        logsumexp: Tensor, cum_seq_q: Tensor | None, cum_seq_k: Tensor | None,
                        max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                        philox_seed: Tensor, philox_offset: Tensor, *,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv)."""
    reason = backward_reason(query, key, value, logsumexp, dropout_p, is_causal, scale)
    routes.record("provider.backward", reason)
    if reason is not None:
        go, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
        grads = torch.ops.aten._flash_attention_backward(
            go, q, k, v, o, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            philox_seed, philox_offset, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)  # type: ignore[return-value]
    dq, dk, dv = torch.ops.dash.attention_backward(
        grad_out=grad_out, q=query, k=key, v=value, out=out, logsumexp=logsumexp, attn_mask=None,
        is_causal=is_causal, scale=scale, enable_gqa=_gqa(query, key))
    return _like(dq, query), _like(dk, key), _like(dv, value)


@dataclasses.dataclass
class _Handle:
    """What the registry keeps while "DASH" is active; ``remove`` restores PyTorch's kernels."""

    library: torch.library.Library | None

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _register_kernels() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")
    library.impl(OVERRIDDEN[0], sdpa_flash_forward, "CUDA")
    library.impl(OVERRIDDEN[1], sdpa_flash_backward, "CUDA")
    return _Handle(library)


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
