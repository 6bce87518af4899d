"""The DASH model (``schedule.py``) for packed sequences, dealt to programs as the kernels do.

Each packed sequence is a virtual batch entry (``ops/packed.py``): its tiles are counted from its
own length, and its KV tiles visit its Q tiles in the order, with the ranks, of a dense sequence of
that many tiles, so a sequence's steps are ``schedule.item_steps`` of its tile count. What packing
adds is the deal: program p takes work indices p, p + P, ..., sequences major. The padded deal
gives every (sequence, KV head) the work items of the *longest* sequence; the items a short
sequence does not have are drawn and skipped (the portable kernel, and the Hopper kernel's
schedules other than ``shift``). The unpadded deal lists the real items only, the sequences with
the most tiles first (the Hopper kernel's ``shift``, ``ops/hopper/deal.py``). (The portable
kernel deals causal unordered items by a work counter instead; that deal is not modelled here.)
:func:`packed_plans` builds either deal (``pad``), :func:`simulate_packed` runs it.

In this model, three causal documents of 59, 29 and 42 tiles on 132 programs with 16 heads
(``c = 1``, ``r = 0.15``) finish ``shift`` 17% later with the padded deal than without (578
against 492 in offset order, 491 longest first), and ``descending`` and ``atomic`` 1-3% sooner;
on an H100 the Hopper kernel dealt without padding ran ``shift`` 12.5% faster there (2.84
against 3.25 ms at d128), ``descending`` and ``atomic`` 3-5% slower (docs/kernels-notes.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dash_inductor.ops import catalog
from dash_inductor.schedule import Simulation, Step, item_steps, items_per_head, run_plans


def packed_plans(schedule: str, *, tiles: Sequence[int], n_heads: int, programs: int,
                 causal: bool, group: int = 1, pad: bool = True) -> list[list[Step]]:
    """Steps of every program for packed sequences of ``tiles[b]`` tiles each (queries and keys
    alike, as the aligned walk makes them), ``n_heads`` KV heads, ``group`` query heads each.

    ``Step.head`` numbers (sequence, KV head) pairs: ``b * n_heads + head``. ``pad``: deal every
    sequence the longest one's item count; else only its own items.
    """
    catalog.get(schedule)
    if not tiles or min(tiles) < 0 or n_heads < 1 or programs < 1 or group < 1:
        raise ValueError(f"need tiles >= 0 (at least one sequence), n_heads, programs and group "
                         f">= 1; got tiles={list(tiles)}, n_heads={n_heads}, programs={programs}, "
                         f"group={group}")
    counts = [items_per_head(n, causal, schedule) if n else 0 for n in tiles]
    per_head = max(counts)
    plans: list[list[Step]] = [[] for _ in range(programs)]
    index = 0
    # The unpadded deal takes the sequences with the most tiles first, ties in offset order.
    order = range(len(tiles)) if pad else sorted(range(len(tiles)), key=lambda b: -tiles[b])
    for b in order:
        n = tiles[b]
        for head in range(n_heads):
            for item in range(per_head if pad else counts[b]):
                if item < counts[b]:
                    steps = item_steps(item, n, n, causal, schedule, group=group)
                    plans[index % programs] += [dataclasses.replace(s, head=b * n_heads + head)
                                                for s in steps]
                index += 1
    return plans


def simulate_packed(schedule: str, *, tiles: Sequence[int], n_heads: int, programs: int,
                    causal: bool, c: float = 1.0, r: float = 0.25, group: int = 1,
                    pad: bool = True) -> Simulation:
    """``schedule.simulate`` for packed sequences (:func:`packed_plans`). ``recompute``'s separate
    dQ pass is not modelled here: it raises ValueError."""
    if catalog.get(schedule).separate_dq:
        raise ValueError(f"simulate_packed models the one-pass schedules, not {schedule!r} (its "
                         f"separate dQ pass is not modelled for packed sequences)")
    if not c > 0 or not r >= 0:
        raise ValueError(f"costs must satisfy c > 0 and r >= 0, got c={c!r}, r={r!r}")
    plans = packed_plans(schedule, tiles=tiles, n_heads=n_heads, programs=programs,
                         causal=causal, group=group, pad=pad)
    return run_plans(plans, catalog.is_ordered(schedule), c, r)
