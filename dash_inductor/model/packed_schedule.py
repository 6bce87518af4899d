"""The DASH model (``schedule.py``) for packed sequences, dealt to programs as the kernels do.

Each packed sequence is a virtual batch entry (``ops/portable/packed.py``): its tiles are counted from its
own length, and its KV tiles visit its Q tiles in the order, with the ranks, of a dense sequence of
that many tiles, so a sequence's steps are ``schedule.item_steps`` of its tile count. What packing
adds is the deal: program p takes work indices p, p + P, ..., sequences major. The padded deal
gives every (sequence, KV head) the work items of the *longest* sequence; the items a short
sequence does not have are drawn and skipped (the portable kernel, and the Hopper kernel's
schedules other than ``shift``). The unpadded deal lists the real items only, the sequences with
the most tiles first (the Hopper kernel's ``shift``, ``ops/hopper/deal.py``). (The portable
kernel deals causal unordered items by a work counter instead; that deal is not modelled here.)
:func:`work_items` lists either deal's items, :func:`packed_plans` deals them (``pad``),
:func:`simulate_packed` runs that.

The Hopper kernel claims the unpadded deal (``ops/hopper/deal.py``): program p starts with index
p, and its load partition claims each later index from a global counter (P + the counter's old
value: indices go out in increasing order) once it has issued its current item's loads, about
``lookahead`` steps before that item ends; the claimed item runs after the current one, so items
of unequal length go to the programs that free up first. Under ``shift`` a head's items wait on
each other (circular ranks), so a program holding two items of one head would hang: the claimed
item waits for the program, the current one for the claimed one's adds. The rule: claim only
once P + counter has reached the end of the current item's head, so the index claimed is of a
later head. Given at most P items per head it cannot hang (``deal.py`` has the argument).
:func:`simulate_claimed` runs that deal by events, with or without the rule.

In this model, three causal documents of 59, 29 and 42 tiles on 132 programs with 16 heads
(``c = 1``, ``r = 0.15``) finish ``shift`` 17% later with the padded deal than without (578
against 492 in offset order, 491 longest first), and ``descending`` and ``atomic`` 1-3% sooner;
on an H100 the Hopper kernel dealt without padding ran ``shift`` 12.5% faster there (2.84
against 3.25 ms at d128), ``descending`` and ``atomic`` 3-5% slower (docs/kernels-notes.md).
Claimed (``lookahead`` 3, the rule), ``shift`` finishes the three documents at 466 against the
fixed deal's 491 (mean busy time 433), and 7 documents of 4, 63, 7, 24, 1, 23 and 3 tiles at 380
against 389; equal-length packings unchanged.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Sequence

from dash_inductor.ops import catalog
from dash_inductor.model.schedule import (Segment, Simulation, Step, WaitCycleError, item_steps,
                                          items_per_head, run_plans)


def _check_deal(tiles: Sequence[int], n_heads: int, programs: int, group: int) -> None:
    if not tiles or min(tiles) < 0 or n_heads < 1 or programs < 1 or group < 1:
        raise ValueError(f"need tiles >= 0 (at least one sequence), n_heads, programs and group "
                         f">= 1; got tiles={list(tiles)}, n_heads={n_heads}, programs={programs}, "
                         f"group={group}")


def _check_costs(schedule: str, c: float, r: float) -> None:
    if catalog.get(schedule).separate_dq:
        raise ValueError(f"the packed model covers the one-pass schedules, not {schedule!r} (its "
                         f"separate dQ pass is not modelled for packed sequences)")
    if not c > 0 or not r >= 0:
        raise ValueError(f"costs must satisfy c > 0 and r >= 0, got c={c!r}, r={r!r}")


def work_items(schedule: str, *, tiles: Sequence[int], n_heads: int, causal: bool,
               group: int = 1, pad: bool = False) -> list[tuple[int, list[Step]]]:
    """The work items in deal order, as (head, steps), ``head = b * n_heads + KV head``: the
    index of an item in this list is its work index. ``pad``: every sequence has the longest
    one's item count, the items it lacks empty (drawn and skipped); else its own items only, the
    sequences with the most tiles first (ties in offset order), as the Hopper kernel deals them."""
    catalog.get(schedule)
    _check_deal(tiles, n_heads, 1, group)
    counts = [items_per_head(n, causal, schedule) if n else 0 for n in tiles]
    order = range(len(tiles)) if pad else sorted(range(len(tiles)), key=lambda b: -tiles[b])
    items: list[tuple[int, list[Step]]] = []
    for b in order:
        for head in range(b * n_heads, (b + 1) * n_heads):
            for item in range(max(counts) if pad else counts[b]):
                steps = item_steps(item, tiles[b], tiles[b], causal, schedule, group=group) \
                    if item < counts[b] else []
                items.append((head, [dataclasses.replace(s, head=head) for s in steps]))
    return items


def packed_plans(schedule: str, *, tiles: Sequence[int], n_heads: int, programs: int,
                 causal: bool, group: int = 1, pad: bool = True) -> list[list[Step]]:
    """Steps of every program for packed sequences of ``tiles[b]`` tiles each (queries and keys
    alike, as the aligned walk makes them), ``n_heads`` KV heads, ``group`` query heads each:
    the fixed deal, program p takes work indices p, p + P, ... of :func:`work_items`.

    ``Step.head`` numbers (sequence, KV head) pairs: ``b * n_heads + head``. ``pad``: deal every
    sequence the longest one's item count; else only its own items.
    """
    catalog.get(schedule)
    _check_deal(tiles, n_heads, programs, group)
    plans: list[list[Step]] = [[] for _ in range(programs)]
    for index, (_, steps) in enumerate(work_items(schedule, tiles=tiles, n_heads=n_heads,
                                                  causal=causal, group=group, pad=pad)):
        plans[index % programs] += steps
    return plans


def simulate_packed(schedule: str, *, tiles: Sequence[int], n_heads: int, programs: int,
                    causal: bool, c: float = 1.0, r: float = 0.25, group: int = 1,
                    pad: bool = True) -> Simulation:
    """``schedule.simulate`` for packed sequences (:func:`packed_plans`). ``recompute``'s separate
    dQ pass is not modelled here: it raises ValueError."""
    _check_costs(schedule, c, r)
    plans = packed_plans(schedule, tiles=tiles, n_heads=n_heads, programs=programs,
                         causal=causal, group=group, pad=pad)
    return run_plans(plans, catalog.is_ordered(schedule), c, r)


def simulate_claimed(schedule: str, *, tiles: Sequence[int], n_heads: int, programs: int,
                     causal: bool, c: float = 1.0, r: float = 0.25, group: int = 1,
                     lookahead: int = 3, head_rule: bool = True) -> Simulation:
    """The unpadded deal claimed as the Hopper kernel claims it (module doc), by events in time
    order: claims must be, since which index a program gets depends on who claims first.

    A program claims when it starts step ``len(item) - lookahead`` of its current item (at its
    start if shorter; at its end if ``lookahead`` is 0), under ``head_rule`` once
    ``programs + counter`` has reached the end of that item's head; the claimed item starts when
    the current one has ended and the claim is made. The dQ waits are ``run_plans``'; at equal
    times steps go before claims, and claims by program. ``stall`` counts dQ waits (as there);
    waits for a claim show in ``idle``. Raises :class:`WaitCycleError` when work remains that no
    program can go on with.
    """
    _check_costs(schedule, c, r)
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ValueError(f"lookahead must be an int >= 0 (steps), got {lookahead!r}")
    _check_deal(tiles, n_heads, programs, group)
    items = work_items(schedule, tiles=tiles, n_heads=n_heads, causal=causal, group=group)
    most = max(Counter(head for head, _ in items).values(), default=0)
    if head_rule and most > programs:
        raise ValueError(f"programs must be >= the most items of one (sequence, KV head), {most}: "
                         f"the head rule's argument needs them all running at once; got {programs}")
    head_end = [0] * len(items)  # one past the last index of each item's head
    for index in reversed(range(len(items))):
        same = index + 1 < len(items) and items[index + 1][0] == items[index][0]
        head_end[index] = head_end[index + 1] if same else index + 1
    ordered, total, n = catalog.is_ordered(schedule), len(items), programs
    current = [p if p < total else total for p in range(n)]  # total: the program has finished
    pos, clock, stall = [0] * n, [0.0] * n, [0.0] * n
    asked, idle = [False] * n, [False] * n  # claim requested; current item over, claim awaited
    claimed: list[int | None] = [None] * n
    counter, pending = 0, set[int]()  # pending: claims held back by the head rule
    timelines: list[list[Segment]] = [[] for _ in range(n)]
    tiles_done: dict[tuple[int, int, int], tuple[int, float]] = {}  # tile: (next rank, its end)
    waiting: dict[tuple[int, int, int, int], tuple[int, float]] = {}  # (tile, rank): (p, computed)
    events = [(0.0, 0, p) for p in range(n) if current[p] < total]  # (time, 0 step/1 claim, p)

    def add(p: int, computed: float) -> None:
        """Program p's dQ add, then those it lets go (the next ranks, already computed)."""
        chain = [(p, computed)]
        while chain:
            p, computed = chain.pop()
            s = items[current[p]][1][pos[p]]
            tile = (s.head, s.qhead, s.q)
            expected, last = tiles_done.get(tile, (0, 0.0))
            start = max(computed, last) if ordered else computed
            stall[p] += start - computed
            if r > 0:
                timelines[p].append(Segment("reduce", start, start + r, s.head, s.qhead, s.q, s.kv))
            tiles_done[tile] = (expected + 1, start + r)
            clock[p], pos[p] = start + r, pos[p] + 1
            heapq.heappush(events, (start + r, 0, p))
            if (*tile, expected + 1) in waiting:
                chain.append(waiting.pop((*tile, expected + 1)))

    def begin(p: int, t: float, index: int) -> None:
        """Program p starts item ``index`` at t, or stops if none is left."""
        current[p], pos[p], asked[p], claimed[p] = min(index, total), 0, False, None
        if index < total:
            heapq.heappush(events, (t, 0, p))

    def claim(p: int, t: float) -> None:
        """Program p's load partition takes the next index, if the head rule lets it."""
        nonlocal counter
        if head_rule and n + counter < head_end[current[p]]:
            pending.add(p)
            return
        claimed[p], counter = n + counter, counter + 1
        if idle[p]:
            idle[p] = False
            begin(p, t, claimed[p])
        for q in sorted(pending):  # the counter moved: they look again, now
            heapq.heappush(events, (t, 1, q))
        pending.clear()

    while events:
        t, kind, p = heapq.heappop(events)
        if kind == 1:
            claim(p, t)
            continue
        steps = items[current[p]][1]
        if pos[p] == max(len(steps) - lookahead, 0) and not asked[p]:  # its loads are issued
            asked[p] = True
            heapq.heappush(events, (t, 1, p))
        if pos[p] == len(steps):  # the item is over: on to the claimed one, once claimed
            if claimed[p] is None:
                idle[p] = True
            else:
                begin(p, t, claimed[p])
            continue
        s = steps[pos[p]]
        timelines[p].append(Segment("compute", t, t + c, s.head, s.qhead, s.q, s.kv))
        if ordered and tiles_done.get((s.head, s.qhead, s.q), (0,))[0] != s.rank:
            waiting[(s.head, s.qhead, s.q, s.rank)] = (p, t + c)
        else:
            add(p, t + c)
    stuck = [p for p in range(n) if current[p] < total]
    if stuck:
        dq = {p: key for key, (p, _) in waiting.items()}
        why = [f"program {p} (item {current[p]}, next {claimed[p]}) waits "
               + (f"for the dQ add before rank {dq[p][3]} of Q tile (head, qhead, q) {dq[p][:3]}"
                  if p in dq else f"for the counter to reach {head_end[current[p]] - n} "
                                  f"(now {counter})") for p in stuck[:4]]
        raise WaitCycleError(f"programs waiting forever: {len(stuck)}, e.g. " + "; ".join(why))
    busy = [sum(seg.end - seg.start for seg in line) for line in timelines]
    return Simulation(max(clock, default=0.0), busy, stall, timelines)
