"""``tiles.key_tile_range`` against the masks themselves: for query rows [start_m, start_m + BLOCK_M)
the kernels skip every KV tile outside [start, end), mask only the tiles of [start, full_start)
and [full_end, end), and fold [full_start, full_end) unmasked. So every tile outside must hold no
visible (row, key) pair, and every tile of the unmasked range must hold no masked one (by causal,
the window, or keys past S); rows past L are never stored and do not count.

One interpreter launch evaluates the function for every Q tile of a drawn problem.
"""

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dash_inductor import pytest_plugin  # noqa: E402
from dash_inductor.ops.shared.tiles import key_tile_range  # noqa: E402

CI = settings.get_profile(pytest_plugin.CI_PROFILE)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _ranges(out, S, diag, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    pid = tl.program_id(0)
    start, full_start, full_end, end = key_tile_range(pid * BLOCK_M, S, diag, BLOCK_M, BLOCK_N,
                                                      CAUSAL, WINDOW, win_left, win_right)
    tl.store(out + pid * 4, start)
    tl.store(out + pid * 4 + 1, full_start)
    tl.store(out + pid * 4 + 2, full_end)
    tl.store(out + pid * 4 + 3, end)


def _visible(L: int, S: int, diag: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(L, S) bool: query row i (diagonal key i + diag) may see key j."""
    rows = torch.arange(L)[:, None] + diag
    keys = torch.arange(S)[None, :]
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep &= keys <= rows
    if window[0] >= 0:
        keep &= keys >= rows - window[0]
    if window[1] >= 0:
        keep &= keys <= rows + window[1]
    return keep


@st.composite
def problems(draw):
    block_m = draw(st.sampled_from([16, 32]))
    block_n = draw(st.sampled_from([16, 32]))
    L = draw(st.integers(1, 200))
    S = draw(st.integers(1, 200))
    causal = draw(st.booleans())
    diag = draw(st.sampled_from([0, S - L]))  # top-left (dash.attention) or bottom-right (varlen)
    window = (draw(st.integers(-1, 120)), draw(st.sampled_from([-1, 0, 3, 40, 150])))
    return block_m, block_n, L, S, causal, diag, window


@settings(CI, max_examples=60)
@given(p=problems())
def test_only_edge_tiles_are_masked_and_no_visible_tile_is_skipped(p):
    block_m, block_n, L, S, causal, diag, window = p
    windowed = window != (-1, -1)
    n_m = triton.cdiv(L, block_m)
    out = torch.empty(n_m * 4, dtype=torch.int32, device=DEVICE)
    _ranges[(n_m,)](out, S, diag, *window, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                    WINDOW=windowed)
    ranges = out.view(n_m, 4).tolist()
    visible = _visible(L, S, diag, causal, window)
    for m, (start, full_start, full_end, end) in enumerate(ranges):
        rows = slice(m * block_m, min((m + 1) * block_m, L))
        if end > start:
            assert start <= full_start <= full_end <= end, (m, ranges[m])
        for n0 in range(0, triton.cdiv(S, block_n) * block_n, block_n):
            tile = visible[rows, n0:n0 + block_n]
            inside = n0 + block_n <= S and bool(tile.all())
            if not start <= n0 < end:
                assert not tile.any(), f"Q tile {m} skips KV tile {n0} where a key is visible"
            if full_start <= n0 < full_end:
                assert inside, f"Q tile {m} leaves KV tile {n0} unmasked, which needs masks"
