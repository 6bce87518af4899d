"""The dQ accumulator's last step: its fp32 rows into the gradient's dtype and layout.

The accumulator holds a (batch, query head)'s rows contiguously; the gradient is (B, H, L, E) in
the caller's strides, often a (B, L, H, E) or packed (T, H, E) layout whose rows of a head are
H * E elements apart. PyTorch's copy of such a transposed view runs its generic strided kernel
(0.099 ms for 16k tokens of 2048 dims on an H100, ~2 TB/s); this kernel reads a block of one
head's rows contiguously and writes each row's E contiguous elements. The dense Hopper backward
keeps each tile of rows in its MMA's register order instead (``hopper/dq_order.py``): a
:class:`TileOrder` tells the kernel where each element of a tile is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import Launches, cdiv

#: Rows a program converts.
BLOCK_ROWS = 64


class TileOrder(NamedTuple):
    """Tiles of ``rows`` rows (of the accumulator's width) whose elements are a bit permutation of
    their row-major order: nibble k of ``row_bits`` (``col_bits``) is the bit of the element's
    offset in its tile that bit k of its row (column) in the tile sets."""

    rows: int
    row_bits: int
    col_bits: int

    @classmethod
    def from_bases(cls, bases: list[list[int]]) -> TileOrder:
        """From the [row, col] of the element at offset 2**i, for every offset bit i."""
        row_bits = col_bits = rows = 0
        for i, (row, col) in enumerate(bases):
            if row:
                row_bits |= i << 4 * (row.bit_length() - 1)
                rows = max(rows, 2 * row)
            else:
                col_bits |= i << 4 * (col.bit_length() - 1)
        return cls(max(rows, 1), row_bits, col_bits)


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _tile_offsets(rows, cols, ROW_BITS: tl.constexpr, COL_BITS: tl.constexpr,
                  TILE_M: tl.constexpr, HEAD_ACC: tl.constexpr):
    """Offsets in their tile of the elements at [rows, cols] of it (``TileOrder``)."""
    offs = rows[:, None] * 0 + cols[None, :] * 0
    for k in tl.static_range(_log2(TILE_M)):
        offs |= ((rows[:, None] >> k) & 1) << ((ROW_BITS >> 4 * k) & 15)
    for k in tl.static_range(_log2(HEAD_ACC)):
        offs |= ((cols[None, :] >> k) & 1) << ((COL_BITS >> 4 * k) & 15)
    return offs


@triton.jit
def _convert_kernel(ACC, DQ, L, H, acc_rows, stride_b, stride_h, stride_l, stride_e,
                    E: tl.constexpr, HEAD_ACC: tl.constexpr, BLOCK: tl.constexpr,
                    TILED: tl.constexpr, ROW_BITS: tl.constexpr, COL_BITS: tl.constexpr):
    """Program (r, bh): rows [r * BLOCK, (r + 1) * BLOCK) of (batch, head) bh; TILED: one tile of
    BLOCK rows in the order ROW_BITS, COL_BITS (``TileOrder``), else row-major."""
    bh = tl.program_id(1)
    first = tl.program_id(0) * BLOCK
    tile_rows = tl.arange(0, BLOCK)
    rows = first + tile_rows
    cols = tl.arange(0, HEAD_ACC)
    inside = (rows[:, None] < L) & (cols[None, :] < E)
    if TILED:
        offs = _tile_offsets(tile_rows, cols, ROW_BITS, COL_BITS, BLOCK, HEAD_ACC)
    else:
        offs = tile_rows[:, None] * HEAD_ACC + cols[None, :]
    acc = tl.load(ACC + (bh.to(tl.int64) * acc_rows + first) * HEAD_ACC + offs, mask=inside)
    b = bh // H
    h = bh % H
    dq = (DQ + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
          + rows[:, None].to(tl.int64) * stride_l + cols[None, :] * stride_e)
    tl.store(dq, acc.to(DQ.dtype.element_ty), mask=inside)


def convert_dq(launches: Launches, dq_acc: torch.Tensor, dq: torch.Tensor,
               order: TileOrder | None = None) -> None:
    """Write fp32 ``dq_acc`` (B * H, rows >= L, D >= E, contiguous; rows a multiple of
    ``order.rows`` where its tiles are in ``order``) into (B, H, L, E) ``dq``."""
    batch, heads, seq, e = dq.shape
    if dq.numel() == 0:
        return
    block = BLOCK_ROWS if order is None else order.rows
    row_bits, col_bits = (0, 0) if order is None else order[1:]
    launches("convert", _convert_kernel, (cdiv(seq, block), batch * heads),
             (dq_acc, dq, seq, heads, dq_acc.shape[1], *dq.stride()),
             dict(E=e, HEAD_ACC=dq_acc.shape[2], BLOCK=block, TILED=order is not None,
                  ROW_BITS=row_bits, COL_BITS=col_bits))
