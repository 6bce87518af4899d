"""Attention dropout's keep mask: a pure function of the call's RNG state and an element's place.

Element (b, h, row, col) of a (B, H, L, S) problem is kept when its 32-bit Philox4x32-10 number
(Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Triton's
``tl.randint4x``) is at least ``threshold = ceil(p * 2**32)``, i.e. when the uniform ``x / 2**32``
is >= p. One Philox call gives four numbers, to four consecutive rows: the counter is
``offset + ((b * H + h) * ceil(L / 4) + row // 4) * S + col``, the number is output ``row % 4``,
and the key is the 64-bit ``seed``. Nothing in it depends on the tiling, the grid, the schedule
or which program computes a tile, so the forward and every backward kernel draw the same mask,
and ``dash_inductor/library/dropout.py`` computes it bit for bit in PyTorch.

``rng`` is the call's int64 (seed, offset) tensor, loaded on the device: a launch never reads it
on the host. Kept values are scaled by ``1 / (1 - p)``, as SDPA's dropout does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Rows that share one Philox call (its four outputs).
ROWS_PER_CALL = 4


class Dropout(NamedTuple):
    """A launch's dropout: the probability and the int64 (seed, offset) tensor on the device."""

    p: float
    rng: torch.Tensor


def threshold(p: float) -> int:
    """The smallest 32-bit number kept: ``ceil(p * 2**32)`` (exact: p * 2**32 is a float), at
    most 2**32 - 1 so that it fits the kernels' uint32 compare."""
    return min(math.ceil(p * 4294967296.0), 4294967295)


def kernel_args(dropout: Dropout | None, placeholder: torch.Tensor) -> tuple:
    """The kernels' (RNG, drop_threshold, drop_scale) arguments: the threshold as the int32 with
    its bits, so that its type never changes with p (no recompile, and the plan's bound launch
    stays valid)."""
    if dropout is None:
        return placeholder, 0, 1.0
    bits = threshold(dropout.p)
    return dropout.rng, bits - (1 << 32) if bits >= 1 << 31 else bits, 1.0 / (1.0 - dropout.p)


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
def keep_t(seed, offset, threshold, bh, row0, cols, L, S, BLOCK_M: tl.constexpr):
    """The keep mask of rows ``row0 .. row0 + BLOCK_M`` (``row0`` a multiple of 4) against keys
    ``cols``, keys along dim 0: (len(cols), BLOCK_M), as the backward's transposed tiles."""
    GROUPS: tl.constexpr = BLOCK_M // 4
    groups = row0 // 4 + tl.arange(0, GROUPS)
    calls = bh.to(tl.int64) * ((L + 3) // 4) + groups.to(tl.int64)
    counter = offset + calls[None, :] * S + cols.to(tl.int64)[:, None]
    x0, x1, x2, x3 = tl.randint4x(seed, counter)
    # join(join(x0, x2), join(x1, x3))[..., j, k] is output 2j + k: row % 4 once flattened.
    x = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [cols.shape[0], BLOCK_M])
    return x >= threshold.to(tl.uint32, bitcast=True)


@triton.jit
def keep(seed, offset, threshold, bh, row0, cols, L, S, BLOCK_M: tl.constexpr):
    """:func:`keep_t` with queries along dim 0: (BLOCK_M, len(cols)), as the forward's tiles."""
    return tl.trans(keep_t(seed, offset, threshold, bh, row0, cols, L, S, BLOCK_M))
