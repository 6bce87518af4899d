"""Attention backward: preprocess, ONE main dK/dV + ordered-dQ kernel, and the recompute dQ kernel.

The main kernel is persistent: program p takes work item p, then p+P, p+2P, ... (ops/shared/schedules.py
lays them out), except that under causal ``recompute`` and ``atomic``, which have no waits, it takes
the next unclaimed item from a counter, which balances causal items of unequal length. Each slot of
an item owns a KV tile, keeps dK and dV in fp32 registers and, for every query head of its GQA
group, visits Q tiles in the schedule's order. Its dQ partial goes into an fp32
accumulator in the order fixed by the schedule's reduction rank, enforced by an int32 ticket per
(b, hq, Q sub-tile) (ops/shared/tickets.py; docs/design.md; DASH, Qiang et al. 2026, for the
orders). The schedule and its properties (ops/catalog.py) are constexprs, so every schedule is
this one kernel body. ``recompute``
skips dQ there and runs the dQ kernel of ``ops/shared/dq_pass.py`` instead.
A sliding window (``window``, WINDOW) limits every KV tile to the contiguous range of Q tiles it
meets, and every Q tile to its KV tiles (``schedules.window_*``): tiles outside are never loaded;
``shift`` has no windowed ranks and falls back to the ordered schedule that runs on any grid.

With DROPOUT every (KV tile, Q sub-tile) step recomputes the forward's keep mask
(``shared/dropout.py``): dV takes the dropped P, dP is dropped, and both are scaled by
``1 / (1 - p)``; ``delta = rowsum(dO * O)`` of the dropped output is still sum_j P dP.

With VARLEN the batch is virtual (``ops/portable/packed.py``): a work item of sequence ``seq`` reads its
bounds from the packed offsets, counts its tiles and items as the sequence alone would (so the
schedule's walks and ranks are that sequence's), and does nothing past them. Causal and window are
aligned bottom-right by shifting the tile coordinates (``tiles.diagonal_origin``); a sub-tile
with no row of the sequence is skipped by every contributor alike. dQ accumulates in packed rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..catalog import Schedule
from ..plan import Plan
from ..shared import schedules as sch
from ..shared.device import head_dim_bucket
from ..shared.dq_convert import convert_dq
from ..shared.dq_pass import launch_dq_pass, load_row_stats
from ..shared.dropout import Dropout, kernel_args, keep_t, load_state
from ..shared.errors import spin_flag, watch_spin_flag
from ..shared.launch import (coresident_programs, cooperative_launch_supported, dot_precision,
                             interpreting, mask_kind)
from ..shared.preprocess import prepare
from ..shared.tickets import add_in_turn, release_last
from ..shared.tiles import KERNEL_LOG2E, LOG2E, load_rows, mm, sequence_tiles, window_keep
from .configs import BackwardConfig


@triton.jit
def _masked_scores_t(s_t, MASK, m_base, rows, cols, L, S, stride_mm, stride_mn,
                     MASK_KIND: tl.constexpr):
    """Apply the user mask to transposed log2-domain scores (keys along dim 0, queries along dim 1)."""
    if MASK_KIND == 1:
        keep = tl.load(MASK + m_base + cols[:, None] * stride_mn + rows[None, :] * stride_mm,
                       mask=(cols[:, None] < S) & (rows[None, :] < L), other=0)
        s_t = tl.where(keep != 0, s_t, float("-inf"))
    if MASK_KIND == 2:
        add = tl.load(MASK + m_base + cols[:, None] * stride_mn + rows[None, :] * stride_mm,
                      mask=(cols[:, None] < S) & (rows[None, :] < L), other=0.0)
        s_t = s_t + add.to(tl.float32) * KERNEL_LOG2E
    return s_t


@triton.jit(do_not_specialize=["drop_threshold"])
def _backward_main_kernel(
        Q, K, V, DO, LSE, DELTA, MASK, DK, DV, DQACC, TICKETS, ERR, WORK_COUNTER, CU_Q, CU_K, RNG,
        stride_qb, stride_qh, stride_qm, stride_qe,
        stride_kb, stride_kh, stride_kn, stride_ke,
        stride_vb, stride_vh, stride_vn, stride_ve,
        stride_db, stride_dh, stride_dm, stride_de,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_dkb, stride_dkh, stride_dkn, stride_dke,
        stride_dvb, stride_dvh, stride_dvn, stride_dve,
        HQ, HKV, L, S, n_q, n_kv, max_q, max_k, qk_scale, sm_scale, max_spin, win_left, win_right,
        items_per_head, total_items, drop_threshold, drop_scale,
        GROUP: tl.constexpr, E: tl.constexpr, EV: tl.constexpr,
        HEAD_E: tl.constexpr, HEAD_EV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, EVEN_L: tl.constexpr, EVEN_S: tl.constexpr,
        WINDOW: tl.constexpr, VARLEN: tl.constexpr,
        SCHEDULE: tl.constexpr, NUM_SLOTS: tl.constexpr, ORDERED: tl.constexpr,
        COMPUTE_DQ: tl.constexpr, ORDERED_WAITS: tl.constexpr, PRECISION: tl.constexpr,
        DROPOUT: tl.constexpr):
    NSUB: tl.constexpr = BLOCK_N // BLOCK_M
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, HEAD_E)
    offs_ev = tl.arange(0, HEAD_EV)
    l_pad = n_q * BLOCK_N
    held = TICKETS  # the ticket whose release is deferred to the next step (amount 0: none yet)
    held_amount = tl.program_id(0) * 0
    work = tl.program_id(0)
    seed, offset = load_state(RNG, DROPOUT)
    while work < total_items:
        head = work // items_per_head
        item = work % items_per_head
        b = head // HKV
        hkv = head % HKV
        # The sequence's tiles: rows [q_lo, q_hi) and keys [k_lo, k_hi) are real (dense: all).
        q_lo, q_hi, k_lo, k_hi, seq_n_q, seq_n_kv = 0, L, 0, S, n_q, n_kv
        if VARLEN:
            q0, k0, q_lo, q_hi, k_lo, k_hi, seq_n_q, seq_n_kv = sequence_tiles(
                CU_Q, CU_K, b, L, S, max_q, max_k, BLOCK_N, CAUSAL or WINDOW)
            seq_items = sch.items_in_head(seq_n_kv, CAUSAL, SCHEDULE)
        for slot in range(NUM_SLOTS):
            kv = sch.slot_kv_tile(item, slot, seq_n_kv, CAUSAL, SCHEDULE)
            if VARLEN:
                kv = tl.where(item < seq_items, kv, -1)
            if kv >= 0:
                cols = kv * BLOCK_N + offs_n
                k_base = b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
                v_base = b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
                dk_base = b.to(tl.int64) * stride_dkb + hkv.to(tl.int64) * stride_dkh
                dv_base = b.to(tl.int64) * stride_dvb + hkv.to(tl.int64) * stride_dvh
                if VARLEN:  # the batch stride is 0: key k_lo of the tiles is the sequence's first
                    k_start = (k0 - k_lo).to(tl.int64)
                    k_base += k_start * stride_kn
                    v_base += k_start * stride_vn
                    dk_base += k_start * stride_dkn
                    dv_base += k_start * stride_dvn
                k = load_rows(K + k_base, cols, offs_e, stride_kn, stride_ke, k_lo, k_hi, E,
                              VARLEN, not EVEN_S, E != HEAD_E)
                v = load_rows(V + v_base, cols, offs_ev, stride_vn, stride_ve, k_lo, k_hi, EV,
                              VARLEN, not EVEN_S, EV != HEAD_EV)
                dk = tl.zeros([BLOCK_N, HEAD_E], tl.float32)
                dv = tl.zeros([BLOCK_N, HEAD_EV], tl.float32)
                if WINDOW:
                    first, count = sch.window_q_range(kv, seq_n_q, BLOCK_N, win_left, win_right,
                                                      CAUSAL)
                else:
                    first, count = kv * 0, sch.visit_count(kv, seq_n_q, CAUSAL)
                n_steps = count * NSUB
                for g in range(GROUP):
                    hq = hkv * GROUP + g
                    bh = b * HQ + hq
                    q_base = b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
                    do_base = b.to(tl.int64) * stride_db + hq.to(tl.int64) * stride_dh
                    m_base = b.to(tl.int64) * stride_mb + hq.to(tl.int64) * stride_mh
                    row_base = bh.to(tl.int64) * L
                    if VARLEN:  # row q_lo of the tiles is the sequence's first; stats are (Hq, T)
                        q_start = (q0 - q_lo).to(tl.int64)
                        q_base += q_start * stride_qm
                        do_base += q_start * stride_dm
                        row_base = hq.to(tl.int64) * L + q_start
                    for it in range(n_steps):
                        if WINDOW:
                            qt = sch.window_q_tile_at(it // NSUB, first, count, SCHEDULE)
                        else:
                            qt = sch.q_tile_at(it // NSUB, kv, seq_n_q, seq_n_kv, CAUSAL, SCHEDULE)
                        sub = it % NSUB
                        row0 = qt * BLOCK_N + sub * BLOCK_M
                        rows = row0 + offs_m
                        live = True
                        if VARLEN:  # no row of the sub-tile exists: every contributor skips it
                            live = (row0 + BLOCK_M > q_lo) & (row0 < q_hi)
                        if live:
                            q = load_rows(Q + q_base, rows, offs_e, stride_qm, stride_qe, q_lo,
                                          q_hi, E, VARLEN, not EVEN_L, E != HEAD_E)
                            do = load_rows(DO + do_base, rows, offs_ev, stride_dm, stride_de, q_lo,
                                           q_hi, EV, VARLEN, not EVEN_L, EV != HEAD_EV)
                            lse2, delta = load_row_stats(LSE, DELTA, row_base, rows, q_lo, q_hi,
                                                         VARLEN, not EVEN_L)
                            s_t = mm(k, tl.trans(q), PRECISION) * qk_scale
                            s_t = _masked_scores_t(s_t, MASK, m_base, rows, cols, L, S, stride_mm,
                                                   stride_mn, MASK_KIND)
                            if CAUSAL:
                                s_t = tl.where(cols[:, None] <= rows[None, :], s_t, float("-inf"))
                            if WINDOW:
                                s_t = tl.where(window_keep(rows[None, :], cols[:, None], win_left,
                                                           win_right), s_t, float("-inf"))
                            p_t = tl.math.exp2(s_t - lse2[None, :])
                            if VARLEN:
                                p_t = tl.where((cols[:, None] >= k_lo) & (cols[:, None] < k_hi),
                                               p_t, 0.0)
                            elif not EVEN_S:
                                p_t = tl.where(cols[:, None] < S, p_t, 0.0)
                            dp_t = mm(v, tl.trans(do), PRECISION)
                            if DROPOUT:
                                kept = keep_t(seed, offset, drop_threshold, bh, row0,
                                              kv * BLOCK_N, L, S, BLOCK_M, BLOCK_N)
                                dv += mm(tl.where(kept, p_t, 0.0).to(do.dtype), do, PRECISION)
                                dp_t = tl.where(kept, dp_t * drop_scale, 0.0)
                            else:
                                dv += mm(p_t.to(do.dtype), do, PRECISION)
                            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
                            dk += mm(ds_t, q, PRECISION)
                            if COMPUTE_DQ:
                                dq = mm(tl.trans(ds_t), k, PRECISION) * sm_scale
                                if VARLEN:  # dQ is accumulated in packed rows, (Hq, T, HEAD_E)
                                    acc_ptrs = (DQACC + (row_base + rows[:, None]) * HEAD_E
                                                + offs_e[None, :])
                                    real = ((rows >= q_lo) & (rows < q_hi))[:, None]
                                    ticket = TICKETS + row_base + tl.maximum(row0, q_lo)
                                else:
                                    acc_ptrs = (DQACC + (bh.to(tl.int64) * l_pad + rows[:, None])
                                                * HEAD_E + offs_e[None, :])
                                    real = None
                                    ticket = TICKETS + (bh * n_q + qt) * NSUB + sub
                                if ORDERED:
                                    if WINDOW:
                                        rank = sch.window_rank(qt, kv, BLOCK_N, win_left)
                                    else:
                                        rank = sch.reduction_rank(qt, kv, seq_n_q, seq_n_kv,
                                                                  CAUSAL, SCHEDULE)
                                    held, held_amount = add_in_turn(acc_ptrs, dq, ticket, rank,
                                                                    held, held_amount, ERR,
                                                                    max_spin, ORDERED_WAITS, real)
                                else:
                                    tl.atomic_add(acc_ptrs, dq, mask=real, sem="relaxed")
                if VARLEN:
                    keys = (cols >= k_lo) & (cols < k_hi)
                else:
                    keys = cols < S
                tl.store(DK + dk_base + cols[:, None] * stride_dkn + offs_e[None, :] * stride_dke,
                         (dk * sm_scale).to(DK.dtype.element_ty),
                         mask=keys[:, None] & (offs_e[None, :] < E))
                tl.store(DV + dv_base + cols[:, None] * stride_dvn + offs_ev[None, :] * stride_dve,
                         (dv * drop_scale if DROPOUT else dv).to(DV.dtype.element_ty),
                         mask=keys[:, None] & (offs_ev[None, :] < EV))
        if (CAUSAL or WINDOW) and not ORDERED:  # items of unequal length, no waits, whole items
            work = tl.atomic_add(WORK_COUNTER, 1, sem="relaxed") + tl.num_programs(0)
        else:  # a fixed deal: the waits rely on it (ops/shared/schedules.py); full-mask items are equal
            work += tl.num_programs(0)
    if ORDERED:
        release_last(held, held_amount, ORDERED_WAITS)


def main_constexprs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    cfg: BackwardConfig, schedule: Schedule, *, is_causal: bool,
                    window: tuple[int, int], packed: bool,
                    dropout: bool = False) -> dict[str, object]:
    """The main kernel's compile-time arguments (and launch options) for (B, H, L, D) views."""
    e, ev = q.shape[3], v.shape[3]
    waits = schedule.ordered and not interpreting()
    constexprs = dict(
        GROUP=q.shape[1] // k.shape[1], E=e, EV=ev, HEAD_E=head_dim_bucket(e),
        HEAD_EV=head_dim_bucket(ev), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=is_causal,
        MASK_KIND=mask_kind(mask), EVEN_L=not packed and q.shape[2] % cfg.block_n == 0,
        EVEN_S=not packed and k.shape[2] % cfg.block_n == 0,
        WINDOW=tuple(window) != (-1, -1), VARLEN=packed, PRECISION=dot_precision(q.dtype),
        SCHEDULE=schedule.id, NUM_SLOTS=schedule.slots(is_causal), ORDERED=schedule.ordered,
        COMPUTE_DQ=not schedule.separate_dq, ORDERED_WAITS=waits, DROPOUT=dropout,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if waits and cooperative_launch_supported():
        constexprs["launch_cooperative_grid"] = True
    return constexprs


def _main_args(tensors: tuple, packed: tuple | None, sizes: tuple[int, ...],
               window: tuple[int, int], scale: float, max_spin: int,
               dropout: Dropout | None = None) -> tuple:
    """The main kernel's positional arguments. ``tensors`` = (q, k, v, grad_out, lse, delta, mask,
    dk, dv, dq accumulator or None, tickets and the work counter after them) as (B, H, L, D) views; ``sizes`` = (L, S,
    Q tiles, KV tiles, items per head, items)."""
    q, k, v, grad_out, lse, delta, mask, dk, dv, dq_acc, tickets = tensors
    mask_t, mask_strides = (q, (0, 0, 0, 0)) if mask is None else (mask, tuple(mask.stride()))
    cu_q, cu_k, max_q, max_k = packed or (tickets, tickets, 0, 0)
    rng, drop_threshold, drop_scale = kernel_args(dropout, tickets)
    return (q, k, v, grad_out, lse, delta, mask_t, dk, dv,
            dq_acc if dq_acc is not None else delta, tickets, spin_flag(q.device), tickets[-1:],
            cu_q, cu_k, rng,
            *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *mask_strides,
            *dk.stride(), *dv.stride(), q.shape[1], k.shape[1], *sizes[:4], max_q, max_k,
            scale * LOG2E, scale, max_spin, *window, *sizes[4:], drop_threshold, drop_scale)


def capacity(constexprs: dict[str, object], views: tuple, packed: tuple | None,
             sizes: tuple[int, ...], window: tuple[int, int], max_spin: int) -> int:
    """How many programs of the main kernel compiled with ``constexprs`` for these (B, H, L, D)
    ``views`` = (q, k, v, grad_out, lse, mask, dk, dv) can run at once (compiles it once)."""
    q, k, v, grad_out, lse, mask, dk, dv = views
    scratch = torch.empty((16,), device=q.device, dtype=torch.float32)
    counters = torch.empty((16,), device=q.device, dtype=torch.int32)
    tensors = (q, k, v, grad_out, lse, scratch, mask, dk, dv, scratch, counters)
    dropout = None
    if constexprs["DROPOUT"]:  # a state of the real dtype: the same binary as the launch's
        dropout = Dropout(0.5, torch.zeros((2,), device=q.device, dtype=torch.int64))
    return coresident_programs(_backward_main_kernel,
                               _main_args(tensors, packed, sizes, window, 1.0, max_spin, dropout),
                               constexprs, q.device)


def run_backward(plan: Plan, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 mask: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                 scale: float, max_spin: int, dropout: Dropout | None = None) -> None:
    """Write the gradients of attention (with the forward's ``dropout``) into ``dq``, ``dk``,
    ``dv`` as ``plan`` says; ``lse`` is the forward's contiguous fp32 (B, Hq, L) logsumexp."""
    cfg, spec, schedule = plan.config, plan.spec, plan.schedule
    batch, hq, seq_q, e = q.shape
    n_q = spec["sizes"][2]
    delta, dq_acc, tickets = prepare(
        out, grad_out, lse, row_stride=seq_q, acc_rows=n_q * cfg.block_n,
        acc_dim=0 if schedule.separate_dq else head_dim_bucket(e), ticket_rows=cfg.block_m,
        with_lse2=False, launches=plan.launches)
    launch_main(plan, (q, k, v, grad_out, lse, delta, mask, dk, dv, dq_acc, tickets),
                None, scale, max_spin, dropout)
    if spec["zero_tail"]:  # keys after the last query tile: no causal query sees them
        dk[:, :, n_q * cfg.block_n:].zero_()
        dv[:, :, n_q * cfg.block_n:].zero_()
    if schedule.separate_dq:
        launch_dq_pass(plan.launches, q, k, v, grad_out, lse, delta, mask, dq, is_causal=spec["causal"],
                       scale=scale, cfg=cfg, window=spec["window"], dropout=dropout)
    else:
        convert_dq(plan.launches, dq_acc.view(batch * hq, n_q * cfg.block_n, -1), dq)
    if schedule.ordered and not interpreting():
        watch_spin_flag(spin_flag(q.device), plan)


def launch_main(plan: Plan, tensors: tuple, packed: tuple | None, scale: float,
                max_spin: int, dropout: Dropout | None = None) -> None:
    """Launch the main kernel on ``tensors`` (see :func:`_main_args`); ``packed`` =
    (cu_seq_q, cu_seq_k, max_q, max_k) for the VARLEN kernel: B sequences over the packed
    tensors (batch stride 0), L and S the packed totals, the tiles those of the longest
    sequence."""
    spec = plan.spec
    plan.launches("main", _backward_main_kernel, plan.grid,
                  _main_args(tensors, packed, spec["sizes"], spec["window"], scale, max_spin,
                             dropout),
                  spec["constexprs"])
