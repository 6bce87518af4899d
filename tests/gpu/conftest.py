"""Fixtures of the GPU tests."""

import pytest
import torch


def _poison_the_allocator() -> None:
    """Leave NaN in the blocks the caching allocator hands out next (large and small pools)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full((n,), float("nan"), device="cuda")
              for n in (1 << 24, *[1 << 17] * 32, *[1 << 12] * 256)]
    del blocks


@pytest.fixture
def poison_allocator():
    """A call that leaves NaN where the next allocations land: a buffer a kernel leaves partly
    unwritten then shows NaN."""
    return _poison_the_allocator
