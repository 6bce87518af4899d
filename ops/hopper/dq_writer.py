"""The Hopper backward's dQ writer: the one-warp partition that adds each step's dQ partial into
the fp32 accumulator, in the schedule's rank order for the ordered schedules (DASH's dQ writer,
Qiang et al. 2026; FlashAttention-3's bulk reduce, Shah et al. 2024). See ``backward.py``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from . import dq_tail, walk
from .dq_order import as_flat
from .primitives import (LAST_NAMED_BARRIER, await_count, named_barrier_sync, partition_barrier,
                         red_add, red_add_rows, tma_add, tma_store, tma_writes_performed)


@gluon.jit
def _take_partial(dq_ready, it, NAMED_HANDOFF: gl.constexpr, HANDOFF_THREADS: gl.constexpr):
    """Wait until the compute warps have stored partial ``it`` (and fenced it for the TMA)."""
    DQ_STAGES: gl.constexpr = dq_ready.shape[0]
    if NAMED_HANDOFF:
        named_barrier_sync(LAST_NAMED_BARRIER - it % DQ_STAGES, HANDOFF_THREADS)
    else:
        mbarrier.wait(dq_ready.index(it % DQ_STAGES), (it // DQ_STAGES) & 1)


@gluon.jit
def dq_writer_partition(dq_desc, dq_bufs, dq_ready, dq_empty, q_empty, work_slots, work_ready,
                        work_empty, DQACC, TICKETS, FINISHED, ERR, CU_Q, CU_K, PREFIX, HQ, HKV, L, S, n_q, n_kv, max_q, max_k,
                        row_stride, win_left, win_right, items_per_head, total_items, max_spin,
                        GROUP: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                        NUM_SLOTS: gl.constexpr, BLOCK_N: gl.constexpr, COMPUTE_DQ: gl.constexpr,
                        ORDERED: gl.constexpr, ROWS: gl.constexpr, WINDOW: gl.constexpr,
                        VARLEN: gl.constexpr, DQ_TMA: gl.constexpr, DQ_FRAGMENT: gl.constexpr,
                        FREES_STAGES: gl.constexpr, PREVIOUS_STAGE: gl.constexpr,
                        NAMED_HANDOFF: gl.constexpr,
                        HANDOFF_THREADS: gl.constexpr, VISIT_HEADS: gl.constexpr,
                        UNPADDED: gl.constexpr, TAIL_CONVERT: gl.constexpr,
                        CLAIMED: gl.constexpr):
    """Add each step's dQ partial into DQACC, in the schedule's rank order when ORDERED: with one
    TMA reduce-add (DQ_TMA; DQ_FRAGMENT: a partial staged in fragment order, through DQACC's
    flat view, ``dq_order.py``), else (and for a packed sub-tile that crosses its sequence's
    edge) with vectorized ``red`` adds from registers. FREES_STAGES: on taking a partial, release a
    Q/dO stage that the compute warps retired before handing the partial over: the KV tile's
    previous step's with PREVIOUS_STAGE (dK in flight), else the partial's own (one arrive a
    step fewer for them, each of which costs them two barriers). NAMED_HANDOFF: the partial
    comes on a named barrier of HANDOFF_THREADS threads, else on the ``dq_ready`` mbarrier.
    An item visits its KV tiles once per VISIT_HEADS query heads (``walk.visit_heads``).
    TAIL_CONVERT: count each finished item in FINISHED (``dq_tail.py``).
    CLAIMED: the items after the program's first come from the load partition (``deal.py``).

    Ordered, the first rank of every partial stores it instead of adding it, so DQACC need not
    be cleared (FlashAttention-3's preprocess clears it): the launchers clear only rows that no
    KV tile reaches, where some may exist, and the rows of packed sub-tiles that cross their
    sequence's edge, which are always added (``packed_prep.py``). x and 0 + x are the same
    float but for the sign of a zero, which no comparison of values sees."""
    if not COMPUTE_DQ:
        return
    DQ_STAGES: gl.constexpr = dq_bufs.shape[0]
    BLOCK_M: gl.constexpr = dq_bufs.shape[1]
    HEAD_D: gl.constexpr = dq_bufs.shape[2]
    STAGES: gl.constexpr = q_empty.shape[0]
    NSUB: gl.constexpr = BLOCK_N // BLOCK_M
    FLAT_ROWS: gl.constexpr = dq_desc.block_type.shape[0]
    # Four contiguous floats per lane and no lane holding another's elements (the adds are raw
    # ``red`` instructions: a replicated element would be added twice).
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // HEAD_D, HEAD_D // 4], [1, 1], [1, 0])
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    it = 0
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
                first, count = walk.q_range(kv, tiles_q, BLOCK_N, win_left, win_right, CAUSAL,
                                            WINDOW)
                first_it = it
                for g in range(g_lo, g_hi):
                    row_base = walk.head_rows(b, hkv * GROUP + g, HQ, q_start, row_stride, VARLEN)
                    for step in range(count * NSUB):
                        qt, row0, live = walk.step_rows(step, kv, first, count, tiles_q,
                                                        tiles_kv, q_lo, q_hi, BLOCK_M, BLOCK_N,
                                                        CAUSAL, WINDOW, VARLEN, SCHEDULE)
                        if live:
                            d = it % DQ_STAGES
                            if VARLEN:  # one ticket per (head, first real row of the sub-tile)
                                ticket = TICKETS + row_base + gl.maximum(row0, q_lo)
                            else:
                                ticket = TICKETS + row_base // BLOCK_M + qt * NSUB + step % NSUB
                            if FREES_STAGES:
                                _take_partial(dq_ready, it, NAMED_HANDOFF, HANDOFF_THREADS)
                                if not PREVIOUS_STAGE:
                                    mbarrier.arrive(q_empty.index(it % STAGES), count=1)
                                elif it > first_it:
                                    mbarrier.arrive(q_empty.index((it - 1) % STAGES), count=1)
                            if ORDERED:
                                # Without FREES_STAGES the turn is polled before the partial is
                                # ready (it usually comes while this step still computes); with
                                # it the partial is taken first, so that a late turn never holds
                                # back the release of the loader's stage.
                                turn = walk.rank(qt, kv, tiles_q, tiles_kv, BLOCK_N, win_left,
                                                 CAUSAL, WINDOW, SCHEDULE)
                                await_count(ticket, turn, turn, ERR, max_spin)
                            if not FREES_STAGES:
                                _take_partial(dq_ready, it, NAMED_HANDOFF, HANDOFF_THREADS)
                            base = DQACC + (row_base + row0).to(gl.int64) * HEAD_D
                            buf = dq_bufs.index(d)
                            crossing = VARLEN and walk.crosses_edge(row0, BLOCK_M, q_lo, q_hi)
                            # Ordered, the first rank stores its partial (1), the others add.
                            first_rank = 0
                            if ORDERED:
                                first_rank = (turn == 0).to(gl.int32)
                            # One TMA reduce-add (or store) per partial, or red.v4 adds from
                            # registers. A packed sub-tile that crosses its sequence's edge adds
                            # row by row (its own rows), always (the packed preprocess clears its
                            # rows): predicated adds become a branch per add in SASS, with no
                            # shared memory load in flight across it, and made the writer the
                            # packed kernel's bottleneck (docs/kernels-notes.md).
                            if crossing:
                                for r in gl.static_range(0, BLOCK_M, ROWS):
                                    vals = buf.slice(r, ROWS, dim=0).load(layout)
                                    ptrs = base + (r + offs_r)[:, None] * HEAD_D + offs_d[None, :]
                                    rows = row0 + r + offs_r
                                    keep = ((rows >= q_lo) & (rows < q_hi)).to(gl.int32)
                                    red_add_rows(ptrs, vals, keep[:, None] + 0 * offs_d[None, :])
                            elif DQ_TMA:
                                if DQ_FRAGMENT:  # the tile's FLAT_ROWS rows of the flat view
                                    box = [(row_base + row0) // BLOCK_M * FLAT_ROWS, 0]
                                    src = as_flat(buf, dq_desc)
                                else:
                                    box = [row_base + row0, 0]
                                    src = buf
                                if first_rank:
                                    tma_store(dq_desc, box, src)
                                else:
                                    tma_add(dq_desc, box, src)
                                tma.store_wait(0)  # read: the staging buffer is free again
                            else:
                                for r in gl.static_range(0, BLOCK_M, ROWS):
                                    vals = buf.slice(r, ROWS, dim=0).load(layout)
                                    ptrs = base + (r + offs_r)[:, None] * HEAD_D + offs_d[None, :]
                                    if first_rank:
                                        red_add(ptrs, vals, STORE=True)
                                    else:
                                        red_add(ptrs, vals)
                            mbarrier.arrive(dq_empty.index(d), count=1)
                            if ORDERED:
                                if DQ_TMA:  # the stores and adds are performed, not only read
                                    tma_writes_performed()
                                # every lane's stores or adds are issued before the release
                                partition_barrier()
                                gl.atomic_add(ticket, 1, sem="release")
                            it += 1
        if TAIL_CONVERT:  # every add of the item is performed and released
            dq_tail.item_finished(FINISHED, b, hkv, HKV)
        work = w.next(work, claim, 1)
        claim += 1
