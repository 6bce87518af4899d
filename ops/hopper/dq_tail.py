"""The packed Hopper backward's dQ conversion in the tail of its own run.

Packed sequences of unequal lengths leave programs without work while others still compute (the
``shift`` deal's gangs, ``deal.py``), and the fp32 dQ accumulator's conversion into the gradient
(``ops/shared/dq_convert.py``, a launch of its own after the kernel) then waits for the last of them.
Here the compute warps of a program that has run out of items convert instead: each (sequence,
KV head) counts its finished items (``item_finished``, by its dQ writer, after the item's last
adds are performed), and a program claims units of (sequence, query head, eighth of the rows) in
the deal's order, waits (bounded, like the writer's turns) until the sequence's items of that
head are all finished, and writes the rows in the gradient's dtype and strides. A unit's values
are the finished sums, so the bits are those of the separate conversion; which program converts
what, and when, changes none. It writes rows of contiguous elements: a gradient whose head dim
is strided keeps the separate conversion (the launcher's choice).

The counters follow the tickets (``ops/preprocess.zeroed_tickets``): one per (sequence, KV head)
and then the claim counter. No wait can hang: a program converts only after its own items, so
every item is run by a program that never waits on a conversion.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import walk
from .primitives import await_count

#: Units of rows a (sequence, query head) is converted in.
CHUNKS = gl.constexpr(8)
#: Rows a pass of the compute warps converts.
PASS_ROWS = gl.constexpr(32)


def counters(num_seqs: int, hkv: int) -> int:
    """The int32 counters the tail conversion needs after the tickets: one per (sequence, KV
    head), one to claim units."""
    return num_seqs * hkv + 1


@triton.jit
def chunk_rows(q0, length, chunk, CHUNKS: tl.constexpr):
    """Packed rows [lo, hi) of unit ``chunk`` of the CHUNKS a sequence's rows [q0, q0 + length)
    are converted in (empty where the sequence is shorter than its chunks)."""
    per_chunk = (length + CHUNKS - 1) // CHUNKS
    lo = q0 + chunk * per_chunk
    return lo, tl.minimum(lo + per_chunk, q0 + length)


@gluon.jit
def item_finished(FINISHED, b, hkv, HKV):
    """Count one more finished item of (sequence ``b``, KV head ``hkv``): called by the dQ
    writer once the item's adds are performed and its tickets released."""
    gl.atomic_add(FINISHED + b * HKV + hkv, 1, sem="release")


@gluon.jit
def convert_tail(DQACC, DQ, FINISHED, ERR, CU_Q, PREFIX, stride_dqt, stride_dqh, HQ,
                 HKV, row_stride, items_per_head, total_items, max_spin, GROUP: gl.constexpr,
                 HEAD_D: gl.constexpr, num_warps: gl.constexpr):
    """Convert claimed units of DQACC (Hq, row_stride, HEAD_D) into DQ (T, Hq, HEAD_D), its last
    dim contiguous, until none is left; units in the unpadded deal's order (``walk.work_head``):
    sequence, query head, chunk."""
    entries = walk.entry_count(total_items, items_per_head, HKV)
    units = entries * HQ * CHUNKS
    CLAIM = FINISHED + entries * HKV
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // HEAD_D, HEAD_D // 4], [num_warps, 1],
                                            [1, 0])
    offs_r = gl.arange(0, PASS_ROWS, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    unit = gl.atomic_add(CLAIM, 1)
    while unit < units:
        j = unit // (HQ * CHUNKS)
        hq = unit // CHUNKS % HQ
        chunk = unit % CHUNKS
        b = gl.load(PREFIX + entries + 1 + j)
        items = gl.load(PREFIX + j + 1) - gl.load(PREFIX + j)
        await_count(FINISHED + b * HKV + hq // GROUP, items, items, ERR, max_spin)
        q0 = gl.load(CU_Q + b)
        lo, hi = chunk_rows(q0, gl.load(CU_Q + b + 1) - q0, chunk, CHUNKS)
        for start in range(lo, hi, PASS_ROWS):
            rows = start + offs_r
            inside = gl.expand_dims(rows < hi, 1) & gl.expand_dims(offs_d < HEAD_D, 0)
            acc = gl.load(DQACC + (hq.to(gl.int64) * row_stride + gl.expand_dims(rows, 1)) * HEAD_D
                          + gl.expand_dims(offs_d, 0), mask=inside, cache_modifier=".cg")
            dq = (DQ + gl.expand_dims(rows, 1).to(gl.int64) * stride_dqt + hq * stride_dqh
                  + gl.expand_dims(offs_d, 0))
            gl.store(dq, acc.to(DQ.dtype.element_ty), mask=inside)
        unit = gl.atomic_add(CLAIM, 1)
