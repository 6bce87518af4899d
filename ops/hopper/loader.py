"""The Hopper backward's load partition (one warp): TMA loads of K and V per KV tile, then of Q,
dO and the row stats per step, into shared memory through mbarrier rings, walking the same items
and steps as the other two partitions (``walk.py``). See ``backward.py``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import walk
from .primitives import tma_load


@gluon.jit
def _load_tile(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
               delta_bufs, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, b, hkv, kv,
               g_lo, g_hi, batch, q_start, k_start, q_lo, q_hi, tiles_q, tiles_kv,
               HQ, stats_stride, win_left, win_right, it, tile, GROUP: gl.constexpr,
               CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, WINDOW: gl.constexpr,
               VARLEN: gl.constexpr):
    """K and V of KV tile ``kv``, then Q, dO and the row stats of every step of query heads
    [g_lo, g_hi) of its group; returns the stage and tile counters."""
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    NSUB: gl.constexpr = BLOCK_N // BLOCK_M
    HEAD_D: gl.constexpr = k_smem.shape[1]
    step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    tile_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    mbarrier.wait(kv_empty, (tile & 1) ^ 1)
    mbarrier.expect(kv_ready, tile_bytes)
    key0 = k_start + kv * BLOCK_N
    tma_load(k_desc, [batch, hkv, key0, 0], kv_ready, k_smem.reshape([1, 1, BLOCK_N, HEAD_D]))
    tma_load(v_desc, [batch, hkv, key0, 0], kv_ready, v_smem.reshape([1, 1, BLOCK_N, HEAD_D]))
    first, count = walk.q_range(kv, tiles_q, BLOCK_N, win_left, win_right, CAUSAL, WINDOW)
    for g in range(g_lo, g_hi):
        q_head = hkv * GROUP + g
        stats_base = walk.stats_row(b, q_head, HQ, q_start, q_lo, stats_stride, BLOCK_M, VARLEN)
        for step in range(count * NSUB):
            _, row0, live = walk.step_rows(step, kv, first, count, tiles_q, tiles_kv, q_lo, q_hi,
                                           BLOCK_M, BLOCK_N, CAUSAL, WINDOW, VARLEN, SCHEDULE)
            if live:
                s = it % STAGES
                mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = q_ready.index(s)
                mbarrier.expect(bar, step_bytes)
                packed_row = q_start + row0
                tma_load(q_desc, [batch, q_head, packed_row, 0], bar,
                         q_bufs.index(s).reshape([1, 1, BLOCK_M, HEAD_D]))
                tma_load(do_desc, [batch, q_head, packed_row, 0], bar,
                         do_bufs.index(s).reshape([1, 1, BLOCK_M, HEAD_D]))
                tma_load(lse_desc, [stats_base + row0], bar, lse_bufs.index(s))
                tma_load(delta_desc, [stats_base + row0], bar, delta_bufs.index(s))
                it += 1
    return it, tile + 1


@gluon.jit
def load_partition(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs,
                    lse_bufs, delta_bufs, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                    work_slots, work_ready, work_empty, CLAIMS, ERR, max_spin,
                    CU_Q, CU_K, PREFIX, HQ, HKV, L, S, n_q, n_kv, max_q, max_k,
                    stats_stride, win_left, win_right, items_per_head, total_items,
                    GROUP: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                    NUM_SLOTS: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                    VISIT_HEADS: gl.constexpr, UNPADDED: gl.constexpr,
                    CLAIMED: gl.constexpr):
    """CLAIMED: claims its program's items after the first (``deal.claim_work``)."""
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    it = 0
    tile = 0
    w = walk.start(items_per_head, total_items, HKV, PREFIX, L, S, n_q, n_kv, CU_Q, CU_K, max_q,
                   max_k, work_slots, work_ready, work_empty, BLOCK_N, CAUSAL, WINDOW, VARLEN,
                   SCHEDULE, NUM_SLOTS, GROUP, VISIT_HEADS, UNPADDED, CLAIMED)
    work = gl.program_id(0)
    claim = 0
    while work < w.works:
        b, hkv, item, q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv = w.item(work)
        batch = walk.tma_batch(b, VARLEN)
        for visit in range(w.VISITS):
            slot, g_lo, g_hi, kv = w.visit(visit, item, tiles_kv)
            if kv >= 0:
                it, tile = _load_tile(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc,
                                      q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem,
                                      q_ready, q_empty, kv_ready, kv_empty, b, hkv, kv, g_lo,
                                      g_hi, batch, q_start, k_start, q_lo, q_hi,
                                      tiles_q, tiles_kv, HQ, stats_stride, win_left, win_right, it,
                                      tile, GROUP, CAUSAL, SCHEDULE, WINDOW, VARLEN)
        work = w.claim(work, item, tiles_kv, claim, CLAIMS, ERR, max_spin)
        claim += 1
