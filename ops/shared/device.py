"""What the kernels key their configs on: the head-dim bucket and the device's architecture."""

from __future__ import annotations

import functools
import os

import torch

#: The architecture key of code run by Triton's interpreter (its own small tiles).
INTERPRETER = "interpreter"


def head_dim_bucket(head_dim: int) -> int:
    """The padded (power of two, at least 16) head dimension the kernels compute with."""
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"head dimension must be in 1..256, got {head_dim}")
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int:
    """The compute-capability major of CUDA ``device`` (cached: every launch asks)."""
    return _capability_major(torch.cuda.current_device() if device.index is None else device.index)


def arch_key(device: torch.device) -> int | str:
    """The architecture key of ``device``: compute-capability major, or INTERPRETER."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return INTERPRETER
    return cuda_major(device)
