"""The packed Hopper backward's preprocess: one launch that readies what the kernel reads besides
the tensors, built on the device from the offsets (the host reads none).

- The row stats: per query head, the exp2-domain logsumexp and delta = rowsum(dO * O) (the dense
  preprocess's values, ``ops/shared/preprocess.py``), in a layout where every TMA box of them starts
  16-byte aligned. The kernel's boxes of sequence b start ``q_lo`` rows before it (its diagonal
  shift, ``tiles.diagonal_origin``) plus multiples of 64, and a 1-D box must start 16-byte
  aligned, so sequence b's rows start at :func:`stats_start`, congruent to q_lo modulo 4, in a
  segment of its own; rows between segments hold +inf and 0 (P = 0 there).
- The deal's order of the sequences and its prefix of work items, where ``shift`` deals them
  unpadded (``deal.py``).
- For the ordered schedules, whose writer stores each row's first partial (``dq_writer.py``) so
  that the fp32 dQ accumulator need not be cleared: zeros in the rows that a store may not reach,
  those of the sequences where some query may see no key (no keys, or, aligned, more queries
  than keys), and those of a sub-tile that crosses its sequence's edge, which the writer adds
  row by row.

One launch instead of a dozen small torch operations and three launches: a training step waits
for the host when the GPU work is short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import catalog
from ..shared.device import head_dim_bucket
from ..shared.launch import Launches, cdiv
from ..shared.preprocess import BLOCK, row_delta
from ..shared.tiles import crosses_edge, diagonal_origin, exp2_logsumexp, sequence_bounds
from .deal import MAX_SORTED, write_item_prefix


@triton.jit
def segment_base(q0, seq, BLOCK_M: tl.constexpr):
    """Where packed sequence ``seq``'s room in the stats begins: each earlier sequence's rows
    plus 2 BLOCK_M + 4 rows of padding and alignment."""
    return q0 + (2 * BLOCK_M + 4) * seq


@triton.jit
def stats_start(q0, seq, q_lo, BLOCK_M: tl.constexpr):
    """The first stats row of packed sequence ``seq`` (first packed row ``q0``, ``q_lo`` the tile
    row of its first query): BLOCK_M rows into its room, up to 3 rows later, congruent to q_lo
    modulo 4. Its rows end at least BLOCK_M rows before the next sequence's first row (whose
    room begins at or after q0 + length + (2 BLOCK_M + 4)(seq + 1))."""
    base = segment_base(q0, seq, BLOCK_M) + BLOCK_M
    return base + ((q_lo - base) & 3)


def stats_rows(total_q: int, num_seqs: int, block_m: int) -> int:
    """Rows of the stats per head: every sequence's room, a multiple of 4."""
    return cdiv(total_q + (2 * block_m + 4) * num_seqs, 4) * 4


@triton.jit
def _packed_prep_kernel(O, DO, LSE, CU_Q, CU_K, STATS, PREFIX, DQACC,
                        stride_ot, stride_oh, stride_oe, stride_dt, stride_dh, stride_de,
                        num_seqs, total_q, total_k, max_q, max_k, row_stride, plane,
                        search_steps, EV: tl.constexpr, HEAD_EV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BOX_M: tl.constexpr, ALIGNED: tl.constexpr,
                        CAUSAL: tl.constexpr,
                        SCHEDULE: tl.constexpr, BLOCK_N: tl.constexpr, WITH_PREFIX: tl.constexpr,
                        PREFIX_BLOCK: tl.constexpr, SORT: tl.constexpr, HEAD_ACC: tl.constexpr):
    """Program (r, h): stats rows [r * BLOCK_M, (r + 1) * BLOCK_M) of query head h, each the row
    of the sequence whose room holds it (the last sequence whose room begins at or before it, by
    binary search), or padding; BOX_M: the kernel's rows per box. Program (0, 0) also writes
    PREFIX (WITH_PREFIX). HEAD_ACC > 0: zero the DQACC (Hq, total_q, HEAD_ACC) rows of those of
    its rows whose sequence may have a query that sees no key, or whose sub-tile of BOX_M rows
    crosses the sequence's edge."""
    h = tl.program_id(1)
    dest = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.zeros([BLOCK_M], tl.int32) + num_seqs - 1
    for _ in range(0, search_steps):  # bisection: enough steps to narrow num_seqs to one
        mid = (lo + hi + 1) // 2
        below = segment_base(tl.load(CU_Q + mid).to(tl.int32), mid, BOX_M) <= dest
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    q0, seq_l, k0, seq_s = sequence_bounds(CU_Q, CU_K, lo, total_q, total_k, max_q, max_k)
    q_lo, _ = diagonal_origin(seq_l, seq_s, ALIGNED)
    offset = dest - stats_start(q0, lo, q_lo, BOX_M)
    real = (offset >= 0) & (offset < seq_l)
    rows = tl.where(real, q0 + offset, 0)
    cols = tl.arange(0, HEAD_EV)
    inside = real[:, None] & (cols[None, :] < EV)
    o = tl.load(O + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh
                + cols[None, :] * stride_oe, mask=inside, other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * stride_dt + h * stride_dh
                 + cols[None, :] * stride_de, mask=inside, other=0.0)
    lse = tl.load(LSE + h.to(tl.int64) * total_q + rows, mask=real, other=float("-inf"))
    stats = STATS + h.to(tl.int64) * row_stride + dest
    tl.store(stats, exp2_logsumexp(lse), mask=dest < row_stride)
    tl.store(stats + plane, row_delta(o, do), mask=dest < row_stride)
    if HEAD_ACC > 0:
        if ALIGNED:  # bottom-right: the first seq_l - seq_s queries see no key
            keyless = seq_l > seq_s
        else:
            keyless = seq_s == 0
        sub_tile = (q_lo + offset) // BOX_M * BOX_M  # tile rows: the sequence's start at q_lo
        crossing = crosses_edge(sub_tile, BOX_M, q_lo, q_lo + seq_l)
        acc_cols = tl.arange(0, HEAD_ACC)
        tl.store(DQACC + (h.to(tl.int64) * total_q + rows[:, None]) * HEAD_ACC + acc_cols[None, :],
                 tl.zeros([BLOCK_M, HEAD_ACC], tl.float32),
                 mask=(real & (keyless | crossing))[:, None])
    if WITH_PREFIX:
        if (tl.program_id(0) == 0) & (h == 0):
            write_item_prefix(CU_Q, CU_K, PREFIX, num_seqs, total_q, total_k, max_q, max_k,
                              BLOCK_N, ALIGNED, CAUSAL, SCHEDULE, PREFIX_BLOCK, SORT)


def packed_prepare(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                   cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, total_k: int, max_q: int,
                   max_k: int, *, aligned: bool, causal: bool, schedule: catalog.Schedule,
                   block_m: int, block_n: int, with_prefix: bool, launches: Launches,
                   keyless_rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(stats (2, Hq * row_stride), row_stride, the deal's prefix or None) for (Tq, Hq, Ev)
    ``out`` and ``grad_out`` and the forward's (Hq, Tq) ``lse``; ``total_k`` packed keys; the
    kernel's boxes of ``block_m`` rows. ``keyless_rows``: a (Hq, Tq, D) dQ accumulator whose
    rows that may see no key are zeroed."""
    total_q, heads, ev = out.shape
    num_seqs = cu_seq_q.numel() - 1
    row_stride = stats_rows(total_q, num_seqs, block_m)
    stats = torch.empty((2, heads * row_stride), device=out.device, dtype=torch.float32)
    prefix = (torch.empty(2 * num_seqs + 1, device=out.device, dtype=torch.int32)
              if with_prefix else None)
    launches("packed_prepare", _packed_prep_kernel, (cdiv(row_stride, BLOCK), heads), (
        out, grad_out, lse.contiguous(), cu_seq_q, cu_seq_k, stats,
        stats if prefix is None else prefix, stats if keyless_rows is None else keyless_rows,
        *out.stride(), *grad_out.stride(), num_seqs,
        total_q, total_k, max_q, max_k, row_stride, heads * row_stride, num_seqs.bit_length()),
        dict(EV=ev, HEAD_EV=head_dim_bucket(ev), BLOCK_M=BLOCK, BOX_M=block_m, ALIGNED=aligned,
        CAUSAL=causal,
        SCHEDULE=schedule.id, BLOCK_N=block_n, WITH_PREFIX=with_prefix,
        PREFIX_BLOCK=min(max(triton.next_power_of_2(num_seqs), 16), MAX_SORTED),
        SORT=num_seqs <= MAX_SORTED,
        HEAD_ACC=0 if keyless_rows is None else keyless_rows.shape[2]))
    return stats, row_stride, prefix
