"""Backward schedules as ``@triton.jit`` functions: which Q tile a KV tile visits at each step,
and the rank of its dQ contribution in that Q tile's fixed reduction order.

The same formulas, in plain Python with a simulator of the DAG model, live in
``dash_inductor/model/schedule.py`` (the twin of this file; a test holds the two against each other).
The schedules' names, ids and properties are defined once, in ``ops/catalog.py``.
The schedules follow DASH (Qiang et al., arXiv 2601.21824). Every function is closed-form integer
arithmetic on non-negative scalars: it runs inside the kernel's inner loop.

Ranks only ever order a contribution after contributions that come earlier in an order every
program follows, so the ordered dQ reduction cannot deadlock:
- ``ascending``, ``descending``, ``recompute``, ``atomic``: work item i owns KV tile i, and a Q tile
  takes its contributions in ascending KV order, i.e. in work-item order; any grid size works.
- ``shift``: a Q tile takes its contributions in (slot, step) order, the order in which each program
  walks its own work item; needs all work items of a head co-resident.
"""

import triton
import triton.language as tl

from ..catalog import SCHEDULES

ASCENDING = tl.constexpr(SCHEDULES["ascending"].id)
DESCENDING = tl.constexpr(SCHEDULES["descending"].id)
SHIFT = tl.constexpr(SCHEDULES["shift"].id)


@triton.jit
def slot_kv_tile(item, slot, n_kv, CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    """KV tile processed by work ``item`` in ``slot``; -1 when that slot is empty."""
    if CAUSAL and SCHEDULE == SHIFT:
        partner = n_kv - 1 - item
        kv = tl.where(slot == 0, item, tl.where(partner > item, partner, -1))
    else:
        kv = tl.where(slot == 0, item, -1)
    return kv


@triton.jit
def items_in_head(n_kv, CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    """Work items of a head of ``n_kv`` KV tiles: ``catalog.Schedule.items_per_head`` on the device,
    for packed sequences, whose tile counts the kernel reads from the offsets."""
    if CAUSAL and SCHEDULE == SHIFT:
        count = (n_kv + 1) // 2
    else:
        count = n_kv + 0
    return count


@triton.jit
def visit_count(kv, n_q, CAUSAL: tl.constexpr):
    """Number of Q tiles KV tile ``kv`` interacts with (causal, top-left: Q tiles kv..n_q-1)."""
    if CAUSAL:
        count = tl.maximum(n_q - kv, 0)
    else:
        count = n_q + 0 * kv
    return count


@triton.jit
def q_tile_at(step, kv, n_q, n_kv, CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    """The Q tile that KV tile ``kv`` visits at ``step`` (0 <= step < visit_count)."""
    if SCHEDULE == DESCENDING:
        q = n_q - 1 - step + 0 * kv
    elif SCHEDULE == SHIFT:
        if CAUSAL:
            half = (n_kv + 1) // 2
            # Left tiles (kv < half) climb their own rows kv..half-2, sweep the shared rows from
            # the bottom up to half, and end on row half-1; right tiles go down.
            up = tl.minimum(half - 1, n_q) - kv
            left = tl.where(step < up, kv + step,
                            tl.where(step < n_q - 1 - kv, n_q + half - 2 - kv - step, half - 1))
            q = tl.where(kv < half, left, n_q - 1 - step)
        else:
            q = (kv % n_q + step) % n_q
    else:
        if CAUSAL:
            q = kv + step
        else:
            q = step + 0 * kv
    return q


@triton.jit
def _cyclic_rank(a, kv, count, width):
    """Rank of kv among 0..count-1 ordered by ((a - kv') mod width, kv'), 0 <= a < width.

    (a - kv') mod width is the step at which tile kv' reaches row a of a cyclic shift; ties
    (count > width) are broken by kv'. Counting residues in a cyclic interval keeps it O(1).
    """
    arrival = (a - kv % width + width) % width
    rounds = count // width
    rest = count % width
    lo = a - arrival + 1
    top = tl.minimum(a + 1, rest)
    no_wrap = tl.maximum(top - lo, 0)
    wrap = top + tl.maximum(rest - (lo + width), 0)
    earlier = rounds * arrival + tl.where(lo >= 0, no_wrap, wrap)
    return earlier + kv // width


@triton.jit
def reduction_rank(q, kv, n_q, n_kv, CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    """0-based position of KV tile ``kv``'s contribution in Q tile ``q``'s dQ reduction order."""
    if SCHEDULE == SHIFT:
        if CAUSAL:
            half = (n_kv + 1) // 2
            rank = tl.where(kv < half, tl.minimum(q, half - 1) - kv, kv)
        else:
            rank = _cyclic_rank(q, kv, n_kv, n_q)
    else:
        rank = kv + 0 * q
    return rank


# ---- sliding windows (the window's right side is never 0 here: that is CAUSAL) -----------------
# A window keeps key j for query i when i - left <= j <= i + right, i.e. j - right <= i <= j + left
# (a side of -1 is open). The rows that see KV tile kv form one interval, so its Q tiles are a
# contiguous range; a Q tile's KV tiles are contiguous too, and it takes them in ascending KV order
# (the work-item order, as ``ascending``): no wait cycle, any grid. ``shift`` has no windowed ranks.

@triton.jit
def window_q_range(kv, n_q, BLOCK, left, right, CAUSAL: tl.constexpr):
    """(first Q tile, count) of the Q tiles that KV tile ``kv`` meets under the window."""
    lo = tl.where(right >= 0, tl.maximum(kv * BLOCK - right, 0), 0)
    if CAUSAL:
        lo = tl.maximum(lo, kv * BLOCK)
    hi = tl.where(left >= 0, tl.minimum(kv * BLOCK + BLOCK - 1 + left, n_q * BLOCK - 1),
                  n_q * BLOCK - 1)
    first = lo // BLOCK
    # Integer division truncates here: an empty range (no Q tile, hi = -1) must not count one.
    return first, tl.where(hi >= lo, hi // BLOCK - first + 1, 0)


@triton.jit
def window_q_tile_at(step, first, count, SCHEDULE: tl.constexpr):
    """The Q tile visited at ``step`` of a window's range: descending walks it down, others up."""
    if SCHEDULE == DESCENDING:
        q = first + count - 1 - step
    else:
        q = first + step
    return q


@triton.jit
def window_rank(q, kv, BLOCK, left):
    """Position of KV tile ``kv`` among Q tile ``q``'s KV tiles (ascending from the first)."""
    first_kv = tl.where(left >= 0, tl.maximum(q * BLOCK - left, 0) // BLOCK, 0)
    return kv - first_kv
