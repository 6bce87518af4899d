"""Host side of the Hopper forward and backward: what they accept, their buffers, descriptors, grids.

The kernels read Q, K, V and dO (and the forward writes O) through rank-4 TMA descriptors over
(batch, heads, rows, head dim) in each tensor's own strides, which need a contiguous last dim and
16-byte aligned strides and base: true of contiguous tensors, of the (B, L, H, D) layout that
models' transposed projections give, and of slices of a fused q/k/v projection. A tensor that
cannot be read so is copied into a contiguous one, which changes no value: the path, and so the
bits, never depend on the memory layout or on the batch size.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import catalog
from ..backward import fit_schedule, window_fallback
from ..configs import backward_config as portable_backward_config
from ..configs import cuda_major
from ..dq_convert import convert_dq
from ..dq_pass import launch_dq_pass
from ..launch import watch_spin_flag
from ..plan import Plan
from ..preprocess import compute_delta, prepare, zeroed_tickets
from ..tiles import LOG2E
from . import deal, dq_tail
from .backward import backward_kernel
from .config import (HEAD_DIMS, HopperBackwardConfig, HopperForwardConfig, backward_config,
                     backward_constexprs, forward_constexprs, ordered_programs, tail_convert,
                     unpadded_deal)
from .packed_prep import packed_prepare
from .forward import forward_kernel

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _tma_strided(t: torch.Tensor) -> bool:
    """Whether a rank-4 TMA descriptor can read (B, H, N, D) ``t`` in place: a contiguous last dim,
    the other strides (of dims longer than 1) positive and 16-byte aligned, and so the address. A
    model's (B, L, H, D) projections seen as (B, H, L, D) qualify, as do contiguous tensors; a
    broadcast (stride 0) does not."""
    size = t.element_size()
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and all(stride > 0 and (stride * size) % 16 == 0
                    for stride, n in zip(t.stride()[:3], t.shape[:3]) if n > 1))


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None) -> str | None:
    """Why the Hopper backward cannot take these inputs; None when it can."""
    if q.device.type != "cuda" or cuda_major(q.device) != 9:
        return "not an sm90 (Hopper) GPU"
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype} (the Hopper kernels take float16 and bfloat16)"
    if mask is not None:
        return "an attn_mask (the Hopper kernels take is_causal or no mask)"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} (the Hopper kernels take E = Ev in {HEAD_DIMS})"
    return None


def tma_readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when a rank-4 TMA descriptor can read it in place, else a contiguous copy (the
    same values) in a fresh, aligned allocation: ``contiguous()`` would return a contiguous but
    misaligned view unchanged."""
    return t if _tma_strided(t) else t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a TMA box (cached: building it is pure Python that
    every launch would otherwise pay again, for each descriptor, on the host)."""
    gl_dtype = gl.float32 if dtype == torch.float32 else _GL_DTYPES[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


#: Validated TMA descriptors by (dtype, shape, strides, box), with no tensor: see _tma_descriptor.
_TEMPLATES: dict[tuple, TensorDescriptor] = {}


def _tma_descriptor(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...],
                    block: tuple[int, ...]) -> TensorDescriptor:
    """A TMA descriptor over ``t``, checked by Triton once per (dtype, shape, strides, box) and then
    only pointed at each launch's tensor: the checks, pure Python, took more host time than the
    launch itself. All of them but the base's 16-byte alignment depend on the key alone; the
    callers hand over aligned tensors (:func:`tma_readable`, fresh allocations)."""
    key = (t.dtype, shape, strides, block)
    template = _TEMPLATES.get(key)
    if template is None:
        if len(_TEMPLATES) >= 1024:
            _TEMPLATES.clear()
        template = TensorDescriptor(t, list(shape), list(strides), list(block),
                                    _shared_layout(block, t.dtype))
        template.base = None  # keeps no tensor alive
        _TEMPLATES[key] = template
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(template.__dict__)
    desc.base = t
    return desc


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-4 TMA descriptor over (B, H, N, D) ``t`` in its own strides, for [1, 1, rows, D]
    boxes (a dim of length 1 gets a stride TMA accepts: it is never stepped along)."""
    shape = tuple(t.shape)
    strides = tuple(stride if n > 1 else 16 // t.element_size()
                    for stride, n in zip(t.stride()[:3], shape[:3])) + (1,)
    return _tma_descriptor(t, shape, strides, (1, 1, rows, shape[3]))


def _accumulator_descriptor(dq_acc: torch.Tensor | None, rows: int, head_d: int,
                            device: torch.device) -> TensorDescriptor:
    """A TMA descriptor over the fp32 dQ accumulator as rows of ``head_d``, for the writer's
    [rows, head_d] reduce-adds; over a small placeholder that the kernel never touches when dQ is
    computed apart (``dq_acc`` None)."""
    acc = (dq_acc if dq_acc is not None
           else torch.empty((rows, head_d), device=device, dtype=torch.float32)).view(-1, head_d)
    return _tma_descriptor(acc, tuple(acc.shape), (head_d, 1), (rows, head_d))


def _row_descriptor(row: torch.Tensor, block: int) -> TensorDescriptor:
    """A rank-1 TMA descriptor over one plane of the row stats, for ``block``-element boxes."""
    return _tma_descriptor(row, tuple(row.shape), (1,), (block,))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, *, is_causal: bool, scale: float,
                      kernel_reason: str | None = None,
                      cfg: HopperForwardConfig | None = None) -> Plan:
    """Write ``out`` and the contiguous fp32 (B, Hq, L) ``lse`` with the Hopper forward; return
    what ran. The caller checked :func:`unsupported_reason`."""
    batch, hq, seq_q, head_d = q.shape
    hkv, seq_k = k.shape[1], k.shape[2]
    cfg = cfg or HopperForwardConfig()
    grid = (triton.cdiv(seq_q, cfg.block_m), batch * hq)
    if not _tma_strided(out):  # written by TMA: through a contiguous buffer
        staged = torch.empty(out.shape, device=out.device, dtype=out.dtype)
        plan = attention_forward(q, k, v, staged, lse, is_causal=is_causal, scale=scale,
                                 kernel_reason=kernel_reason, cfg=cfg)
        out.copy_(staged)
        return plan
    q, k, v = (tma_readable(t) for t in (q, k, v))
    if not lse.is_contiguous():
        raise ValueError("lse must be a contiguous fp32 tensor of shape (B, Hq, L)")
    if seq_q == 0 or seq_k == 0:  # no program would have a key to wait for
        out.zero_()
        lse.fill_(float("-inf"))
        return Plan("forward", "hopper", kernel_reason, None, None, None, (), cfg)
    forward_kernel[grid](
        _descriptor(q, cfg.warpgroup_rows), _descriptor(k, cfg.block_n),
        _descriptor(v, cfg.block_n), _descriptor(out, cfg.warpgroup_rows), lse, seq_q, seq_k, hq,
        scale * LOG2E,
        **forward_constexprs(is_causal, hq // hkv, cfg))
    return Plan("forward", "hopper", kernel_reason, None, None, None, grid, cfg)


def _fit(schedule: catalog.Schedule, causal: bool, window: tuple[int, int], n_kv: int,
         capacity: int, shape: str) -> tuple[catalog.Schedule, str | None]:
    """The schedule that runs, and why it is not the one asked (as the portable launcher)."""
    fitted, reason = window_fallback(schedule, causal, window)
    return (fitted, reason) if reason else fit_schedule(schedule, causal, n_kv, capacity, shape)


@functools.lru_cache(maxsize=256)
def _geometry(schedule: catalog.Schedule, cfg: HopperBackwardConfig, batch: int, hkv: int,
              n_kv: int, is_causal: bool, group: int, even_s: bool, windowed: bool, varlen: bool,
              sms: int) -> tuple[int, int, tuple[int], dict[str, object]]:
    """(items per head, items, grid, constexprs) of a backward launch, which shapes and options
    alone decide (cached, as everything a launch recomputes is host time the step waits for)."""
    per_head = schedule.items_per_head(n_kv, is_causal)
    total_items = batch * hkv * per_head
    # A head's items are equally long unless a window, the packing or an unpaired causal mask
    # gives them different numbers of Q tiles.
    equal_items = not (windowed or varlen) and (not is_causal or schedule.paired_when_causal)
    aligned = cfg.aligned_grid and schedule.ordered and equal_items
    programs = ordered_programs(per_head, sms) if aligned else sms
    return per_head, total_items, (min(total_items, programs),), backward_constexprs(
        schedule.name, is_causal, group, even_s, cfg, windowed, varlen)


def _launch(views: tuple, stats: torch.Tensor, dq_acc: torch.Tensor | None,
            tickets: torch.Tensor, error_flag: torch.Tensor, packed: tuple | None,
            prefix: torch.Tensor | None, sizes: tuple[int, ...], schedule: catalog.Schedule,
            cfg: HopperBackwardConfig, *, is_causal: bool, window: tuple[int, int], scale: float,
            max_spin: int, even_s: bool, dq: torch.Tensor | None = None) -> tuple[int]:
    """One launch of the backward kernel over (B, H, N, D) ``views`` = (q, k, v, grad_out, dk,
    dv); ``sizes`` = (batch entries, L, S, Q tiles, KV tiles, rows per head of the dQ
    accumulator, of the stats); ``dq_acc`` None when dQ is computed apart; ``tickets`` and
    ``error_flag`` zeros; ``prefix`` the unpadded deal's (``packed_prep.py``); ``dq`` the (T, H,
    D) gradient where the kernel converts the accumulator itself (``dq_tail.py``, its counters
    after the tickets); return the grid."""
    q, k, v, grad_out, dk, dv = views
    batch, seq_q, seq_k, n_q, n_kv, row_stride, stats_stride = sizes
    hq, hkv = q.shape[1], k.shape[1]
    per_head, total_items, grid, constexprs = _geometry(
        schedule, cfg, batch, hkv, n_kv, is_causal, hq // hkv, even_s, window != (-1, -1),
        packed is not None, _sm_count(q.device.index or 0))
    cu_q, cu_k, max_q, max_k = packed or (tickets, tickets, 0, 0)
    stash = stats  # fp32, never touched unless the items visit their tiles head by head
    if constexprs["VISIT_HEADS"] < constexprs["GROUP"]:
        stash = torch.empty((grid[0], constexprs["NUM_SLOTS"], 2, cfg.block_n, q.shape[3]),
                            device=q.device, dtype=torch.float32)
    dk_batch, dv_batch = (0, 0) if packed else (dk.stride(0), dv.stride(0))
    if constexprs["TAIL_CONVERT"] != (dq is not None):
        raise ValueError("the kernel converts dQ itself exactly when it is given the gradient")
    dq_strides = (0, 0) if dq is None else dq.stride()[:2]
    backward_kernel[grid](
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
        _descriptor(grad_out, cfg.block_m), _row_descriptor(stats[0], cfg.block_m),
        _row_descriptor(stats[1], cfg.block_m),
        _accumulator_descriptor(dq_acc, cfg.block_m, q.shape[3], q.device), dk, dv,
        stats if dq_acc is None else dq_acc, dk if dq is None else dq, stash, tickets,
        error_flag, cu_q, cu_k, tickets if prefix is None else prefix,
        dk_batch, dk.stride(1), dk.stride(2), dv_batch, dv.stride(1), dv.stride(2), *dq_strides,
        hq, hkv, seq_q, seq_k, n_q, n_kv, max_q, max_k, row_stride, stats_stride, *window,
        per_head,
        total_items, scale * LOG2E, scale, max_spin, **constexprs)
    return grid


@functools.lru_cache(maxsize=256)
def _dense_choice(q_shape: torch.Size, k_shape: torch.Size, requested: catalog.Schedule,
                  is_causal: bool, window: tuple[int, int], cfg: HopperBackwardConfig,
                  sms: int) -> tuple[catalog.Schedule, str | None, int, int, str]:
    """(the schedule that runs, why it is not the one asked, Q tiles, KV tiles, the shape as
    errors name it) of a dense backward, which shapes and options alone decide (cached)."""
    n_q, n_kv = triton.cdiv(q_shape[2], cfg.block_n), triton.cdiv(k_shape[2], cfg.block_n)
    shape = f"q {tuple(q_shape)}, k {tuple(k_shape)}, causal={is_causal}"
    schedule, fallback = _fit(requested, is_causal, window, n_kv, sms, shape)
    return schedule, fallback, n_q, n_kv, shape


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                       dv: torch.Tensor, *, is_causal: bool, scale: float,
                       schedule: catalog.Schedule, max_spin: int, schedule_requested: str | None = None,
                       kernel_reason: str | None = None,
                       cfg: HopperBackwardConfig | None = None,
                       window: tuple[int, int] = (-1, -1)) -> Plan:
    """Write dq, dk, dv with the Hopper kernel; return what ran.

    The caller checked :func:`unsupported_reason`. One CTA per SM (its shared memory takes the
    SM), so a grid of at most the SM count is co-resident and the ordered waits cannot hang.
    """
    window = tuple(window)
    batch, hq, seq_q, head_d = q.shape
    seq_k = k.shape[2]
    cfg = cfg or backward_config(head_d, is_causal)
    requested = schedule
    schedule, fallback, n_q, n_kv, shape = _dense_choice(
        q.shape, k.shape, requested, is_causal, window, cfg, _sm_count(q.device.index or 0))
    # A misaligned view, or the stride-0 gradient of out.sum(): same values, new layout.
    q, k, v, grad_out = (tma_readable(t) for t in (q, k, v, grad_out))
    rows = n_q * cfg.block_n
    # The ordered writer stores each row's first partial: only rows that see no key (a window
    # with more queries than keys, or no keys) would be left unwritten.
    stats, dq_acc, tickets, flags = prepare(
        out, grad_out, lse, row_stride=rows, acc_rows=rows,
        acc_dim=0 if schedule.separate_dq else head_d, ticket_rows=cfg.block_m, with_lse2=True,
        clear_acc=not schedule.ordered or seq_k == 0 or (window != (-1, -1) and seq_q > seq_k))
    error_flag = flags[:1]
    grid = _launch((q, k, v, grad_out, dk, dv), stats, dq_acc, tickets, error_flag, None, None,
                   (batch, seq_q, seq_k, n_q, n_kv, rows, rows), schedule, cfg, is_causal=is_causal,
                   window=window, scale=scale, max_spin=max_spin,
                   even_s=seq_k % cfg.block_n == 0)
    if is_causal and seq_k > n_q * cfg.block_n:
        dk[:, :, n_q * cfg.block_n:].zero_()
        dv[:, :, n_q * cfg.block_n:].zero_()
    if schedule.separate_dq:  # the dQ pass reads delta by rows of L
        launch_dq_pass(q, k, v, grad_out, lse, compute_delta(out, grad_out), None, dq,
                       is_causal=is_causal, scale=scale,
                       cfg=portable_backward_config(head_d, q.dtype, is_causal, 9), window=window)
    else:
        convert_dq(dq_acc, dq)
    if schedule.ordered:
        watch_spin_flag(error_flag, f"{shape}, schedule {schedule.name!r}")
    return Plan("backward", "hopper", kernel_reason, schedule_requested or requested.name,
                schedule.name, fallback, grid, cfg)


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, packed: tuple, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, *, is_causal: bool, scale: float,
                    schedule: catalog.Schedule, max_spin: int, window: tuple[int, int],
                    schedule_requested: str | None = None, kernel_reason: str | None = None,
                    cfg: HopperBackwardConfig | None = None) -> Plan:
    """The packed-sequence backward (``ops/packed.py``'s contract: (T, H, D) tensors, ``lse``
    (Hq, Tq), ``packed`` = (cu_seq_q, cu_seq_k, max_q, max_k) checked by the caller) with the
    Hopper kernel, in one launch; every element of ``dq``, ``dk`` and ``dv`` is written; return
    what ran."""
    window = tuple(window)
    cu_seq_q, cu_seq_k, max_q, max_k = packed
    (tq, hq, head_d), tk = q.shape, k.shape[0]
    num_seqs = cu_seq_q.numel() - 1
    cfg = cfg or backward_config(head_d, is_causal, packed=True)
    if dq.stride(2) != 1:  # the kernel's own conversion writes rows of contiguous elements
        cfg = dataclasses.replace(cfg, tail_convert=False)
    aligned = is_causal or window != (-1, -1)
    span_q, span_k = (max(max_q, max_k),) * 2 if aligned else (max_q, max_k)
    n_q, n_kv = triton.cdiv(span_q, cfg.block_n), triton.cdiv(span_k, cfg.block_n)
    shape = (f"packed q {tuple(q.shape)}, k {tuple(k.shape)}, {num_seqs} sequences, "
             f"max_q={max_q}, max_k={max_k}, causal={is_causal}")
    requested = schedule
    schedule, fallback = _fit(schedule, is_causal, window, max(n_kv, 1),
                              _sm_count(q.device.index or 0), shape)
    plan = Plan("backward", "hopper", kernel_reason, schedule_requested or requested.name,
                schedule.name, fallback, (), cfg)
    if not (num_seqs and n_q and n_kv and tq and tk):  # no sequence has both queries and keys
        for grad in (dq, dk, dv):
            grad.zero_()
        return plan
    heads_first = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, grad_out))
    q4, k4, v4, do4 = (tma_readable(t) for t in heads_first)
    dq_acc = None
    if not schedule.separate_dq:  # the ordered writer stores each row's first partial
        allocate = torch.empty if schedule.ordered else torch.zeros
        dq_acc = allocate((hq, tq, head_d), device=q.device, dtype=torch.float32)
    stats, stats_stride, prefix = packed_prepare(
        out, grad_out, lse, cu_seq_q, cu_seq_k, tk, max_q, max_k, aligned=aligned,
        causal=is_causal, schedule=schedule, block_m=cfg.block_m, block_n=cfg.block_n,
        with_prefix=unpadded_deal(cfg, schedule.name, True),
        keyless_rows=dq_acc if schedule.ordered else None)
    in_kernel = tail_convert(cfg, schedule.name, True)
    # After the tickets: the claimed deal's counter, then the tail conversion's (``backward.py``).
    counters = deal.COUNTERS.value + (dq_tail.counters(num_seqs, k.shape[1]) if in_kernel else 0)
    tickets, flags = zeroed_tickets(hq * tq + counters, q.device)
    error_flag = flags[:1]
    dk4, dv4 = (t.transpose(0, 1).unsqueeze(0) for t in (dk, dv))
    grid = _launch((q4, k4, v4, do4, dk4, dv4), stats, dq_acc, tickets, error_flag, packed,
                   prefix, (num_seqs, tq, tk, n_q, n_kv, tq, stats_stride), schedule, cfg,
                   is_causal=is_causal, window=window, scale=scale, max_spin=max_spin,
                   even_s=False, dq=dq if in_kernel else None)
    if schedule.separate_dq:
        virtual = (t.transpose(0, 1).unsqueeze(0).expand(num_seqs, -1, -1, -1)
                   for t in (q, k, v, grad_out, dq))
        vq, vk, vv, vdo, vdq = virtual
        delta = compute_delta(*(t.transpose(0, 1).unsqueeze(0) for t in (out, grad_out)))
        launch_dq_pass(vq, vk, vv, vdo, lse, delta, None, vdq, is_causal=is_causal, scale=scale,
                       cfg=portable_backward_config(head_d, q.dtype, is_causal, 9), window=window,
                       packed=packed)
    elif not in_kernel:
        convert_dq(dq_acc, dq.transpose(0, 1).unsqueeze(0))
    if schedule.ordered:
        watch_spin_flag(error_flag, f"{shape}, schedule {schedule.name!r}")
    return dataclasses.replace(plan, grid=grid)
