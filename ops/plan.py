"""What a launcher decided and ran, returned to its caller (and reported by ``explain``/``info``).

Built on the host from values the launcher already has: making one never syncs with the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Plan:
    """One launch: which kernel path and schedule ran, why they differ from the request, the grid."""

    op: str  #: "forward" or "backward"
    kernel: str  #: the kernel path that ran: "portable", "hopper", or "reference" (PyTorch)
    kernel_reason: str | None  #: why ``kernel="auto"`` did not take the fastest path; None if it did
    schedule_requested: str | None  #: the backward schedule asked for ("auto" included); None: forward
    schedule: str | None  #: the backward schedule that ran; None: forward
    fallback: str | None  #: why ``schedule`` differs from the request (beyond "auto"); else None
    grid: tuple[int, ...]  #: the main kernel's launch grid; () where no kernel was launched
    config: Any = None  #: the tile config (``ops.configs.ForwardConfig`` / ``BackwardConfig``)
