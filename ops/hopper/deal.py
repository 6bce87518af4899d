"""How the Hopper backward deals the work items of packed sequences to its programs.

Program p runs work indices p, p + P, ... in order. The padded deal (``walk.work_head``, also the
dense one) counts every sequence's items as if it were the longest, so index w is item
w % per_head of (sequence, KV head) w // per_head, and the items a shorter sequence lacks are
drawn and skipped: the programs then start a (sequence, KV head)'s items at different times, and
under ``shift`` they wait for each other's dQ turns (``dash_inductor/packed_schedule.py``).

The unpadded deal lists the real items only, sequences major and each (sequence, KV head)'s
items together. ``PREFIX[b]`` counts the items per KV head of the sequences before b; one
program of the packed preprocess (``packed_prep.py``) builds it on the device from the offsets
(the host reads none), and each partition of the kernel finds a work index's sequence by binary
search (``walk.work_head``). A (sequence, KV head) still holds at most P items (``fit_schedule``
sizes P for the longest), all within P consecutive work indices, so each ordered wait is for an
item that a program reaches by finishing items of lower indices only: the argument of
``ops/schedules.py`` holds as before.

The unpadded deal is also claimed: program p starts with index p, and its load partition then
claims each next index from a counter (index P + the counter's old value) once it has issued
the previous item's loads, and hands it to the compute and writer partitions through a ring of
two slots in shared memory (``first_work``, ``next_work``). Items of unequal length then go to
the programs that finish first, as FlashAttention-3's tile scheduler deals causal tiles. Indices
are still claimed in increasing order, so the argument holds: the lowest (sequence, KV head)
with unfinished items has every item claimed, by programs each of which runs it or a lower,
finished-or-running item before it, so its waits end. The bits do not change: a dQ element's
adds keep the schedule's order whichever program runs an item.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .. import schedules as sch
from ..tiles import sequence_tiles


@triton.jit
def write_item_prefix(CU_Q, CU_K, PREFIX, num_seqs, total_q, total_k, max_q, max_k,
                      BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr, CAUSAL: tl.constexpr,
                      SCHEDULE: tl.constexpr, BLOCK: tl.constexpr):
    """PREFIX[0] = 0, PREFIX[b + 1] = the items per KV head of sequences 0..b (as the walk
    counts them: ``tiles.sequence_tiles`` and ``walk.slot_tile``), by one program, BLOCK
    sequences at a time (the packed preprocess, ``packed_prep.py``, runs it)."""
    tl.store(PREFIX, 0)
    carry = 0
    for start in range(0, num_seqs, BLOCK):
        index = start + tl.arange(0, BLOCK)
        inside = index < num_seqs
        seq = tl.minimum(index, num_seqs - 1)
        tiles_kv = sequence_tiles(CU_Q, CU_K, seq, total_q, total_k, max_q, max_k, BLOCK_N,
                                  ALIGNED)[7]
        items = tl.where(inside, sch.items_in_head(tiles_kv, CAUSAL, SCHEDULE), 0)
        tl.store(PREFIX + 1 + index, carry + tl.cumsum(items, 0), mask=inside)
        carry += tl.sum(items, 0)


@gluon.jit
def _publish(work, n, slots, work_ready, work_empty):
    """The load partition hands its n-th work index to the other partitions (a ring of two)."""
    s = n % 2
    mbarrier.wait(work_empty.index(s), ((n // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slots.index(s).store(gl.full([32], work, gl.int32, layout=layout))
    mbarrier.arrive(work_ready.index(s), count=1)


@gluon.jit
def _take(n, slots, work_ready, work_empty, NUM_WARPS: gl.constexpr):
    """A compute or writer partition takes its n-th work index from the load partition."""
    s = n % 2
    mbarrier.wait(work_ready.index(s), (n // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    work = gl.max(slots.index(s).load(layout), axis=0)
    mbarrier.arrive(work_empty.index(s), count=1)
    return work


@gluon.jit
def first_work(slots, work_ready, work_empty, LOADER: gl.constexpr, CLAIMED: gl.constexpr,
               NUM_WARPS: gl.constexpr):
    """A partition's first work index: its program's (every deal starts with one per program)."""
    work = gl.program_id(0)
    if CLAIMED:
        if LOADER:
            _publish(work, 0, slots, work_ready, work_empty)
        else:
            work = _take(0, slots, work_ready, work_empty, NUM_WARPS)
    return work


@gluon.jit
def next_work(work, n, COUNTER, slots, work_ready, work_empty, LOADER: gl.constexpr,
              CLAIMED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """A partition's n-th work index (n >= 1), after ``work``: P further on (P programs), or,
    CLAIMED, the next one the load partition claims from the counter once it has issued the
    previous item's loads; an index at or past the last ends the partition's walk."""
    if CLAIMED:
        if LOADER:
            work = gl.atomic_add(COUNTER, 1) + gl.num_programs(0)
            _publish(work, n, slots, work_ready, work_empty)
        else:
            work = _take(n, slots, work_ready, work_empty, NUM_WARPS)
    else:
        work = work + gl.num_programs(0)
    return work
