"""The dispatcher's rules: which kernel path runs a call, what ``schedule="auto"`` means there, and
which schedule fits.

The one place each is decided (``dispatch.py`` calls them once per signature): ``auto`` is
resolved by :func:`auto_schedule` from each kernel family's measured rule, and a schedule that
cannot run (no windowed ranks, or too few co-resident programs) falls back with its reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import catalog
from .catalog import AUTO, KERNELS, Schedule
from .hopper import config as hopper_config
from .hopper import support
from .portable.configs import PORTABLE_AUTO
from .shared.launch import warn_once

PORTABLE = "portable"
HOPPER = "hopper"
NO_WINDOW = (-1, -1)


def hopper_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, window: tuple[int, int], op: str) -> str | None:
    if op == "forward" and tuple(window) != NO_WINDOW:
        return f"window_size={tuple(window)} (the Hopper forward takes no sliding window)"
    if q.device.type != "cuda":
        return f"device {q.device.type!r} (the Hopper kernels run on sm90 GPUs)"
    return support.unsupported_reason(q, k, v, mask)


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"dash.attention: kernel must be one of {list(KERNELS)}, got {kernel!r}")


def forward_path(kernel: str, q, k, v, mask, window, dropout: bool = False,
                 causal: bool = False) -> tuple[str, str | None]:
    """The forward's kernel path, and why ``auto`` did not take the Hopper one."""
    check_kernel(kernel)
    if kernel == PORTABLE:
        return PORTABLE, None
    reason = hopper_unsupported(q, k, v, mask, window, "forward")
    if kernel == HOPPER and reason is not None:  # refused when the forward runs, not later
        raise ValueError(f"dash.attention: kernel='hopper' cannot run this attention: {reason}; "
                         f"use kernel='auto' or 'portable'")
    if reason is not None or kernel == HOPPER:
        return (PORTABLE if reason else HOPPER), reason
    slower = dropout and hopper_config.dropout_slower("forward", q.shape[-1], causal)
    if slower:
        return PORTABLE, slower
    shortest = hopper_config.FORWARD_MIN_SEQ[q.shape[-1]]
    if q.shape[2] >= shortest:
        return HOPPER, None
    return PORTABLE, (f"the Hopper forward measured faster at head dim {q.shape[-1]} only from "
                      f"N = {shortest}")


#: Why ``kernel="auto"`` keeps packed sequences on the portable forward.
PACKED_FORWARD_UNMEASURED = ("packed sequences (the Hopper packed forward runs when named, "
                             "kernel='hopper': not yet measured against the portable one)")


def varlen_forward_path(kernel: str, q, k, v, window) -> tuple[str, str | None]:
    """The packed forward's kernel path, and why ``auto`` did not take the Hopper one."""
    check_kernel(kernel)
    if kernel == PORTABLE:
        return PORTABLE, None
    reason = hopper_unsupported(q, k, v, None, window, "forward")
    if kernel == HOPPER and reason is not None:
        raise ValueError(f"dash.varlen_attention: kernel='hopper' cannot run this attention: "
                         f"{reason}; use kernel='auto' or 'portable'")
    if kernel == HOPPER:
        return HOPPER, None
    return PORTABLE, reason or PACKED_FORWARD_UNMEASURED


def backward_path(kernel: str, schedule: str, q, k, v, mask, window, dropout: bool = False,
                  causal: bool = False) -> tuple[str, str | None]:
    """The backward's kernel path for the requested schedule, and why ``auto`` did not take the
    Hopper one. ``auto`` takes it for the ordered schedules, which the portable kernels run with
    the dQ turn on their critical path (``hopper_config.FASTER_ON_HOPPER``), and with dropout
    where it measured faster (``hopper_config.dropout_slower``)."""
    check_kernel(kernel)
    if kernel == PORTABLE:
        return PORTABLE, None
    reason = hopper_unsupported(q, k, v, mask, window, "backward")
    if kernel == HOPPER and reason is not None:
        raise ValueError(f"dash.attention: kernel='hopper' cannot run this attention: {reason}; "
                         f"use kernel='auto' or 'portable'")
    if reason is None and kernel != HOPPER and dropout:
        reason = hopper_config.dropout_slower("backward", q.shape[-1], causal)
    if reason is not None:
        return PORTABLE, reason
    if kernel == HOPPER or schedule == AUTO or schedule in hopper_config.FASTER_ON_HOPPER:
        return HOPPER, None
    return PORTABLE, (f"schedule {schedule!r} measured faster on the portable kernels (the "
                      f"Hopper path is picked for {list(hopper_config.FASTER_ON_HOPPER)})")


def auto_schedule(path: str, causal: bool, packed: bool, head_dim: int,
                  windowed: bool) -> Schedule:
    """What ``schedule="auto"`` runs on ``path``: each kernel family's measured rule."""
    if path == HOPPER:
        return catalog.get(hopper_config.auto_on_hopper(causal, packed, head_dim, windowed))
    return catalog.get(PORTABLE_AUTO)


def requested_schedule(schedule: str, path: str, causal: bool, packed: bool, head_dim: int,
               window: tuple[int, int]) -> Schedule:
    if schedule == AUTO:
        return auto_schedule(path, causal, packed, head_dim, window != NO_WINDOW)
    if schedule not in catalog.SCHEDULES:
        raise ValueError(f"schedule must be {AUTO!r} or one of {list(catalog.NAMES)}, "
                         f"got {schedule!r}")
    return catalog.get(schedule)


def window_fallback(schedule: Schedule, causal: bool,
                    window: tuple[int, int]) -> tuple[Schedule, str | None]:
    """The schedule that runs under ``window``, and why it is not the one asked: ``shift`` has no
    windowed ranks and falls back to the ordered schedule that runs on any grid."""
    if tuple(window) == NO_WINDOW or schedule.name != "shift":
        return schedule, None
    fitted = catalog.get(catalog.fallback(causal))
    return fitted, (f"schedule 'shift' has no sliding-window ranks; using {fitted.name!r} "
                    f"(ordered, window-aware) instead")


def fit_schedule(schedule: Schedule, causal: bool, window: tuple[int, int], n_kv: int,
                 capacity: Callable[[Schedule], int], shape: str) -> tuple[Schedule, str | None]:
    """The schedule that runs: the window's fallback, or one whose items of a head fit the
    ``capacity`` co-resident programs; and why it is not the one asked (warned once)."""
    fitted, reason = window_fallback(schedule, causal, window)
    if reason or not schedule.coresident_head:
        return fitted, reason
    needed = schedule.items_per_head(n_kv, causal)
    available = capacity(schedule)
    if needed <= available:
        return schedule, None
    fallback = catalog.get(catalog.fallback(causal))
    reason = (f"schedule {schedule.name!r} needs {needed} co-resident programs per head for "
              f"{shape}, the GPU holds {available}; using {fallback.name!r} instead")
    warn_once(f"dash attention backward: {reason}")
    return fallback, reason
