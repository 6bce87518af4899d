"""The backward's preprocess: one launch that readies what the main backward kernel reads.

Per block of rows of one (batch, head) it writes delta = rowsum(dO * O) in fp32, the softmax
backward's term shared by every KV tile of a row; for the Hopper kernel also the logsumexp in the
exp2 domain beside it (the load warp brings both rows in by TMA, padded rows included); and the
zeros the main kernel accumulates into: the block's rows of the fp32 dQ accumulator (unless the
kernel stores each row's first partial, as the Hopper kernel's ordered dQ writer does), its dQ
tickets and the work counter after them. FlashAttention-3's preprocess clears its dQ accumulator the
same way.
One launch instead of a kernel and half a dozen fills matters because a training step at N = 4k
waits on the backward's host time (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import head_dim_bucket
from .launch import Launches, cdiv
from .tiles import exp2_logsumexp

#: Counters after the tickets: the work counter of the portable kernel's dynamic deal.
COUNTERS = 1
#: Rows a program of the preprocess covers (or a ticket's rows, if more).
BLOCK = 64


@triton.jit
def row_delta(o, do):
    """delta = rowsum(dO * O) in fp32 of [rows, head dim] tiles (the packed Hopper preprocess,
    ``hopper/packed_prep.py``, shares it, so that both paths' deltas are summed alike)."""
    return tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)


@triton.jit
def _preprocess_kernel(O, DO, LSE, STATS, DQACC, TICKETS,
                       stride_ob, stride_oh, stride_om, stride_oe,
                       stride_db, stride_dh, stride_dm, stride_de,
                       HQ, L, row_stride, plane, acc_rows, n_tickets,
                       EV: tl.constexpr, HEAD_EV: tl.constexpr, BLOCK_M: tl.constexpr,
                       WITH_LSE2: tl.constexpr, HEAD_ACC: tl.constexpr, CLEAR: tl.constexpr,
                       TICKET_ROWS: tl.constexpr, N_COUNTERS: tl.constexpr):
    """Program (r, bh): rows [r * BLOCK_M, (r + 1) * BLOCK_M) of head bh.

    STATS holds delta by rows of ``row_stride`` (rows past L: 0); WITH_LSE2, the exp2-domain
    logsumexp first (rows past L: +inf, so P = 0 there) and delta ``plane`` elements later.
    CLEAR: zero this block's DQACC rows (HEAD_ACC wide, ``acc_rows`` a head; none when
    HEAD_ACC is 0), its tickets (one per TICKET_ROWS rows, which divides BLOCK_M) and, in
    program (0, 0), the N_COUNTERS counters after the ``n_tickets`` tickets.
    """
    pid_bh = tl.program_id(1)
    block = tl.program_id(0)
    b = pid_bh // HQ
    h = pid_bh % HQ
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_EV)
    inside = (rows[:, None] < L) & (cols[None, :] < EV)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + rows[:, None] * stride_om + cols[None, :] * stride_oe, mask=inside, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
                 + rows[:, None] * stride_dm + cols[None, :] * stride_de, mask=inside, other=0.0)
    delta = row_delta(o, do)
    stats = STATS + pid_bh.to(tl.int64) * row_stride + rows
    if WITH_LSE2:
        lse = tl.load(LSE + pid_bh.to(tl.int64) * L + rows, mask=rows < L, other=float("-inf"))
        tl.store(stats, exp2_logsumexp(lse), mask=rows < row_stride)
        stats += plane
    tl.store(stats, delta, mask=rows < row_stride)
    if CLEAR:
        if HEAD_ACC > 0:
            acc_cols = tl.arange(0, HEAD_ACC)
            tl.store(DQACC + (pid_bh.to(tl.int64) * acc_rows + rows[:, None]) * HEAD_ACC
                     + acc_cols[None, :], tl.zeros([BLOCK_M, HEAD_ACC], tl.float32),
                     mask=rows[:, None] < acc_rows)
        PER_BLOCK: tl.constexpr = BLOCK_M // TICKET_ROWS
        first = block * PER_BLOCK + tl.arange(0, PER_BLOCK)
        tl.store(TICKETS + pid_bh * (acc_rows // TICKET_ROWS) + first,
                 tl.zeros([PER_BLOCK], tl.int32), mask=first * TICKET_ROWS < acc_rows)
        if (block == 0) & (pid_bh == 0):
            tl.store(TICKETS + n_tickets + tl.arange(0, N_COUNTERS),
                     tl.zeros([N_COUNTERS], tl.int32))


class Prepared(NamedTuple):
    """What :func:`prepare` made: ``stats`` (delta, or the exp2 logsumexp and delta), the zeroed
    dQ accumulator (None when the schedule has none), and the zeroed tickets followed by the
    :data:`COUNTERS` zeroed counters, in one buffer (kernels index past the tickets: no views)."""

    stats: torch.Tensor
    dq_acc: torch.Tensor | None
    tickets: torch.Tensor


def prepare(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, *, row_stride: int,
            acc_rows: int, acc_dim: int, ticket_rows: int, with_lse2: bool, launches: Launches,
            clear_acc: bool = True) -> Prepared:
    """Everything the dense backward kernels read besides the inputs, in one launch.

    ``out``/``grad_out`` (B, Hq, L, Ev), ``lse`` contiguous fp32 (B, Hq, L). Stats of ``row_stride``
    rows a head (L, or the padded rows of the Hopper kernel's TMA boxes, ``with_lse2``: then
    (2, B * Hq * row_stride)); a dQ accumulator (B * Hq, ``acc_rows``, ``acc_dim``, a power of
    two) unless ``acc_dim`` is 0, zeroed unless not ``clear_acc`` (for a kernel that writes every
    row it reads back); a ticket per ``ticket_rows`` (a power of two) of ``acc_rows``, then
    :data:`COUNTERS` counters.
    """
    batch, hq, seq_q, ev = out.shape
    heads, device = batch * hq, out.device
    stats = torch.empty((2 if with_lse2 else 1, heads * row_stride), device=device,
                        dtype=torch.float32)
    dq_acc = None
    if acc_dim:
        dq_acc = torch.empty((heads, acc_rows, acc_dim), device=device, dtype=torch.float32)
    n_tickets = heads * (acc_rows // ticket_rows)
    buffer = torch.empty((n_tickets + COUNTERS,), device=device, dtype=torch.int32)
    block = max(BLOCK, ticket_rows)
    launches("prepare", _preprocess_kernel, (cdiv(max(row_stride, acc_rows), block), heads), (
        out, grad_out, lse, stats, buffer if dq_acc is None else dq_acc, buffer,
        *out.stride(), *grad_out.stride(), hq, seq_q, row_stride, heads * row_stride, acc_rows,
        n_tickets), dict(EV=ev, HEAD_EV=head_dim_bucket(ev), BLOCK_M=block, WITH_LSE2=with_lse2,
                         HEAD_ACC=acc_dim if clear_acc else 0, CLEAR=True, TICKET_ROWS=ticket_rows,
                         N_COUNTERS=COUNTERS))
    stats = stats if with_lse2 else stats.view(heads, row_stride)
    return Prepared(stats, dq_acc, buffer)


def zeroed_tickets(count: int, device: torch.device) -> torch.Tensor:
    """``count`` zeroed tickets and the :data:`COUNTERS` zeroed counters after them, the layout
    :func:`prepare` writes, for the packed paths, whose tickets follow packed rows."""
    return torch.zeros((count + COUNTERS,), device=device, dtype=torch.int32)


def compute_delta(out: torch.Tensor, grad_out: torch.Tensor, launches: Launches) -> torch.Tensor:
    """delta = rowsum(dO * O) in fp32, shape (B * Hq, L), alone (the packed paths, whose tickets
    and accumulators follow packed rows)."""
    batch, hq, seq_q, ev = out.shape
    delta = torch.empty((batch * hq, seq_q), device=out.device, dtype=torch.float32)
    launches("delta", _preprocess_kernel, (cdiv(seq_q, BLOCK), batch * hq), (
        out, grad_out, delta, delta, delta, delta, *out.stride(), *grad_out.stride(), hq, seq_q,
        seq_q, 0, 0, 0), dict(EV=ev, HEAD_EV=head_dim_bucket(ev), BLOCK_M=BLOCK, WITH_LSE2=False,
                              HEAD_ACC=0, CLEAR=False, TICKET_ROWS=BLOCK, N_COUNTERS=COUNTERS))
    return delta
