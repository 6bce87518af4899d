"""Which kernel path runs a launch: the one place that chooses between kernel families.

``kernel`` is the caller's choice (``dash_inductor.config.kernel``, captured when the forward runs):
"portable" is the ``tl`` kernels of ``ops/``; "hopper" the sm90 Gluon family of ``ops/hopper/``,
refused with the reason when it cannot take the inputs; "auto" takes the
Hopper kernels where they measured faster than the portable ones (``hopper.config``:
``FORWARD_MIN_SEQ`` for the forward, ``FASTER_ON_HOPPER`` for the backward schedules;
docs/kernels-notes.md, docs/benchmarks.md) and the portable kernels everywhere else, and says why.
"""

from __future__ import annotations

import torch

from .catalog import KERNELS

PORTABLE = "portable"
HOPPER = "hopper"
NO_WINDOW = (-1, -1)


def _hopper_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, window: tuple[int, int], op: str) -> str | None:
    if op == "forward" and tuple(window) != NO_WINDOW:
        return f"window_size={tuple(window)} (the Hopper forward takes no sliding window)"
    if q.device.type != "cuda":
        return f"device {q.device.type!r} (the Hopper kernels run on sm90 GPUs)"
    try:
        from .hopper.launch import unsupported_reason
    except ImportError as error:  # a Triton without Gluon
        return f"the Hopper kernels cannot be imported ({error})"
    return unsupported_reason(q, k, v, mask)


def select_kernel(kernel: str, op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, is_causal: bool, schedule: str | None = None,
                  window: tuple[int, int] = NO_WINDOW) -> tuple[str, str | None]:
    """The path that runs ``op`` ("forward" or "backward") with the resolved backward ``schedule``,
    and why "auto" did not take the Hopper path (None when it did, or a path was named)."""
    del is_causal  # both paths take causal and full masks alike
    if kernel not in KERNELS:
        raise ValueError(f"dash.attention: kernel must be one of {list(KERNELS)}, got {kernel!r}")
    if kernel == PORTABLE:
        return PORTABLE, None
    reason = _hopper_unsupported(q, k, v, mask, window, op)
    if kernel == HOPPER and reason is not None:  # refused when the forward runs, not later
        raise ValueError(f"dash.attention: kernel='hopper' cannot run this attention: {reason}; "
                         f"use kernel='auto' or 'portable'")
    if reason is not None:
        return PORTABLE, reason
    from .hopper.config import FASTER_ON_HOPPER, FORWARD_MIN_SEQ

    if kernel == HOPPER:
        return HOPPER, None
    if op == "forward":
        shortest = FORWARD_MIN_SEQ[q.shape[-1]]
        if q.shape[2] >= shortest:
            return HOPPER, None
        return PORTABLE, (f"the Hopper forward measured faster at head dim {q.shape[-1]} only "
                          f"from N = {shortest}")
    if schedule not in FASTER_ON_HOPPER:
        return PORTABLE, (f"schedule {schedule!r} measured faster on the portable kernels "
                          f"(the Hopper path is picked for {list(FASTER_ON_HOPPER)})")
    return HOPPER, None
