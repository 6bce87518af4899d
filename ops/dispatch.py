"""The dispatcher: every host decision of an attention launch, made once per call signature.

A call's signature is what the decisions depend on: the op, the device and its architecture,
dtype, shapes, strides and 16-byte alignment of every tensor (so also what Triton specialises the
kernels on), mask kind, causal flag and window, and the requested kernel path, schedule and spin
bound. From it the dispatcher builds a :class:`~.plan.Plan`: the kernel path and why, the
schedule object (``auto`` resolved here and nowhere else), the tile config, the grid, and the
launcher that executes it. The plan is cached by signature, so a call of a signature already
seen costs a dictionary lookup before its launches; ``cache_info()`` and ``cache_clear()`` work
as ``functools.lru_cache``'s. The rules it applies (kernel path, ``auto``, fit) are in
``rules.py``. Launchers only execute plans: none imports this module or another path's launcher.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import rules
from .catalog import AUTO, Schedule
from .hopper import config as hopper_config
from .hopper import support
from .plan import HOLDERS, Plan
from .portable import backward, forward, packed
from .portable.configs import backward_config, forward_config
from .shared.device import arch_key
from .shared.dropout import Dropout
from .shared.launch import Launches, cdiv, heads_first, interpreting, virtual

PORTABLE, HOPPER, NO_WINDOW = rules.PORTABLE, rules.HOPPER, rules.NO_WINDOW

log = logging.getLogger("dash_inductor")


class CacheInfo(NamedTuple):
    """The plan cache's statistics, as ``functools.lru_cache``'s ``cache_info()``."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


_MAXSIZE = 1024  #: signatures kept; a model has a handful per layer shape
_PLANS: dict[tuple, Plan] = {}
_STATS = [0, 0]  # hits, misses


def cache_info() -> CacheInfo:
    """Hits, misses, capacity and size of the plan cache."""
    return CacheInfo(_STATS[0], _STATS[1], _MAXSIZE, len(_PLANS))


def cache_clear() -> None:
    """Forget every plan, those kept by the library's signatures too, and the statistics (the
    next call of each signature plans anew)."""
    _PLANS.clear()
    _STATS[:] = [0, 0]
    for clear in HOLDERS:
        clear()


def _cached(key: tuple, build: Callable[[], Plan]) -> Plan:
    plan = _PLANS.get(key)
    if plan is not None:
        _STATS[0] += 1
        return plan
    _STATS[1] += 1
    plan = build()
    if len(_PLANS) >= _MAXSIZE:
        del _PLANS[next(iter(_PLANS))]  # the oldest signature
    _PLANS[key] = plan
    log.debug("dash_inductor: planned %s", plan)
    return plan


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What the plan of a call depends on in a tensor (Triton specialises on the alignment)."""
    if t is None:
        return None
    return t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0


def _state_layout(dropout: Dropout | None) -> tuple | None:
    """Dropout's part of a signature: its state's layout (a pointer Triton specialises on)."""
    return None if dropout is None else _layout(dropout.rng)


def _device_key(q: torch.Tensor) -> tuple:
    """The device, and what picks kernel variants beside the tensors: TF32 for float32 dots, and
    whether Triton interprets (tests switch it per process)."""
    return q.device, torch.backends.cuda.matmul.allow_tf32, interpreting()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(q: torch.Tensor) -> int:
    return _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _hopper():
    """The Hopper launchers and the kernels' counter layout (imported once the path is taken:
    they need Gluon)."""
    from .hopper import deal, dq_tail
    from .hopper import launch as hopper_launch

    return hopper_launch, deal, dq_tail


# --- dense forward and backward ---------------------------------------------------------------

def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, *,
                      is_causal: bool, scale: float, kernel: str = AUTO,
                      window: tuple[int, int] = NO_WINDOW, dropout: Dropout | None = None,
                      config=None) -> Plan:
    """Write softmax(q k^T * scale + mask) v into ``out`` and its natural-log logsumexp into the
    contiguous fp32 (B, Hq, L) ``lse``; return the plan that ran. ``window`` = (left, right):
    query i sees keys i - left..i + right (-1: that side open), top-left aligned. ``dropout``
    drops probabilities after the softmax (``shared/dropout.py``). ``config`` overrides the tile
    table (tests and tuning only)."""
    window = tuple(window)
    key = ("forward", *_device_key(q), _layout(q), _layout(k), _layout(v), _layout(mask),
           _layout(out), is_causal, window, kernel, _state_layout(dropout), config)
    plan = _cached(key, lambda: _plan_forward(q, k, v, mask, out, is_causal, window, kernel,
                                              dropout is not None, config))
    plan.run(plan, q, k, v, mask, out, lse, scale, dropout)
    return plan


def _plan_forward(q, k, v, mask, out, is_causal, window, kernel, dropout, config) -> Plan:
    path, reason = rules.forward_path(kernel, q, k, v, mask, window, dropout, is_causal)
    batch, hq, seq_q, e = q.shape
    if path == HOPPER:
        launcher = _hopper()[0]
        cfg = config or hopper_config.forward_config(e, dropout=dropout)
        grid = (cdiv(seq_q, cfg.block_m), batch * hq) if seq_q and k.shape[2] else ()
        spec = dict(constexprs=hopper_config.forward_constexprs(is_causal, hq // k.shape[1], cfg,
                                                                dropout=dropout),
                    copies=tuple(not support.tma_strided(t) for t in (q, k, v)),
                    stage_out=not support.tma_strided(out))
        return Plan("forward", HOPPER, reason, None, None, None, grid, cfg,
                    launcher.run_forward, spec, Launches())
    cfg = config or forward_config(max(e, v.shape[3]), q.dtype, is_causal, arch_key(q.device))
    spec = dict(window=window, constexprs=forward.constexprs(
        q, k, v, mask, cfg, is_causal=is_causal, window=window, packed=False, dropout=dropout))
    grid = (cdiv(seq_q, cfg.block_m), batch * hq)
    return Plan("forward", PORTABLE, reason, None, None, None, grid, cfg, forward.run_forward,
                spec, Launches())


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       mask: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
                       dv: torch.Tensor, *, is_causal: bool, scale: float, schedule: str = AUTO,
                       max_spin: int = 1 << 26, kernel: str = AUTO,
                       window: tuple[int, int] = NO_WINDOW, dropout: Dropout | None = None,
                       config=None) -> Plan:
    """Write the gradients of attention into ``dq``, ``dk``, ``dv``; return the plan that ran.
    ``lse`` is the forward's contiguous fp32 (B, Hq, L) logsumexp; ``dropout`` the forward's."""
    window = tuple(window)
    key = ("backward", *_device_key(q), _layout(grad_out), _layout(q), _layout(k), _layout(v),
           _layout(out), _layout(mask), _layout(dq), _layout(dk), _layout(dv), is_causal, window,
           schedule, max_spin, kernel, _state_layout(dropout), config)
    plan = _cached(key, lambda: _plan_backward(grad_out, q, k, v, lse, mask, dk, dv, is_causal,
                                               window, schedule, max_spin, kernel,
                                               dropout is not None, config))
    plan.run(plan, grad_out, q, k, v, out, lse, mask, dq, dk, dv, scale, max_spin, dropout)
    return plan


def _plan_backward(grad_out, q, k, v, lse, mask, dk, dv, is_causal, window, schedule, max_spin,
                   kernel, dropout, config) -> Plan:
    path, reason = rules.backward_path(kernel, schedule, q, k, v, mask, window, dropout,
                                        is_causal)
    batch, hq, seq_q, e = q.shape
    seq_k, ev = k.shape[2], v.shape[3]
    requested = rules.requested_schedule(schedule, path, is_causal, False, max(e, ev), window)
    shape = f"q {tuple(q.shape)}, k {tuple(k.shape)}, causal={is_causal}"
    if path == HOPPER:
        launcher = _hopper()[0]
        cfg = config or hopper_config.backward_config(e, is_causal)
        n_q, n_kv = cdiv(seq_q, cfg.block_n), cdiv(seq_k, cfg.block_n)
        sms = _sms(q)
        fitted, fallback = rules.fit_schedule(requested, is_causal, window, n_kv, lambda _: sms,
                                              shape)
        per_head, items, grid, constexprs = hopper_config.backward_geometry(
            fitted, cfg, batch, k.shape[1], n_kv, is_causal, hq // k.shape[1],
            seq_k % cfg.block_n == 0, window != NO_WINDOW, False, sms, dropout)
        spec = dict(
            window=window, causal=is_causal, shape=shape, tiles=(n_q, n_kv),
            items=(per_head, items), constexprs=constexprs,
            copies=tuple(not support.tma_strided(t) for t in (q, k, v, grad_out)),
            # The ordered writer stores each row's first partial: only rows that see no key (a
            # window with more queries than keys, or no keys) would be left unwritten.
            clear_acc=(not fitted.ordered or seq_k == 0
                       or (window != NO_WINDOW and seq_q > seq_k)),
            zero_tail=is_causal and seq_k > n_q * cfg.block_n,
            dq_config=backward_config(e, q.dtype, is_causal, 9))
        return Plan("backward", HOPPER, reason, schedule, fitted, fallback, grid, cfg,
                    launcher.run_backward, spec, Launches())
    cfg = config or backward_config(max(e, ev), q.dtype, is_causal, arch_key(q.device))
    if cfg.block_n % cfg.block_m:
        raise ValueError(f"backward config needs block_m dividing block_n, got {cfg}")
    n_q, n_kv = cdiv(seq_q, cfg.block_n), cdiv(seq_k, cfg.block_n)
    views = (q, k, v, grad_out, lse, mask, dk, dv)
    fitted, fallback, grid, spec = _portable_main(views, None, cfg, requested, is_causal, window,
                                                  max_spin, (seq_q, seq_k, n_q, n_kv), batch,
                                                  shape, dropout)
    spec.update(zero_tail=is_causal and seq_k > n_q * cfg.block_n)
    return Plan("backward", PORTABLE, reason, schedule, fitted, fallback, grid, cfg,
                backward.run_backward, spec, Launches())


def _portable_main(views: tuple, packed_args: tuple | None, cfg, requested: Schedule,
                   is_causal: bool, window: tuple[int, int], max_spin: int,
                   sizes: tuple[int, int, int, int], entries: int, shape: str,
                   dropout: bool = False) -> tuple:
    """(schedule that runs, why not the one asked, grid, launcher spec) of the portable main
    kernel: the grid holds only co-resident programs, which the compiled kernel's registers and
    shared memory decide."""
    q, k, v, mask = views[0], views[1], views[2], views[5]
    n_kv = sizes[3]
    is_packed = packed_args is not None

    def main(schedule: Schedule) -> tuple[dict, tuple[int, ...]]:
        per_head = schedule.items_per_head(max(n_kv, 1), is_causal)
        constexprs = backward.main_constexprs(q, k, v, mask, cfg, schedule, is_causal=is_causal,
                                              window=window, packed=is_packed, dropout=dropout)
        return constexprs, (*sizes, per_head, entries * k.shape[1] * per_head)

    def capacity(schedule: Schedule) -> int:
        if interpreting():
            return 1 << 30  # programs run one after another: any deal is safe
        constexprs, full_sizes = main(schedule)
        return backward.capacity(constexprs, views, packed_args, full_sizes, window, max_spin)

    fitted, fallback = rules.fit_schedule(requested, is_causal, window, max(n_kv, 1), capacity,
                                          shape)
    constexprs, full_sizes = main(fitted)
    per_head, items = full_sizes[4:]
    if not interpreting():
        programs = min(items, capacity(fitted))
    elif not is_packed:
        programs = min(items, 3)
    else:
        # The interpreter runs programs one after another: one program per item of a head adds
        # each sequence's dQ in the order of its items, wherever the packing puts the sequence.
        programs = per_head
    spec = dict(window=window, causal=is_causal, shape=shape, sizes=full_sizes,
                constexprs=constexprs)
    return fitted, fallback, (programs,), spec


# --- packed sequences -------------------------------------------------------------------------

def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor,
                   cu_seq_k: torch.Tensor, max_q: int, max_k: int, out: torch.Tensor,
                   lse: torch.Tensor, *, is_causal: bool, scale: float,
                   window: tuple[int, int] = NO_WINDOW, kernel: str = AUTO, config=None) -> Plan:
    """Write each packed sequence's attention into ``out`` (Tq, Hq, Ev) and its logsumexp into
    the contiguous fp32 ``lse`` (Hq, Tq), in one launch that reads the offsets on the device;
    return the plan that ran (``ops/portable/packed.py`` has the layout)."""
    window = tuple(window)
    key = ("varlen_forward", *_device_key(q), _layout(q), _layout(k), _layout(v), _layout(out),
           _layout(cu_seq_q), _layout(cu_seq_k), max_q, max_k, is_causal, window, kernel, config)
    plan = _cached(key, lambda: _plan_varlen_forward(q, k, v, out, cu_seq_q, max_q, max_k,
                                                     is_causal, window, kernel, config))
    plan.run(plan, q, k, v, cu_seq_q, cu_seq_k, out, lse, scale)
    return plan


def _plan_varlen_forward(q, k, v, out, cu_seq_q, max_q, max_k, is_causal, window, kernel,
                         config) -> Plan:
    path, reason = rules.varlen_forward_path(kernel, q, k, v, window)
    num_seqs = cu_seq_q.numel() - 1
    if path == HOPPER:
        launcher = _hopper()[0]
        cfg = config or hopper_config.forward_config(q.shape[-1], varlen=True)
        (tq, hq, _), (tk, hkv, _) = q.shape, k.shape
        # Sequences x heads on axis 0, which may pass 65535 programs; none launches without keys.
        runs = num_seqs and max_q and tq and tk
        grid = (num_seqs * hq, cdiv(max_q, cfg.block_m)) if runs else ()
        views = [heads_first(t) for t in (q, k, v, out)]
        spec = dict(max_lens=(max_q, max_k),
                    constexprs=hopper_config.forward_constexprs(is_causal, hq // hkv, cfg,
                                                                varlen=True),
                    copies=tuple(not support.tma_strided(t) for t in views[:3]),
                    stage_out=not support.tma_strided(views[3]))
        return Plan("forward", HOPPER, reason, None, None, None, grid, cfg,
                    launcher.run_varlen_forward, spec, Launches())
    cfg = config or forward_config(max(q.shape[2], v.shape[2]), q.dtype, is_causal,
                                   arch_key(q.device))
    grid = (num_seqs * q.shape[1], cdiv(max_q, cfg.block_m))
    views = (virtual(t, num_seqs) for t in (q, k, v))
    spec = dict(window=window, max_lens=(max_q, max_k), constexprs=forward.constexprs(
        *views, None, cfg, is_causal=is_causal, window=window, packed=True))
    return Plan("forward", PORTABLE, reason, None, None, None, grid if all(grid) else (), cfg,
                packed.run_varlen_forward, spec, Launches())


def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: torch.Tensor, max_q: int, max_k: int, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor, *, is_causal: bool, scale: float,
                    schedule: str = AUTO, max_spin: int = 1 << 26, kernel: str = AUTO,
                    window: tuple[int, int] = NO_WINDOW, config=None) -> Plan:
    """Write every element of the packed gradients ``dq``, ``dk``, ``dv``; ``lse`` is the
    forward's (Hq, Tq); return the plan that ran. Each sequence's tile walks and reduction ranks
    are its own, so its bits do not depend on what is packed beside it."""
    window = tuple(window)
    key = ("varlen_backward", *_device_key(q), _layout(grad_out), _layout(q), _layout(k),
           _layout(v), _layout(out), _layout(dq), _layout(dk), _layout(dv), _layout(cu_seq_q),
           _layout(cu_seq_k), max_q, max_k, is_causal, window, schedule, max_spin, kernel,
           config)
    plan = _cached(key, lambda: _plan_varlen_backward(
        grad_out, q, k, v, lse, (cu_seq_q, cu_seq_k, max_q, max_k), dq, dk, dv, is_causal, window,
        schedule, max_spin, kernel, config))
    plan.run(plan, grad_out, q, k, v, out, lse, cu_seq_q, cu_seq_k, dq, dk, dv, scale, max_spin)
    return plan


def _plan_varlen_backward(grad_out, q, k, v, lse, packed_args, dq, dk, dv, is_causal, window,
                          schedule, max_spin, kernel, config) -> Plan:
    path, reason = rules.backward_path(kernel, schedule, q, k, v, None, window)
    (tq, hq, e), (tk, hkv, ev) = q.shape, v.shape
    cu_seq_q, _, max_q, max_k = packed_args
    num_seqs = cu_seq_q.numel() - 1
    requested = rules.requested_schedule(schedule, path, is_causal, True, max(e, ev), window)
    aligned = is_causal or window != NO_WINDOW
    span_q, span_k = (max(max_q, max_k),) * 2 if aligned else (max_q, max_k)
    shape = (f"packed q {tuple(q.shape)}, k {tuple(k.shape)}, {num_seqs} sequences, "
             f"max_q={max_q}, max_k={max_k}, causal={is_causal}")
    spec = dict(window=window, causal=is_causal, shape=shape, max_lens=(max_q, max_k))
    if path == HOPPER:
        launcher, deal, dq_tail = _hopper()
        cfg = config or hopper_config.backward_config(e, is_causal, packed=True)
        if dq.stride(2) != 1:  # the kernel's own conversion writes rows of contiguous elements
            cfg = dataclasses.replace(cfg, tail_convert=False)
        n_q, n_kv = cdiv(span_q, cfg.block_n), cdiv(span_k, cfg.block_n)
        sms = _sms(q)
        fitted, fallback = rules.fit_schedule(requested, is_causal, window, max(n_kv, 1),
                                        lambda _: sms, shape)
        per_head, items, grid, constexprs = hopper_config.backward_geometry(
            fitted, cfg, num_seqs, hkv, max(n_kv, 1), is_causal, hq // hkv, False,
            window != NO_WINDOW, True, sms)
        counters = deal.COUNTERS.value + (dq_tail.counters(num_seqs, hkv)
                                          if constexprs["TAIL_CONVERT"] else 0)
        spec.update(tiles=(n_q, n_kv), items=(per_head, items), constexprs=constexprs,
                    aligned=aligned, counters=counters,
                    copies=tuple(not support.tma_strided(heads_first(t))
                                 for t in (q, k, v, grad_out)),
                    dq_config=backward_config(e, q.dtype, is_causal, 9))
        runs = num_seqs and n_q and n_kv and tq and tk
        return Plan("backward", HOPPER, reason, schedule, fitted, fallback,
                    grid if runs else (), cfg, launcher.run_varlen_backward, spec, Launches())
    cfg = config or backward_config(max(e, ev), q.dtype, is_causal, arch_key(q.device))
    if cfg.block_n % cfg.block_m:
        raise ValueError(f"backward config needs block_m dividing block_n, got {cfg}")
    n_q, n_kv = cdiv(span_q, cfg.block_n), cdiv(span_k, cfg.block_n)
    if not (num_seqs and n_q and n_kv and tq and tk):  # no sequence has both queries and keys
        return Plan("backward", PORTABLE, reason, schedule, requested, None, (), cfg,
                    packed.run_varlen_backward, spec, Launches())
    views = tuple(virtual(t, num_seqs) for t in (q, k, v, grad_out))
    lse_c = lse.contiguous()
    dk4, dv4 = (virtual(t, num_seqs) for t in (dk, dv))
    fitted, fallback, grid, main_spec = _portable_main(
        (*views, lse_c, None, dk4, dv4), packed_args, cfg, requested,
        is_causal, window, max_spin, (tq, tk, n_q, n_kv), num_seqs, shape)
    spec.update(main_spec)
    return Plan("backward", PORTABLE, reason, schedule, fitted, fallback, grid, cfg,
                packed.run_varlen_backward, spec, Launches())
