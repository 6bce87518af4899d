"""Host side of the Hopper forward and backward: buffers, TMA descriptors and launches of a plan.

The dispatcher decides everything a plan fixes (``ops/dispatch.py``); these launchers allocate
the call's buffers, point TMA descriptors at its tensors and launch. A tensor that the
descriptors cannot read in place (``support.tma_strided``) is copied first, as the plan says.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..plan import Plan
from ..shared.dq_convert import TileOrder, convert_dq
from ..shared.dq_pass import launch_dq_pass
from ..shared.dropout import Dropout, kernel_args
from ..shared.errors import spin_flag, watch_spin_flag
from ..shared.launch import heads_first, virtual
from ..shared.offsets_check import check_offsets
from ..shared.preprocess import compute_delta, prepare, zeroed_tickets
from ..shared.tiles import LOG2E
from .backward import backward_kernel
from .dq_order import flat_box, flat_layout, fragment_bases
from .forward import forward_kernel
from .packed_prep import packed_prepare
from .support import tma_copy

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype,
                   swizzled: bool = True) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA box, swizzled or (the dQ accumulator's flat view) not
    (cached: building it is pure Python that every launch would otherwise pay again, for each
    descriptor, on the host)."""
    if not swizzled:
        return flat_layout()
    gl_dtype = gl.float32 if dtype == torch.float32 else _GL_DTYPES[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


class _Address:
    """A base address and its dtype: all that a TMA descriptor reads from its base, so that a
    cached descriptor keeps no tensor alive."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


#: TMA descriptors by (address, dtype, shape, strides, box). A training step calls each layer
#: with tensors the caching allocator hands out again at the same addresses, so most launches find
#: theirs: Triton's checks of a new descriptor took more host time than the launch itself.
_DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def _tma_descriptor(ptr: int, dtype: torch.dtype, shape: tuple[int, ...],
                    strides: tuple[int, ...], block: tuple[int, ...],
                    swizzled: bool = True) -> TensorDescriptor:
    """A TMA descriptor over the tensor at ``ptr`` (16-byte aligned: fresh allocations, and the
    inputs that ``support.tma_copy`` made readable)."""
    key = (ptr, dtype, shape, strides, block, swizzled)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        if len(_DESCRIPTORS) >= 4096:
            _DESCRIPTORS.clear()
        desc = _DESCRIPTORS[key] = TensorDescriptor(
            _Address(ptr, dtype), list(shape), list(strides), list(block),
            _shared_layout(block, dtype, swizzled))
    return desc


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-4 TMA descriptor over (B, H, N, D) ``t`` in its own strides, for [1, 1, rows, D]
    boxes (a dim of length 1 gets a stride TMA accepts: it is never stepped along)."""
    shape, stride, unit = t.shape, t.stride(), 16 // t.element_size()
    strides = (stride[0] if shape[0] > 1 else unit, stride[1] if shape[1] > 1 else unit,
               stride[2] if shape[2] > 1 else unit, 1)
    return _tma_descriptor(t.data_ptr(), t.dtype, shape, strides, (1, 1, rows, shape[3]))


def _accumulator_descriptor(ptr: int, elements: int, rows: int, head_d: int,
                            fragment: bool) -> TensorDescriptor:
    """A TMA descriptor over ``elements`` fp32 of the dQ accumulator at ``ptr`` for the writer's
    adds of [rows, head_d] tiles: as rows of ``head_d``, or, with the tiles in ``fragment`` order,
    as the flat view's rows (``dq_order.py``). Where dQ is computed apart the kernel never
    touches it, and any aligned address serves."""
    box = flat_box(rows, head_d) if fragment else (rows, head_d)
    width = box[1]
    return _tma_descriptor(ptr, torch.float32, (max(elements // width, box[0]), width),
                           (width, 1), box, swizzled=not fragment)


@functools.lru_cache(maxsize=None)
def _fragment_order(block_m: int, head_d: int, num_warps: int, row_warps: int) -> TileOrder:
    """Where the dense backward's DQACC holds each element of a tile (``dq_order.py``)."""
    return TileOrder.from_bases(fragment_bases(block_m, head_d, num_warps, row_warps))


def _row_descriptors(stats: torch.Tensor, block: int) -> tuple[TensorDescriptor, ...]:
    """Rank-1 TMA descriptors over the two fp32 planes of the row stats, for ``block``-element
    boxes (by address: views of the planes would cost more than the descriptors)."""
    plane = stats.shape[1]
    ptr = stats.data_ptr()
    return tuple(_tma_descriptor(ptr + 4 * plane * i, torch.float32, (plane,), (1,), (block,))
                 for i in range(2))


def _readable(tensors: tuple[torch.Tensor, ...], copies: tuple[bool, ...]) -> tuple:
    if not any(copies):
        return tensors
    return tuple(tma_copy(t) if copy else t for t, copy in zip(tensors, copies))


def _forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, packed: tuple | None, scale: float,
             dropout: Dropout | None = None) -> None:
    """One launch of the forward over (B, H, N, D) views; ``packed`` = (cu_seq_q, cu_seq_k,
    max_q, max_k) for the VARLEN kernel, whose views are the packed tensors' ``heads_first``."""
    spec, cfg = plan.spec, plan.config
    q, k, v = _readable((q, k, v), spec["copies"])
    target = out
    if spec["stage_out"]:  # written by TMA: through a contiguous buffer
        out = torch.empty(out.shape, device=out.device, dtype=out.dtype)
    cu_q, cu_k, max_q, max_k = packed or (lse, lse, 0, 0)
    plan.launches("forward", forward_kernel, plan.grid, (
        _descriptor(q, cfg.warpgroup_rows), _descriptor(k, cfg.block_n),
        _descriptor(v, cfg.block_n), _descriptor(out, cfg.warpgroup_rows), out, lse, cu_q, cu_k,
        out.stride(1), out.stride(2), q.shape[2], k.shape[2], q.shape[1], max_q, max_k,
        scale * LOG2E, *kernel_args(dropout, lse)), spec["constexprs"])
    if out is not target:
        target.copy_(out)


def run_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: None, out: torch.Tensor, lse: torch.Tensor, scale: float,
                dropout: Dropout | None = None) -> None:
    """Write ``out`` and the contiguous fp32 (B, Hq, L) ``lse`` with the Hopper forward (with
    ``dropout``); the portable launcher's arguments, whose ``mask`` is None here
    (``support.unsupported_reason``)."""
    if not plan.grid:  # no program would have a key to wait for
        out.zero_()
        lse.fill_(float("-inf"))
        return
    _forward(plan, q, k, v, out, lse, None, scale, dropout)


def run_varlen_forward(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float) -> None:
    """The packed-sequence forward (``ops/portable/packed.py``'s contract: (T, H, D) tensors,
    ``lse`` the contiguous fp32 (Hq, Tq) that the packed backward reads) with the Hopper kernel,
    in one launch that reads the offsets on the device, after their device check."""
    max_q, max_k = plan.spec["max_lens"]
    check_offsets(plan.launches, cu_seq_q, cu_seq_k, (q.shape[0], k.shape[0]), (max_q, max_k))
    if not plan.grid:  # no key in the packing (or no query): every query row sees none
        out.zero_()
        lse.fill_(float("-inf"))
        return
    _forward(plan, *map(heads_first, (q, k, v, out)), lse, (cu_seq_q, cu_seq_k, max_q, max_k),
             scale)


def _launch(plan: Plan, views: tuple, stats: torch.Tensor, dq_acc: torch.Tensor | None,
            tickets: torch.Tensor, packed: tuple | None,
            prefix: torch.Tensor | None, sizes: tuple[int, ...], scale: float, max_spin: int,
            dq: torch.Tensor | None = None, dropout: Dropout | None = None) -> None:
    """One launch of the backward kernel over (B, H, N, D) ``views`` = (q, k, v, grad_out, dk,
    dv); ``sizes`` = (batch entries, L, S, Q tiles, KV tiles, rows per head of the dQ
    accumulator, of the stats); ``dq_acc`` None when dQ is computed apart; ``tickets`` zeros;
    ``prefix`` the unpadded deal's (``packed_prep.py``); ``dq`` the (T, H,
    D) gradient where the kernel converts the accumulator itself (``dq_tail.py``, its counters
    after the tickets); ``dropout`` the forward's (dense only)."""
    q, k, v, grad_out, dk, dv = views
    cfg, spec = plan.config, plan.spec
    per_head, total_items, constexprs = spec["items"] + (spec["constexprs"],)
    cu_q, cu_k, max_q, max_k = packed or (tickets, tickets, 0, 0)
    stash = stats  # fp32, never touched unless the items visit their tiles head by head
    if constexprs["VISIT_HEADS"] < constexprs["GROUP"]:
        stash = torch.empty((plan.grid[0], constexprs["NUM_SLOTS"], 2, cfg.block_n, q.shape[3]),
                            device=q.device, dtype=torch.float32)
    dk_batch, dv_batch = (0, 0) if packed else (dk.stride(0), dv.stride(0))
    dq_strides = (0, 0) if dq is None else dq.stride()[:2]
    acc = stats if dq_acc is None else dq_acc  # stats: a placeholder the kernel never touches
    plan.launches("main", backward_kernel, plan.grid, (
        _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n),
        _descriptor(grad_out, cfg.block_m), *_row_descriptors(stats, cfg.block_m),
        _accumulator_descriptor(acc.data_ptr(), acc.numel(), cfg.block_m, q.shape[3],
                                constexprs["DQ_FRAGMENT"]), dk, dv,
        acc, dk if dq is None else dq, stash, tickets, spin_flag(q.device), cu_q, cu_k, tickets if prefix is None else prefix,
        dk_batch, dk.stride(1), dk.stride(2), dv_batch, dv.stride(1), dv.stride(2), *dq_strides,
        q.shape[1], k.shape[1], *sizes[1:5], max_q, max_k, *sizes[5:], *spec["window"],
        per_head, total_items,
        scale * LOG2E, scale, max_spin, *kernel_args(dropout, tickets)), constexprs)


def run_backward(plan: Plan, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: None,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
                 max_spin: int, dropout: Dropout | None = None) -> None:
    """Write dq, dk, dv with the Hopper kernel (the portable launcher's arguments; ``mask`` is
    None here), with the forward's ``dropout``. One CTA per SM (its shared memory takes the SM), so a grid of at most the SM
    count is co-resident and the ordered waits cannot hang."""
    cfg, spec, schedule = plan.config, plan.spec, plan.schedule
    batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    n_q, n_kv = spec["tiles"]
    # A misaligned view, or the stride-0 gradient of out.sum(): same values, new layout.
    q, k, v, grad_out = _readable((q, k, v, grad_out), spec["copies"])
    rows = n_q * cfg.block_n
    stats, dq_acc, tickets = prepare(
        out, grad_out, lse, row_stride=rows, acc_rows=rows,
        acc_dim=0 if schedule.separate_dq else q.shape[3], ticket_rows=cfg.block_m,
        with_lse2=True, clear_acc=spec["clear_acc"], launches=plan.launches)
    _launch(plan, (q, k, v, grad_out, dk, dv), stats, dq_acc, tickets, None, None,
            (batch, seq_q, seq_k, n_q, n_kv, rows, rows), scale, max_spin, dropout=dropout)
    if spec["zero_tail"]:  # keys after the last query tile: no causal query sees them
        dk[:, :, rows:].zero_()
        dv[:, :, rows:].zero_()
    if schedule.separate_dq:  # the dQ pass reads delta by rows of L
        launch_dq_pass(plan.launches, q, k, v, grad_out, lse,
                       compute_delta(out, grad_out, plan.launches), None, dq,
                       is_causal=spec["causal"], scale=scale, cfg=spec["dq_config"],
                       window=spec["window"], dropout=dropout)
    else:
        order = None
        if spec["constexprs"]["DQ_FRAGMENT"]:
            order = _fragment_order(cfg.block_m, q.shape[3], cfg.num_warps, cfg.dq_row_warps)
        convert_dq(plan.launches, dq_acc, dq, order)
    if schedule.ordered:
        watch_spin_flag(spin_flag(q.device), plan)


def run_varlen_backward(plan: Plan, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, dq: torch.Tensor,
                        dk: torch.Tensor, dv: torch.Tensor, scale: float, max_spin: int) -> None:
    """The packed-sequence backward (``ops/portable/packed.py``'s contract: (T, H, D) tensors, ``lse``
    (Hq, Tq)) with the Hopper kernel, in one launch; every element of ``dq``, ``dk`` and ``dv``
    is written."""
    cfg, spec, schedule = plan.config, plan.spec, plan.schedule
    max_q, max_k = spec["max_lens"]
    if not plan.grid:  # no sequence has both queries and keys
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    (tq, hq, head_d), tk = q.shape, k.shape[0]
    num_seqs = cu_seq_q.numel() - 1
    n_q, n_kv = spec["tiles"]
    packed = (cu_seq_q, cu_seq_k, max_q, max_k)
    q4, k4, v4, do4 = _readable(tuple(map(heads_first, (q, k, v, grad_out))), spec["copies"])
    dq_acc = None
    if not schedule.separate_dq:  # the ordered writer stores each row's first partial
        allocate = torch.empty if schedule.ordered else torch.zeros
        dq_acc = allocate((hq, tq, head_d), device=q.device, dtype=torch.float32)
    stats, stats_stride, prefix = packed_prepare(
        out, grad_out, lse, cu_seq_q, cu_seq_k, tk, max_q, max_k, aligned=spec["aligned"],
        causal=spec["causal"], schedule=schedule, block_m=cfg.block_m, block_n=cfg.block_n,
        with_prefix=spec["constexprs"]["UNPADDED"],
        keyless_rows=dq_acc if schedule.ordered else None, launches=plan.launches)
    in_kernel = spec["constexprs"]["TAIL_CONVERT"]
    tickets = zeroed_tickets(hq * tq + spec["counters"], q.device)
    dk4, dv4 = map(heads_first, (dk, dv))
    _launch(plan, (q4, k4, v4, do4, dk4, dv4), stats, dq_acc, tickets, packed,
            prefix, (num_seqs, tq, tk, n_q, n_kv, tq, stats_stride), scale, max_spin,
            dq=dq if in_kernel else None)
    if schedule.separate_dq:
        vq, vk, vv, vdo, vdq = (virtual(t, num_seqs) for t in (q, k, v, grad_out, dq))
        delta = compute_delta(*map(heads_first, (out, grad_out)), plan.launches)
        launch_dq_pass(plan.launches, vq, vk, vv, vdo, lse, delta, None, vdq,
                       is_causal=spec["causal"], scale=scale, cfg=spec["dq_config"],
                       window=spec["window"], packed=packed)
    elif not in_kernel:
        convert_dq(plan.launches, dq_acc, heads_first(dq))
    if schedule.ordered:
        watch_spin_flag(spin_flag(q.device), plan)
