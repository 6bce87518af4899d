"""The DASH model for packed sequences (dash_inductor/model/packed_schedule.py): the kernels' deal,
every needed pair once with its sequence's own ranks, no wait cycle, one sequence = dense."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dash_inductor.model import schedule
from dash_inductor.ops.catalog import NAMES, ORDERED
from dash_inductor.model.packed_schedule import packed_plans, simulate_claimed, simulate_packed

ONE_PASS = [name for name in NAMES if name != "recompute"]
packings = st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any)


@settings(max_examples=40, deadline=None)
@given(tiles=packings, heads=st.integers(1, 3), programs=st.integers(1, 12), causal=st.booleans(),
       name=st.sampled_from(NAMES), pad=st.booleans())
def test_every_needed_pair_once_with_the_ranks_of_its_sequence_alone(tiles, heads, programs, causal,
                                                                      name, pad):
    plans = packed_plans(name, tiles=tiles, n_heads=heads, programs=programs, causal=causal,
                         pad=pad)
    seen = Counter((s.head, s.q, s.kv) for plan in plans for s in plan)
    needed = Counter((b * heads + h, q, kv) for b, n in enumerate(tiles) for h in range(heads)
                     for q in range(n) for kv in range(n) if not causal or q >= kv)
    assert seen == needed
    for plan in plans:
        for s in plan:
            n = tiles[s.head // heads]
            assert s.rank == schedule.reduction_rank(s.q, s.kv, n, n, causal, name)


@settings(max_examples=30, deadline=None)
@given(tiles=packings, heads=st.integers(1, 3), causal=st.booleans(),
       name=st.sampled_from([n for n in ONE_PASS if n in ORDERED]), pad=st.booleans())
def test_ordered_schedules_finish_under_either_deal(tiles, heads, causal, name, pad):
    """No wait cycle: the kernels' ordered waits never hang on packed sequences (with enough
    programs for a head's items to run at once, as the launchers guarantee for ``shift``)."""
    programs = max(schedule.items_per_head(n, causal, name) for n in tiles if n)
    sim = simulate_packed(name, tiles=tiles, n_heads=heads, programs=programs, causal=causal,
                          pad=pad)
    assert sim.makespan >= max(sim.busy) > 0


@pytest.mark.parametrize("name", ONE_PASS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_sequence_is_the_dense_model(name, causal):
    if causal and name == "atomic":
        pytest.skip("the dense model deals causal atomic items by the portable kernel's work "
                    "counter; the packed deal is fixed, as in the Hopper kernel")
    dense = schedule.program_plans(name, n_tiles=12, n_heads=4, programs=13, causal=causal)
    assert packed_plans(name, tiles=[12], n_heads=4, programs=13, causal=causal) == dense
    sim = simulate_packed(name, tiles=[12], n_heads=4, programs=13, causal=causal, r=0.3)
    assert sim.makespan == schedule.simulate(name, n_tiles=12, n_heads=4, programs=13,
                                             causal=causal, r=0.3).makespan


def test_the_padded_deal_draws_the_short_sequences_empty_items():
    """Every sequence is dealt the longest one's item count (3 here): sequence 1's two empty
    items push sequence 2's onto programs 2 and 3. Without padding the sequences go longest
    first: sequence 2's items to programs 3 and 0, then sequence 1's to 1."""
    steps = lambda **kw: [len(plan) for plan in packed_plans("atomic", tiles=[3, 1, 2], n_heads=1,
                                                              programs=4, causal=False, **kw)]
    assert steps() == [3, 3, 3 + 2, 1 + 2]
    assert steps(pad=False) == [3 + 2, 3 + 1, 3, 2]


def test_recompute_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="recompute"):
        simulate_packed("recompute", tiles=[4], n_heads=1, programs=2, causal=True)
    with pytest.raises(ValueError, match="tiles"):
        packed_plans("shift", tiles=[], n_heads=1, programs=2, causal=True)
    with pytest.raises(ValueError, match="zigzag"):
        packed_plans("zigzag", tiles=[2], n_heads=1, programs=2, causal=True)


# ---- the claimed deal (simulate_claimed) ---------------------------------------------------------

def _claimed_programs(draw, tiles, causal, name):
    most = max(schedule.items_per_head(n, causal, name) for n in tiles if n)
    return draw(st.integers(most, max(most, 40)))


@settings(max_examples=250, deadline=None)
@given(data=st.data(), tiles=st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(any),
       heads=st.integers(1, 3), causal=st.booleans(), name=st.sampled_from(["shift", "descending"]),
       lookahead=st.integers(0, 4), group=st.integers(1, 2))
def test_the_claimed_deal_with_the_head_rule_runs_every_step_once_in_rank_order(
        data, tiles, heads, causal, name, lookahead, group):
    """No wait cycle, each step of the unpadded deal computed once, each Q tile's adds one after
    another in rank order, each program doing one thing at a time."""
    programs = _claimed_programs(data.draw, tiles, causal, name)
    sim = simulate_claimed(name, tiles=tiles, n_heads=heads, programs=programs, causal=causal,
                           group=group, lookahead=lookahead)
    steps = [s for plan in packed_plans(name, tiles=tiles, n_heads=heads, programs=programs,
                                        causal=causal, group=group, pad=False) for s in plan]
    rank = {(s.head, s.qhead, s.q, s.kv): s.rank for s in steps}
    segments = [seg for line in sim.timelines for seg in line]
    run = Counter((seg.head, seg.qhead, seg.q, seg.kv, rank[(seg.head, seg.qhead, seg.q, seg.kv)])
                  for seg in segments if seg.kind == "compute")
    assert run == Counter((s.head, s.qhead, s.q, s.kv, s.rank) for s in steps)
    adds: dict[tuple[int, int, int], list] = {}
    for seg in sorted((seg for seg in segments if seg.kind == "reduce"), key=lambda g: g.start):
        adds.setdefault((seg.head, seg.qhead, seg.q), []).append(seg)
    for tile, segs in adds.items():
        assert [rank[(*tile, seg.kv)] for seg in segs] == list(range(len(segs)))
        assert all(a.end <= b.start for a, b in zip(segs, segs[1:]))
    for line in sim.timelines:
        assert all(a.end <= b.start for a, b in zip(line, line[1:]))
    assert sim.makespan == max(seg.end for seg in segments)


def test_without_the_head_rule_a_program_claims_its_own_head_and_hangs():
    """Sequence 1 (3 tiles) deals indices 0-2, sequence 0 (2 tiles) 3 and 4. Program 3's short
    item 3 claims first, index 4, its own head's next item, and at Q tile 1 waits for that one's
    add (rank 0 there): which it would run only after. The rule holds the claim back."""
    kw = dict(tiles=[2, 3], n_heads=1, programs=4, causal=False, lookahead=1)
    hang = r"program 3 \(item 3, next 4\) waits for the dQ add before rank 1"
    with pytest.raises(schedule.WaitCycleError, match=hang):
        simulate_claimed("shift", head_rule=False, **kw)
    assert simulate_claimed("shift", **kw).makespan > 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles,heads,programs", [([8] * 4, 16, 132), ([8] * 4, 3, 16),
                                                  ([12] * 3, 3, 40), ([16] * 4, 16, 132)])
def test_the_claimed_deal_costs_equal_packings_nothing(tiles, heads, programs, causal):
    kw = dict(tiles=tiles, n_heads=heads, programs=programs, causal=causal, r=0.15)
    fixed = simulate_packed("shift", pad=False, **kw).makespan
    assert simulate_claimed("shift", **kw).makespan <= fixed * 1.01


def test_the_claimed_deal_finishes_three_documents_sooner():
    kw = dict(tiles=[59, 29, 42], n_heads=16, programs=132, causal=True, r=0.15)
    fixed = simulate_packed("shift", pad=False, **kw).makespan
    claimed = simulate_claimed("shift", **kw).makespan
    assert claimed < fixed - 10  # 466.35 against 491.35


def test_simulate_claimed_refuses_bad_arguments():
    kw = dict(tiles=[6], n_heads=1, causal=False)
    with pytest.raises(ValueError, match="programs"):
        simulate_claimed("shift", programs=5, **kw)  # a head of 6 items on 5 programs
    with pytest.raises(ValueError, match="lookahead"):
        simulate_claimed("shift", programs=6, lookahead=-1, **kw)
    with pytest.raises(ValueError, match="lookahead"):
        simulate_claimed("shift", programs=6, lookahead=1.5, **kw)
    with pytest.raises(ValueError, match="recompute"):
        simulate_claimed("recompute", programs=6, **kw)
    with pytest.raises(ValueError, match="c > 0"):
        simulate_claimed("shift", programs=6, c=0.0, **kw)
    with pytest.raises(ValueError, match="tiles"):
        simulate_claimed("shift", tiles=[], n_heads=1, programs=6, causal=False)
    with pytest.raises(ValueError, match="zigzag"):
        simulate_claimed("zigzag", programs=6, **kw)
    # Without the rule its precondition is not needed: a head's 6 unordered items of 6 steps
    # each on 2 programs, 3 items each.
    assert simulate_claimed("atomic", programs=2, head_rule=False, **kw).makespan == 18 * 1.25
