"""Which kernel each integration call went to, counted and logged.

The integrations decide per call whether dash's op can take it; a call it cannot take goes on to
PyTorch's own attention. Counting every decision lets tests (and users) check that dash really ran
instead of assuming it, and logging each fallback reason once on the ``dash_inductor`` logger
(``TORCH_LOGS=dash_inductor``) says why it did not.
"""

from __future__ import annotations

import collections
import logging
from types import ModuleType

import torch

from dash_inductor.integrations.import_hook import after_import

log = logging.getLogger("dash_inductor")

#: Calls per (integration, reason); reason None means dash's op ran. Integrations are "hf",
#: "provider.forward", "provider.backward" (SDPA's flash backend), "provider.varlen_forward" and
#: "provider.varlen_backward" (``varlen_attn``).
counts: collections.Counter[tuple[str, str | None]] = collections.Counter()
_logged: set[tuple[str, str]] = set()


def record(integration: str, reason: str | None) -> None:
    """Count one call of ``integration`` (under torch.compile: one per trace); log a fallback
    reason the first time it is seen."""
    counts[(integration, reason)] += 1
    if reason is None or (integration, reason) in _logged:
        return
    _logged.add((integration, reason))
    log.info("dash_inductor: %s fell back to PyTorch's attention: %s", integration, reason)


def _constant_under_dynamo(_dynamo: ModuleType) -> None:
    """Under torch.compile Dynamo runs ``record`` at trace time and keeps no guard on the counts
    (reading them in traced code made Dynamo guard on their value and recompile every step):
    compiled code counts each routing decision once per trace, as a captured CUDA graph counts
    once per capture. Marked when Dynamo is imported, as marking imports it (seconds)."""
    torch.compiler.assume_constant_result(record)


after_import("torch._dynamo", _constant_under_dynamo)


def dash_calls(integration: str) -> int:
    """How many calls of ``integration`` ran dash's op."""
    return counts[(integration, None)]


def fallbacks(integration: str) -> dict[str, int]:
    """The fallback reasons of ``integration`` with their call counts."""
    return {reason: n for (name, reason), n in counts.items()
            if name == integration and reason is not None}


def reset() -> None:
    """Forget the counts and which reasons were logged (each reason is logged again once)."""
    counts.clear()
    _logged.clear()
