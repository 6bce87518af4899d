"""The Hopper backward's packed row stats (``ops/hopper/launch.packed_row_stats``), on the CPU:
every sequence's rows land where the kernel's TMA boxes read them, each box starts 16-byte
aligned, and segments never overlap (the kernel itself is checked on a GPU, tests/gpu)."""

import math

import pytest
import torch

from dash_inductor.ops.hopper.launch import packed_row_stats
from dash_inductor.ops.tiles import LOG2E



@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_rows_land_where_the_aligned_boxes_read_them(seed, aligned):
    gen = torch.Generator().manual_seed(seed)
    lens_q = torch.randint(0, 300, (7,), generator=gen)
    lens_k = torch.randint(0, 300, (7,), generator=gen)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lens_q.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lens_k.cumsum(0)]).to(torch.int32)
    heads, total = 3, int(cu_q[-1])
    lse = torch.randn(heads, total, generator=gen)
    lse[0, :5] = float("-inf")  # rows that saw no key: +inf in the stats, as the dense layout
    delta = torch.randn(heads, total, generator=gen)
    stats, start, row_stride = packed_row_stats(lse, delta, cu_q, cu_k, aligned)
    stats = stats.view(2, heads, row_stride)
    assert row_stride % 4 == 0
    end_of_previous = 0
    for i in range(7):
        lq, lk = int(lens_q[i]), int(lens_k[i])
        q_lo = max(lk - lq, 0) if aligned else 0
        first = int(start[i])
        assert (first - q_lo) % 4 == 0  # a box at row0 (a multiple of 64) - q_lo is aligned
        assert first >= end_of_previous and first + lq <= row_stride
        end_of_previous = first + lq
        rows = slice(int(cu_q[i]), int(cu_q[i]) + lq)
        want = lse[:, rows] * LOG2E
        want[want == -math.inf] = math.inf
        assert torch.equal(stats[0, :, first:first + lq], want)
        assert torch.equal(stats[1, :, first:first + lq], delta[:, rows])
