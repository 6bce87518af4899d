"""How the Hopper backward deals the work items of packed sequences to its programs.

Program p runs work indices p, p + P, ... in order. The padded deal (``walk.work_head``, also the
dense one) counts every sequence's items as if it were the longest, so index w is item
w % per_head of (sequence, KV head) w // per_head, and the items a shorter sequence lacks are
drawn and skipped: the programs then start a (sequence, KV head)'s items at different times, and
under ``shift`` they wait for each other's dQ turns (``dash_inductor/packed_schedule.py``).

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
finishing items of lower indices only: the argument of ``ops/schedules.py`` holds whatever the
order of the sequences, and no order changes a bit (each dQ sum keeps its ranks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import schedules as sch
from ..tiles import sequence_tiles


#: The most sequences the deal orders longest first (one block of the preprocess's program).
MAX_SORTED = 1024


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
