"""What the Hopper kernels can take, and how a tensor is read by their TMA descriptors.

Host-side and free of Gluon, so the dispatcher asks here before anything imports the kernels.
The kernels read every tensor through rank-4 TMA descriptors over (batch, heads, rows, head dim)
in its own strides, which need a contiguous last dim and 16-byte aligned strides and base: true
of contiguous tensors, of the (B, L, H, D) layout that models' transposed projections give, and
of slices of a fused q/k/v projection. A tensor they cannot read so is copied into a contiguous
one, which changes no value: the path, and so the bits, never depend on the memory layout.
"""

from __future__ import annotations

import functools

import torch

from ..shared.device import cuda_major
from .config import HEAD_DIMS

DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _gluon_missing() -> str | None:
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as error:  # a Triton without Gluon
        return f"the Hopper kernels cannot be imported ({error})"
    return None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None) -> str | None:
    """Why the Hopper kernels cannot take these inputs; None when they can."""
    if q.device.type != "cuda" or cuda_major(q.device) != 9:
        return "not an sm90 (Hopper) GPU"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the Hopper kernels take float16 and bfloat16)"
    if mask is not None:
        return "an attn_mask (the Hopper kernels take is_causal or no mask)"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} (the Hopper kernels take E = Ev in {HEAD_DIMS})"
    return _gluon_missing()


def tma_strided(t: torch.Tensor) -> bool:
    """Whether a rank-4 TMA descriptor can read (B, H, N, D) ``t`` in place: a contiguous last dim,
    the other strides (of dims longer than 1) positive and 16-byte aligned, and so the address. A
    model's (B, L, H, D) projections seen as (B, H, L, D) qualify, as do contiguous tensors; a
    broadcast (stride 0) does not."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(stride > 0 and (stride * size) % 16 == 0
                    for stride, n in zip(t.stride()[:3], t.shape[:3]) if n > 1))


def tma_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (the same values) in a fresh, aligned allocation, for a tensor
    that :func:`tma_strided` refuses: ``contiguous()`` would return a contiguous but misaligned
    view unchanged."""
    return t.clone(memory_format=torch.contiguous_format)
