"""The DASH model for packed sequences (dash_inductor/packed_schedule.py): the kernels' deal,
every needed pair once with its sequence's own ranks, no wait cycle, one sequence = dense."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dash_inductor import schedule
from dash_inductor.ops.catalog import NAMES, ORDERED
from dash_inductor.packed_schedule import packed_plans, simulate_packed

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
