"""How the Hopper backward deals the work items of packed sequences to its programs.

Program p runs work indices p, p + P, ... in order. The padded deal (``walk.work_head``, also the
dense one) counts every sequence's items as if it were the longest, so index w is item
w % per_head of (sequence, KV head) w // per_head, and the items a shorter sequence lacks are
drawn and skipped: the programs then start a (sequence, KV head)'s items at different times, and
under ``shift`` they wait for each other's dQ turns (``dash_inductor/model/packed_schedule.py``).

The unpadded deal lists the real items only, sequences major and each (sequence, KV head)'s
items together, the sequences with the most KV tiles first (ties in offset order): the longest
work first, so that the last rounds hold short items (in the packed model, 2.2% sooner on
average over twelve random packings of 16k tokens, up to 7%; docs/kernels-notes.md). Where one
block of the preprocess cannot hold every sequence (more than ``MAX_SORTED``) they keep their
offset order. ``PREFIX[j]`` counts the items per KV head of the first j sequences in that order
and ``PREFIX[num_seqs + 1 + j]`` is the j-th sequence; one program of the packed preprocess
(``packed_prep.py``) builds both on the device from the offsets (the host reads none), and each
partition of the kernel finds a work index's place by binary search (``walk.work_head``). A
(sequence, KV head) still holds at most P items (``fit_schedule`` sizes P for the longest), all
within P consecutive work indices, so each ordered wait is for an item that a program reaches by
finishing items of lower indices only: the argument of ``ops/shared/schedules.py`` holds whatever the
order of the sequences, and no order changes a bit (each dQ sum keeps its ranks).

Where the config asks (causal masks: ``config.backward_config``), the unpadded deal is also
claimed: program p starts with index p, and its load partition claims each later index from a
counter (P + the counter's old value) once it has issued all loads of its current item
(``claim_work``), and hands it to the compute and dQ writer partitions through a ring of two
slots in shared memory (``next_work``), so items of unequal length go to the programs that free
up first (FlashAttention-3's tile scheduler deals its causal tiles so). A program never claims
an item of its current item's (sequence, KV head): it waits until the counter has passed that
head's last index. Without that rule a short item's program could claim the next item of its own
head, which its current item waits on (``shift``'s ranks are circular within a head) while the
claimed one waits for the program: a wait that only the spin bound ends. With it, the argument
holds: indices are claimed in increasing order, so the lowest (sequence, KV head) with
unfinished items has all its items claimed (a head holds at most P items, and a program that
holds one of them claims past the head only), each by a program that runs it after finished or
running items of lower heads. The model is ``packed_schedule.simulate_claimed``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..shared import schedules as sch
from ..shared.tiles import sequence_tiles
from .primitives import await_count


#: The most sequences the deal orders longest first (one block of the preprocess's program).
MAX_SORTED = 1024
#: int32 counters the claimed deal keeps after the tickets (its claim counter; the tail
#: conversion's, ``dq_tail.counters``, follow).
COUNTERS = gl.constexpr(1)


@triton.jit
def write_item_prefix(CU_Q, CU_K, PREFIX, num_seqs, total_q, total_k, max_q, max_k,
                      BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr, CAUSAL: tl.constexpr,
                      SCHEDULE: tl.constexpr, BLOCK: tl.constexpr, SORT: tl.constexpr):
    """PREFIX[0] = 0, PREFIX[j + 1] = the items per KV head of the first j + 1 sequences of the
    deal (as the walk counts them: ``tiles.sequence_tiles`` and ``walk.slot_tile``), and
    PREFIX[num_seqs + 1 + j] = the j-th sequence: SORT (every sequence in one BLOCK), the most KV
    tiles first, ties in offset order; else the offsets' order, BLOCK sequences at a time. One
    program (the packed preprocess, ``packed_prep.py``, runs it)."""
    tl.store(PREFIX, 0)
    carry = 0
    for start in range(0, num_seqs, BLOCK):  # SORT: one block
        index = start + tl.arange(0, BLOCK)
        inside = index < num_seqs
        seq = tl.minimum(index, num_seqs - 1)
        tiles_kv = sequence_tiles(CU_Q, CU_K, seq, total_q, total_k, max_q, max_k, BLOCK_N,
                                  ALIGNED)[7]
        order = index
        if SORT:
            # One ascending sort of (fewest tiles missing, then offset order), padding lanes
            # last: the key carries both the tile count and the sequence.
            most = tl.cdiv(max_q + max_k, BLOCK_N)
            key = tl.where(inside, (most - tiles_kv).to(tl.int64) * BLOCK + index,
                           (1 << 62) + index.to(tl.int64))
            ordered = tl.sort(key)
            order = (ordered % BLOCK).to(tl.int32)
            tiles_kv = most - (ordered // BLOCK).to(tl.int32)
        items = tl.where(inside, sch.items_in_head(tiles_kv, CAUSAL, SCHEDULE), 0)
        tl.store(PREFIX + 1 + index, carry + tl.cumsum(items, 0), mask=inside)
        tl.store(PREFIX + num_seqs + 1 + index, order, mask=inside)
        carry += tl.sum(items, 0)


@gluon.jit
def _publish(work, claim, slots, ready, empty):
    """The load partition hands its ``claim``-th claimed index to the other partitions."""
    s = claim % 2
    mbarrier.wait(empty.index(s), ((claim // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slots.index(s).store(gl.full([32], work, gl.int32, layout=layout))
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _take(claim, slots, ready, empty, NUM_WARPS: gl.constexpr):
    """A compute or writer partition takes the ``claim``-th claimed index (``mbarrier.arrive``
    holds back its elected thread until every warp of the partition has read the slot)."""
    s = claim % 2
    mbarrier.wait(ready.index(s), (claim // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    work = gl.max(slots.index(s).load(layout), axis=0)
    mbarrier.arrive(empty.index(s), count=1)
    return work


@gluon.jit
def claim_work(work, head_end, works, claim, CLAIMS, ERR, max_spin, slots, ready, empty,
               CLAIMED: gl.constexpr):
    """The load partition's work index after ``work`` (an index at or past the last ends every
    partition's walk): P further on, or, CLAIMED, its program's ``claim``-th claimed index, taken
    from the counter CLAIMS once that has passed ``head_end`` (one past the last index of the
    current item's sequence and KV head; a bounded wait, the error flag ERR; a read above
    ``works``, the count of work indices, is no count the counter can hold), and published to
    the other partitions."""
    if CLAIMED:
        programs = gl.num_programs(0)
        # a program's claims stop at its first index past the last: the counter stays <= works
        await_count(CLAIMS, head_end - programs, works, ERR, max_spin)
        work = gl.atomic_add(CLAIMS, 1, sem="relaxed") + programs
        _publish(work, claim, slots, ready, empty)
    else:
        work = work + gl.num_programs(0)
    return work


@gluon.jit
def next_work(work, claim, slots, ready, empty, CLAIMED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """A compute or writer partition's work index after ``work``: the load partition's
    (``claim_work``)."""
    if CLAIMED:
        work = _take(claim, slots, ready, empty, NUM_WARPS)
    else:
        work = work + gl.num_programs(0)
    return work
