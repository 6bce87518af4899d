"""The backward's preprocess (``ops/shared/preprocess.py``) in the Triton interpreter, against PyTorch:
delta, the exp2-domain logsumexp with its padding, and the zeros it writes over whatever the
buffers held before (they are allocated empty; here they start as garbage)."""

from __future__ import annotations

import math
import os
import types

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from dash_inductor.ops.shared import preprocess  # noqa: E402
from dash_inductor.ops.shared.launch import Launches  # noqa: E402
from dash_inductor.ops.shared.tiles import LOG2E  # noqa: E402


@pytest.fixture
def garbage_buffers(monkeypatch):
    """``torch.empty`` in the preprocess returns tensors full of garbage, so that a value it
    forgets to write cannot pass for a zero."""

    def empty(shape, *, device, dtype):
        fill = -7 if dtype == torch.int32 else math.nan
        return torch.full(shape, fill, device=device, dtype=dtype)

    shim = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch)
                                    if not name.startswith("__")})
    shim.empty = empty
    monkeypatch.setattr(preprocess, "torch", shim)


def _inputs(batch: int, heads: int, seq: int, ev: int, transposed: bool):
    gen = torch.Generator().manual_seed(seq * 31 + ev)
    shape = (batch, seq, heads, ev) if transposed else (batch, heads, seq, ev)
    out, grad_out = (torch.randn(shape, generator=gen) for _ in range(2))
    if transposed:  # a model's (B, L, H, D) projections, seen as (B, H, L, D)
        out, grad_out = out.transpose(1, 2), grad_out.transpose(1, 2)
    lse = torch.randn((batch, heads, seq), generator=gen) * 3
    lse[0, 0, :: max(seq // 3, 1)] = -math.inf  # rows that saw no key
    return out, grad_out, lse


def _delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return (out.double() * grad_out.double()).sum(-1).flatten(0, 1)


@pytest.mark.parametrize("seq, ev, acc_dim, transposed",
                         [(100, 64, 64, False), (130, 40, 64, True), (64, 128, 128, False)])
def test_hopper_stats_accumulator_and_tickets(garbage_buffers, seq, ev, acc_dim, transposed):
    batch, heads, rows = 2, 3, -(-seq // 128) * 128
    out, grad_out, lse = _inputs(batch, heads, seq, ev, transposed)
    prep = preprocess.prepare(out, grad_out, lse, row_stride=rows, acc_rows=rows,
                              acc_dim=acc_dim, ticket_rows=64, with_lse2=True,
                              launches=Launches())
    lse2, delta = prep.stats.view(2, batch * heads, rows)
    expected = lse.flatten(0, 1) * LOG2E
    expected[expected == -math.inf] = math.inf
    torch.testing.assert_close(lse2[:, :seq], expected, rtol=1e-6, atol=0)
    assert torch.equal(lse2[:, seq:], torch.full_like(lse2[:, seq:], math.inf))
    torch.testing.assert_close(delta[:, :seq].double(), _delta(out, grad_out), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(delta[:, seq:], torch.zeros_like(delta[:, seq:]))
    assert prep.dq_acc.shape == (batch * heads, rows, acc_dim)
    assert torch.equal(prep.dq_acc, torch.zeros_like(prep.dq_acc))
    assert prep.tickets.shape == (batch * heads * rows // 64 + preprocess.COUNTERS,)
    assert torch.equal(prep.tickets, torch.zeros_like(prep.tickets))


@pytest.mark.parametrize("acc_dim", [0, 64])
def test_portable_delta_and_small_tickets(garbage_buffers, acc_dim):
    """Portable layout: delta by rows of L, an accumulator padded past L, tickets of 16 rows."""
    batch, heads, seq, ev, acc_rows = 1, 2, 90, 48, 96
    out, grad_out, lse = _inputs(batch, heads, seq, ev, False)
    prep = preprocess.prepare(out, grad_out, lse, row_stride=seq, acc_rows=acc_rows,
                              acc_dim=acc_dim, ticket_rows=16, with_lse2=False,
                              launches=Launches())
    torch.testing.assert_close(prep.stats.double(), _delta(out, grad_out), rtol=1e-5, atol=1e-5)
    if acc_dim:
        assert prep.dq_acc.shape == (batch * heads, acc_rows, acc_dim)
        assert torch.equal(prep.dq_acc, torch.zeros_like(prep.dq_acc))
    else:
        assert prep.dq_acc is None
    assert prep.tickets.shape == (batch * heads * acc_rows // 16 + preprocess.COUNTERS,)
    assert torch.equal(prep.tickets, torch.zeros_like(prep.tickets))


def test_compute_delta_alone():
    out, grad_out, _ = _inputs(1, 2, 77, 64, True)
    torch.testing.assert_close(preprocess.compute_delta(out, grad_out, Launches()).double(),
                               _delta(out, grad_out), rtol=1e-5, atol=1e-5)
