"""Validation and canonical form of ``dash::attention``'s arguments, with SDPA's semantics.

Everything here works on real and fake tensors alike (only shapes, strides, dtypes and devices are
read), so the fake kernels raise the same errors at trace time and allocate outputs with the same
strides as the real kernels.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dash_inductor.library.window import NO_WINDOW, Window, check_window, with_causal

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Largest head dim (E and Ev) of the CUDA kernels.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Canonical:
    """Arguments in the 4-D form the kernels take, plus what is needed to map results back.

    ``q`` (B, H, L, E), ``k`` (B, Hkv, S, E), ``v`` (B, Hkv, S, Ev) and ``mask`` (B, H, L, S) may be
    ``expand``-ed views of the caller's tensors (zero strides on broadcast dims); gradients computed for
    them are summed back to the caller's shapes by ``reduce_grad``. ``window`` and ``is_causal``
    are in ``window.with_causal``'s form: a window's right side of 0 is ``is_causal``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    is_causal: bool
    scale: float
    three_d: bool
    window: Window = NO_WINDOW

    def squeeze(self, t: Tensor) -> Tensor:
        """Drop the batch dim that 3-D inputs were given."""
        return t.squeeze(0) if self.three_d else t

    def form(self) -> Form:
        """What this canonical form decided, without its tensors (no mask)."""
        return Form(self.q.shape, self.k.shape, self.v.shape, self.is_causal, self.scale,
                    self.three_d, self.window)

    def reduce_grad(self, grad4: Tensor, original: Tensor) -> Tensor:
        """Sum a gradient of an expanded 4-D view back to the caller's tensor shape, in a fixed order."""
        grad = self.squeeze(grad4)
        return grad if grad.shape == original.shape else grad.sum_to_size(original.shape)


@dataclass(frozen=True)
class Form:
    """A :class:`Canonical` without tensors: binds the caller's tensors of the same shapes (the
    saved inputs of a backward) without validating them again."""

    q_shape: torch.Size
    k_shape: torch.Size
    v_shape: torch.Size
    is_causal: bool
    scale: float
    three_d: bool
    window: Window

    def bind(self, q: Tensor, k: Tensor, v: Tensor) -> Canonical:
        q4, k4, v4 = (t.unsqueeze(0) if self.three_d else t for t in (q, k, v))
        return Canonical(_expand(q4, self.q_shape), _expand(k4, self.k_shape),
                         _expand(v4, self.v_shape), None, self.is_causal, self.scale,
                         self.three_d, self.window)


def _expand(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` broadcast to ``shape``: itself where nothing broadcasts (a view costs host time)."""
    return t if t.shape == shape else t.expand(shape)


def _fail(message: str) -> None:
    raise ValueError(f"dash.attention: {message}")


def check_not_nested(query: object, key: object, value: object,
                     where: str = "dash.attention") -> None:
    """A ValueError naming the first of query, key and value that is a nested tensor.

    The public entries call it before the op: the dispatcher rejects a nested tensor (jagged or
    strided layout) with a bare ``NotImplementedError`` before the op's own checks could run.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, Tensor) and t.is_nested:
            raise ValueError(
                f"{where}: {name} is a nested tensor (layout {t.layout}); nested tensors are not "
                f"supported. For sequences of different lengths, pack them into one "
                f"(total_tokens, heads, head_dim) tensor and call dash_inductor.varlen_attention")


def check_sdpa_flags(is_causal: object, scale: object, enable_gqa: object, where: str) -> None:
    """SDPA's scalar arguments by type, as SDPA checks them: a float in ``is_causal`` is most
    likely ``dropout_p`` passed in SDPA's order to a signature without it."""
    for name, value in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool, got {value!r} (the arguments follow "
                             f"scaled_dot_product_attention's order: query, key, value, "
                             f"attn_mask, dropout_p, is_causal, scale, enable_gqa)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"{where}: scale must be a float or None (1/sqrt(E)), got {scale!r}")


def _check_tensors(q: Tensor, k: Tensor, v: Tensor) -> None:
    check_not_nested(q, k, v)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            _fail(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4):
            _fail(f"{name} must be 3-D (H, L, E) or 4-D (B, H, L, E), got {t.dim()}-D shape "
                  f"{tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"{name} has dtype {t.dtype}; expected a floating dtype "
                  f"(float16, bfloat16, float32 or float64)")
    if not q.dim() == k.dim() == v.dim():
        _fail(f"query, key and value must have the same rank, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if not q.dtype == k.dtype == v.dtype:
        _fail(f"query, key and value must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        _fail(f"query, key and value must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"query and key must have the same head dim E, got query (..., L, {q.shape[-1]}) and "
              f"key (..., S, {k.shape[-1]})")
    if k.shape[:-1] != v.shape[:-1]:
        _fail(f"key (..., S, E) and value (..., S, Ev) must agree on all dims but the last, got key "
              f"{tuple(k.shape)} and value {tuple(v.shape)}")
    if q.shape[-1] == 0:
        _fail("the head dim E of query and key must be at least 1")
    if q.device.type == "cuda" and max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        _fail(f"head dims up to {MAX_HEAD_DIM} are supported on CUDA, got E={q.shape[-1]}, "
              f"Ev={v.shape[-1]}")


def _broadcast(name: str, a: int, b: int) -> int:
    if a != b and a != 1 and b != 1:
        _fail(f"{name} of query ({a}) and key/value ({b}) must match or one of them be 1")
    return max(a, b)


def _head_counts(hq: int, hkv: int, enable_gqa: bool) -> tuple[int, int]:
    """(output heads, KV heads as the kernels see them)."""
    if enable_gqa:
        if hkv == 0 or hq % hkv != 0:
            _fail(f"with enable_gqa=True the number of query heads ({hq}) must be a multiple of the "
                  f"number of key/value heads ({hkv})")
        return hq, hkv
    if hq == hkv or hkv == 1:
        return hq, hkv  # one KV head broadcasts to every query head: a GQA group of all heads
    if hq == 1:
        return hkv, hkv
    _fail(f"query has {hq} heads and key/value {hkv}; they must match, key/value must have 1 head, "
          f"or pass enable_gqa=True with query heads a multiple of key/value heads")
    raise AssertionError  # unreachable, for type checkers


def _check_mask(mask: Tensor, q: Tensor, target: tuple[int, ...], is_causal: bool) -> None:
    if not isinstance(mask, Tensor):
        _fail(f"attn_mask must be a Tensor or None, got {type(mask).__name__}")
    if is_causal:
        _fail("attn_mask must be None when is_causal=True (as in scaled_dot_product_attention)")
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):
        _fail(f"attn_mask must be bool (True = attend) or a float mask of dtype float32 or {q.dtype} "
              f"(the query's), got {mask.dtype}")
    if mask.device != q.device:
        _fail(f"attn_mask is on {mask.device} but query is on {q.device}")
    if mask.dim() > len(target) or any(m not in (1, t) for m, t in zip(reversed(mask.shape),
                                                                          reversed(target))):
        _fail(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the attention shape "
              f"{target} ((B, H, L, S), or (H, L, S) for 3-D inputs)")


#: Forms of unmasked calls already validated, by everything the validation reads.
_FORMS: dict[tuple, Form] = {}


def canonicalize(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, window_size: Sequence[int] = NO_WINDOW) -> Canonical:
    """Validate SDPA-style arguments and bring them to the kernels' 4-D form (views, no copies).

    An unmasked call whose shapes, dtypes, devices and flags were validated before is only bound
    (a step calls each layer's shapes again and again); symbolic shapes are always validated, and
    so is every call Dynamo traces (reading the cache there makes Dynamo guard on its contents)."""
    key = None
    if (attn_mask is None and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and not torch.compiler.is_compiling()):
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                   v.device, q.is_nested, is_causal, scale, enable_gqa, tuple(window_size))
            form = _FORMS.get(key)
        except (TypeError, RuntimeError):  # symbolic sizes do not hash; nested ones raise
            key = form = None
        if form is not None:
            return form.bind(q, k, v)
    c = _canonicalize(q, k, v, attn_mask, is_causal, scale, enable_gqa, window_size)
    if key is not None:
        if len(_FORMS) >= 1024:
            _FORMS.clear()
        _FORMS[key] = c.form()
    return c


def _canonicalize(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                  scale: float | None, enable_gqa: bool, window_size: Sequence[int]) -> Canonical:
    _check_tensors(q, k, v)
    window, causal = with_causal(check_window(window_size, "dash.attention"), bool(is_causal))
    three_d = q.dim() == 3
    q4, k4, v4 = (t.unsqueeze(0) if three_d else t for t in (q, k, v))
    batch = _broadcast("the batch size", q4.shape[0], k4.shape[0])
    heads, kv_heads = _head_counts(q4.shape[1], k4.shape[1], enable_gqa)
    l, s = q4.shape[2], k4.shape[2]
    target = (batch, heads, l, s)
    if attn_mask is not None:
        _check_mask(attn_mask, q, target[1:] if three_d else target, is_causal)
    if scale is not None and not math.isfinite(scale):
        _fail(f"scale must be a finite float or None (1/sqrt(E)), got {scale}")
    return Canonical(
        q=_expand(q4, torch.Size((batch, heads, l, q4.shape[3]))),
        k=_expand(k4, torch.Size((batch, kv_heads, s, k4.shape[3]))),
        v=_expand(v4, torch.Size((batch, kv_heads, s, v4.shape[3]))),
        mask=None if attn_mask is None else _expand(attn_mask, torch.Size(target)),
        is_causal=causal,
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        three_d=three_d,
        window=window,
    )


def empty_like_layout(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
                      ) -> Tensor:
    """An empty 4-D (B, H, L, D) tensor laid out as ``like``: (B, L, H, D) in memory when ``like`` is
    a transposed (B, L, H, D) view, as models pass, and contiguous otherwise."""
    dtype = like.dtype if dtype is None else dtype
    b, h, l, d = shape
    if like.stride(1) < like.stride(2):
        return torch.empty((b, l, h, d), dtype=dtype, device=like.device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=like.device)


class unfilled(contextlib.ContextDecorator):
    """Allocate without PyTorch's deterministic-mode fill, for buffers the kernels write in full.

    Under ``torch.use_deterministic_algorithms(True)`` every ``torch.empty`` also launches a kernel
    that fills the new memory with NaN (``torch.utils.deterministic.fill_uninitialized_memory``),
    so that a read of memory never written is reproducible. The dash kernels write every element
    of their outputs and buffers, so the fill is pure cost: eight launches and their host time a
    forward and backward. The flag is process-wide: allocations of other threads during the
    call are not filled either. A class rather than a generator: it is entered twice a call.
    """

    __slots__ = ("_restore",)

    def _recreate_cm(self) -> "unfilled":  # as a decorator: a fresh state for each (nested) call
        return type(self)()

    def __enter__(self) -> None:
        deterministic = torch.utils.deterministic
        self._restore = (deterministic.fill_uninitialized_memory
                         and torch.are_deterministic_algorithms_enabled())
        if self._restore:
            deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc: object) -> None:
        if self._restore:
            torch.utils.deterministic.fill_uninitialized_memory = True
