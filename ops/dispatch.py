"""Which kernel path runs a launch: the one place that chooses between kernel families.

``kernel`` is the caller's choice (``dash_inductor.config.kernel``, captured when the forward runs):
"auto" picks the fastest path available for the inputs, "portable" the ``tl`` kernels of ``ops/``,
"hopper" the sm90 family. Only the portable kernels exist so far.
"""

from __future__ import annotations

import torch

from .catalog import KERNELS

PORTABLE = "portable"


def select_kernel(kernel: str, op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, is_causal: bool) -> tuple[str, str | None]:
    """The path that runs ``op`` ("forward" or "backward") on these inputs, and why "auto" did not
    take a faster one (None when it did, or when the path was asked for by name)."""
    if kernel == "auto":
        return PORTABLE, "hopper kernels not built yet"
    if kernel == PORTABLE:
        return PORTABLE, None
    if kernel == "hopper":
        raise ValueError("dash.attention: kernel='hopper' is not available: the hopper kernels "
                         "are not built yet; use kernel='auto' or 'portable'")
    raise ValueError(f"dash.attention: kernel must be one of {list(KERNELS)}, got {kernel!r}")
