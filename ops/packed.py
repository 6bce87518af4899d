"""Launchers of the kernels over packed variable-length sequences (``varlen_attn``'s layout).

Tokens of N sequences are packed along dim 0: q (Tq, Hq, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev);
sequence i owns query rows ``cu_seq_q[i]:cu_seq_q[i+1]`` and key rows ``cu_seq_k[i]:cu_seq_k[i+1]``,
at most ``max_q`` and ``max_k`` of them. Each pass is one launch of the dense kernels' VARLEN
variant over a virtual batch of N sequences, as if each were padded to ``max_q``/``max_k``: the
programs read their sequence's bounds from the offsets on the device and do nothing past them, so
the host never reads the offsets and a sequence's bits do not depend on what is packed beside it.
Causal and window are aligned bottom-right per sequence (FlashAttention's varlen convention).
The backward runs the Hopper kernel instead (``ops/hopper/``, the same virtual batch) where
``ops/dispatch.py`` picks it; the forward is always the portable one.

On CUDA a one-program kernel checks the offsets' contract (``ops/offsets.py``) and raises
through the launches' error flags (``launch.watch_spin_flag``): asynchronously, at a later launch
or ``launch.check_spin_flags``. The kernels treat a sequence whose bounds break the contract as
empty, so they never touch memory outside the tensors meanwhile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backward import choose_path, launch_main, resolve_schedule
from .catalog import KERNELS
from .configs import arch_key, backward_config, forward_config, head_dim_bucket
from .dispatch import HOPPER, PORTABLE
from .dq_convert import convert_dq
from .dq_pass import launch_dq_pass
from .preprocess import compute_delta, zeroed_tickets
from .forward import launch_forward
from .launch import watch_spin_flag
from . import offsets
from .plan import Plan

_START, _ORDER = tl.constexpr(offsets.START), tl.constexpr(offsets.ORDER)
_END, _LONGEST = tl.constexpr(offsets.END), tl.constexpr(offsets.LONGEST)
_KEYS = tl.constexpr(offsets.KEYS)
_NO_HOPPER = "packed sequences (the Hopper forward takes no cu_seq offsets)"


@triton.jit
def _breaches(CU, n, total, max_len, BLOCK: tl.constexpr):
    """Bits of the offsets' breaches (``ops/offsets.py``) for ``n`` sequences."""
    bad_order = tl.zeros([BLOCK], tl.int32)
    too_long = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        a = tl.load(CU + i, mask=inside, other=0)
        b = tl.load(CU + i + 1, mask=inside, other=0)
        bad_order = tl.maximum(bad_order, tl.where(inside & (b < a), 1, 0))
        too_long = tl.maximum(too_long, tl.where(inside & (b - a > max_len), 1, 0))
    return (tl.where(tl.load(CU) != 0, _START, 0) | (tl.max(bad_order, 0) * _ORDER)
            | tl.where(tl.load(CU + n) != total, _END, 0) | (tl.max(too_long, 0) * _LONGEST))


@triton.jit
def _check_offsets_kernel(CU_Q, CU_K, FLAG, n, total_q, total_k, max_q, max_k,
                          BLOCK: tl.constexpr):
    code = (_breaches(CU_Q, n, total_q, max_q, BLOCK)
            | (_breaches(CU_K, n, total_k, max_k, BLOCK) << _KEYS))
    tl.store(FLAG, code.to(tl.int32))


def offsets_flag(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, totals: tuple[int, int],
                 max_lens: tuple[int, int]) -> torch.Tensor:
    """The device check of the offsets: a one-element int32 tensor, 0 or the breaches' bits."""
    flag = torch.zeros((1,), device=cu_seq_q.device, dtype=torch.int32)
    _check_offsets_kernel[(1,)](cu_seq_q, cu_seq_k, flag, cu_seq_q.numel() - 1, *totals,
                                *max_lens, BLOCK=1024)
    return flag


def _check_on_device(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, totals: tuple[int, int],
                     max_lens: tuple[int, int]) -> None:
    """On CUDA, check the offsets without a host sync: a breach raises ``ValueError`` later (CPU
    offsets are checked on the host by the caller before it launches)."""
    if cu_seq_q.device.type != "cuda":
        return
    flag = offsets_flag(cu_seq_q, cu_seq_k, totals, max_lens)
    watch_spin_flag(flag, lambda code: ValueError(offsets.device_breach(code, totals, max_lens)))


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"dash.varlen_attention: kernel must be one of {list(KERNELS)}, got "
                         f"{kernel!r}")


def _forward_reason(kernel: str) -> str | None:
    """Why ``kernel="auto"`` runs the portable forward; the Hopper path has no packed forward."""
    _check_kernel(kernel)
    if kernel == HOPPER:
        raise ValueError(f"dash.varlen_attention: kernel='hopper' cannot run {_NO_HOPPER} in one "
                         "launch")
    return None if kernel == PORTABLE else _NO_HOPPER


def _virtual(t: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Packed (T, H, D) as the kernels' (num_seqs, H, T, D) with batch stride 0: every sequence of
    the virtual batch sees the whole packing and starts at its own offset."""
    return t.transpose(0, 1).unsqueeze(0).expand(num_seqs, -1, -1, -1)


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor,
                   cu_seq_k: torch.Tensor, max_q: int, max_k: int, out: torch.Tensor,
                   lse: torch.Tensor, *, is_causal: bool, scale: float,
                   window: tuple[int, int] = (-1, -1), kernel: str = "auto", config=None) -> Plan:
    """Write each packed sequence's attention into ``out`` (Tq, Hq, Ev) and its logsumexp into
    the contiguous fp32 ``lse`` (Hq, Tq), in one launch; return what ran.

    ``is_causal`` and ``window`` (left, right; right is never 0 here: that is ``is_causal``) are
    aligned bottom-right per sequence: query i of a sequence of L queries and S keys has diagonal
    key i + S - L. A query that sees no key gets 0 and a logsumexp of -inf.
    """
    reason = _forward_reason(kernel)
    num_seqs, hq = cu_seq_q.numel() - 1, q.shape[1]
    if not lse.is_contiguous():
        raise ValueError("lse must be a contiguous fp32 tensor of shape (Hq, Tq)")
    cfg = config or forward_config(max(q.shape[2], v.shape[2]), q.dtype, is_causal,
                                   arch_key(q.device))
    _check_on_device(cu_seq_q, cu_seq_k, (q.shape[0], k.shape[0]), (max_q, max_k))
    grid = (num_seqs * hq, triton.cdiv(max_q, cfg.block_m))
    if grid[0] and grid[1]:
        views = (_virtual(t, num_seqs) for t in (q, k, v))
        launch_forward(grid, *views, None, _virtual(out, num_seqs), lse, (0, q.shape[0]),
                       (cu_seq_q, cu_seq_k, max_q, max_k), cfg, is_causal=is_causal, scale=scale,
                       window=tuple(window))
    return Plan("forward", PORTABLE, reason, None, None, None, grid, cfg)


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: torch.Tensor, max_q: int, max_k: int, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, *, is_causal: bool, scale: float,
                    schedule: str = "auto", max_spin: int = 1 << 26, kernel: str = "auto",
                    config=None, window: tuple[int, int] = (-1, -1)) -> Plan:
    """Write every element of the packed gradients ``dq``, ``dk``, ``dv`` (a sequence without
    queries has KV tiles that no Q tile visits, so its keys get zeros: ``tiles.sequence_tiles``),
    one launch per kernel; return what ran.

    ``lse`` is the forward's (Hq, Tq). Every schedule's tile walks and reduction ranks are those
    of each sequence alone: the kernel counts a sequence's tiles from its bounds, and aligns the
    diagonal by shifting its tile coordinates (``tiles.diagonal_origin``), so a causal sequence
    with more keys than queries runs the square causal schedule of max(L, S) on its real rows.
    """
    window = tuple(window)
    (tq, hq, e), (tk, ev) = q.shape, (v.shape[0], v.shape[2])
    num_seqs = cu_seq_q.numel() - 1
    arch = arch_key(q.device)
    cfg = config or backward_config(max(e, ev), q.dtype, is_causal, arch)
    if cfg.block_n % cfg.block_m:
        raise ValueError(f"backward config needs block_m dividing block_n, got {cfg}")
    aligned = is_causal or window != (-1, -1)
    span_q, span_k = (max(max_q, max_k),) * 2 if aligned else (max_q, max_k)
    n_q, n_kv = triton.cdiv(span_q, cfg.block_n), triton.cdiv(span_k, cfg.block_n)
    requested = resolve_schedule(schedule, max(e, ev), q.dtype, is_causal, max(n_kv, 1), arch)
    _check_kernel(kernel)
    path, reason, requested = choose_path(kernel, schedule, requested, q, k, v, None, is_causal,
                                          window, packed=True)
    _check_on_device(cu_seq_q, cu_seq_k, (tq, tk), (max_q, max_k))
    if path == HOPPER:
        from .hopper.launch import varlen_backward as hopper_varlen_backward

        return hopper_varlen_backward(grad_out, q, k, v, out, lse,
                                      (cu_seq_q, cu_seq_k, max_q, max_k), dq, dk, dv,
                                      is_causal=is_causal, scale=scale, schedule=requested,
                                      max_spin=max_spin, window=window,
                                      schedule_requested=schedule, kernel_reason=reason)
    if not (num_seqs and n_q and n_kv and tq and tk):  # no sequence has both queries and keys
        for grad in (dq, dk, dv):
            grad.zero_()
        return Plan("backward", PORTABLE, reason, schedule, requested.name, None, (), cfg)
    q4, k4, v4, do4, out4, dq4, dk4, dv4 = (_virtual(t, num_seqs)
                                            for t in (q, k, v, grad_out, out, dq, dk, dv))
    lse = lse.contiguous()
    delta = compute_delta(out4[:1], do4[:1])
    dq_acc = None
    if not requested.separate_dq:
        dq_acc = torch.zeros((hq, tq, head_dim_bucket(e)), device=q.device, dtype=torch.float32)
    tickets, flags = zeroed_tickets(hq * tq, q.device)
    packed = (cu_seq_q, cu_seq_k, max_q, max_k)
    shape = (f"packed q {tuple(q.shape)}, k {tuple(k.shape)}, {num_seqs} sequences, "
             f"max_q={max_q}, max_k={max_k}, causal={is_causal}")
    fitted, fallback, grid, error_flag = launch_main(
        (q4, k4, v4, do4, lse, delta, None, dk4, dv4, dq_acc, tickets, flags), packed,
        (tq, tk, n_q, n_kv), cfg, requested, is_causal=is_causal, window=window, scale=scale,
        max_spin=max_spin, shape=shape)
    if fitted.separate_dq:
        launch_dq_pass(q4, k4, v4, do4, lse, delta, None, dq4, is_causal=is_causal, scale=scale,
                       cfg=cfg, window=window, packed=packed)
    else:
        convert_dq(dq_acc, dq.transpose(0, 1).unsqueeze(0))
    if error_flag is not None:
        watch_spin_flag(error_flag, f"{shape}, schedule {fitted.name!r}")
    return Plan("backward", PORTABLE, reason, schedule, fitted.name, fallback, grid, cfg)
