"""Static tile configurations of the portable kernels, and what ``schedule="auto"`` runs on them.

Determinism forbids timing-based autotuning at run time (docs/design.md): a config chosen by a
race between candidates could differ between runs and change the bits. So every choice here is a
fixed table lookup keyed by (head-dim bucket, dtype, causal, GPU architecture), filled offline from
measurements written down in docs/kernels-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shared.device import INTERPRETER, head_dim_bucket


@dataclass(frozen=True)
class ForwardConfig:
    """Tile shape of the forward kernel: BLOCK_M query rows per program, BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BackwardConfig:
    """Tile shape of the backward kernels.

    ``block_n`` is the schedule's tile (KV rows per program slot and Q rows per schedule Q tile);
    ``block_m`` (dividing ``block_n``) is the Q sub-tile processed per inner step. ``dq_block_m`` and
    ``dq_block_n`` shape the separate dQ kernel of the ``recompute`` schedule.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    dq_num_stages: int


# Small tiles keep the interpreter fast and exercise sub-tiles (block_m < block_n) and many tiles.
_INTERPRETER_FORWARD = ForwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
_INTERPRETER_BACKWARD = BackwardConfig(block_m=16, block_n=32, num_warps=4, num_stages=1,
                                       dq_block_m=16, dq_block_n=16, dq_num_warps=4, dq_num_stages=1)

# (arch major, head-dim bucket, is 4-byte dtype, causal) -> config. Hopper (9) entries are measured
# (docs/kernels-notes.md); other architectures use the conservative defaults below.
_FORWARD: dict[tuple[int, int, bool, bool], ForwardConfig] = {}
_BACKWARD: dict[tuple[int, int, bool, bool], BackwardConfig] = {}


def _fill_hopper() -> None:
    """H200 measurements (docs/kernels-notes.md): bf16, N = 4096, B*N = 16k, H*D = 2048."""
    for causal in (False, True):
        for bucket in (16, 32, 64):
            _FORWARD[(9, bucket, False, causal)] = ForwardConfig(128, 64, 8, 3)
            dq_tile = (64, 64, 4, 3) if causal else (128, 64, 8, 3)
            _BACKWARD[(9, bucket, False, causal)] = BackwardConfig(64, 64, 4, 3, *dq_tile)
        _FORWARD[(9, 128, False, causal)] = (ForwardConfig(128, 64, 8, 3) if causal
                                             else ForwardConfig(64, 64, 4, 3))
        _BACKWARD[(9, 128, False, causal)] = BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3)
        _FORWARD[(9, 256, False, causal)] = ForwardConfig(64, 64, 4, 2)
        _BACKWARD[(9, 256, False, causal)] = BackwardConfig(32, 64, 8, 1, 64, 32, 8, 1)


_fill_hopper()


def _default_forward(bucket: int, wide: bool) -> ForwardConfig:
    if bucket >= 256 or (wide and bucket >= 128):
        return ForwardConfig(32, 32, 4, 1)
    if bucket >= 128 or wide:
        return ForwardConfig(64, 32, 4, 2)
    return ForwardConfig(64, 64, 4, 2)


def _default_backward(bucket: int, wide: bool) -> BackwardConfig:
    if bucket >= 256 or (wide and bucket >= 128):
        return BackwardConfig(16, 32, 4, 1, 32, 16, 4, 1)
    if bucket >= 128 or wide:
        return BackwardConfig(32, 64, 4, 1, 64, 32, 4, 1)
    return BackwardConfig(32, 64, 4, 2, 64, 32, 4, 2)


def forward_config(head_dim: int, dtype: torch.dtype, causal: bool, arch: int | str) -> ForwardConfig:
    """The forward tile config for a (head dim, dtype, causal, arch) key; never timing-dependent."""
    if arch == INTERPRETER:
        return _INTERPRETER_FORWARD
    bucket, wide = head_dim_bucket(head_dim), dtype.itemsize >= 4
    return _FORWARD.get((arch, bucket, wide, causal), _default_forward(bucket, wide))


def backward_config(head_dim: int, dtype: torch.dtype, causal: bool, arch: int | str) -> BackwardConfig:
    """The backward tile config for a (head dim, dtype, causal, arch) key; never timing-dependent."""
    if arch == INTERPRETER:
        return _INTERPRETER_BACKWARD
    bucket, wide = head_dim_bucket(head_dim), dtype.itemsize >= 4
    return _BACKWARD.get((arch, bucket, wide, causal), _default_backward(bucket, wide))


#: What ``schedule="auto"`` runs on the portable kernels: the separate dQ pass, which needs no
#: co-resident programs and measured the fastest deterministic schedule there at every point
#: (H200, bf16, d128, N = 4k: 400 TFLOP/s full and 342 causal, against ``shift``'s 273 and 252).
PORTABLE_AUTO = "recompute"
