"""FlashAttention-2 forward: ``out`` and the natural-log logsumexp, one program per (Q tile, b*h).

Online softmax (Dao, "FlashAttention-2", 2023) in the exp2 domain: the scores are multiplied by
``scale * log2(e)`` once so that every exponential is a cheap ``exp2``. Causal (top-left) attention
skips the KV tiles entirely above the diagonal and masks only the diagonal band; a sliding
window (``window``: left, right, -1 = open) skips the KV tiles outside it and masks only its
edge tiles;
user masks are loaded tile by tile through their (possibly zero) strides; GQA reads the KV head
``h // group``.

With DROPOUT the probabilities that go into P V are dropped with ``shared/dropout.py``'s mask and
the output is scaled by ``1 / (1 - p)``; the running sum and the logsumexp stay undropped, as
SDPA's dropout applies after the softmax.

With VARLEN the batch is virtual: program (seq * Hq + h, m) reads sequence ``seq``'s rows and
length from the packed offsets (``tiles.sequence_bounds``), exits past its length, and aligns
causal and window bottom-right (diagonal key ``S - L``), as FlashAttention's varlen kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import Plan
from ..shared.device import head_dim_bucket
from ..shared.dropout import Dropout, kernel_args, keep, load_state
from ..shared.launch import dot_precision, mask_kind
from ..shared.tiles import (LN2, LOG2E, key_tile_range, load_tile, masked_scores, mm, row_offset,
                            sequence_rows, window_keep)
from .configs import ForwardConfig


@triton.jit
def _scores_tile(q, K, offs_m, cols, L, S, diag, qk_scale, MASK, stride_mm, stride_mn, stride_kn,
                 stride_ke, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, BOUNDS: tl.constexpr,
                 E: tl.constexpr, HEAD_E: tl.constexpr, PRECISION: tl.constexpr):
    """Load one K tile and return its masked log2-domain scores against the resident Q tile."""
    k = load_tile(K, cols, tl.arange(0, HEAD_E), stride_kn, stride_ke, S, E, BOUNDS, E != HEAD_E)
    return masked_scores(q, k, offs_m, cols, L, S, diag, qk_scale, MASK, stride_mm, stride_mn,
                         MASK_KIND, CAUSAL, BOUNDS, PRECISION)


@triton.jit
def _online_step(acc, m_i, l_i, s, V, start_n, offs_n, S, stride_vn, stride_ve, drop,
                 BOUNDS: tl.constexpr, EV: tl.constexpr, HEAD_EV: tl.constexpr,
                 PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """Fold one tile of log2-domain scores into the running max, sum and output accumulator;
    ``drop`` = (seed, offset, threshold, bh, row0, L) of the dropout mask."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        seed, offset, threshold, bh, row0, L = drop
        p = tl.where(keep(seed, offset, threshold, bh, row0, start_n, L, S, p.shape[0],
                          p.shape[1]), p, 0.0)
    v = load_tile(V, start_n + offs_n, tl.arange(0, HEAD_EV), stride_vn, stride_ve, S, EV, BOUNDS,
                  EV != HEAD_EV)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _key_tile(acc, m_i, l_i, q, K, V, MASK, offs_m, start_n, offs_n, L, S, diag, qk_scale,
              stride_mm, stride_mn, stride_kn, stride_ke, stride_vn, stride_ve, win_left,
              win_right, drop, EDGE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, E: tl.constexpr, HEAD_E: tl.constexpr, EV: tl.constexpr,
              HEAD_EV: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    """Fold the KV tile at ``start_n`` into the online softmax. Only an EDGE tile (one that
    crosses the diagonal, S or a window's edge: ``tiles.key_tile_range``) checks bounds and
    applies the causal and window masks; a user mask applies to every tile."""
    s = _scores_tile(q, K, offs_m, start_n + offs_n, L, S, diag, qk_scale, MASK, stride_mm,
                     stride_mn, stride_kn, stride_ke, MASK_KIND, EDGE and CAUSAL, EDGE, E, HEAD_E,
                     PRECISION)
    if EDGE and WINDOW:
        s = tl.where(window_keep(offs_m[:, None] + diag, (start_n + offs_n)[None, :], win_left,
                                 win_right), s, float("-inf"))
    return _online_step(acc, m_i, l_i, s, V, start_n, offs_n, S, stride_vn, stride_ve, drop, EDGE,
                        EV, HEAD_EV, PRECISION, DROPOUT)


@triton.jit(do_not_specialize=["drop_threshold"])
def _attention_forward_kernel(
        Q, K, V, MASK, OUT, LSE, CU_Q, CU_K, RNG,
        stride_qb, stride_qh, stride_qm, stride_qe,
        stride_kb, stride_kh, stride_kn, stride_ke,
        stride_vb, stride_vh, stride_vn, stride_ve,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_ob, stride_oh, stride_om, stride_oe,
        stride_lb, stride_lh,
        HQ, L, S, max_q, max_k, qk_scale, win_left, win_right, drop_threshold, drop_scale,
        GROUP: tl.constexpr, E: tl.constexpr, EV: tl.constexpr,
        HEAD_E: tl.constexpr, HEAD_EV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, WINDOW: tl.constexpr,
        VARLEN: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr):
    M_AXIS: tl.constexpr = 1 if VARLEN else 0  # sequences x heads may pass 65535 programs
    pid_m = tl.program_id(M_AXIS)
    pid_bh = tl.program_id(1 - M_AXIS)
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hkv = hq // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_ev = tl.arange(0, HEAD_EV)

    q0, L, k0, S, diag = sequence_rows(CU_Q, CU_K, b, L, S, max_q, max_k, VARLEN)
    if VARLEN:
        if start_m >= L:
            return
    q_base = row_offset(b, hq, q0, stride_qb, stride_qh, stride_qm)
    k_base = row_offset(b, hkv, k0, stride_kb, stride_kh, stride_kn)
    v_base = row_offset(b, hkv, k0, stride_vb, stride_vh, stride_vn)
    o_base = row_offset(b, hq, q0, stride_ob, stride_oh, stride_om)
    lse_base = row_offset(b, hq, q0, stride_lb, stride_lh, 1)
    q = load_tile(Q + q_base, offs_m, tl.arange(0, HEAD_E), stride_qm, stride_qe, L, E,
                  VARLEN or not EVEN_M, E != HEAD_E)
    k_ptr = K + k_base
    v_ptr = V + v_base
    mask_ptr = MASK + b.to(tl.int64) * stride_mb + hq.to(tl.int64) * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_EV], tl.float32)
    seed, offset = load_state(RNG, DROPOUT)
    drop = (seed, offset, drop_threshold, pid_bh, start_m, L)

    start, full_start, full_end, end = key_tile_range(start_m, S, diag, BLOCK_M, BLOCK_N, CAUSAL,
                                                      WINDOW, win_left, win_right)
    for start_n in range(start, full_start, BLOCK_N):
        acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, offs_m, start_n, offs_n,
                                  L, S, diag, qk_scale, stride_mm, stride_mn, stride_kn, stride_ke,
                                  stride_vn, stride_ve, win_left, win_right, drop, True,
                                  MASK_KIND, CAUSAL, WINDOW, E, HEAD_E, EV, HEAD_EV, PRECISION,
                                  DROPOUT)
    for start_n in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, offs_m, start_n, offs_n,
                                  L, S, diag, qk_scale, stride_mm, stride_mn, stride_kn, stride_ke,
                                  stride_vn, stride_ve, win_left, win_right, drop, False,
                                  MASK_KIND, CAUSAL, WINDOW, E, HEAD_E, EV, HEAD_EV, PRECISION,
                                  DROPOUT)
    for start_n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _key_tile(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, offs_m, start_n, offs_n,
                                  L, S, diag, qk_scale, stride_mm, stride_mn, stride_kn, stride_ke,
                                  stride_vn, stride_ve, win_left, win_right, drop, True,
                                  MASK_KIND, CAUSAL, WINDOW, E, HEAD_E, EV, HEAD_EV, PRECISION,
                                  DROPOUT)

    seen = l_i != 0.0  # 0 only where no key was seen; NaN (a NaN or +inf score) stays NaN
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DROPOUT:
        out = out * drop_scale
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2,
                   float("-inf"))
    o_ptrs = OUT + o_base + offs_m[:, None] * stride_om + offs_ev[None, :] * stride_oe
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_ev[None, :] < EV))
    tl.store(LSE + lse_base + offs_m, lse, mask=offs_m < L)


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    if mask is None:
        return q, (0, 0, 0, 0)
    return mask, tuple(mask.stride())


def constexprs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               cfg: ForwardConfig, *, is_causal: bool, window: tuple[int, int],
               packed: bool, dropout: bool = False) -> dict[str, object]:
    """The forward kernel's compile-time arguments for (B, H, L, D) views of a call."""
    e, ev = q.shape[3], v.shape[3]
    return dict(GROUP=q.shape[1] // k.shape[1], E=e, EV=ev, HEAD_E=head_dim_bucket(e),
                HEAD_EV=head_dim_bucket(ev), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                EVEN_M=not packed and q.shape[2] % cfg.block_m == 0, CAUSAL=is_causal,
                MASK_KIND=mask_kind(mask), WINDOW=tuple(window) != (-1, -1), VARLEN=packed,
                PRECISION=dot_precision(q.dtype), DROPOUT=dropout, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def run_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                scale: float, dropout: Dropout | None = None) -> None:
    """Write softmax(q k^T * scale + mask) v (with ``dropout``) into ``out`` and its logsumexp into
    the contiguous fp32 (B, Hq, L) ``lse``, as ``plan`` says."""
    hq, seq_q = q.shape[1], q.shape[2]
    launch_forward(plan, q, k, v, mask, out, lse, (hq * seq_q, seq_q), None, scale, dropout)


def launch_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                   lse_strides: tuple[int, int], packed: tuple | None, scale: float,
                   dropout: Dropout | None = None) -> None:
    """Launch the forward kernel on (B, H, L, D) views; ``lse_strides`` are its (batch, head)
    strides. ``packed`` = (cu_seq_q, cu_seq_k, max_q, max_k) for the VARLEN kernel: the views are
    the packed tensors with batch stride 0, B the number of sequences, and the grid's axes
    swapped: (B * H, Q tiles)."""
    mask_t, mask_strides = _mask_args(mask, q)
    cu_q, cu_k, max_q, max_k = packed or (lse, lse, 0, 0)
    rng, threshold, drop_scale = kernel_args(dropout, lse)
    plan.launches("forward", _attention_forward_kernel, plan.grid, (
        q, k, v, mask_t, out, lse, cu_q, cu_k, rng,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(), *lse_strides,
        q.shape[1], q.shape[2], k.shape[2], max_q, max_k, scale * LOG2E, *plan.spec["window"],
        threshold, drop_scale),
        plan.spec["constexprs"])
