"""Launchers of the kernels over packed variable-length sequences (``varlen_attn``'s layout).

Tokens of N sequences are packed along dim 0: q (Tq, Hq, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev);
sequence i owns query rows ``cu_seq_q[i]:cu_seq_q[i+1]`` and key rows ``cu_seq_k[i]:cu_seq_k[i+1]``,
at most ``max_q`` and ``max_k`` of them. Each pass is one launch of the dense kernels' VARLEN
variant over a virtual batch of N sequences, as if each were padded to ``max_q``/``max_k``: the
programs read their sequence's bounds from the offsets on the device and do nothing past them, so
the host never reads the offsets and a sequence's bits do not depend on what is packed beside it.
Causal and window are aligned bottom-right per sequence (FlashAttention's varlen convention).
The Hopper kernels take the same virtual batch (``ops/hopper/``) where the dispatcher picks them.

On CUDA a one-program kernel checks the offsets' contract (``ops/shared/offsets_check.py``) and
raises through a flag of its own: asynchronously, at a later launch or
``errors.check_spin_flags``. The kernels treat a sequence whose bounds break the contract as
empty, so they never touch memory outside the tensors meanwhile.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from ..shared.device import head_dim_bucket
from ..shared.dq_convert import convert_dq
from ..shared.dq_pass import launch_dq_pass
from ..shared.errors import spin_flag, watch_spin_flag
from ..shared.launch import heads_first, interpreting, virtual
from ..shared.offsets_check import check_offsets
from ..shared.preprocess import compute_delta, zeroed_tickets
from .backward import launch_main
from .forward import launch_forward


def run_varlen_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float) -> None:
    """Write each packed sequence's attention into ``out`` (Tq, Hq, Ev) and its logsumexp into
    the contiguous fp32 ``lse`` (Hq, Tq), in one launch, as ``plan`` says.

    Causal and window (left, right; right is never 0 here: that is causal) are aligned
    bottom-right per sequence: query i of a sequence of L queries and S keys has diagonal key
    i + S - L. A query that sees no key gets 0 and a logsumexp of -inf.
    """
    max_q, max_k = plan.spec["max_lens"]
    check_offsets(plan.launches, cu_seq_q, cu_seq_k, (q.shape[0], k.shape[0]), (max_q, max_k))
    if not plan.grid:
        return
    num_seqs = cu_seq_q.numel() - 1
    views = (virtual(t, num_seqs) for t in (q, k, v))
    launch_forward(plan, *views, None, virtual(out, num_seqs), lse, (0, q.shape[0]),
                   (cu_seq_q, cu_seq_k, max_q, max_k), scale)


def run_varlen_backward(plan: Plan, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, dq: torch.Tensor,
                        dk: torch.Tensor, dv: torch.Tensor, scale: float, max_spin: int) -> None:
    """Write every element of the packed gradients ``dq``, ``dk``, ``dv`` (a sequence without
    queries has KV tiles that no Q tile visits, so its keys get zeros: ``tiles.sequence_tiles``),
    one launch per kernel, as ``plan`` says; ``lse`` is the forward's (Hq, Tq).

    Every schedule's tile walks and reduction ranks are those of each sequence alone: the kernel
    counts a sequence's tiles from its bounds, and aligns the diagonal by shifting its tile
    coordinates (``tiles.diagonal_origin``), so a causal sequence with more keys than queries
    runs the square causal schedule of max(L, S) on its real rows.
    """
    spec, schedule = plan.spec, plan.schedule
    max_q, max_k = spec["max_lens"]
    (tq, hq, e), tk = q.shape, k.shape[0]
    check_offsets(plan.launches, cu_seq_q, cu_seq_k, (tq, tk), (max_q, max_k))
    if not plan.grid:  # no sequence has both queries and keys
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    num_seqs = cu_seq_q.numel() - 1
    q4, k4, v4, do4, out4, dq4, dk4, dv4 = (virtual(t, num_seqs)
                                            for t in (q, k, v, grad_out, out, dq, dk, dv))
    lse = lse.contiguous()
    delta = compute_delta(out4[:1], do4[:1], plan.launches)
    dq_acc = None
    if not schedule.separate_dq:
        dq_acc = torch.zeros((hq, tq, head_dim_bucket(e)), device=q.device, dtype=torch.float32)
    tickets = zeroed_tickets(hq * tq, q.device)
    packed = (cu_seq_q, cu_seq_k, max_q, max_k)
    launch_main(plan, (q4, k4, v4, do4, lse, delta, None, dk4, dv4, dq_acc, tickets),
                packed, scale, max_spin)
    if schedule.separate_dq:
        launch_dq_pass(plan.launches, q4, k4, v4, do4, lse, delta, None, dq4,
                       is_causal=spec["causal"], scale=scale, cfg=plan.config,
                       window=spec["window"], packed=packed)
    else:
        convert_dq(plan.launches, dq_acc, heads_first(dq))
    if schedule.ordered and not interpreting():
        watch_spin_flag(spin_flag(q.device), plan)
