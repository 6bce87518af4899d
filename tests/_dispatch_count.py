"""Count the attention ops that really ran, below autograd, instead of trusting a flag."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

DASH_OPS = ("dash.attention.default", "dash.attention_backward.default")


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside the ``with`` block, by name ("dash.attention.default")."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def attention_ops(self) -> dict[str, int]:
        """Counts of dash's ops and of PyTorch's attention kernels (any op named *attention*)."""
        return {name: n for name, n in self.counts.items() if "attention" in name}


def sdpa_free(counter: OpCounter) -> bool:
    """Whether no PyTorch attention kernel ran (only dash's ops)."""
    return all(name in DASH_OPS for name in counter.attention_ops())

