"""ops/shared/schedules.py's @triton.jit functions equal their plain-Python twins in dash_inductor/model/schedule.py,
and both take the schedules' names, ids and properties from ops/catalog.py.

One tiny kernel launch per (schedule, causal, n_q, n_kv) evaluates every function for every
(work item, slot, step) and every (q, kv) pair; on machines without CUDA it runs in the interpreter.
"""

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dash_inductor.model import schedule as model  # noqa: E402
from dash_inductor.ops import catalog  # noqa: E402
from dash_inductor.ops.shared import schedules as ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = range(1, 13)


@triton.jit
def _evaluate_schedule(kv_out, count_out, q_out, rank_out, pair_rank_out, n_items, n_q, n_kv,
                       STEPS_BLOCK: tl.constexpr, PAIRS_BLOCK: tl.constexpr,
                       CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    # Every (item, slot, step): slot_kv_tile, visit_count, q_tile_at, and the rank of that visit.
    index = tl.arange(0, STEPS_BLOCK)
    item = index // (2 * n_q)
    slot = (index // n_q) % 2
    step = index % n_q
    inside = item < n_items
    kv = ops.slot_kv_tile(item, slot, n_kv, CAUSAL, SCHEDULE)
    owned = inside & (kv >= 0)
    count = ops.visit_count(tl.maximum(kv, 0), n_q, CAUSAL)
    visited = owned & (step < count)
    q = ops.q_tile_at(step, tl.maximum(kv, 0), n_q, n_kv, CAUSAL, SCHEDULE)
    rank = ops.reduction_rank(tl.where(visited, q, 0), tl.maximum(kv, 0), n_q, n_kv, CAUSAL, SCHEDULE)
    tl.store(kv_out + index, kv, mask=inside)
    tl.store(count_out + index, count, mask=owned)
    tl.store(q_out + index, q, mask=visited)
    tl.store(rank_out + index, rank, mask=visited)
    # Every (q, kv) pair, visited or not: the full rank table.
    pair = tl.arange(0, PAIRS_BLOCK)
    pair_q = pair // n_kv
    pair_kv = pair % n_kv
    pair_rank = ops.reduction_rank(pair_q, pair_kv, n_q, n_kv, CAUSAL, SCHEDULE)
    tl.store(pair_rank_out + pair, pair_rank, mask=pair < n_q * n_kv)


def _run_kernel(schedule: str, causal: bool, n_q: int, n_kv: int) -> dict[str, list[int]]:
    n_items = catalog.items_per_head(n_kv, causal, schedule)
    steps_block = triton.next_power_of_2(n_items * 2 * n_q)
    pairs_block = triton.next_power_of_2(n_q * n_kv)
    outputs = {name: torch.full((size,), -7, dtype=torch.int32, device=DEVICE)
               for name, size in (("kv", steps_block), ("count", steps_block), ("q", steps_block),
                                  ("rank", steps_block), ("pair_rank", pairs_block))}
    _evaluate_schedule[(1,)](outputs["kv"], outputs["count"], outputs["q"], outputs["rank"],
                             outputs["pair_rank"], n_items, n_q, n_kv, STEPS_BLOCK=steps_block,
                             PAIRS_BLOCK=pairs_block, CAUSAL=causal, SCHEDULE=catalog.get(schedule).id)
    return {name: tensor.tolist() for name, tensor in outputs.items()}


def _expected(schedule: str, causal: bool, n_q: int, n_kv: int) -> dict[str, list[int]]:
    """The same buffers filled from the plain-Python model (-7 where the kernel stores nothing)."""
    n_items = model.items_per_head(n_kv, causal, schedule)
    size = triton.next_power_of_2(n_items * 2 * n_q)
    expected = {name: [-7] * size for name in ("kv", "count", "q", "rank")}
    for item, slot, step in itertools.product(range(n_items), range(2), range(n_q)):
        index = (item * 2 + slot) * n_q + step
        kv = model.slot_kv_tile(item, slot, n_kv, causal, schedule)
        expected["kv"][index] = kv
        if kv < 0:
            continue
        expected["count"][index] = model.visit_count(kv, n_q, causal)
        if step < expected["count"][index]:
            q = model.q_tile_at(step, kv, n_q, n_kv, causal, schedule)
            expected["q"][index] = q
            expected["rank"][index] = model.reduction_rank(q, kv, n_q, n_kv, causal, schedule)
    expected["pair_rank"] = [-7] * triton.next_power_of_2(n_q * n_kv)
    for q, kv in itertools.product(range(n_q), range(n_kv)):
        expected["pair_rank"][q * n_kv + kv] = model.reduction_rank(q, kv, n_q, n_kv, causal, schedule)
    return expected


def test_ids_are_distinct_and_the_kernels_constants_come_from_the_catalog():
    assert model.SCHEDULES == catalog.NAMES
    assert sorted(s.id for s in catalog.SCHEDULES.values()) == list(range(len(catalog.NAMES)))
    for constant in (ops.ASCENDING, ops.DESCENDING, ops.SHIFT):
        assert int(constant.value) in {s.id for s in catalog.SCHEDULES.values()}
    assert [catalog.get(name).id for name in ("ascending", "descending", "shift")] == \
        [int(c.value) for c in (ops.ASCENDING, ops.DESCENDING, ops.SHIFT)]


def test_catalog_properties_agree_with_the_model():
    """Work items cover every KV tile once with the catalogue's slot counts; a schedule the model
    finds waiting on other programs is ordered; one that needs its head co-resident deadlocks with
    fewer programs."""
    for schedule, causal, n_kv in itertools.product(catalog.NAMES, (False, True), SIZES):
        per_head = catalog.items_per_head(n_kv, causal, schedule)
        slots = catalog.num_slots(causal, schedule)
        owned = sorted(kv for item in range(per_head) for slot in range(slots)
                       if (kv := model.slot_kv_tile(item, slot, n_kv, causal, schedule)) >= 0)
        assert owned == list(range(n_kv)), (schedule, causal, n_kv)
        stalls = model.simulate(schedule, n_tiles=n_kv, n_heads=2, programs=per_head,
                                causal=causal).stall
        assert catalog.is_ordered(schedule) or not any(stalls)
    with pytest.raises(model.WaitCycleError):
        model.simulate("shift", n_tiles=4, n_heads=1, programs=2, causal=False)


@pytest.mark.parametrize("bad,match", [(("fastest",), "schedule must be one of"),
                                       (("shift", 0), "n_kv must be a positive int")])
def test_host_helpers_name_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        if len(bad) == 1:
            catalog.num_slots(True, bad[0])
        else:
            catalog.items_per_head(bad[1], True, bad[0])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", catalog.NAMES)
def test_triton_schedule_functions_equal_the_model(schedule, causal):
    sizes = list(itertools.product(SIZES, SIZES))
    if not catalog.is_ordered(schedule):  # visit like ascending: a sample is enough
        sizes = sizes[::7]
    for n_q, n_kv in sizes:
        got = _run_kernel(schedule, causal, n_q, n_kv)
        assert got == _expected(schedule, causal, n_q, n_kv), (schedule, causal, n_q, n_kv)


@triton.jit
def _evaluate_window(first_out, count_out, q_out, rank_out, n_q, n_kv, block, left, right,
                     BLOCK: tl.constexpr, CAUSAL: tl.constexpr, SCHEDULE: tl.constexpr):
    # Every (kv, step): the window's Q range, the Q tile at that step and its rank.
    index = tl.arange(0, BLOCK)
    kv = index // n_q
    step = index % n_q
    inside = kv < n_kv
    first, count = ops.window_q_range(kv, n_q, block, left, right, CAUSAL)
    visited = inside & (step < count)
    q = ops.window_q_tile_at(step, first, count, SCHEDULE)
    rank = ops.window_rank(q, kv, block, left)
    tl.store(first_out + index, first, mask=inside)
    tl.store(count_out + index, count, mask=inside)
    tl.store(q_out + index, q, mask=visited)
    tl.store(rank_out + index, rank, mask=visited)


WINDOWS = [(left, right, causal) for left in (-1, 0, 1, 3, 8) for right in (-1, 1, 4, 9)
           for causal in (False, True) if not causal or right == -1]


@pytest.mark.parametrize("schedule", [s for s in catalog.NAMES if s != "shift"])
def test_triton_window_functions_equal_the_model(schedule):
    n_q, n_kv, block = 6, 5, 3
    size = triton.next_power_of_2(n_q * n_kv)
    for left, right, causal in WINDOWS:
        outputs = [torch.full((size,), -7, dtype=torch.int32, device=DEVICE) for _ in range(4)]
        _evaluate_window[(1,)](*outputs, n_q, n_kv, block, left, right, BLOCK=size,
                               CAUSAL=causal, SCHEDULE=catalog.get(schedule).id)
        expected = [[-7] * size for _ in range(4)]
        for kv, step in itertools.product(range(n_kv), range(n_q)):
            index = kv * n_q + step
            first, count = model.window_q_range(kv, n_q, block, left, right, causal)
            expected[0][index], expected[1][index] = first, count
            if step < count:
                q = model.window_q_tile_at(step, first, count, schedule)
                expected[2][index], expected[3][index] = q, model.window_rank(q, kv, block, left)
        assert [o.tolist() for o in outputs] == expected, (schedule, left, right, causal)


@triton.jit
def _window_counts(count_out, n_q, block, left, right, BLOCK: tl.constexpr,
                   CAUSAL: tl.constexpr):
    kv = tl.arange(0, BLOCK)
    tl.store(count_out + kv, ops.window_q_range(kv, n_q, block, left, right, CAUSAL)[1])


def test_window_range_of_a_sequence_without_queries_is_empty():
    """A packed sequence with keys and no queries has KV tiles and no Q tile
    (``tiles.sequence_tiles``): its tiles must visit nothing, though Triton's integer division
    truncates the empty range's last row (-1) to tile 0."""
    for left, right, causal in WINDOWS:
        counts = torch.full((8,), -7, dtype=torch.int32, device=DEVICE)
        _window_counts[(1,)](counts, 0, 3, left, right, BLOCK=8, CAUSAL=causal)
        expected = [model.window_q_range(kv, 0, 3, left, right, causal)[1] for kv in range(8)]
        assert counts.tolist() == expected == [0] * 8, (left, right, causal)


@pytest.mark.parametrize("schedule", [s for s in catalog.NAMES if s != "shift"])
def test_window_model_visits_the_window_once_in_work_item_order(schedule):
    for (left, right, causal), n_q, n_kv in itertools.product(WINDOWS, range(1, 7), range(1, 7)):
        model.check_window(schedule, n_q=n_q, n_kv=n_kv, block=2, left=left, right=right,
                           causal=causal)
    with pytest.raises(ValueError, match="shift has no windowed ranks"):
        model.check_window("shift", n_q=2, n_kv=2, block=2, left=1, right=-1, causal=False)
