"""The ``recompute`` schedule's dQ kernel: one program per Q tile sums dS K over its KV tiles in
ascending order, with no waits (the main kernel of ``ops/portable/backward.py`` then skips dQ). Also the
per-row statistics both backward kernels load. A sliding window limits each Q tile to the KV tiles
its rows see; the tiles outside are never loaded. With DROPOUT, dP is dropped with the forward's
keep mask (``dropout.py``) and scaled by ``1 / (1 - p)``, as in the main kernel. With VARLEN the
batch is virtual, as in the forward (``ops/portable/forward.py``): a program reads its sequence's
bounds and exits past its length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import head_dim_bucket
from .dropout import Dropout, kernel_args, keep, load_state
from .launch import Launches, cdiv, dot_precision, mask_kind
from .tiles import (LOG2E, exp2_logsumexp, key_tile_range, load_tile, masked_scores, mm,
                    row_offset, sequence_rows, window_keep)


@triton.jit
def load_row_stats(LSE, DELTA, row_base, rows, lo, hi, CHECK_LO: tl.constexpr,
                   CHECK_ROWS: tl.constexpr):
    """Log2-domain logsumexp (+inf where a row sees no key, so its probabilities are 0) and delta
    of ``rows`` (outside [``lo``, ``hi``) where checked: +inf and 0)."""
    if CHECK_LO:
        inside = (rows >= lo) & (rows < hi)
        lse = tl.load(LSE + row_base + rows, mask=inside, other=float("-inf"))
        delta = tl.load(DELTA + row_base + rows, mask=inside, other=0.0)
    elif CHECK_ROWS:
        lse = tl.load(LSE + row_base + rows, mask=rows < hi, other=float("-inf"))
        delta = tl.load(DELTA + row_base + rows, mask=rows < hi, other=0.0)
    else:
        lse = tl.load(LSE + row_base + rows)
        delta = tl.load(DELTA + row_base + rows)
    return exp2_logsumexp(lse), delta


@triton.jit
def _dq_tile_step(dq, q, do, lse2, delta, K, V, MASK, rows, col0, offs_n, L, S, diag, qk_scale,
                  stride_kn, stride_ke, stride_vn, stride_ve, stride_mm, stride_mn,
                  win_left, win_right, drop,
                  E: tl.constexpr, EV: tl.constexpr, HEAD_E: tl.constexpr, HEAD_EV: tl.constexpr,
                  CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr,
                  WINDOW: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """Add one KV tile's dS K to a dQ tile (recompute schedule).

    Queries stay along dim 0 throughout, so dS feeds the last dot straight from registers; the
    transposed orientation of the main kernel would cost a shared-memory round trip per tile.
    """
    cols = col0 + offs_n
    k = load_tile(K, cols, tl.arange(0, HEAD_E), stride_kn, stride_ke, S, E, BOUNDS, E != HEAD_E)
    v = load_tile(V, cols, tl.arange(0, HEAD_EV), stride_vn, stride_ve, S, EV, BOUNDS, EV != HEAD_EV)
    s = masked_scores(q, k, rows, cols, L, S, diag, qk_scale, MASK, stride_mm, stride_mn,
                      MASK_KIND, CAUSAL, BOUNDS, PRECISION)
    if WINDOW:
        s = tl.where(window_keep(rows[:, None] + diag, cols[None, :], win_left, win_right), s,
                     float("-inf"))
    p = tl.math.exp2(s - lse2[:, None])
    dp = mm(do, tl.trans(v), PRECISION)
    if DROPOUT:
        seed, offset, threshold, bh, row0, drop_scale = drop
        dp = tl.where(keep(seed, offset, threshold, bh, row0, col0, L, S, rows.shape[0],
                           cols.shape[0]),
                      dp * drop_scale, 0.0)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    return dq + mm(ds, k, PRECISION)


@triton.jit(do_not_specialize=["drop_threshold"])
def _backward_dq_kernel(
        Q, K, V, DO, LSE, DELTA, MASK, DQ, CU_Q, CU_K, RNG,
        stride_qb, stride_qh, stride_qm, stride_qe,
        stride_kb, stride_kh, stride_kn, stride_ke,
        stride_vb, stride_vh, stride_vn, stride_ve,
        stride_db, stride_dh, stride_dm, stride_de,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_dqb, stride_dqh, stride_dqm, stride_dqe,
        stride_lb, stride_lh,
        HQ, L, S, max_q, max_k, qk_scale, sm_scale, win_left, win_right, drop_threshold,
        drop_scale, GROUP: tl.constexpr, E: tl.constexpr, EV: tl.constexpr,
        HEAD_E: tl.constexpr, HEAD_EV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        EVEN_M: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, WINDOW: tl.constexpr,
        VARLEN: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """dQ of one Q tile from all its KV tiles in ascending order (recompute schedule): no waits."""
    M_AXIS: tl.constexpr = 1 if VARLEN else 0  # sequences x heads may pass 65535 programs
    pid_bh = tl.program_id(1 - M_AXIS)
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hkv = hq // GROUP
    if CAUSAL:  # the last Q tiles see the most keys: launch them first, for a shorter tail
        start_m = (tl.num_programs(M_AXIS) - 1 - tl.program_id(M_AXIS)) * BLOCK_M
    else:
        start_m = tl.program_id(M_AXIS) * BLOCK_M
    q0, L, k0, S, diag = sequence_rows(CU_Q, CU_K, b, L, S, max_q, max_k, VARLEN)
    if VARLEN:
        if start_m >= L:
            return
    q_base = row_offset(b, hq, q0, stride_qb, stride_qh, stride_qm)
    do_base = row_offset(b, hq, q0, stride_db, stride_dh, stride_dm)
    dq_base = row_offset(b, hq, q0, stride_dqb, stride_dqh, stride_dqm)
    k_base = row_offset(b, hkv, k0, stride_kb, stride_kh, stride_kn)
    v_base = row_offset(b, hkv, k0, stride_vb, stride_vh, stride_vn)
    row_base = row_offset(b, hq, q0, stride_lb, stride_lh, 1)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, HEAD_E)
    offs_ev = tl.arange(0, HEAD_EV)
    check_rows = VARLEN or not EVEN_M
    q = load_tile(Q + q_base, rows, offs_e, stride_qm, stride_qe, L, E, check_rows, E != HEAD_E)
    do = load_tile(DO + do_base, rows, offs_ev, stride_dm, stride_de, L, EV, check_rows,
                   EV != HEAD_EV)
    lse2, delta = load_row_stats(LSE, DELTA, row_base, rows, 0, L, False, check_rows)
    k_ptr = K + k_base
    v_ptr = V + v_base
    mask_ptr = MASK + b.to(tl.int64) * stride_mb + hq.to(tl.int64) * stride_mh
    start, full_start, full_end, end = key_tile_range(start_m, S, diag, BLOCK_M, BLOCK_N, CAUSAL,
                                                      WINDOW, win_left, win_right)
    offs_n = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_E], tl.float32)
    seed, offset = load_state(RNG, DROPOUT)
    drop = (seed, offset, drop_threshold, pid_bh, start_m, drop_scale)
    for start_n in range(start, full_start, BLOCK_N):  # a window's left edge
        dq = _dq_tile_step(dq, q, do, lse2, delta, k_ptr, v_ptr, mask_ptr, rows, start_n, offs_n,
                           L, S, diag, qk_scale, stride_kn, stride_ke, stride_vn, stride_ve,
                           stride_mm, stride_mn, win_left, win_right, drop, E, EV, HEAD_E,
                           HEAD_EV, CAUSAL, True, MASK_KIND, WINDOW, PRECISION, DROPOUT)
    for start_n in range(full_start, full_end, BLOCK_N):
        dq = _dq_tile_step(dq, q, do, lse2, delta, k_ptr, v_ptr, mask_ptr, rows, start_n, offs_n,
                           L, S, diag, qk_scale, stride_kn, stride_ke, stride_vn, stride_ve,
                           stride_mm, stride_mn, win_left, win_right, drop, E, EV, HEAD_E,
                           HEAD_EV, False, False, MASK_KIND, False, PRECISION, DROPOUT)
    for start_n in range(full_end, end, BLOCK_N):
        dq = _dq_tile_step(dq, q, do, lse2, delta, k_ptr, v_ptr, mask_ptr, rows, start_n, offs_n,
                           L, S, diag, qk_scale, stride_kn, stride_ke, stride_vn, stride_ve,
                           stride_mm, stride_mn, win_left, win_right, drop, E, EV, HEAD_E,
                           HEAD_EV, CAUSAL, True, MASK_KIND, WINDOW, PRECISION, DROPOUT)
    tl.store(DQ + dq_base + rows[:, None] * stride_dqm + offs_e[None, :] * stride_dqe,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rows[:, None] < L) & (offs_e[None, :] < E))


def launch_dq_pass(launches: Launches, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor | None,
                   dq: torch.Tensor, *, is_causal: bool, scale: float, cfg,
                   window: tuple[int, int] = (-1, -1), packed: tuple | None = None,
                   dropout: Dropout | None = None) -> None:
    """The ``recompute`` schedule's dQ kernel: each Q tile sums its KV tiles in ascending order.

    ``packed`` = (cu_seq_q, cu_seq_k, max_q, max_k) runs it over packed sequences (VARLEN): the
    (B, H, T, D) views have batch stride 0, B sequences, ``lse``/``delta`` are (H, T), and the
    grid is (B * H, Q tiles)."""
    batch, hq, seq_q, e = q.shape
    hkv, seq_k, ev = k.shape[1], k.shape[2], v.shape[3]
    mask_t, mask_strides = (q, (0, 0, 0, 0)) if mask is None else (mask, tuple(mask.stride()))
    if packed is None:
        cu_q, cu_k, max_q, max_k = lse, lse, 0, 0
        grid, lse_strides = (cdiv(seq_q, cfg.dq_block_m), batch * hq), (hq * seq_q, seq_q)
    else:
        cu_q, cu_k, max_q, max_k = packed
        grid, lse_strides = (batch * hq, cdiv(max_q, cfg.dq_block_m)), (0, seq_q)
    rng, drop_threshold, drop_scale = kernel_args(dropout, lse)
    launches("dq_pass", _backward_dq_kernel, grid, (
        q, k, v, grad_out, lse, delta, mask_t, dq, cu_q, cu_k, rng,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *mask_strides, *dq.stride(),
        *lse_strides, hq, seq_q, seq_k, max_q, max_k, scale * LOG2E, scale, *window,
        drop_threshold, drop_scale), dict(
        GROUP=hq // hkv, E=e, EV=ev, HEAD_E=head_dim_bucket(e), HEAD_EV=head_dim_bucket(ev),
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        EVEN_M=packed is None and seq_q % cfg.dq_block_m == 0,
        CAUSAL=is_causal, MASK_KIND=mask_kind(mask), WINDOW=tuple(window) != (-1, -1),
        VARLEN=packed is not None, PRECISION=dot_precision(q.dtype),
        DROPOUT=dropout is not None, num_warps=cfg.dq_num_warps,
        num_stages=cfg.dq_num_stages))
