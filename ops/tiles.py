"""Tile-level ``@triton.jit`` helpers shared by the forward and backward kernels.

Loads check only the bounds that can be exceeded (constexpr flags), so the hot loops over whole
tiles issue unmasked, vectorisable loads; the dot widens bf16 where the CPU interpreter needs it;
scores come out in the log2 domain with every mask applied, for the kernels that keep queries
along dim 0 (the forward and the dQ pass).
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load ``ptr[rows, cols]`` (zeros outside ``n_rows`` x ``n_cols`` where checked)."""
    ptrs = ptr + rows[:, None] * stride_r + cols[None, :] * stride_c
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation at the precision chosen by ``dot_precision``.

    "widen_bf16": the CPU interpreter multiplies bf16 tiles as their raw 16-bit integers (Triton
    3.9), so there the operands are widened to fp32 first (products of bf16 values are exact).
    """
    if PRECISION == "widen_bf16":
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b, input_precision=PRECISION)
    return product


@triton.jit
def masked_scores(q, k, rows, cols, L, S, qk_scale, MASK, stride_mm, stride_mn,
                  MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, BOUNDS: tl.constexpr,
                  PRECISION: tl.constexpr):
    """``q k^T`` for query ``rows`` and key ``cols`` in the log2 domain, masks applied (-inf).

    ``MASK`` points at this (batch, head)'s mask; MASK_KIND 1 is boolean (True = attend), 2 is
    additive. BOUNDS masks keys at or past ``S``; CAUSAL keeps keys at or before the query.
    """
    s = mm(q, tl.trans(k), PRECISION) * qk_scale
    if MASK_KIND == 1:
        keep = tl.load(MASK + rows[:, None] * stride_mm + cols[None, :] * stride_mn,
                       mask=(rows[:, None] < L) & (cols[None, :] < S), other=0)
        s = s + tl.where(keep != 0, 0.0, float("-inf"))  # added, as SDPA: NaN stays NaN
    if MASK_KIND == 2:
        add = tl.load(MASK + rows[:, None] * stride_mm + cols[None, :] * stride_mn,
                      mask=(rows[:, None] < L) & (cols[None, :] < S), other=0.0)
        s = s + add.to(tl.float32) * 1.4426950408889634
    if BOUNDS:
        s = tl.where(cols[None, :] < S, s, float("-inf"))
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    return s


@triton.jit
def window_keep(rows, cols, left, right):
    """True where query ``rows`` may see key ``cols`` (broadcast) under a (left, right) window;
    a side of -1 is open."""
    return (((cols >= rows - left) | (left < 0)) & ((cols <= rows + right) | (right < 0)))


@triton.jit
def key_tile_range(start_m, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, win_left, win_right):
    """The keys that query rows [start_m, start_m + BLOCK_M) visit, for kernels that keep queries
    along dim 0 (the forward and the dQ pass): tiles in [start, full_end) need no causal, bounds or
    window masking, tiles in [full_end, end) need them; keys past ``end`` are never loaded."""
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M, S)
        full_end = tl.minimum((start_m + 1) // BLOCK_N, S // BLOCK_N) * BLOCK_N
    else:
        end = S
        full_end = (S // BLOCK_N) * BLOCK_N
    start = 0
    if WINDOW:  # every visited tile is masked, in the second loop
        start, end = window_key_range(start_m, end, BLOCK_M, BLOCK_N, win_left, win_right)
        full_end = start
    return start, full_end, end


@triton.jit
def window_key_range(start_m, end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, left, right):
    """[first KV tile's start, end) of the keys that query rows [start_m, start_m + BLOCK_M) can
    see under the window, within [0, ``end``): the tiles outside are never loaded."""
    lo = tl.where(left >= 0, tl.maximum(start_m - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(end, start_m + BLOCK_M + right), end)
    return (lo // BLOCK_N) * BLOCK_N, hi
