"""Attention dropout: the RNG state a call draws, and its keep mask in PyTorch.

The mask is ``ops/shared/dropout.py``'s, bit for bit: Philox4x32-10 (Salmon et al., SC 2011)
keyed by the call's 64-bit seed, one call per eight elements of a 16 x 16 block (that module's
docstring gives the counter and which 16-bit half an element takes), kept when the half is at
least ``ceil(p * 2**16)``. Written here in int64 tensor arithmetic (every product below 2**63, so
nothing relies on overflow) for the reference kernels and the tests.

The state is an int64 (seed, offset) tensor on the query's device, drawn by ``dash::dropout_rng``
from PyTorch's default generator of that device: on the device, without a host sync, and inside
a CUDA graph (where PyTorch's generator advances per replay). ``torch.manual_seed`` therefore
reproduces a run. The backward takes the same tensor and recomputes the mask; it is never stored.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox4x32 multipliers (M0, M1)
_WEYL = (0x9E3779B9, 0xBB67AE85)  # key increments per round
_ROUNDS = 10
#: The draws' range: offset + counter stays below 2**63 for any tensor that fits in memory.
_STATE_HIGH = 1 << 62


def check_p(dropout_p: object, where: str = "dash.attention") -> float:
    """``dropout_p`` as a float in [0, 1), else a ValueError naming ``where``."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"{where}: dropout_p must be a float, got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_state(dropout_p: float, rng_state: Tensor | None, device: torch.device,
                where: str = "dash.attention") -> None:
    """With dropout, ``rng_state`` must be the int64 (2,) tensor ``dash::dropout_rng`` draws."""
    if dropout_p == 0.0:
        return
    if rng_state is None:
        raise ValueError(f"{where}: dropout_p={dropout_p} needs rng_state, the (seed, offset) "
                         f"tensor of torch.ops.dash.dropout_rng(query) (dash_inductor.attention "
                         f"draws it)")
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
        raise ValueError(f"{where}: rng_state must be an int64 tensor of shape (2,), got "
                         f"{rng_state.dtype} {tuple(rng_state.shape)}")
    if rng_state.device != device:
        raise ValueError(f"{where}: rng_state is on {rng_state.device}, the query on {device}")


@torch.library.custom_op("dash::dropout_rng", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def dropout_rng(like: Tensor) -> Tensor:
    """A fresh int64 (seed, offset) on ``like``'s device from its default generator. Tagged
    nondeterministic_seeded: compilers keep it in program order and never recompute it."""
    return torch.randint(0, _STATE_HIGH, (2,), dtype=torch.int64, device=like.device)


@dropout_rng.register_fake
def _dropout_rng_fake(like: Tensor) -> Tensor:
    return torch.empty((2,), dtype=torch.int64, device=like.device)


def _mul(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of ``a * m`` for uint32 values ``a`` held in int64, in 16-bit
    halves of ``m`` so that no product reaches 2**63."""
    low_part, high_part = a * (m & 0xFFFF), a * (m >> 16)
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return high, low


def philox(seed: Tensor, counter: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 of counters (low, high word of ``counter``, 0, 0) under key ``seed`` (low,
    high word), as Triton's ``tl.randint4x(seed, counter)``: four uint32 tensors held in int64."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        hi0, lo0 = _mul(c0, _ROUND[0])
        hi2, lo2 = _mul(c2, _ROUND[1])
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _WEYL[0]) & _MASK32, (k1 + _WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def keep_mask(rng_state: Tensor, dropout_p: float, shape: tuple[int, int, int, int],
              cols: slice = slice(None), rows: slice = slice(None)) -> Tensor:
    """The bool keep mask of a (B, H, L, S) problem at queries ``rows`` and keys ``cols`` (step-1
    slices), on ``rng_state``'s device, without reading the state on the host."""
    # Imported at use: that module also holds the kernels' Triton functions.
    from dash_inductor.ops.shared.dropout import BLOCK, threshold

    batch, heads, n_rows, keys = shape
    start, stop, _ = cols.indices(keys)
    row0, row1, _ = rows.indices(n_rows)
    stop, row1 = max(stop, start), max(row1, row0)
    device = rng_state.device
    # The 16 x 16 blocks that hold the slices, as (block, call index within the block) pairs.
    q_first, q_last = row0 // BLOCK, -(-row1 // BLOCK)
    k_first, k_last = start // BLOCK, -(-stop // BLOCK)
    q_calls = 4 * -(-n_rows // BLOCK)
    k_calls = 8 * -(-keys // BLOCK)
    bh = torch.arange(batch * heads, device=device).view(batch, heads, 1, 1)
    qc = torch.arange(4 * q_first, 4 * q_last, device=device).view(1, 1, -1, 1)
    kc = torch.arange(8 * k_first, 8 * k_last, device=device).view(1, 1, 1, -1)
    counter = rng_state[1] + (bh * q_calls + qc) * k_calls + kc
    words = torch.stack(philox(rng_state[0], counter), dim=-1)  # [..., qc, kc, 2 q3 + k3]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # [..., q0]
    nq, nk = q_last - q_first, k_last - k_first
    x = halves.view(batch, heads, nq, 4, nk, 8, 2, 2, 2)  # (qh, qm, kh, kl, q3, k3, q0)
    x = x.permute(0, 1, 2, 6, 3, 8, 4, 7, 5).reshape(batch, heads, nq * BLOCK, nk * BLOCK)
    q_skip, k_skip = row0 - q_first * BLOCK, start - k_first * BLOCK
    x = x[:, :, q_skip:q_skip + row1 - row0, k_skip:k_skip + stop - start]
    return x >= threshold(dropout_p)
