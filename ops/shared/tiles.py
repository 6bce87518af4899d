"""Tile-level ``@triton.jit`` helpers shared by the forward and backward kernels.

Loads check only the bounds that can be exceeded (constexpr flags), so the hot loops over whole
tiles issue unmasked, vectorisable loads; the dot widens bf16 where the CPU interpreter needs it;
scores come out in the log2 domain with every mask applied, for the kernels that keep queries
along dim 0 (the forward and the dQ pass). ``diag`` is the key on query 0's diagonal: 0 for
``dash.attention`` (top-left), ``S - L`` for a packed sequence (bottom-right, as FlashAttention).
Packed sequences (``VARLEN`` kernels) read their bounds from the offsets with ``sequence_bounds``.
"""

import triton
import triton.language as tl

#: log2(e): scores times ``scale * LOG2E`` are in the exp2 domain the kernels' softmax runs in.
LOG2E = 1.4426950408889634
#: LOG2E as ``@triton.jit`` code reads it (a kernel cannot read a plain float global, and the
#: launchers pass ``scale * LOG2E`` as a float argument, which a constexpr would turn into one).
KERNEL_LOG2E = tl.constexpr(LOG2E)
#: ln(2): turns a log2-domain logsumexp back into the natural-log one the op returns.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def exp2_logsumexp(lse):
    """A natural-log logsumexp in the exp2 domain (times LOG2E), +inf where the row saw no key
    (-inf), so that P = exp2(S - lse2) is 0 there."""
    return tl.where(lse == float("-inf"), float("inf"), lse * KERNEL_LOG2E)


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
def load_rows(ptr, rows, cols, stride_r, stride_c, lo, hi, n_cols, CHECK_LO: tl.constexpr,
              CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """``load_tile`` of rows ``lo <= rows < hi`` when CHECK_LO (a packed sequence's rows in
    coordinates that start before its first row), else of rows below ``hi`` as ``load_tile``."""
    if CHECK_LO:
        inside = (rows[:, None] >= lo) & (rows[:, None] < hi)
        if CHECK_COLS:
            inside = inside & (cols[None, :] < n_cols)
        tile = tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=inside,
                       other=0.0)
    else:
        tile = load_tile(ptr, rows, cols, stride_r, stride_c, hi, n_cols, CHECK_ROWS, CHECK_COLS)
    return tile


@triton.jit
def sequence_bounds(CU_Q, CU_K, seq, total_q, total_k, max_q, max_k):
    """(first query row, queries, first key row, keys) of packed sequence ``seq``, int32.

    Offsets that break the contract (checked on the host for CPU tensors, flagged by the offsets
    check on CUDA) make the sequence empty, so no kernel reads or writes outside the tensors.
    """
    q0 = tl.load(CU_Q + seq).to(tl.int32)
    q1 = tl.load(CU_Q + seq + 1).to(tl.int32)
    k0 = tl.load(CU_K + seq).to(tl.int32)
    k1 = tl.load(CU_K + seq + 1).to(tl.int32)
    valid = ((q0 >= 0) & (q1 >= q0) & (q1 - q0 <= max_q) & (q1 <= total_q)
             & (k0 >= 0) & (k1 >= k0) & (k1 - k0 <= max_k) & (k1 <= total_k))
    return (tl.where(valid, q0, 0), tl.where(valid, q1 - q0, 0), tl.where(valid, k0, 0),
            tl.where(valid, k1 - k0, 0))


@triton.jit
def sequence_rows(CU_Q, CU_K, b, L, S, max_q, max_k, VARLEN: tl.constexpr):
    """(first query row, queries, first key row, keys, diagonal key of query 0) of batch entry
    ``b`` for the kernels that keep queries along dim 0 (the forward and the dQ pass): packed
    sequence ``b`` aligned bottom-right (``sequence_bounds``), or a dense entry (0, L, 0, S, 0)."""
    if VARLEN:
        q0, seq_l, k0, seq_s = sequence_bounds(CU_Q, CU_K, b, L, S, max_q, max_k)
        result = (q0, seq_l, k0, seq_s, seq_s - seq_l)
    else:
        result = (b * 0, L + b * 0, b * 0, S + b * 0, b * 0)
    return result


@triton.jit
def row_offset(b, h, row, stride_b, stride_h, stride_r):
    """Element offset of ``row`` of (batch ``b``, head ``h``) in int64 (a packed sequence's rows
    start at its first row, its batch stride being 0)."""
    return (b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
            + row.to(tl.int64) * stride_r)


@triton.jit
def diagonal_origin(seq_l, seq_s, ALIGNED: tl.constexpr):
    """(row of query 0, column of key 0) of a packed sequence in the backward's tile coordinates.

    When ALIGNED (causal or a window), queries are shifted by S - L or keys by L - S so that query
    i's diagonal key (i + S - L, bottom-right) sits on row = column: the masks and the schedules'
    tile walks and ranks are then the top-left ones of ``dash.attention``, on a square of
    max(L, S). Rows and columns before the origin are padding: never loaded or stored.
    """
    if ALIGNED:
        q_lo = tl.maximum(seq_s - seq_l, 0)
        k_lo = tl.maximum(seq_l - seq_s, 0)
    else:
        q_lo = seq_l * 0
        k_lo = seq_s * 0
    return q_lo, k_lo


@triton.jit
def crosses_edge(first, SIZE: tl.constexpr, lo, hi):
    """Whether rows (or keys) [first, first + SIZE) of a tile reach outside a packed sequence's
    [lo, hi): only such a boundary tile holds a neighbour's rows, to zero or to leave out (the
    Hopper backward's partitions, and its preprocess, which clears such a sub-tile's dQ rows)."""
    return (first < lo) | (first + SIZE > hi)


@triton.jit
def sequence_tiles(CU_Q, CU_K, seq, total_q, total_k, max_q, max_k, BLOCK_N: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """(first query row, first key row, q_lo, q_hi, k_lo, k_hi, Q tiles, KV tiles) of packed
    sequence ``seq`` in the backward's tile coordinates (``diagonal_origin``): rows [q_lo, q_hi)
    and keys [k_lo, k_hi) are real. A sequence without keys has no tiles; one without queries
    has its KV tiles and no Q tile, so that the kernels write its keys' zero gradients and the
    callers need not clear them. One definition for every kernel that walks a packed sequence's
    tiles, so that they agree."""
    q0, seq_l, k0, seq_s = sequence_bounds(CU_Q, CU_K, seq, total_q, total_k, max_q, max_k)
    q_lo, k_lo = diagonal_origin(seq_l, seq_s, ALIGNED)
    q_hi = q_lo + seq_l
    k_hi = k_lo + seq_s
    keys = (seq_s > 0).to(tl.int32)
    queries = (seq_l > 0).to(tl.int32)
    return (q0, k0, q_lo, q_hi, k_lo, k_hi, tl.cdiv(q_hi, BLOCK_N) * keys * queries,
            tl.cdiv(k_hi, BLOCK_N) * keys)


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
def masked_scores(q, k, rows, cols, L, S, diag, qk_scale, MASK, stride_mm, stride_mn,
                  MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, BOUNDS: tl.constexpr,
                  PRECISION: tl.constexpr):
    """``q k^T`` for query ``rows`` and key ``cols`` in the log2 domain, masks applied (-inf).

    ``MASK`` points at this (batch, head)'s mask; MASK_KIND 1 is boolean (True = attend), 2 is
    additive. BOUNDS masks keys at or past ``S``; CAUSAL keeps keys at or before the query's
    diagonal key (row + ``diag``).
    """
    s = mm(q, tl.trans(k), PRECISION) * qk_scale
    if MASK_KIND == 1:
        keep = tl.load(MASK + rows[:, None] * stride_mm + cols[None, :] * stride_mn,
                       mask=(rows[:, None] < L) & (cols[None, :] < S), other=0)
        s = s + tl.where(keep != 0, 0.0, float("-inf"))  # added, as SDPA: NaN stays NaN
    if MASK_KIND == 2:
        add = tl.load(MASK + rows[:, None] * stride_mm + cols[None, :] * stride_mn,
                      mask=(rows[:, None] < L) & (cols[None, :] < S), other=0.0)
        s = s + add.to(tl.float32) * KERNEL_LOG2E
    if BOUNDS:
        s = tl.where(cols[None, :] < S, s, float("-inf"))
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None] + diag, s, float("-inf"))
    return s


@triton.jit
def window_keep(rows, cols, left, right):
    """True where query ``rows`` may see key ``cols`` (broadcast) under a (left, right) window;
    a side of -1 is open."""
    return (((cols >= rows - left) | (left < 0)) & ((cols <= rows + right) | (right < 0)))


@triton.jit
def key_tile_range(start_m, S, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, win_left, win_right):
    """The keys that query rows [start_m, start_m + BLOCK_M) visit, for kernels that keep queries
    along dim 0 (the forward and the dQ pass), as (start, full_start, full_end, end): the tiles
    in [full_start, full_end) need no causal, bounds or window masking, those in [start,
    full_start) (a window's left edge) and [full_end, end) (the diagonal, S, a window's right
    edge) need them, keys outside [start, end) are never loaded. Visited in ascending order, a
    tile gives the same bits masked or not. ``end`` may be negative (rows whose diagonal lies
    before key 0 see nothing): the loops are empty then."""
    first = start_m + diag  # the first row's diagonal key
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M + diag, S)
        full_end = tl.minimum(tl.maximum(first + 1, 0) // BLOCK_N, S // BLOCK_N) * BLOCK_N
    else:
        end = S
        full_end = (S // BLOCK_N) * BLOCK_N
    start = 0
    full_start = 0
    if WINDOW:
        start, end = window_key_range(first, end, BLOCK_M, BLOCK_N, win_left, win_right)
        # Left edge: a tile is inside for every row once it starts at the last row's first key.
        left_in = tl.cdiv(tl.maximum(first + BLOCK_M - 1 - win_left, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.where(win_left >= 0, tl.maximum(left_in, start), start), end)
        # Right edge: a tile is inside for every row if it ends by the first row's last key.
        right_in = (tl.maximum(first + win_right + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = tl.where(win_right >= 0, tl.minimum(full_end, right_in), full_end)
        full_end = tl.minimum(tl.maximum(full_end, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def window_key_range(start_m, end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, left, right):
    """[first KV tile's start, end) of the keys that query rows [start_m, start_m + BLOCK_M) can
    see under the window (``start_m`` shifted by the diagonal, possibly negative), within
    [0, ``end``): the tiles outside are never loaded."""
    lo = tl.where(left >= 0, tl.maximum(start_m - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(end, start_m + BLOCK_M + right), end)
    return (lo // BLOCK_N) * BLOCK_N, hi
