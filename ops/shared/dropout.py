"""Attention dropout's keep mask: a pure function of the call's RNG state and an element's place.

One Philox4x32-10 call (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2,
3", SC 2011; Triton's ``tl.randint4x``) decides eight elements of a (B, H, L, S) problem, one
16-bit half of its outputs each. Element (b, h, q, k) (q the query row, k the key column) takes
call ``offset + ((b * H + h) * 4 * ceil(L / 16) + qc) * 8 * ceil(S / 16) + kc``, where
``qc = 4 (q // 16) + (q % 8) // 2`` and ``kc = 8 (k // 16) + k % 8``; output ``2 q3 + k3``
(bit 3 of q and of k); its low half for an even q, its high half for an odd one. The element is
kept when that half is at least ``threshold = ceil(p * 2**16)``: p rounded up to a multiple of
2**-16, so the keep rate is within 2**-16 of 1 - p. Kept values are scaled by ``1 / (1 - p)``,
as SDPA's dropout does. The key is the 64-bit ``seed``.

Why this order: the Hopper backward's S^T accumulator gives a thread q bits 0 and 3 and k bit 3
as registers, so each thread draws the calls of its own elements and no number crosses lanes;
eight elements a call is half the Philox work of one 32-bit number each. Nothing depends on the
tiling, the grid, the schedule or which program computes a tile, so the forward and every
backward kernel draw the same mask, and ``dash_inductor/library/dropout.py`` computes it bit for
bit in PyTorch. A tile's rows and columns start at multiples of 16 and span multiples of 16.

``rng`` is the call's int64 (seed, offset) tensor, loaded on the device: a launch never reads it
on the host.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Rows and columns of the square block whose calls a tile draws whole.
BLOCK = 16


class Dropout(NamedTuple):
    """A launch's dropout: the probability and the int64 (seed, offset) tensor on the device."""

    p: float
    rng: torch.Tensor


def threshold(p: float) -> int:
    """The smallest 16-bit number kept: ``ceil(p * 2**16)`` (exact: p * 2**16 is a float), at
    most 2**16 - 1 so that some element can be kept for any p < 1."""
    return min(math.ceil(p * 65536.0), 65535)


def kernel_args(dropout: Dropout | None, placeholder: torch.Tensor) -> tuple:
    """The kernels' (RNG, drop_threshold, drop_scale) arguments; the threshold an int32 for
    every p, so that its type never changes (no recompile, the plan's bound launch stays
    valid)."""
    if dropout is None:
        return placeholder, 0, 1.0
    return dropout.rng, threshold(dropout.p), 1.0 / (1.0 - dropout.p)


@triton.jit
def load_state(RNG, DROPOUT: tl.constexpr):
    """The (seed, offset) pair, or zeros without dropout (never loaded then)."""
    if DROPOUT:
        seed = tl.load(RNG)
        offset = tl.load(RNG + 1)
    else:
        seed = tl.zeros([], tl.int64)
        offset = tl.zeros([], tl.int64)
    return seed, offset


@triton.jit
def _halves(x):
    """Output ``x``'s (low, high) 16-bit halves along a new last dim: q bit 0."""
    return tl.join(x & 0xFFFF, x >> 16)


@triton.jit
def keep_t(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """The keep mask of rows [row0, row0 + BLOCK_M) against keys [col0, col0 + BLOCK_N), keys
    along dim 0: (BLOCK_N, BLOCK_M), as the backward's transposed tiles."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "a dropout tile spans 16s")
    KC: tl.constexpr = BLOCK_N // 2
    QC: tl.constexpr = BLOCK_M // 4
    q_calls = bh.to(tl.int64) * ((L + 15) // 16 * 4) + row0 // 4 + tl.arange(0, QC)
    k_calls = col0 // 2 + tl.arange(0, KC)
    counter = offset + q_calls[None, :] * ((S + 15) // 16 * 8) + k_calls.to(tl.int64)[:, None]
    x0, x1, x2, x3 = tl.randint4x(seed, counter)
    # [kc, qc, q0, k3, q3]; kc = (kh, kl), qc = (qh, qm) -> (kh, k3, kl, qh, q3, qm, q0)
    x = tl.join(tl.join(_halves(x0), _halves(x1)), tl.join(_halves(x2), _halves(x3)))
    x = tl.reshape(x, [KC // 8, 8, QC // 4, 4, 2, 2, 2])
    x = tl.reshape(tl.permute(x, (0, 5, 1, 2, 6, 3, 4)), [BLOCK_N, BLOCK_M])
    return x >= threshold.to(tl.uint32)


@triton.jit
def keep(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr):
    """:func:`keep_t` with queries along dim 0: (BLOCK_M, BLOCK_N), as the forward's tiles."""
    return tl.trans(keep_t(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M, BLOCK_N))
