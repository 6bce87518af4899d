"""The Hopper backward's walk over its work, shared by the kernel's three partitions.

Each partition (loader, compute, dQ writer) walks the same items, KV tiles and steps on its own, so
all three must agree on every count and skip: they do, by running the one loop of ``Walk`` over
their program's items and calling these functions with the same arguments. The schedules'
formulas are those of the portable kernel (``ops/shared/schedules.py``), and so are the geometry
of packed sequences and windows (``ops/portable/backward.py``; ``ops/shared/tiles.py``):

- a work item of sequence ``b`` (VARLEN: the virtual batch of ``ops/portable/packed.py``) counts its tiles
  from that sequence's bounds; causal and windows are aligned bottom-right by shifting the tile
  coordinates (``tiles.diagonal_origin``), so rows ``[q_lo, q_hi)`` and keys ``[k_lo, k_hi)`` are
  real and everything outside is padding (dense: ``q_lo = k_lo = 0``, ``q_hi = L``, ``k_hi = S``);
- a window limits each KV tile to a contiguous range of Q tiles and ranks contributions in
  ascending KV order (``schedules.window_*``).
"""

from __future__ import annotations

import typing

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Triton 3.6's Gluon has no public aggregate; its own modules use the language's.
try:
    from triton.experimental.gluon import aggregate
except ImportError:
    from triton.language.core import _aggregate as aggregate

from ..shared import schedules as sch
from ..shared import tiles
from . import deal
from .packed_prep import stats_start


@gluon.jit
def entry_count(total_items, items_per_head, HKV):
    """The batch entries (packed: sequences) of a launch of ``total_items``, each counted with
    ``items_per_head`` items per KV head."""
    return total_items // (items_per_head * HKV)


@gluon.jit
def work_count(total_items, items_per_head, HKV, PREFIX, UNPADDED: gl.constexpr):
    """The work indices to deal: ``total_items`` (every batch entry or sequence counted with
    ``items_per_head`` items per KV head), or, UNPADDED, the real items of packed sequences
    (``deal.py``)."""
    if UNPADDED:
        result = gl.load(PREFIX + entry_count(total_items, items_per_head, HKV)) * HKV
    else:
        result = total_items
    return result


@gluon.jit
def work_head(work, items_per_head, total_items, HKV, PREFIX, UNPADDED: gl.constexpr):
    """(batch or sequence, KV head, item) of a work index, heads major: every entry with
    ``items_per_head`` items per KV head, or, UNPADDED, the j-th sequence of the deal's order
    with PREFIX[j + 1] - PREFIX[j] (the last j with PREFIX[j] * HKV <= work, by binary search;
    the sequence at PREFIX[entries + 1 + j]: ``deal.py``)."""
    if UNPADDED:
        entries = entry_count(total_items, items_per_head, HKV)
        lo = 0 * work
        hi = entries - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            below = gl.load(PREFIX + mid) * HKV <= work
            lo = gl.where(below, mid, lo)
            hi = gl.where(below, hi, mid - 1)
        first = gl.load(PREFIX + lo)
        count = gl.load(PREFIX + lo + 1) - first
        local = work - first * HKV
        result = (gl.load(PREFIX + entries + 1 + lo), local // count, local % count)
    else:
        head = work // items_per_head
        result = (head // HKV, head % HKV, work % items_per_head)
    return result


@gluon.jit
def sequence_tiles(b, L, S, n_q, n_kv, CU_Q, CU_K, max_q, max_k, BLOCK_N: gl.constexpr,
                   ALIGNED: gl.constexpr, VARLEN: gl.constexpr):
    """(q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles of Q, tiles of KV) of batch entry ``b``.

    Tile row ``r`` is packed row ``q_start + r`` and tile key ``c`` packed key ``k_start + c``
    (VARLEN; dense: 0). A sequence without keys has no tiles, one without queries no Q tile.
    """
    if VARLEN:
        q0, k0, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv = tiles.sequence_tiles(
            CU_Q, CU_K, b, L, S, max_q, max_k, BLOCK_N, ALIGNED)
        result = (q0 - q_lo, k0 - k_lo, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv)
    else:
        result = (0 * b, 0 * b, 0 * b, L + 0 * b, 0 * b, S + 0 * b, n_q + 0 * b, n_kv + 0 * b)
    return result


@gluon.jit
def slot_tile(item, slot, tiles_kv, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr):
    """The KV tile of ``slot`` of ``item`` in a sequence of ``tiles_kv`` KV tiles; -1: none."""
    kv = sch.slot_kv_tile(item, slot, tiles_kv, CAUSAL, SCHEDULE)
    live = item < sch.items_in_head(tiles_kv, CAUSAL, SCHEDULE)
    return gl.where(live, kv, -1)


@gluon.jit
def visit_heads(visit, NUM_SLOTS: gl.constexpr, GROUP: gl.constexpr, VISIT_HEADS: gl.constexpr):
    """(slot, first query head, last query head + 1) of a work item's ``visit``-th visit of a KV
    tile: each slot's tile once for all the query heads of its GQA group (VISIT_HEADS = GROUP,
    ``NUM_SLOTS`` visits), or once per VISIT_HEADS of them, the heads outermost (``NUM_SLOTS *
    GROUP / VISIT_HEADS`` visits): then every item of a KV head spends the same time on each
    query head, so the items in flight touch few query heads' dQ, Q and dO at a time
    (docs/kernels-notes.md)."""
    if VISIT_HEADS < GROUP:
        first = visit // NUM_SLOTS * VISIT_HEADS
        result = (visit % NUM_SLOTS, first, first + VISIT_HEADS)
    else:
        result = (visit, 0 * visit, 0 * visit + GROUP)
    return result


def _aggregate(cls):
    """``aggregate`` with a constructor taking the fields in order, which Triton 3.6's
    aggregates do not generate (a constexpr function: it gets its arguments unwrapped, so plain
    values go back into constexprs), and the fields' types resolved, which 3.6 checks as given."""
    cls.__annotations__ = typing.get_type_hints(cls)  # 3.6 checks fields against them
    names = tuple(cls.__annotations__)

    def __init__(self, *fields):
        for name, value in zip(names, fields, strict=True):
            setattr(self, name, value if isinstance(value, gl.base_value) else gl.constexpr(value))

    cls.__init__ = gluon.constexpr_function(__init__)
    return aggregate(cls)


#: A scalar argument of the kernel: Triton's launcher passes an int equal to 1 as a constexpr.
_Int = gl.tensor | gl.constexpr


@_aggregate
class Walk:
    """The loop over a program's work items, the same in its three partitions (``start``)::

        w = walk.start(...)
        work = gl.program_id(0)  # every deal starts at the program's index
        claim = 0
        while work < w.works:
            b, hkv, item, q_start, ..., tiles_kv = w.item(work)
            for visit in range(w.VISITS):
                slot, g_lo, g_hi, kv = w.visit(visit, item, tiles_kv)
                if kv >= 0:
                    ...
            work = w.next(work, claim, NUM_WARPS)  # the load partition: w.claim(work, ...)
            claim += 1

    The cursor (work, claim) stays in the partition: creating or stepping it in a jitted helper
    added debug-scope labels to the PTX, on which ptxas allocated and scheduled differently.
    """
    items_per_head: _Int
    total_items: _Int
    HKV: _Int
    PREFIX: gl.tensor
    L: _Int
    S: _Int
    n_q: _Int
    n_kv: _Int
    CU_Q: gl.tensor
    CU_K: gl.tensor
    max_q: _Int
    max_k: _Int
    works: _Int
    slots: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    WINDOW: gl.constexpr
    VARLEN: gl.constexpr
    SCHEDULE: gl.constexpr
    NUM_SLOTS: gl.constexpr
    GROUP: gl.constexpr
    VISIT_HEADS: gl.constexpr
    VISITS: gl.constexpr
    UNPADDED: gl.constexpr
    CLAIMED: gl.constexpr

    @gluon.jit
    def item(self, work):
        """(b, KV head, item) of work index ``work`` (``work_head``), then its sequence's
        (q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles of Q, tiles of KV) (``sequence_tiles``)."""
        b, hkv, item = work_head(work, self.items_per_head, self.total_items, self.HKV,
                                 self.PREFIX, self.UNPADDED)
        q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv = sequence_tiles(
            b, self.L, self.S, self.n_q, self.n_kv, self.CU_Q, self.CU_K, self.max_q,
            self.max_k, self.BLOCK_N, self.CAUSAL or self.WINDOW, self.VARLEN)
        return b, hkv, item, q_start, k_start, q_lo, q_hi, k_lo, k_hi, tiles_q, tiles_kv

    @gluon.jit
    def visit(self, visit, item, tiles_kv):
        """(slot, first query head, last query head + 1, KV tile or -1: none) of ``item``'s
        ``visit``-th visit of a KV tile (``visit_heads``, ``slot_tile``)."""
        slot, g_lo, g_hi = visit_heads(visit, self.NUM_SLOTS, self.GROUP, self.VISIT_HEADS)
        kv = slot_tile(item, slot, tiles_kv, self.CAUSAL, self.SCHEDULE)
        return slot, g_lo, g_hi, kv

    @gluon.jit
    def next(self, work, claim, NUM_WARPS: gl.constexpr):
        """The compute or writer partition's work index after ``work``, its ``claim``-th step
        (``deal.next_work``)."""
        return deal.next_work(work, claim, self.slots, self.ready, self.empty, self.CLAIMED,
                              NUM_WARPS)

    @gluon.jit
    def claim(self, work, item, tiles_kv, claim, CLAIMS, ERR, max_spin):
        """The load partition's work index after ``work`` (``item`` of a sequence of ``tiles_kv``
        KV tiles), its ``claim``-th step (``deal.claim_work``: past the item's head)."""
        head_end = work - item + sch.items_in_head(tiles_kv, self.CAUSAL, self.SCHEDULE)
        return deal.claim_work(work, head_end, self.works, claim, CLAIMS, ERR, max_spin,
                               self.slots, self.ready, self.empty, self.CLAIMED)


@gluon.jit
def start(items_per_head, total_items, HKV, PREFIX, L, S, n_q, n_kv, CU_Q, CU_K, max_q, max_k,
          slots, ready, empty, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
          WINDOW: gl.constexpr, VARLEN: gl.constexpr, SCHEDULE: gl.constexpr,
          NUM_SLOTS: gl.constexpr, GROUP: gl.constexpr, VISIT_HEADS: gl.constexpr,
          UNPADDED: gl.constexpr, CLAIMED: gl.constexpr):
    """A partition's ``Walk`` from the kernel's arguments; ``slots``, ``ready`` and ``empty`` are
    the claimed deal's ring (``deal.py``). An item visits its KV tiles once per slot and
    VISIT_HEADS query heads (``visit_heads``)."""
    works = work_count(total_items, items_per_head, HKV, PREFIX, UNPADDED)
    return Walk(items_per_head, total_items, HKV, PREFIX, L, S, n_q, n_kv, CU_Q, CU_K, max_q,
                max_k, works, slots, ready, empty, BLOCK_N, CAUSAL, WINDOW, VARLEN, SCHEDULE,
                NUM_SLOTS, GROUP, VISIT_HEADS, NUM_SLOTS * (GROUP // VISIT_HEADS), UNPADDED,
                CLAIMED)


@gluon.jit
def q_range(kv, tiles_q, BLOCK_N: gl.constexpr, win_left, win_right, CAUSAL: gl.constexpr,
            WINDOW: gl.constexpr):
    """(first Q tile, count) of the Q tiles KV tile ``kv`` meets (first is 0 without a window)."""
    if WINDOW:
        first, count = sch.window_q_range(kv, tiles_q, BLOCK_N, win_left, win_right, CAUSAL)
    else:
        first = 0 * kv
        count = sch.visit_count(kv, tiles_q, CAUSAL)
    return first, count


@gluon.jit
def step_rows(step, kv, first, count, tiles_q, tiles_kv, q_lo, q_hi, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              VARLEN: gl.constexpr, SCHEDULE: gl.constexpr):
    """(Q tile, first row of the sub-tile, whether it holds a real row) of KV tile ``kv``'s
    ``step``-th step: its visit ``step // (BLOCK_N // BLOCK_M)``, in the schedule's order, one
    sub-tile of BLOCK_M rows at a time. A packed sequence's first and last tiles may have
    sub-tiles of padding only, which every partition skips."""
    NSUB: gl.constexpr = BLOCK_N // BLOCK_M
    if WINDOW:
        qt = sch.window_q_tile_at(step // NSUB, first, count, SCHEDULE)
    else:
        qt = sch.q_tile_at(step // NSUB, kv, tiles_q, tiles_kv, CAUSAL, SCHEDULE)
    row0 = qt * BLOCK_N + (step % NSUB) * BLOCK_M
    if VARLEN:
        live = (row0 + BLOCK_M > q_lo) & (row0 < q_hi)
    else:
        live = row0 >= 0
    return qt, row0, live


#: Whether a tile's rows or keys reach outside its packed sequence (``tiles.crosses_edge``).
crosses_edge = tiles.crosses_edge


#: A packed tile's key outside its sequence, recoded (``key_order``): beyond any tile coordinate.
OUTSIDE = gl.constexpr(1 << 30)


@gluon.jit
def key_order(keys, k_lo, k_hi):
    """A packed tile's keys (1-D, once per KV tile) with those outside the sequence's [k_lo, k_hi)
    recoded to OUTSIDE: then ``key <= query`` holds exactly where the key is real and not after
    the query, and ``key < OUTSIDE`` where it is real, one test per element as in a dense tile.
    The queries need none: the stats' padding gives rows outside the sequence P = 0
    (``packed_prep.py``). Five tests per element made the packed causal kernel 10-25% slower,
    and the sequence's bounds in every step cost it registers (docs/kernels-notes.md)."""
    return gl.where((keys >= k_lo) & (keys < k_hi), keys, OUTSIDE)


@gluon.jit
def rank(qt, kv, tiles_q, tiles_kv, BLOCK_N: gl.constexpr, win_left, CAUSAL: gl.constexpr,
         WINDOW: gl.constexpr, SCHEDULE: gl.constexpr):
    """The position of KV tile ``kv``'s dQ contribution in Q tile ``qt``'s reduction order."""
    if WINDOW:
        r = sch.window_rank(qt, kv, BLOCK_N, win_left)
    else:
        r = sch.reduction_rank(qt, kv, tiles_q, tiles_kv, CAUSAL, SCHEDULE)
    return r


@gluon.jit
def tma_batch(b, VARLEN: gl.constexpr):
    """Batch entry ``b``'s coordinate in the (B, H, N, D) TMA descriptors of Q, K, V and dO: packed
    sequences are all in the one entry of (1, H, T, D) views."""
    result = b
    if VARLEN:
        result = 0
    return result


@gluon.jit
def head_rows(b, hq, HQ, q_start, row_stride, VARLEN: gl.constexpr):
    """The row of tile row 0 in the dQ accumulator and, packed, the tickets, for query head ``hq``
    of batch entry ``b``."""
    if VARLEN:  # accumulator (Hq, row_stride) by packed row
        result = hq * row_stride + q_start
    else:  # accumulator (B * Hq, row_stride)
        result = (b * HQ + hq) * row_stride
    return result


@gluon.jit
def stats_row(b, hq, HQ, q_start, q_lo, stats_stride, BLOCK_M: gl.constexpr,
              VARLEN: gl.constexpr):
    """The row of tile row 0 in the row stats, (B * Hq, stats_stride) or, packed, (Hq,
    stats_stride). A 1-D TMA box must start 16-byte aligned and a packed sequence starts
    anywhere, so packed stats are laid out with each sequence at ``packed_prep.stats_start``,
    congruent to its q_lo modulo 4, in a room padded with BLOCK_M rows on each side."""
    if VARLEN:
        result = hq * stats_stride + stats_start(q_start + q_lo, b, q_lo, BLOCK_M) - q_lo
    else:
        result = (b * HQ + hq) * stats_stride
    return result
