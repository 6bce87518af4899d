"""The packed Hopper backward's preprocess (``ops/hopper/packed_prep.py``), on the CPU (Triton
interpreter): every sequence's row stats land where the kernel's TMA boxes read them, each box
starts 16-byte aligned, a box that holds a sequence's rows holds no other sequence's (BLOCK_M
rows of padding on each side), the padding holds +inf and 0, and the values are the dense
preprocess's (the kernel itself is checked on a GPU, tests/gpu)."""

import itertools
import math

import pytest
import torch

from dash_inductor.ops import catalog
from dash_inductor.ops.hopper.packed_prep import packed_prepare
from dash_inductor.ops.shared.launch import Launches
from dash_inductor.ops.shared.preprocess import compute_delta
from dash_inductor.ops.shared.tiles import LOG2E


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_rows_land_where_the_aligned_boxes_read_them(seed, aligned, dtype):
    gen = torch.Generator().manual_seed(seed)
    lens_q = torch.randint(0, 150, (7,), generator=gen).tolist()
    lens_k = torch.randint(0, 150, (7,), generator=gen).tolist()
    heads, ev, total, box = 3, 20, sum(lens_q), 16  # a head dim below its power-of-two bucket
    out, grad_out = (torch.randn(total, heads, ev, generator=gen).to(dtype) for _ in range(2))
    lse = torch.randn(heads, total, generator=gen)
    lse[0, :5] = -math.inf  # rows that saw no key: +inf in the stats, as the dense layout
    stats, row_stride, prefix = packed_prepare(
        out, grad_out, lse, _offsets(lens_q), _offsets(lens_k), sum(lens_k), max(lens_q),
        max(lens_k), aligned=aligned, causal=aligned, schedule=catalog.get("descending"),
        block_m=box, block_n=2 * box, with_prefix=False, launches=Launches())
    assert prefix is None and row_stride % 4 == 0
    stats = stats.view(2, heads, row_stride)
    delta = compute_delta(out.transpose(0, 1).unsqueeze(0), grad_out.transpose(0, 1).unsqueeze(0),
                          Launches())
    lse2 = lse * LOG2E
    lse2[lse2 == -math.inf] = math.inf
    padding = torch.ones(row_stride, dtype=torch.bool)
    end_of_previous, q0 = 0, 0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q_lo = max(lk - lq, 0) if aligned else 0
        room = q0 + (2 * box + 4) * i + box
        first = room + ((q_lo - room) & 3)
        assert (first - q_lo) % 4 == 0  # a box at row0 (a multiple of box) - q_lo is aligned
        # the boxes reach box - 1 rows before and after the sequence's rows, and no further
        assert first - (box - 1) > end_of_previous and first + lq + box - 1 <= row_stride
        end_of_previous = first + lq + box - 1
        if lq:
            assert torch.equal(stats[0, :, first:first + lq], lse2[:, q0:q0 + lq])
            assert torch.equal(stats[1, :, first:first + lq], delta[:, q0:q0 + lq])
            padding[first:first + lq] = False
        q0 += lq
    assert bool((stats[0, :, padding] == math.inf).all())
    assert bool((stats[1, :, padding] == 0).all())


@pytest.mark.parametrize("aligned", [False, True])
def test_rows_a_first_store_may_miss_are_zeroed_in_the_accumulator(aligned):
    """The ordered Hopper writer stores each row's first partial instead of adding it into a
    cleared accumulator, so the preprocess zeroes the rows of the sequences where a query may see
    no key (no keys; aligned bottom-right, more queries than keys) and those of the sub-tiles
    that cross a sequence's edge (added row by row), and leaves the rest alone."""
    lens_q = [40, 0, 70, 33, 90, 5]
    lens_k = [40, 30, 0, 50, 20, 5]
    heads, ev, total = 2, 16, sum(lens_q)
    gen = torch.Generator().manual_seed(0)
    out, grad_out = (torch.randn(total, heads, ev, generator=gen) for _ in range(2))
    lse = torch.randn(heads, total, generator=gen)
    acc = torch.full((heads, total, 32), math.nan)
    packed_prepare(out, grad_out, lse, _offsets(lens_q), _offsets(lens_k), sum(lens_k),
                   max(lens_q), max(lens_k), aligned=aligned, causal=aligned,
                   schedule=catalog.get("shift"), block_m=16, block_n=32, with_prefix=False,
                   keyless_rows=acc, launches=Launches())
    q0, box = 0, 16
    for lq, lk in zip(lens_q, lens_k):
        q_lo = max(lk - lq, 0) if aligned else 0
        keyless = lk == 0 or (aligned and lq > lk)
        for i in range(lq):
            sub_tile = (q_lo + i) // box * box
            crossing = sub_tile < q_lo or sub_tile + box > q_lo + lq
            row = acc[:, q0 + i]
            assert bool((row == 0).all()) if keyless or crossing else bool(row.isnan().all()), \
                (lq, lk, i)
        q0 += lq
