"""The CPU reference's blocking: problems of several query blocks, the keys a block leaves out
under causality or a window, and batch invariance on shapes where batched matrix products lose it.
"""

from __future__ import annotations

import math

import pytest
import torch

import dash_inductor
from dash_inductor.library import reference
from dash_inductor.testing import assert_batch_invariant
from tests._reference import sdpa_math, tolerance

#: Three query blocks and a ragged fourth.
ROWS = 3 * reference.BLOCK_M + 5


def _inputs(batch, hq, hkv, l, s, e, ev=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, hq, l, e), (batch, hkv, s, e), (batch, hkv, s, ev or e))
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def _forward_backward(q, k, v, **kwargs):
    out = dash_inductor.attention(q, k, v, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    return out, torch.autograd.grad(out, (q, k, v), grad_out), grad_out


def _keep(l: int, s: int, window: tuple[int, int], is_causal: bool) -> torch.Tensor:
    """keep[i, j]: key j within the window of query i (sides capped: int64 must not overflow)."""
    rows, cols = torch.arange(l)[:, None], torch.arange(s)[None, :]
    left, right = (min(side, l + s) for side in window)
    keep = torch.ones(l, s, dtype=torch.bool)
    if left >= 0:
        keep &= cols >= rows - left
    if right >= 0:
        keep &= cols <= rows + right
    return keep & (cols <= rows) if is_causal else keep


@pytest.mark.parametrize("window, is_causal", [((-1, -1), True), ((70, 9), False),
                                               ((100, -1), True), ((3, 2**63 - 1), False)])
def test_blocks_match_sdpa_math(window, is_causal):
    """Causal and windowed GQA over several blocks, each skipping the keys all its rows mask."""
    q, k, v = _inputs(2, 4, 2, ROWS, ROWS + 20, 16, dtype=torch.float64)
    out, grads, grad_out = _forward_backward(q, k, v, is_causal=is_causal, window_size=window,
                                             enable_gqa=True)
    keep = _keep(ROWS, ROWS + 20, window, is_causal)
    expected, leaves = sdpa_math(q, k, v, attn_mask=keep, enable_gqa=True)
    theirs = (expected, *torch.autograd.grad(expected, leaves[:3], grad_out))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), theirs):
        torch.testing.assert_close(a, b, **tolerance(torch.float64), msg=name)


@pytest.mark.parametrize("where, value", [("key", math.nan), ("value", math.inf),
                                          ("value", math.nan)])
def test_poison_in_a_key_every_block_leaves_out_still_spreads(where, value):
    """The last key is masked for every row but the last: a NaN there makes SDPA's math backend
    NaN in every row (NaN + -inf, 0 * inf), so the reference must not skip it."""
    q, k, v = _inputs(1, 2, 1, ROWS, ROWS, 16, seed=1)
    with torch.no_grad():
        (k if where == "key" else v)[0, 0, -1, 3] = value
    out, grads, grad_out = _forward_backward(q, k, v, is_causal=True, enable_gqa=True)
    expected, leaves = sdpa_math(q, k, v, is_causal=True, enable_gqa=True)
    theirs = (expected, *torch.autograd.grad(expected, leaves[:3], grad_out.double()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), theirs):
        assert torch.equal(a.isnan(), b.isnan()), name


# Shapes on which a batched product gave a sequence other bits alone than in its batch (one KV
# head, a few rows or keys, a small value head dim): MKL's kernel and rounding change with the
# batch size and the alignment.
BATCHED_PRODUCT_SHAPES = [
    dict(shape=(2, 4, 1, 15, 1, 8), kwargs=dict(is_causal=True)),
    dict(shape=(3, 2, 1, 14, 11, 8), kwargs=dict(window_size=(1, -1))),
    dict(shape=(2, 4, 1, 54, 9, 64), kwargs=dict(window_size=(14, 26)), mask=True),
    dict(shape=(4, 1, 1, 234, 266, 64, 8), kwargs={}),
    dict(shape=(2, 2, 1, 65, 130, 128, 8), kwargs={}, mask=True),
]


def _attention(**kwargs):
    def call(q, k, v, mask=None):
        return dash_inductor.attention(q, k, v, attn_mask=mask, enable_gqa=True, **kwargs)
    return call


@pytest.mark.parametrize("case", BATCHED_PRODUCT_SHAPES, ids=lambda c: str(c["shape"]))
def test_batch_invariant_where_batched_products_are_not(case):
    args = _inputs(*case["shape"], seed=2)
    if case.get("mask"):
        b, _, _, l, s = case["shape"][:5]
        args.append(torch.rand(b, 1, l, s, generator=torch.Generator().manual_seed(3)) > 0.3)
    assert_batch_invariant(_attention(**case["kwargs"]), args)
