"""Packed sequences as ``varlen_attn`` takes them: argument checks and per-sequence views.

Tokens of N sequences are packed along dim 0: ``query`` (Tq, Hq, E), ``key`` (Tk, Hkv, E),
``value`` (Tk, Hkv, Ev); sequence ``i`` owns query rows ``cu_seq_q[i]:cu_seq_q[i+1]`` and key
rows ``cu_seq_k[i]:cu_seq_k[i+1]``. ``check_packed`` reads only metadata (it runs on fake tensors
at trace time); ``sequences`` reads the offsets' values on the host, for CPU tensors only (free
there; the reference's per-sequence views need them); the packed kernels check CUDA offsets on
the device (``ops/shared/offsets_check.py``). The contract and its messages are defined once, in
``ops/shared/offsets.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dash_inductor.ops.shared import offsets
from dash_inductor.library.shapes import MAX_HEAD_DIM, SUPPORTED_DTYPES
from dash_inductor.library.window import NO_WINDOW, Window, check_window, dense_keep, with_causal

WHERE = offsets.WHERE


def _fail(message: str) -> None:
    raise ValueError(f"{WHERE}: {message}")


def _check_qkv(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            _fail(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            _fail(f"{name} must be 3-D (T, H, D) packed tokens, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if not query.dtype == key.dtype == value.dtype:
        _fail(f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, "
              f"{value.dtype}")
    if not query.device == key.device == value.device:
        _fail(f"query, key and value must be on the same device, got {query.device}, "
              f"{key.device}, {value.device}")
    if query.shape[2] != key.shape[2]:
        _fail(f"query and key must have the same head dim, got query (Tq, Hq, {query.shape[2]}) "
              f"and key (Tk, Hkv, {key.shape[2]})")
    if query.shape[2] == 0:
        _fail("the head dim of query and key must be at least 1")
    if key.shape[:2] != value.shape[:2]:
        _fail(f"key and value must agree on (Tk, Hkv), got key {tuple(key.shape)} and value "
              f"{tuple(value.shape)}")
    if query.device.type == "cuda" and max(query.shape[2], value.shape[2]) > MAX_HEAD_DIM:
        _fail(f"head dims up to {MAX_HEAD_DIM} are supported on CUDA, got {query.shape[2]}, "
              f"{value.shape[2]}")
    hq, hkv = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hkv:
        _fail(f"query has {hq} heads and key/value {hkv}; they must match, or pass "
              f"enable_gqa=True with query heads a multiple of key/value heads")
    if enable_gqa and (hkv == 0 or hq % hkv != 0):
        _fail(f"with enable_gqa=True the number of query heads ({hq}) must be a multiple of the "
              f"number of key/value heads ({hkv})")


def _check_offsets(name: str, cu: Tensor, device: torch.device) -> None:
    if not isinstance(cu, Tensor):
        _fail(f"{name} must be a Tensor of cumulative sequence offsets, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        _fail(f"{name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() == 0:
        _fail(f"{name} must be 1-D of length N + 1 (N sequences), got shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(f"{name} is on {cu.device} but query is on {device}")


def check_packed(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
                 max_q: int, max_k: int, scale: float | None, window_size: Sequence[int],
                 enable_gqa: bool) -> Window:
    """Check everything but the offsets' values; return the window as the kernels take it.

    FlashAttention (hence ``varlen_attn``) treats a window side of at least ``max_k`` as
    unbounded; so does this, so that both compute the same function.
    """
    _check_qkv(query, key, value, enable_gqa)
    _check_offsets("cu_seq_q", cu_seq_q, query.device)
    _check_offsets("cu_seq_k", cu_seq_k, query.device)
    if cu_seq_q.numel() != cu_seq_k.numel():
        _fail(f"cu_seq_q and cu_seq_k must have the same length N + 1, got {cu_seq_q.numel()} "
              f"and {cu_seq_k.numel()}")
    for name, value_ in (("max_q", max_q), ("max_k", max_k)):
        if isinstance(value_, bool) or not isinstance(value_, (int, torch.SymInt)) or value_ < 0:
            _fail(f"{name} must be a non-negative int, got {value_!r}")
    if scale is not None and not math.isfinite(scale):
        _fail(f"scale must be a finite float or None (1/sqrt(D)), got {scale}")
    left, right = check_window(window_size, WHERE)
    return (-1 if left >= max_k else left), (-1 if right >= max_k else right)


@dataclass(frozen=True)
class Segment:
    """One sequence: its query rows [q0, q1) and key rows [k0, k1) in the packed tensors."""

    q0: int
    q1: int
    k0: int
    k1: int


def _offsets(name: str, cu: Tensor, total: int, max_len: int) -> list[int]:
    values = cu.tolist()
    problem = offsets.host_breach(name, values, total, max_len)
    if problem is not None:
        raise ValueError(problem)
    return values


def sequences(query: Tensor, key: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int,
              max_k: int) -> list[Segment]:
    """The sequences' row ranges, after checking the offsets' values (reads them on the host)."""
    cq = _offsets("cu_seq_q", cu_seq_q, query.shape[0], max_q)
    ck = _offsets("cu_seq_k", cu_seq_k, key.shape[0], max_k)
    return [Segment(*bounds) for bounds in zip(cq, cq[1:], ck, ck[1:])]


def view(t: Tensor, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of a packed (T, H, D) tensor as the dense kernels' (1, H, n, D) view."""
    return t[start:stop].transpose(0, 1).unsqueeze(0)


def keep(seg: Segment, window: Window, device: torch.device) -> Tensor | None:
    """A sequence's (Lq, Lk) keep-mask: the window aligned bottom-right, as FlashAttention's."""
    lq, lk = seg.q1 - seg.q0, seg.k1 - seg.k0
    return dense_keep(lq, lk, window, device, offset=lk - lq)


def kernel_window(seg: Segment, window: Window, heads: int, device: torch.device
                  ) -> tuple[Tensor | None, Window, bool]:
    """(mask, window, is_causal) for the dense kernels: where Lq = Lk bottom-right is top-left,
    so the kernels take the window itself and skip the tiles outside it; otherwise a mask."""
    if seg.q1 - seg.q0 == seg.k1 - seg.k0:
        window, causal = with_causal(window, False)
        return None, window, causal
    inside = keep(seg, window, device)
    mask = None if inside is None else inside.expand(1, heads, *inside.shape)
    return mask, NO_WINDOW, False
