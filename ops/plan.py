"""What the dispatcher decided for a call signature, and what a launcher executes.

Plain Python: making one never touches the GPU, and reading one (``last_plans()``, ``explain``,
``info``) never syncs with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .catalog import Schedule


@dataclass(frozen=True, eq=False)
class Plan:
    """One signature's launch: kernel path and schedule, why they differ from the request, the
    grid and tile config; ``run`` executes it on a call's tensors."""

    op: str  #: "forward" or "backward"
    kernel: str  #: the kernel path that runs: "portable", "hopper", or "reference" (PyTorch)
    kernel_reason: str | None  #: why ``kernel="auto"`` did not take the fastest path; None if it did
    schedule_requested: str | None  #: the backward schedule asked for ("auto" included); None: forward
    schedule: Schedule | None  #: the backward schedule that runs; None: forward
    fallback: str | None  #: why ``schedule`` differs from the request (beyond "auto"); else None
    grid: tuple[int, ...]  #: the main kernel's launch grid; () where no kernel is launched
    config: Any = None  #: the tile config (``ops.portable.configs`` or ``ops.hopper.config``)
    run: Callable[..., None] | None = field(default=None, repr=False)  #: the launcher
    spec: Mapping[str, Any] = field(default_factory=dict, repr=False)  #: what the launcher reads
    launches: Any = field(default=None, repr=False)  #: its bound kernels (``launch.Launches``)

    def __repr__(self) -> str:
        schedule = None if self.schedule is None else self.schedule.name
        return (f"Plan(op={self.op!r}, kernel={self.kernel!r}, kernel_reason={self.kernel_reason!r}, "
                f"schedule_requested={self.schedule_requested!r}, schedule={schedule!r}, "
                f"fallback={self.fallback!r}, grid={self.grid!r}, config={self.config!r})")


#: Caches of plans kept outside the dispatcher (the library's per-signature plans), which
#: ``dispatch.cache_clear`` clears with its own.
HOLDERS: list[Callable[[], None]] = []
