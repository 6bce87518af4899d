"""The DAG model of dash_inductor/model/schedule.py: DASH's results, and the invariants of every schedule."""

import itertools
import random

import pytest

from dash_inductor.model import schedule as S

# Dyadic costs keep sums of floats exact; ratios c/r from 1 to 8.
COSTS = [(1.0, 0.125), (1.0, 0.25), (0.75, 0.5), (2.0, 0.25)]


@pytest.mark.parametrize("c,r", COSTS)
@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("heads", [1, 2, 5])
def test_full_mask_shift_is_zero_idle_and_ascending_pays_the_start_up_skew(c, r, n, heads):
    shift = S.simulate("shift", n_tiles=n, n_heads=heads, programs=n, causal=False, c=c, r=r)
    assert shift.makespan == heads * n * (c + r)
    assert shift.idle == [0.0] * n and shift.stall == [0.0] * n
    ascending = S.simulate("ascending", n_tiles=n, n_heads=heads, programs=n, causal=False, c=c, r=r)
    assert ascending.makespan == heads * n * (c + r) + (n - 1) * r
    assert max(ascending.stall) > 0


@pytest.mark.parametrize("c,r", COSTS)
@pytest.mark.parametrize("n", [2, 4, 6, 10])
@pytest.mark.parametrize("heads", [2, 4, 6])
def test_causal_symmetric_shift_reaches_the_paper_bound(c, r, n, heads):
    sim = S.simulate("shift", n_tiles=n, n_heads=heads, programs=n, causal=True, c=c, r=r)
    assert sim.makespan == heads * (n + 1) * (c + r) / 2
    assert sim.idle == [0.0] * n, "every program works the whole time"
    work = heads * n * (n + 1) / 2 * (c + r)
    assert sim.makespan * n == work


@pytest.mark.parametrize("c,r", COSTS)
@pytest.mark.parametrize("n,heads,programs", [(4, 2, 4), (8, 8, 8), (8, 8, 11), (16, 32, 132), (12, 6, 40)])
def test_causal_descending_beats_ascending(c, r, n, heads, programs):
    kwargs = dict(n_tiles=n, n_heads=heads, programs=programs, causal=True, c=c, r=r)
    descending = S.simulate("descending", **kwargs).makespan
    ascending = S.simulate("ascending", **kwargs).makespan
    assert descending < ascending
    if programs % n == 0:  # a fixed KV tile per program: descending saves exactly the skew
        assert ascending - descending == (n - 1) * r


def test_descending_gains_most_when_programs_rotate_over_kv_tiles():
    kwargs = dict(n_tiles=16, n_heads=32, programs=132, causal=True, c=1.0, r=0.25)
    descending = S.simulate("descending", **kwargs).makespan
    ascending = S.simulate("ascending", **kwargs).makespan
    assert descending < 0.75 * ascending


def _exact_domain():
    """Cases where predicted_makespan is exact (see its docstring)."""
    for schedule, causal, n_q, n_kv, group, heads, k in itertools.product(
            S.SCHEDULES, (False, True), range(1, 8), range(1, 8), (1, 2), (1, 3, 4), (1, 2)):
        if schedule == "shift" and n_q < n_kv - causal:
            continue
        programs = k * S.items_per_head(n_kv, causal, schedule)
        if schedule == "recompute" and programs % n_q:
            continue
        yield schedule, causal, n_q, n_kv, group, heads, programs


def _dealt_by_counter(schedule, causal):
    """recompute/atomic take the next free item; with causal masks that breaks the closed form."""
    return causal and schedule not in S.ORDERED


def test_predicted_makespan_equals_the_simulated_critical_path():
    rng = random.Random(4)
    cases = [case for case in _exact_domain() if not _dealt_by_counter(case[0], case[1])]
    assert len(cases) > 1000
    for schedule, causal, n_q, n_kv, group, heads, programs in cases:
        c, r = rng.choice(COSTS)
        kwargs = dict(n_tiles=n_kv, n_q_tiles=n_q, n_heads=heads, programs=programs, causal=causal,
                      group=group, c=c, r=r)
        simulated = S.simulate(schedule, **kwargs).makespan
        assert S.predicted_makespan(schedule, **kwargs) == pytest.approx(simulated, rel=1e-12), kwargs


def test_dealing_by_counter_never_loses_to_the_fixed_deal_critical_path():
    """Causal recompute/atomic take the next free item; the fixed deal's closed form bounds them."""
    cases = [case for case in _exact_domain() if _dealt_by_counter(case[0], case[1])]
    assert len(cases) > 100
    for (schedule, causal, n_q, n_kv, group, heads, programs), (c, r) in itertools.product(cases, COSTS):
        kwargs = dict(n_tiles=n_kv, n_q_tiles=n_q, n_heads=heads, programs=programs, causal=causal,
                      group=group, c=c, r=r)
        assert S.simulate(schedule, **kwargs).makespan <= S.predicted_makespan(schedule, **kwargs), kwargs


def test_dealing_by_counter_balances_causal_items_when_programs_barely_exceed_tiles():
    """64 KV tiles on 68 programs: dealt p, p+P, ..., program 0 would get KV tiles 0, 4, 8, ... of
    every head (1.6x the mean work); taking the next free item stays within 1.2x of it."""
    n, heads, programs, cost = 64, 8, 68, 1.25
    sim = S.simulate("atomic", n_tiles=n, n_heads=heads, programs=programs, causal=True, c=1.0, r=0.25)
    mean = heads * n * (n + 1) / 2 * cost / programs
    head_major = [0.0] * programs
    for work in range(heads * n):
        head_major[work % programs] += (n - work % n) * cost
    assert sim.makespan < 1.2 * mean < 0.75 * max(head_major)


@pytest.mark.parametrize("visit_heads", [None, 1, 2], ids=["slots-outer", "1-head", "2-heads"])
@pytest.mark.parametrize("group", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [4, 6, 9, 16])
def test_causal_shift_stays_zero_idle_with_gqa(n, group, visit_heads):
    """Whether an item visits every query head of a group per KV tile (the portable kernel) or
    both KV tiles per one or two query heads (the Hopper kernel), its waits must not compound."""
    sim = S.simulate("shift", n_tiles=n, n_heads=4, programs=n + n % 2, causal=True, group=group,
                     c=1.0, r=0.25, visit_heads=visit_heads)
    assert sim.stall == [0.0] * (n + n % 2)
    longest = n + 1
    assert sim.makespan == 2 * group * longest * 1.25


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("n", [6, 16])
def test_visits_by_head_keep_a_kv_heads_items_on_few_query_heads(n, group):
    """Head by head, every item of a KV head is on the same query head at every step (so the
    items in flight share that head's dQ, Q and dO); two heads a visit, on at most two; tile by
    tile, they spread over the group."""
    def query_heads_in_flight(visit_heads):
        plans = S.program_plans("shift", n_tiles=n, n_heads=1, programs=(n + 1) // 2,
                                causal=True, group=group, visit_heads=visit_heads)
        return max(len({plan[t].qhead for plan in plans if t < len(plan)})
                   for t in range(max(map(len, plans))))
    assert query_heads_in_flight(1) == 1
    assert query_heads_in_flight(2) == 2
    assert query_heads_in_flight(None) > 2 or group == 2


def _program_counts(rng, schedule, n_kv, causal):
    per_head = S.items_per_head(n_kv, causal, schedule)
    fewest = per_head if S.needs_coresident_head(schedule) else 1
    return sorted({fewest, fewest + 1, per_head, per_head + 1, 2 * per_head, rng.randint(fewest, 3 * per_head)})


@pytest.mark.parametrize("schedule", S.SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_every_schedule_is_valid_for_all_small_shapes(schedule, causal):
    rng = random.Random(hash((schedule, causal)) % 1000)
    for n_q, n_kv in itertools.product(range(1, 13), range(1, 13)):
        S.check(schedule, n_tiles=n_kv, n_q_tiles=n_q, causal=causal)
        if rng.random() < 0.3:
            for programs in _program_counts(rng, schedule, n_kv, causal):
                S.check(schedule, n_tiles=n_kv, n_q_tiles=n_q, causal=causal, group=rng.randint(1, 3),
                        programs=programs, n_heads=rng.randint(1, 4))


@pytest.mark.parametrize("schedule", S.ORDERED)
def test_each_q_tile_is_reduced_in_rank_order_whatever_the_grid(schedule):
    for causal, (n_q, n_kv), group in itertools.product((False, True), [(5, 5), (6, 4), (3, 7)], (1, 2)):
        fewest = S.items_per_head(n_kv, causal, schedule) if S.needs_coresident_head(schedule) else 1
        expected = {}
        for (q, kv), rank in S.rank_table(n_q, n_kv, causal, schedule).items():
            expected.setdefault(q, {})[rank] = kv
        for programs in (fewest, fewest + 2, 2 * n_kv + 1):
            sim = S.simulate(schedule, n_tiles=n_kv, n_q_tiles=n_q, n_heads=3, programs=programs,
                             causal=causal, group=group, r=0.5)
            added: dict[tuple[int, int, int], list[tuple[float, int]]] = {}
            for line in sim.timelines:
                for seg in line:
                    if seg.kind == "reduce":
                        added.setdefault((seg.head, seg.qhead, seg.q), []).append((seg.start, seg.kv))
            assert len(added) == 3 * group * n_q
            for (_, _, q), events in added.items():
                assert [kv for _, kv in sorted(events)] == [expected[q][i] for i in range(len(expected[q]))]


@pytest.mark.parametrize("a,count,width", [(a, n, w) for w in range(1, 7) for n in range(1, 14)
                                           for a in range(w)])
def test_cyclic_rank_counts_earlier_arrivals(a, count, width):
    keys = sorted(((a - kv) % width, kv) for kv in range(count))
    for kv in range(count):
        assert S._cyclic_rank(a, kv, count, width) == keys.index(((a - kv) % width, kv))


def test_simulator_reports_a_wait_cycle(monkeypatch):
    # Ranks in descending KV order make KV tile 0 wait for tile n-1, which one program runs later.
    monkeypatch.setattr(S, "reduction_rank", lambda q, kv, n_q, n_kv, causal, schedule: n_kv - 1 - kv)
    with pytest.raises(S.WaitCycleError, match="wait forever"):
        S.simulate("ascending", n_tiles=4, n_heads=1, programs=1, causal=False)
    S.simulate("ascending", n_tiles=4, n_heads=1, programs=4, causal=False)


def test_shift_needs_a_co_resident_head():
    with pytest.raises(ValueError, match="programs must be >= 3"):
        S.check("shift", n_tiles=3, causal=False, programs=2)
    with pytest.raises(S.WaitCycleError):
        S.simulate("shift", n_tiles=3, n_heads=1, programs=2, causal=False)


def test_check_catches_a_missed_pair_and_a_broken_rank(monkeypatch):
    original_q, original_rank = S.q_tile_at, S.reduction_rank
    monkeypatch.setattr(S, "q_tile_at", lambda t, kv, *args: min(original_q(t, kv, *args), 2))
    with pytest.raises(S.ScheduleError, match="visited pairs"):
        S.check("descending", n_tiles=4, causal=False)
    monkeypatch.setattr(S, "q_tile_at", original_q)
    monkeypatch.setattr(S, "reduction_rank", lambda q, kv, *args: original_rank(q, kv, *args) // 2)
    with pytest.raises(S.ScheduleError, match="not 0..3"):
        S.check("ascending", n_tiles=4, causal=False)


@pytest.mark.parametrize("bad,match", [
    (dict(schedule="fastest"), "schedule must be one of"),
    (dict(n_tiles=0), "n_tiles must be a positive int"),
    (dict(programs=2.5), "programs must be a positive int"),
    (dict(c=0.0), "costs must satisfy"),
])
def test_bad_arguments_are_named(bad, match):
    kwargs = dict(schedule="ascending", n_tiles=4, n_heads=1, programs=2, causal=False)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        S.simulate(kwargs.pop("schedule"), **kwargs)


def test_model_backs_the_hopper_grid_rule():
    """The Hopper launcher runs equally long items (unmasked, causal ``shift`` pairs) on a whole
    number of heads' worth of programs and unequal ones on every SM (``ordered_programs``):
    in the model too, unmasked ``descending`` finishes sooner on 128 programs than on 132 (a
    head straddling two rounds waits), causal ``descending`` later, ``shift`` the same."""
    def makespan(name, causal, programs):
        return S.simulate(name, n_tiles=32, n_heads=64, programs=programs, causal=causal).makespan

    assert makespan("descending", False, 128) < makespan("descending", False, 132)
    assert makespan("descending", True, 128) > makespan("descending", True, 132)
    for causal in (False, True):
        assert makespan("shift", causal, 128) == makespan("shift", causal, 132)
