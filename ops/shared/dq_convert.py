"""The dQ accumulator's last step: its fp32 rows into the gradient's dtype and layout.

The accumulator holds a (batch, query head)'s rows contiguously; the gradient is (B, H, L, E) in
the caller's strides, often a (B, L, H, E) or packed (T, H, E) layout whose rows of a head are
H * E elements apart. PyTorch's copy of such a transposed view runs its generic strided kernel
(0.099 ms for 16k tokens of 2048 dims on an H100, ~2 TB/s); this kernel reads a block of one
head's rows contiguously and writes each row's E contiguous elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launches

#: Rows a program converts.
BLOCK_ROWS = 64


@triton.jit
def _convert_kernel(ACC, DQ, L, H, acc_rows, stride_b, stride_h, stride_l, stride_e,
                    E: tl.constexpr, HEAD_ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, bh): rows [r * BLOCK, (r + 1) * BLOCK) of (batch, head) bh."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_ACC)
    inside = (rows[:, None] < L) & (cols[None, :] < E)
    acc = tl.load(ACC + (bh.to(tl.int64) * acc_rows + rows[:, None]) * HEAD_ACC + cols[None, :],
                  mask=inside)
    b = bh // H
    h = bh % H
    dq = (DQ + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
          + rows[:, None].to(tl.int64) * stride_l + cols[None, :] * stride_e)
    tl.store(dq, acc.to(DQ.dtype.element_ty), mask=inside)


def convert_dq(launches: Launches, dq_acc: torch.Tensor, dq: torch.Tensor) -> None:
    """Write fp32 ``dq_acc`` (B * H, rows >= L, D >= E, contiguous) into (B, H, L, E) ``dq``."""
    batch, heads, seq, e = dq.shape
    if dq.numel() == 0:
        return
    launches("convert", _convert_kernel, (triton.cdiv(seq, BLOCK_ROWS), batch * heads),
             (dq_acc, dq, seq, heads, dq_acc.shape[1], *dq.stride()),
             dict(E=e, HEAD_ACC=dq_acc.shape[2], BLOCK=BLOCK_ROWS))
