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
"""

from __future__ import annotations

import triton
import triton.language as tl

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
