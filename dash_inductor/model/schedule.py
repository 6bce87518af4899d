"""The DASH DAG model of the deterministic attention backward, in plain Python (no torch, no triton).

Qiang et al., "DASH: Deterministic Attention Scheduling for High-throughput Reproducible LLM
Training" (arXiv 2601.21824, ICLR 2026) model the backward as chains of tasks, one chain per KV
tile: for every Q tile it visits, a compute of cost ``c`` and then the ordered dQ reduction of
cost ``r``, which may start only once the previous contribution to that Q tile (by rank) is added.
This module holds the schedule formulas (the twin of ``ops/shared/schedules.py``, same names, same
arithmetic), their tables, a simulator of the DAG on a persistent grid, a validator, and the
closed-form critical paths; the schedules' names and properties come from ``ops/catalog.py``.
It also draws the figures in ``docs/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dash_inductor.ops import catalog
from dash_inductor.ops.catalog import ORDERED, items_per_head, needs_coresident_head, num_slots

#: Every schedule name (defined, with its properties, in ``ops/catalog.py``).
SCHEDULES = catalog.NAMES


def _check_schedule(schedule: str) -> None:
    catalog.get(schedule)


def _check_tiles(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ---- the formulas: twins of the @triton.jit functions in ops/shared/schedules.py -----------------------

def slot_kv_tile(item: int, slot: int, n_kv: int, causal: bool, schedule: str) -> int:
    """KV tile processed by work ``item`` in ``slot``; -1 when that slot is empty."""
    if causal and schedule == "shift":
        partner = n_kv - 1 - item
        return item if slot == 0 else (partner if partner > item else -1)
    return item if slot == 0 else -1


def visit_count(kv: int, n_q: int, causal: bool) -> int:
    """Number of Q tiles KV tile ``kv`` interacts with (causal, top-left: Q tiles kv..n_q-1)."""
    return max(n_q - kv, 0) if causal else n_q


def q_tile_at(step: int, kv: int, n_q: int, n_kv: int, causal: bool, schedule: str) -> int:
    """The Q tile that KV tile ``kv`` visits at ``step`` (0 <= step < visit_count)."""
    if schedule == "descending":
        return n_q - 1 - step
    if schedule == "shift":
        if causal:
            half = (n_kv + 1) // 2
            if kv >= half:
                return n_q - 1 - step
            # Left tiles climb their own rows kv..half-2, sweep the shared rows from the bottom
            # up to half, and end on row half-1: every Q tile sees its contributors in an order
            # that no GQA group size can reverse (see docs/schedules.md).
            if step < min(half - 1, n_q) - kv:
                return kv + step
            if step < n_q - 1 - kv:
                return n_q + half - 2 - kv - step
            return half - 1
        return (kv % n_q + step) % n_q
    return kv + step if causal else step


def _cyclic_rank(a: int, kv: int, count: int, width: int) -> int:
    """Rank of kv among 0..count-1 ordered by ((a - kv') mod width, kv'), 0 <= a < width."""
    arrival = (a - kv % width + width) % width
    rounds, rest = divmod(count, width)
    lo = a - arrival + 1
    top = min(a + 1, rest)
    earlier = max(top - lo, 0) if lo >= 0 else top + max(rest - (lo + width), 0)
    return rounds * arrival + earlier + kv // width


def reduction_rank(q: int, kv: int, n_q: int, n_kv: int, causal: bool, schedule: str) -> int:
    """0-based position of KV tile ``kv``'s contribution in Q tile ``q``'s dQ reduction order."""
    if schedule == "shift":
        if causal:
            half = (n_kv + 1) // 2
            return min(q, half - 1) - kv if kv < half else kv
        return _cyclic_rank(q, kv, n_kv, n_q)
    return kv


def window_q_range(kv: int, n_q: int, block: int, left: int, right: int,
                   causal: bool) -> tuple[int, int]:
    """(first Q tile, count) that KV tile ``kv`` meets under a (left, right) window (right >= 1
    or -1: a right side of 0 is ``causal``); rows j - right..j + left see key j."""
    lo = max(kv * block - right, 0) if right >= 0 else 0
    if causal:
        lo = max(lo, kv * block)
    hi = min(kv * block + block - 1 + left, n_q * block - 1) if left >= 0 else n_q * block - 1
    return lo // block, hi // block - lo // block + 1 if hi >= lo else 0


def window_q_tile_at(step: int, first: int, count: int, schedule: str) -> int:
    """The Q tile visited at ``step`` of a window's range: descending walks it down, others up."""
    return first + count - 1 - step if schedule == "descending" else first + step


def window_rank(q: int, kv: int, block: int, left: int) -> int:
    """Position of KV tile ``kv`` among Q tile ``q``'s KV tiles, ascending from the first."""
    return kv - (max(q * block - left, 0) // block if left >= 0 else 0)


# ---- tables ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One visit of a KV tile to a Q tile: a compute, then the dQ add at position ``rank``."""

    head: int
    qhead: int
    q: int
    kv: int
    rank: int


def q_order(kv: int, n_q: int, n_kv: int, causal: bool, schedule: str) -> list[int]:
    """The Q tiles KV tile ``kv`` visits, in visiting order."""
    return [q_tile_at(t, kv, n_q, n_kv, causal, schedule) for t in range(visit_count(kv, n_q, causal))]


def rank_table(n_q: int, n_kv: int, causal: bool, schedule: str) -> dict[tuple[int, int], int]:
    """Reduction rank of every needed (q, kv) pair."""
    return {(q, kv): reduction_rank(q, kv, n_q, n_kv, causal, schedule)
            for q in range(n_q) for kv in range(n_kv) if not causal or q >= kv}


def item_steps(item: int, n_q: int, n_kv: int, causal: bool, schedule: str, *,
               head: int = 0, group: int = 1, visit_heads: int | None = None) -> list[Step]:
    """The steps of one work item in kernel loop order: slot, then query head, then step; with
    ``visit_heads`` (the Hopper kernel's GQA causal pairs, ``walk.visit_heads``) each block of
    that many query heads, then slot, then query head, then step."""
    tiles = [kv for kv in (slot_kv_tile(item, slot, n_kv, causal, schedule)
                           for slot in range(num_slots(causal, schedule))) if kv >= 0]
    width = visit_heads or group
    visits = [(kv, qhead) for first in range(0, group, width) for kv in tiles
              for qhead in range(first, min(first + width, group))]
    return [Step(head, qhead, q, kv, reduction_rank(q, kv, n_q, n_kv, causal, schedule))
            for kv, qhead in visits for q in q_order(kv, n_q, n_kv, causal, schedule)]


def program_plans(schedule: str, *, n_tiles: int, n_heads: int, programs: int, causal: bool,
                  group: int = 1, n_q_tiles: int | None = None,
                  visit_heads: int | None = None) -> list[list[Step]]:
    """Steps of every program of a persistent grid, head-major items.

    Program p takes items p, p+P, ...; except under causal ``recompute`` and ``atomic``, where the
    program that frees up first takes the next item (all steps of one of them cost the same).
    """
    n_q = n_tiles if n_q_tiles is None else n_q_tiles
    for name, value in (("n_tiles", n_tiles), ("n_q_tiles", n_q), ("n_heads", n_heads),
                        ("programs", programs), ("group", group)):
        _check_tiles(name, value)
    per_head = items_per_head(n_tiles, causal, schedule)
    plans: list[list[Step]] = [[] for _ in range(programs)]
    busy = [0] * programs
    for index in range(n_heads * per_head):
        head, item = divmod(index, per_head)
        steps = item_steps(item, n_q, n_tiles, causal, schedule, head=head, group=group,
                           visit_heads=visit_heads)
        if catalog.is_ordered(schedule) or not causal or index < programs:
            program = index % programs
        else:  # the kernel's work counter: whichever program frees up first takes the next item
            program = min(range(programs), key=lambda p: (busy[p], p))
        plans[program] += steps
        busy[program] += len(steps)
    return plans


# ---- the DAG simulator ----------------------------------------------------------------------------

class WaitCycleError(RuntimeError):
    """The programs of a schedule wait on each other in a cycle: the kernel would hang."""


@dataclass(frozen=True)
class Segment:
    """One task on a program's timeline; kind is "compute", "reduce" or "dq" (recompute's dQ pass)."""

    kind: str
    start: float
    end: float
    head: int
    qhead: int
    q: int
    kv: int


@dataclass
class Simulation:
    """Result of :func:`simulate`: makespan, per-program busy/stall time and timelines."""

    makespan: float
    busy: list[float]
    stall: list[float] = field(repr=False)
    timelines: list[list[Segment]] = field(repr=False)

    @property
    def idle(self) -> list[float]:
        """Per program: time not spent computing or reducing (waits, and the tail after it ends)."""
        return [self.makespan - b for b in self.busy]


def run_plans(plans: list[list[Step]], ordered: bool, c: float, r: float, t0: float = 0.0,
              kind: str = "compute") -> Simulation:
    """Longest-path times of the DAG: per program a chain of tasks (``plans``), per Q tile a rank
    order (when ``ordered``); compute costs ``c``, each dQ add ``r``."""
    n = len(plans)
    clock, pos = [t0] * n, [0] * n
    computed: list[float | None] = [None] * n
    tiles: dict[tuple[int, int, int], tuple[int, float]] = {}
    waiting: dict[tuple[int, int, int, int], int] = {}
    timelines: list[list[Segment]] = [[] for _ in range(n)]
    stall = [0.0] * n
    ready = list(range(n))
    while ready:
        p = ready.pop()
        plan, line = plans[p], timelines[p]
        while pos[p] < len(plan):
            s = plan[pos[p]]
            if computed[p] is None:
                computed[p] = clock[p] + c
                line.append(Segment(kind, clock[p], clock[p] + c, s.head, s.qhead, s.q, s.kv))
            tile = (s.head, s.qhead, s.q)
            expected, last = tiles.get(tile, (0, t0))
            if ordered and expected != s.rank:
                waiting[(*tile, s.rank)] = p
                break
            start = max(computed[p], last) if ordered else computed[p]
            stall[p] += start - computed[p]
            if r > 0:
                line.append(Segment("reduce", start, start + r, s.head, s.qhead, s.q, s.kv))
            tiles[tile] = (expected + 1, start + r)
            clock[p], computed[p] = start + r, None
            pos[p] += 1
            woken = waiting.pop((*tile, expected + 1), None)
            if woken is not None:
                ready.append(woken)
    stuck = [p for p in range(n) if pos[p] < len(plans[p])]
    if stuck:
        blocked = [(p, plans[p][pos[p]]) for p in stuck[:4]]
        raise WaitCycleError(f"{len(stuck)} programs wait forever, e.g. (program, step): {blocked}")
    makespan = max(clock, default=t0)
    busy = [sum(seg.end - seg.start for seg in line) for line in timelines]
    return Simulation(makespan, busy, stall, timelines)


def _dq_pass_plans(n_q: int, n_kv: int, n_heads: int, programs: int, causal: bool,
                   group: int) -> list[list[Step]]:
    """recompute's second kernel: one item per (head, query head, Q tile) over its KV tiles."""
    plans: list[list[Step]] = [[] for _ in range(programs)]
    index = 0
    for head in range(n_heads):
        for qhead in range(group):
            for q in range(n_q):
                kvs = range(min(q + 1, n_kv) if causal else n_kv)
                plans[index % programs] += [Step(head, qhead, q, kv, 0) for kv in kvs]
                index += 1
    return plans


def simulate(schedule: str, *, n_tiles: int, n_heads: int, programs: int, causal: bool,
             c: float = 1.0, r: float = 0.25, group: int = 1, n_q_tiles: int | None = None,
             visit_heads: int | None = None) -> Simulation:
    """Simulate the DAG of one backward on a persistent grid of ``programs`` programs.

    ``n_tiles`` KV tiles and ``n_q_tiles`` (default ``n_tiles``) Q tiles per head, ``n_heads``
    (batch x KV head) pairs, ``group`` query heads per KV head. ``atomic`` reduces without order;
    ``recompute`` runs a KV pass without dQ, then a dQ pass that recomputes each pair (cost c).
    Raises :class:`WaitCycleError` when the programs would wait on each other forever.
    """
    _check_schedule(schedule)
    if not c > 0 or not r >= 0:
        raise ValueError(f"costs must satisfy c > 0 and r >= 0, got c={c!r}, r={r!r}")
    plans = program_plans(schedule, n_tiles=n_tiles, n_heads=n_heads, programs=programs,
                          causal=causal, group=group, n_q_tiles=n_q_tiles,
                          visit_heads=visit_heads)
    if not catalog.get(schedule).separate_dq:
        return run_plans(plans, catalog.is_ordered(schedule), c, r)
    n_q = n_tiles if n_q_tiles is None else n_q_tiles
    kv_pass = run_plans(plans, False, c, 0.0)
    dq_plans = _dq_pass_plans(n_q, n_tiles, n_heads, programs, causal, group)
    dq_pass = run_plans(dq_plans, False, c, 0.0, t0=kv_pass.makespan, kind="dq")
    return Simulation(dq_pass.makespan, [a + b for a, b in zip(kv_pass.busy, dq_pass.busy)],
                      [0.0] * programs, [a + b for a, b in zip(kv_pass.timelines, dq_pass.timelines)])


# ---- validation and closed forms ------------------------------------------------------------------

class ScheduleError(ValueError):
    """A schedule misses or repeats a (q, kv) pair, or its ranks are not a permutation."""


def check(schedule: str, *, n_tiles: int, causal: bool, n_q_tiles: int | None = None, group: int = 1,
          programs: int | None = None, n_heads: int = 2) -> None:
    """Raise unless every needed (q, kv) pair is visited exactly once (and no other), every KV
    tile has exactly one owner, ranks are a permutation per Q tile, and ``programs`` programs
    (default: the fewest allowed) finish without a wait cycle."""
    n_q = n_tiles if n_q_tiles is None else n_q_tiles
    _check_tiles("n_tiles", n_tiles)
    _check_tiles("n_q_tiles", n_q)
    per_head = items_per_head(n_tiles, causal, schedule)
    fewest = per_head if needs_coresident_head(schedule) else 1
    programs = fewest if programs is None else programs
    if programs < fewest:
        raise ValueError(f"programs must be >= {fewest} for {schedule!r} (a head's work items must "
                         f"be co-resident), got {programs}")
    owners = sorted(slot_kv_tile(i, s, n_tiles, causal, schedule)
                    for i in range(per_head) for s in range(num_slots(causal, schedule)))
    if [kv for kv in owners if kv >= 0] != list(range(n_tiles)):
        raise ScheduleError(f"{schedule}: KV tiles are not owned exactly once: {owners}")
    visits = [(s.q, s.kv) for i in range(per_head) for s in item_steps(i, n_q, n_tiles, causal, schedule)]
    needed = sorted(rank_table(n_q, n_tiles, causal, schedule))
    if sorted(visits) != needed:
        raise ScheduleError(f"{schedule}: visited pairs differ from the needed ones "
                            f"(n_q={n_q}, n_kv={n_tiles}, causal={causal})")
    ranks: dict[int, list[int]] = {}
    for (q, _), rank in rank_table(n_q, n_tiles, causal, schedule).items():
        ranks.setdefault(q, []).append(rank)
    for q, got in ranks.items():
        if sorted(got) != list(range(len(got))):
            raise ScheduleError(f"{schedule}: ranks of Q tile {q} are not 0..{len(got) - 1}: {sorted(got)}")
    simulate(schedule, n_tiles=n_tiles, n_heads=n_heads, programs=programs, causal=causal,
             group=group, n_q_tiles=n_q)


def check_window(schedule: str, *, n_q: int, n_kv: int, block: int, left: int, right: int,
                 causal: bool) -> None:
    """Raise unless the windowed formulas visit exactly the (Q tile, KV tile) pairs whose rows and
    keys meet inside the window, each once, with ranks 0..k-1 per Q tile in ascending KV order
    (the work-item order every program follows: no wait cycle, any grid)."""
    if schedule == "shift":
        raise ValueError("shift has no windowed ranks (the launcher falls back)")

    def meets(q: int, kv: int) -> bool:
        return any((left < 0 or j >= i - left) and (right < 0 or j <= i + right)
                   and (not causal or j <= i)
                   for i in range(q * block, q * block + block)
                   for j in range(kv * block, kv * block + block))

    visits = {}
    for kv in range(n_kv):
        first, count = window_q_range(kv, n_q, block, left, right, causal)
        order = [window_q_tile_at(t, first, count, schedule) for t in range(count)]
        if len(set(order)) != count:
            raise AssertionError(f"KV tile {kv} visits {order}: a Q tile twice")
        visits.update({(q, kv): window_rank(q, kv, block, left) for q in order})
    needed = {(q, kv) for q in range(n_q) for kv in range(n_kv) if meets(q, kv)}
    if set(visits) != needed:
        raise AssertionError(f"visited {sorted(set(visits) ^ needed)} wrongly")
    for q in range(n_q):
        ranks = [visits[(q, kv)] for kv in range(n_kv) if (q, kv) in visits]
        if ranks != list(range(len(ranks))):
            raise AssertionError(f"Q tile {q} has ranks {ranks}, not 0..{len(ranks) - 1} by KV")


def predicted_makespan(schedule: str, *, n_tiles: int, n_heads: int, programs: int, causal: bool,
                       c: float = 1.0, r: float = 0.25, group: int = 1,
                       n_q_tiles: int | None = None) -> float:
    """DASH's closed-form critical paths, for k = programs // items_per_head groups of programs
    that each take every k-th head (h' = ceil(n_heads / k) heads per group).

    Exact in the model when ``programs`` is a multiple of ``items_per_head`` (shift: also
    ``n_q_tiles >= n_tiles``, or ``>= n_tiles - 1`` when causal; recompute: also ``programs`` a
    multiple of ``n_q_tiles``); otherwise an estimate, and :func:`simulate` gives the model's value.
        full:   shift h'g n_q (c+r) [+ (ceil(n_kv/n_q)-1) r when n_kv > n_q];
                ascending, descending h'g n_q (c+r) + (n_kv-1) r;  atomic h'g n_q (c+r)
        causal: shift h'g (n_q + n_q-n_kv+1) (c+r) (the paired items; n_q = n_kv = n gives
                h'(n+1)(c+r), i.e. m(n+1)(c+r)/2 on n programs); ascending h'g n_q (c+r)
                + (min(n_q, n_kv)-1) r; descending, atomic h'g n_q (c+r)
        recompute: h'g n_q c for the KV pass + ceil(m g n_q / P) max_q(contributors) c for dQ.
    """
    n_q = n_tiles if n_q_tiles is None else n_q_tiles
    _check_schedule(schedule)
    for name, value in (("n_tiles", n_tiles), ("n_q_tiles", n_q), ("n_heads", n_heads),
                        ("programs", programs), ("group", group)):
        _check_tiles(name, value)
    n_kv = n_tiles
    per_head = items_per_head(n_kv, causal, schedule)
    if needs_coresident_head(schedule) and programs < per_head:
        raise ValueError(f"programs must be >= items_per_head = {per_head} for {schedule!r}, got {programs}")
    heads = -(-n_heads // max(programs // per_head, 1)) * group
    if schedule == "shift":
        if causal:
            paired = n_q + max(n_q - n_kv + 1, 0) if n_kv > 1 else n_q
            return heads * paired * (c + r)
        return heads * n_q * (c + r) + (-(-n_kv // n_q) - 1) * r
    if schedule == "recompute":
        contributors = min(n_q, n_kv) if causal else n_kv
        return heads * n_q * c + -(-n_heads * group * n_q // programs) * contributors * c
    skew = 0 if schedule == "atomic" or (causal and schedule == "descending") else \
        (min(n_q, n_kv) if causal else n_kv) - 1
    return heads * n_q * (c + r) + skew * r
