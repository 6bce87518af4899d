"""Attention backward for Hopper (sm90) in Gluon: one warp-specialized, persistent kernel.

Each CTA walks work items exactly like the portable kernel (ops/portable/backward.py): an item owns one or
two KV tiles of one (batch, KV head); for every query head of its GQA group the KV tile visits Q
tiles in the schedule's order (ops/shared/schedules.py, the same ``@triton.jit`` formulas). Three
partitions share that walk, each doing one job (the split of FlashAttention-3's backward, Shah et
al. 2024, and of DASH's dQ writer, Qiang et al. 2026):

- ``load_partition`` (1 warp, ``loader.py``): TMA loads of K and V per KV tile and of Q and dO
  per step, into shared memory, through mbarrier rings.
- ``_compute_partition`` (the default partition, two warpgroups): keeps dK and dV in registers,
  computes S^T, P^T, dP^T, dS^T with wgmma, and hands each step's dQ partial to shared memory.
- ``dq_writer_partition`` (1 warp, ``dq_writer.py``): adds each dQ partial into the fp32
  accumulator with one TMA reduce-add (FlashAttention-3's bulk reduce). Ordered schedules wait for
  the partial's ticket (acquire), add, wait until the adds are performed in global memory (not
  only read from shared memory) and release the ticket to the next rank, so the sum of every dQ
  element runs in the schedule's fixed order while the compute warps go on.

Queries sit along dim 1 of S^T (keys along dim 0), so dK and dV accumulate from registers, and
dS^T goes through shared memory once to feed dQ = dS K.

WINDOW (a sliding window) and VARLEN (packed sequences, ``ops/portable/packed.py``'s virtual batch) walk the
tiles as the portable kernel does (``walk.py``). A packed sequence's TMA boxes may reach into its
neighbours (or past the tensor, where TMA reads zeros): the compute warps zero such rows of a
boundary tile in shared memory before any MMA reads it and mask P to the sequence's keys (its rows
outside get P = 0 from their stats), and the writer adds only the sequence's rows, so no value of a
neighbour (not even a NaN) reaches a sequence's gradients, and its bits do not depend on what is
packed beside it. The row stats of packed sequences come from a layout where every TMA box starts
16-byte aligned and holds no other sequence's rows (``packed_prep.py``), so a step masks only the
keys.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                               warpgroup_mma, warpgroup_mma_wait)

from . import deal, dq_tail, dropout, walk
from .dq_order import dq_mma_layout, staging_layout
from .dq_writer import dq_writer_partition
from .loader import load_partition
from .primitives import (LAST_NAMED_BARRIER, named_barrier_arrive, partition_barrier,
                         store_kv_grads, zero_outside)


@gluon.jit
def _step(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, dq_bufs, q_ready,
          q_empty, dq_ready, dq_empty, dk, dv, it, first_it, row0, cols, q_lo, q_hi,
          S, win_left, win_right, qk_scale, sm_scale, s_layout: gl.constexpr,
          a_layout: gl.constexpr, dq_layout: gl.constexpr, CAUSAL: gl.constexpr,
          WINDOW: gl.constexpr, VARLEN: gl.constexpr, EVEN_S: gl.constexpr,
          COMPUTE_DQ: gl.constexpr, DK_IN_FLIGHT: gl.constexpr, NAMED_HANDOFF: gl.constexpr,
          WRITER_FREES: gl.constexpr, HANDOFF_THREADS: gl.constexpr, num_warps: gl.constexpr,
          drop, DROPOUT: gl.constexpr):
    """One step of a KV tile: S^T, P^T, dP^T, dS^T for the Q sub-tile of rows [row0, row0 +
    BLOCK_M) in stage ``it``; dV and dK accumulate (returned), the dQ partial goes to the writer.
    DROPOUT (``dropout.py``; ``drop`` = (seed, offset, threshold, scale, bh, L, first key)):
    dV takes the dropped P^T (scaled once, at the store), dS^T the dropped and scaled dP^T, as
    the portable kernel does."""
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_D: gl.constexpr = k_smem.shape[1]
    DQ_STAGES: gl.constexpr = dq_bufs.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
    s = it % STAGES
    q_s = q_bufs.index(s)
    do_s = do_bufs.index(s)
    mbarrier.wait(q_ready.index(s), (it // STAGES) & 1)
    if VARLEN:  # rows of a neighbour (or of nothing) in the boxes: zeros before any MMA
        if walk.crosses_edge(row0, BLOCK_M, q_lo, q_hi):
            zero_outside(q_s, q_lo - row0, q_hi - row0, num_warps)
            zero_outside(do_s, q_lo - row0, q_hi - row0, num_warps)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DROPOUT:  # drawn while the two MMAs run
        seed, offset, threshold, drop_scale, bh, L, col0 = drop
        kept = dropout.keep_t(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M, BLOCK_N,
                              s_layout)
    if DK_IN_FLIGHT:
        # In flight: the previous step's dK, then S^T and dP^T. Waiting for S^T also retires
        # that dK; its Q/dO stage is released with this step's hand-off (below).
        s_t, dk = warpgroup_mma_wait(1, deps=(s_t, dk))
    else:
        s_t = warpgroup_mma_wait(1, deps=(s_t, ))
    lse2 = lse_bufs.index(s).load(row_layout)
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    keys = gl.expand_dims(cols, 1)
    queries = gl.expand_dims(rows, 0)
    # Packed: ``cols`` holds the keys recoded by ``walk.key_order``; rows outside the sequence
    # have P = 0 already (their stats are the padding's +inf, their Q zeros).
    if CAUSAL:
        p_t = gl.where(keys <= queries, p_t, 0.0)
    elif VARLEN:
        p_t = gl.where(keys < walk.OUTSIDE, p_t, 0.0)
    if WINDOW:  # as tiles.window_keep: a side of -1 is open
        inside = (((keys >= queries - win_left) | (win_left < 0))
                  & ((keys <= queries + win_right) | (win_right < 0)))
        p_t = gl.where(inside, p_t, 0.0)
    if not (VARLEN or EVEN_S):
        p_t = gl.where(keys < S, p_t, 0.0)
    if DROPOUT:
        # dP^T first, so that each mask bit is used twice at once: held across the dV MMA's
        # issue, ptxas packed the 32 predicates into registers (~100 more instructions a step).
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        dp_t = gl.where(kept, dp_t * drop_scale, 0.0)
        p_v = gl.where(kept, p_t, 0.0)
        dv = warpgroup_mma(gl.convert_layout(p_v.to(dtype), a_layout), do_s, dv, is_async=True)
    else:
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_s, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
    delta = delta_bufs.index(s).load(row_layout)
    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
    if COMPUTE_DQ or DK_IN_FLIGHT:
        # dQ = dS K reads both warpgroups' keys of dS^T; dK taking dS^T from shared memory (not
        # registers) leaves ptxas the registers to keep dK in flight into the next step.
        ds_smem.store(ds_t)
        fence_async_shared()
        partition_barrier()
    if COMPUTE_DQ:  # dQ first, so that handing it to the writer overlaps dK
        dq_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
    if DK_IN_FLIGHT:
        dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
    else:
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_s, dk, is_async=True)
    d = it % DQ_STAGES
    # The compiler brackets each mbarrier arrive of this two-warpgroup partition with barriers
    # over its warps (one before, one before the next shared-memory access); a named barrier's
    # arrive (NAMED_HANDOFF) is each thread's own. Where the writer frees the stages
    # (WRITER_FREES), the step hands over its partial and nothing else.
    if COMPUTE_DQ:
        # dQ is staged while dK's MMA runs (FlashAttention-4's order).
        dq, dv, dk = warpgroup_mma_wait(1, deps=(dq, dv, dk))
        mbarrier.wait(dq_empty.index(d), ((it // DQ_STAGES) & 1) ^ 1)
        dq_bufs.index(d).store(dq * sm_scale)
        if WRITER_FREES and not DK_IN_FLIGHT:
            # dK retires before the hand-off, so that the writer frees this step's stage with
            # its partial; before the fence, as ptxas 12.8 segfaults on this wait after it.
            dk = warpgroup_mma_wait(0, deps=(dk, ))
        fence_async_shared()  # the writer's TMA reads the partial (the async proxy)
        if NAMED_HANDOFF:
            # A named barrier has no phases: this arrive may not run ahead of the writer's wait
            # for the buffer's previous partial, which the dq_empty wait above guarantees.
            named_barrier_arrive(LAST_NAMED_BARRIER - d, HANDOFF_THREADS, num_warps)
        else:
            mbarrier.arrive(dq_ready.index(d), count=1)
    else:
        dv, dk = warpgroup_mma_wait(1, deps=(dv, dk))
    if DK_IN_FLIGHT:  # the previous step's MMAs are retired (by this step's first wait)
        if not WRITER_FREES and it > first_it:
            mbarrier.arrive(q_empty.index((it - 1) % STAGES), count=1)
    elif not WRITER_FREES:
        # dK from registers must retire within its step: left in flight, it made ptxas serialize
        # every wgmma (advisory C7512).
        dk = warpgroup_mma_wait(0, deps=(dk, ))
        mbarrier.arrive(q_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _compute_partition(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, dq_bufs,
                       q_ready, q_empty, kv_ready, kv_empty, dq_ready, dq_empty, work_slots,
                       work_ready, work_empty, DK, DV, STASH,
                       DQACC, DQ, FINISHED, ERR, CU_Q, CU_K, PREFIX, stride_dkb, stride_dkh,
                       stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_dqt, stride_dqh,
                       HQ, HKV, L, S, n_q, n_kv, max_q, max_k, row_stride, win_left,
                       win_right, items_per_head, total_items, qk_scale, sm_scale, max_spin,
                       GROUP: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                       NUM_SLOTS: gl.constexpr, COMPUTE_DQ: gl.constexpr, EVEN_S: gl.constexpr,
                       DK_IN_FLIGHT: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                       NAMED_HANDOFF: gl.constexpr, WRITER_FREES: gl.constexpr,
                       HANDOFF_THREADS: gl.constexpr, VISIT_HEADS: gl.constexpr,
                       UNPADDED: gl.constexpr, TAIL_CONVERT: gl.constexpr, CLAIMED: gl.constexpr,
                       DQ_ROW_WARPS: gl.constexpr, num_warps: gl.constexpr, RNG, drop_threshold,
                       drop_scale, DROPOUT: gl.constexpr):
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    HEAD_D: gl.constexpr = k_smem.shape[1]
    NSUB: gl.constexpr = BLOCK_N // BLOCK_M
    dtype: gl.constexpr = k_smem.dtype
    # Visits of fewer query heads than the group keep a tile's dK and dV in STASH in between.
    STASHED: gl.constexpr = VISIT_HEADS < GROUP
    # Keys along dim 0 of S^T, split over both warpgroups; dQ as ``dq_order.dq_mma_layout``.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = dq_mma_layout(BLOCK_M, HEAD_D, num_warps, DQ_ROW_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_kd = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, kv_layout))
    seed, offset = dropout.load_state(RNG, DROPOUT)
    it = 0
    tile = 0
    w = walk.start(items_per_head, total_items, HKV, PREFIX, L, S, n_q, n_kv, CU_Q, CU_K, max_q,
                   max_k, work_slots, work_ready, work_empty, BLOCK_N, CAUSAL, WINDOW, VARLEN,
                   SCHEDULE, NUM_SLOTS, GROUP, VISIT_HEADS, UNPADDED, CLAIMED)
    work = gl.program_id(0)
    claim = 0
    while work < w.works:
        b, hkv, item, q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv = w.item(work)
        for visit in range(w.VISITS):
            slot, g_lo, g_hi, kv = w.visit(visit, item, tiles_kv)
            if kv >= 0:
                cols = kv * BLOCK_N + offs_n
                if VARLEN:
                    cols = walk.key_order(cols, k_lo, k_hi)
                if STASHED:  # the tile's dK and dV over the heads before g_lo, kept here
                    stash = (STASH + ((gl.program_id(0) * NUM_SLOTS + slot) * 2) * BLOCK_N * HEAD_D
                             + gl.expand_dims(offs_kn, 1) * HEAD_D + gl.expand_dims(offs_kd, 0))
                    kept = gl.expand_dims(offs_kn >= 0, 1) & (g_lo > 0)
                    dk = gl.load(stash, mask=kept, other=0.0)
                    dv = gl.load(stash + BLOCK_N * HEAD_D, mask=kept, other=0.0)
                else:
                    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=kv_layout)
                    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=kv_layout)
                mbarrier.wait(kv_ready, tile & 1)
                if VARLEN:
                    if walk.crosses_edge(kv * BLOCK_N, BLOCK_N, k_lo, k_hi):
                        zero_outside(k_smem, k_lo - kv * BLOCK_N, k_hi - kv * BLOCK_N, num_warps)
                        zero_outside(v_smem, k_lo - kv * BLOCK_N, k_hi - kv * BLOCK_N, num_warps)
                first, count = walk.q_range(kv, tiles_q, BLOCK_N, win_left, win_right, CAUSAL,
                                            WINDOW)
                first_it = it
                for g in range(g_lo, g_hi):
                    drop = (seed, offset, drop_threshold, drop_scale, b * HQ + hkv * GROUP + g, L,
                            kv * BLOCK_N)
                    for step in range(count * NSUB):
                        _, row0, live = walk.step_rows(step, kv, first, count, tiles_q,
                                                       tiles_kv, q_lo, q_hi, BLOCK_M, BLOCK_N,
                                                       CAUSAL, WINDOW, VARLEN, SCHEDULE)
                        if live:
                            dk, dv = _step(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem,
                                           ds_smem, dq_bufs, q_ready, q_empty, dq_ready, dq_empty,
                                           dk, dv, it, first_it, row0, cols, q_lo, q_hi, S,
                                           win_left, win_right, qk_scale, sm_scale,
                                           s_layout, a_layout, dq_layout, CAUSAL, WINDOW, VARLEN,
                                           EVEN_S, COMPUTE_DQ, DK_IN_FLIGHT, NAMED_HANDOFF,
                                           WRITER_FREES, HANDOFF_THREADS, num_warps, drop,
                                           DROPOUT)
                            it += 1
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                if DK_IN_FLIGHT and it > first_it:
                    mbarrier.arrive(q_empty.index((it - 1) % STAGES), count=1)
                mbarrier.arrive(kv_empty, count=1)
                tile += 1
                if STASHED:
                    if g_hi < GROUP:  # each thread reads back its own elements: no barrier
                        gl.store(stash, dk)
                        gl.store(stash + BLOCK_N * HEAD_D, dv)
                    else:
                        store_kv_grads(DK, DV, dk, dv, b, hkv, kv, k_start, k_lo, k_hi,
                                       stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                                       stride_dvn, sm_scale, drop_scale, dtype, num_warps)
                else:
                    store_kv_grads(DK, DV, dk, dv, b, hkv, kv, k_start, k_lo, k_hi, stride_dkb,
                                   stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                                   sm_scale, drop_scale, dtype, num_warps)
        work = w.next(work, claim, num_warps)
        claim += 1
    if TAIL_CONVERT:  # out of items: convert the finished rows while the others compute
        dq_tail.convert_tail(DQACC, DQ, FINISHED, ERR, CU_Q, PREFIX, stride_dqt, stride_dqh, HQ,
                             HKV, row_stride, items_per_head, total_items, max_spin, GROUP,
                             HEAD_D, num_warps)


@gluon.jit(do_not_specialize=["drop_threshold"])  # its value changes with p, not the plan
def backward_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, DQACC,
                    DQ, STASH, TICKETS, ERR, CU_Q, CU_K, PREFIX, stride_dkb, stride_dkh,
                    stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_dqt, stride_dqh, HQ,
                    HKV, L, S, n_q, n_kv,
                    max_q, max_k, row_stride, stats_stride, win_left, win_right,
                    items_per_head, total_items, qk_scale,
                    sm_scale, max_spin, RNG, drop_threshold, drop_scale,
                    GROUP: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                    NUM_SLOTS: gl.constexpr, COMPUTE_DQ: gl.constexpr, ORDERED: gl.constexpr,
                    EVEN_S: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, DQ_STAGES: gl.constexpr, WRITER_ROWS: gl.constexpr,
                    DK_IN_FLIGHT: gl.constexpr, DQ_TMA: gl.constexpr, DQ_FRAGMENT: gl.constexpr,
                    DQ_ROW_WARPS: gl.constexpr,
                    NAMED_HANDOFF: gl.constexpr, VISIT_HEADS: gl.constexpr, UNPADDED: gl.constexpr, TAIL_CONVERT: gl.constexpr,
                    CLAIMED: gl.constexpr, LOAD_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
                    DROPOUT: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV (written) and dQ partials (added into DQACC) of every work item; see the module doc.

    Dense: rank-4 descriptors over (B, heads, rows, D) in the tensors' own strides, row stats and
    DQACC over (B * Hq, row_stride), the row stats over (B * Hq, stats_stride). VARLEN:
    descriptors over (1, heads, T, D) views of the packed tensors, DQACC and TICKETS over
    (Hq, row_stride) by packed row, the stats over (Hq, stats_stride) with sequence b's rows from
    ``packed_prep.stats_start``; batch entry b is sequence b of the offsets CU_Q, CU_K (L, S:
    totals); UNPADDED: the items are dealt by PREFIX (``deal.py``), else every sequence has
    ``items_per_head``; CLAIMED: each program's items after its first are claimed from a counter
    (``deal.py``). VISIT_HEADS < GROUP: STASH holds each program's fp32 dK and dV of its
    items' KV tiles between their visits, (programs, NUM_SLOTS, 2, BLOCK_N, D). DQ_FRAGMENT:
    DQACC holds each tile of BLOCK_M rows in fragment order (``dq_order.py``), dq_desc over it
    as rows of ``dq_order.FLAT`` floats; else dq_desc over its rows of D. DROPOUT: ``dropout.py``'s
    mask from RNG's int64 (seed, offset), as the portable kernel applies it.
    """
    dtype: gl.constexpr = q_desc.dtype
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    # The red.v4 writer and the packed crossing sub-tiles read the partial by rows.
    gl.static_assert(not DQ_FRAGMENT or (DQ_TMA and not VARLEN), "fragment order: dense, TMA writer")
    gl.static_assert(16 * DQ_ROW_WARPS <= BLOCK_M, "dQ's row warps cover 16 rows each")
    if DQ_FRAGMENT:  # in the MMA's register order (``dq_order.py``); dq_desc: DQACC flat
        dq_layout: gl.constexpr = staging_layout(BLOCK_M, HEAD_D, num_warps, DQ_ROW_WARPS)
    elif DQ_TMA:  # the layout of the TMA reduce-add's box (dq_desc: DQACC as rows of HEAD_D)
        dq_layout: gl.constexpr = dq_desc.layout
    else:
        # 16-byte chunks XOR-swizzled by row: the MMA layout's stores (8 rows per warp) and the
        # writer's row loads both hit distinct banks.
        dq_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    # The writer frees the Q/dO stages as it takes the partials, which the compute warps hand
    # over only after retiring the stage's MMAs: with dK in flight, the previous step's stage
    # (this step's first wait retired it); with the named hand-off and dK retired in its step,
    # the step's own. Then a compute step ends with one arrive, or with none on a named barrier.
    WRITER_FREES: gl.constexpr = COMPUTE_DQ and (DK_IN_FLIGHT or NAMED_HANDOFF)
    # The named hand-off's participants: the compute warps and the writer's one warp.
    HANDOFF_THREADS: gl.constexpr = 32 * num_warps + 32
    gl.static_assert(not NAMED_HANDOFF or DQ_STAGES <= LAST_NAMED_BARRIER - 1,
                     "one named barrier per dQ buffer, above the two of the warp specialization")
    # Packed, after the tickets: the deal's claim counter (CLAIMED), then each (sequence, KV
    # head)'s finished items (TAIL_CONVERT, ``dq_tail.py``).
    CLAIMS = TICKETS + HQ * row_stride
    FINISHED = CLAIMS + deal.COUNTERS

    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], tile_layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_STAGES, BLOCK_M, HEAD_D], dq_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], bar_layout)
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], bar_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    # CLAIMED: the claimed work indices, from the load partition to the other two.
    work_slots = gl.allocate_shared_memory(gl.int32, [2, 32],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    work_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    work_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(DQ_STAGES):
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=1)
    for i in gl.static_range(2):
        mbarrier.init(work_ready.index(i), count=1)
        mbarrier.init(work_empty.index(i), count=2 if COMPUTE_DQ else 1)

    gl.warp_specialize([
        (_compute_partition, (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, dq_bufs,
                              q_ready, q_empty, kv_ready, kv_empty, dq_ready, dq_empty,
                              work_slots, work_ready, work_empty, DK, DV, STASH, DQACC, DQ,
                              FINISHED, ERR, CU_Q, CU_K, PREFIX, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                              stride_dqt, stride_dqh, HQ, HKV, L, S, n_q, n_kv, max_q,
                              max_k, row_stride, win_left, win_right, items_per_head, total_items,
                              qk_scale, sm_scale, max_spin,
                              GROUP, CAUSAL, SCHEDULE, NUM_SLOTS, COMPUTE_DQ, EVEN_S, DK_IN_FLIGHT,
                              WINDOW, VARLEN, NAMED_HANDOFF, WRITER_FREES, HANDOFF_THREADS,
                              VISIT_HEADS, UNPADDED, TAIL_CONVERT, CLAIMED, DQ_ROW_WARPS,
                              num_warps, RNG, drop_threshold, drop_scale, DROPOUT)),
        (load_partition, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs,
                           lse_bufs, delta_bufs, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                           work_slots, work_ready, work_empty, CLAIMS, ERR, max_spin, CU_Q,
                           CU_K, PREFIX, HQ, HKV, L, S, n_q, n_kv, max_q, max_k,
                           stats_stride, win_left, win_right, items_per_head, total_items,
                           GROUP, CAUSAL, SCHEDULE, NUM_SLOTS, WINDOW, VARLEN, VISIT_HEADS,
                           UNPADDED, CLAIMED)),
        (dq_writer_partition, (dq_desc, dq_bufs, dq_ready, dq_empty, q_empty, work_slots,
                               work_ready, work_empty, DQACC, TICKETS,
                               FINISHED, ERR, CU_Q, CU_K, PREFIX, HQ, HKV, L, S, n_q, n_kv, max_q,
                               max_k, row_stride, win_left, win_right, items_per_head,
                               total_items, max_spin, GROUP, CAUSAL, SCHEDULE, NUM_SLOTS,
                               BLOCK_N, COMPUTE_DQ, ORDERED, WRITER_ROWS, WINDOW, VARLEN, DQ_TMA,
                               DQ_FRAGMENT, WRITER_FREES,
                               DK_IN_FLIGHT, NAMED_HANDOFF, HANDOFF_THREADS, VISIT_HEADS,
                               UNPADDED, TAIL_CONVERT, CLAIMED)),
    ], [1, 1], [LOAD_REGS, WRITER_REGS])
