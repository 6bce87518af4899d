"""Deterministic blocked attention in plain PyTorch: the CPU kernel and the tests' readable twin.

Same algorithm as the Triton kernels, written for reading: the forward walks KV blocks in ascending
order with an online softmax; the backward recomputes the probabilities from the logsumexp, block by
block, and adds every partial sum in a fixed order. Accumulation is in float32 (float64 for float64
inputs), so the result depends only on the inputs, never on timing.

All functions take the canonical 4-D form that ``library.py`` produces: q (B, Hq, L, E),
k (B, Hkv, S, E), v (B, Hkv, S, Ev) with Hq a multiple of Hkv, and ``mask`` None or a bool
(True = attend) / additive float tensor broadcastable to (B, Hq, L, S). ``window`` is a
(left, right) sliding window (``dash_inductor/library/window.py``), top-left aligned like ``is_causal``.
``dropout`` is None or a ``Dropout(p, rng)``: probabilities are dropped after the softmax with the
kernels' mask (``dropout.py``) and kept ones scaled by 1 / (1 - p), as SDPA; the logsumexp is the
undropped one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dash_inductor.library.dropout import keep_mask
from dash_inductor.library.window import NO_WINDOW, Window, keep

if TYPE_CHECKING:
    from dash_inductor.ops.shared.dropout import Dropout

#: KV block size of the online softmax. Any value gives the same function up to rounding; a fixed
#: one gives the same bits every time.
BLOCK = 64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything narrower accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kv_for_query_heads(t: Tensor, n_query_heads: int) -> Tensor:
    """View KV heads per query head (GQA: query head h reads KV head h // group), no copy."""
    b, h_kv, s, d = t.shape
    group = n_query_heads // h_kv
    return t[:, :, None].expand(b, h_kv, group, s, d).reshape(b, n_query_heads, s, d)


def _operands(acc: torch.dtype, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in the accumulation dtype and contiguous (B, H, N, D), whatever their layout:
    torch.matmul folds a strided batch of one (a model's (B, N, H, D) projections, permuted)
    without a copy and a larger one with a copy, and the two products round differently, so a
    sample's bits would depend on the batch size."""
    return tuple(t.to(acc).contiguous() for t in tensors)


def _scores(q: Tensor, k_block: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
            start: int, window: Window) -> Tensor:
    """Scaled scores of all queries against keys [start, start + block), with masking applied.

    Boolean, causal and window masks are *added* as -inf, as SDPA's math backend does, so a NaN or +inf
    score at a masked key stays NaN instead of being hidden.
    """
    s = torch.matmul(q, k_block.transpose(-1, -2)) * scale
    if mask is not None:
        m = mask[..., start:start + k_block.shape[-2]]
        s = s + (_masked_as_minus_inf(~m, s.dtype) if m.dtype == torch.bool else m.to(s.dtype))
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(start, start + k_block.shape[-2], device=q.device)[None, :]
    if is_causal:
        s = s + _masked_as_minus_inf(cols > rows, s.dtype)
    inside = keep(rows, cols, window)
    if inside is not None:
        s = s + _masked_as_minus_inf(~inside, s.dtype)
    return s


def _masked_as_minus_inf(masked: Tensor, dtype: torch.dtype) -> Tensor:
    """-inf where ``masked``, 0 elsewhere: the additive form of a boolean mask."""
    return torch.zeros((), dtype=dtype, device=masked.device).masked_fill(masked, -math.inf)


def _expand_mask(mask: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    return None if mask is None else mask.expand(shape)


def _kept(dropout: Dropout | None, shape: tuple[int, ...], start: int) -> Tensor | None:
    """The keep mask of keys [start, start + BLOCK), or None without dropout."""
    if dropout is None:
        return None
    return keep_mask(dropout.rng, dropout.p, shape, slice(start, start + BLOCK))


def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                      scale: float, window: Window = NO_WINDOW,
                      dropout: Dropout | None = None) -> tuple[Tensor, Tensor]:
    """Returns ``out`` (B, Hq, L, Ev) in q's dtype and ``lse`` (B, Hq, L) in the accumulation dtype.

    Rows that see no key get ``lse = -inf`` and ``out = 0 @ v``: zero, or NaN where ``v`` holds a
    NaN or inf, as SDPA's math backend gives. A NaN or +inf score (masked or not) makes its row's
    softmax NaN, as in SDPA's; ``out`` and ``lse`` are NaN there, and the backward follows.
    """
    acc = accumulation_dtype(q.dtype)
    b, h, l, _ = q.shape
    qa, ka, va = _operands(acc, q, _kv_for_query_heads(k, h), _kv_for_query_heads(v, h))
    mask = _expand_mask(mask, (b, h, l, k.shape[-2]))
    row_max = torch.full((b, h, l, 1), -math.inf, dtype=acc, device=q.device)
    row_sum = torch.zeros((b, h, l, 1), dtype=acc, device=q.device)
    out = torch.zeros((b, h, l, v.shape[-1]), dtype=acc, device=q.device)
    for start in range(0, k.shape[-2], BLOCK):
        s = _scores(qa, ka[:, :, start:start + BLOCK], mask, is_causal, scale, start, window)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        # Rows that have seen no key yet keep a -inf maximum; shift them by 0 instead (no NaN).
        # A +inf maximum stays: inf - inf makes the row NaN, as in SDPA's softmax.
        shift = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(s - shift)
        correction = torch.exp(row_max - shift)
        row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
        kept = _kept(dropout, (b, h, l, k.shape[-2]), start)
        if kept is not None:
            p = p * kept
        out = out * correction + torch.matmul(p, va[:, :, start:start + BLOCK])
        row_max = new_max
    # Only a row that saw no key has row_sum == 0 (NaN is not 0: NaN rows stay NaN); its
    # row_max + log(row_sum) is -inf.
    out = out / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    if dropout is not None:
        out = out * (1.0 / (1.0 - dropout.p))
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return out.to(q.dtype), lse


def _probabilities(s: Tensor, lse: Tensor) -> Tensor:
    """exp(s - lse) with rows of lse = -inf (no key seen) giving probability 0, not NaN; rows
    of lse = NaN (a NaN or +inf score) give NaN, as SDPA's softmax does."""
    safe = torch.where(lse == -math.inf, math.inf, lse)
    return torch.exp(s - safe[..., None])


def _blocked_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      mask: Tensor | None, is_causal: bool, scale: float, want_mask_grad: bool,
                      window: Window, dropout: Dropout | None):
    """Per-query-head (dq, dk, dv, dmask), KV blocks in ascending order, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    b, h, l, _ = q.shape
    s_len = k.shape[-2]
    qa, doa, ka, va, outa = _operands(acc, q, grad_out, _kv_for_query_heads(k, h),
                                      _kv_for_query_heads(v, h), out)
    mask = _expand_mask(mask, (b, h, l, s_len))
    lse = lse.to(acc)
    delta = (doa * outa).sum(dim=-1, keepdim=True)
    dq = torch.zeros_like(qa)
    dk = torch.zeros_like(ka)
    dv = torch.zeros_like(va)
    dmask = torch.zeros((b, h, l, s_len), dtype=acc, device=q.device) if want_mask_grad else None
    for start in range(0, s_len, BLOCK):
        kb, vb = ka[:, :, start:start + BLOCK], va[:, :, start:start + BLOCK]
        p = _probabilities(_scores(qa, kb, mask, is_causal, scale, start, window), lse)
        dp = torch.matmul(doa, vb.transpose(-1, -2))
        kept = _kept(dropout, (b, h, l, s_len), start)
        if kept is not None:  # dV sees the dropped, scaled P; dP is dropped and scaled alike
            drop_scale = 1.0 / (1.0 - dropout.p)
            dp = dp * kept * drop_scale
            dv[:, :, start:start + BLOCK] = torch.matmul((p * kept * drop_scale).transpose(-1, -2),
                                                         doa)
        else:
            dv[:, :, start:start + BLOCK] = torch.matmul(p.transpose(-1, -2), doa)
        ds = p * (dp - delta)
        dk[:, :, start:start + BLOCK] = torch.matmul(ds.transpose(-1, -2), qa) * scale
        dq += torch.matmul(ds, kb) * scale
        if dmask is not None:
            dmask[..., start:start + BLOCK] = ds
    return dq, dk, dv, dmask


def _sum_query_heads(t: Tensor, n_kv_heads: int) -> Tensor:
    """Sum per-query-head KV gradients over each GQA group, in a fixed order."""
    b, h, s, d = t.shape
    return t.view(b, n_kv_heads, h // n_kv_heads, s, d).sum(dim=2)


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Tensor | None, is_causal: bool, scale: float,
                       window: Window = NO_WINDOW,
                       dropout: Dropout | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) in the dtypes of q, k, v."""
    dq, dk, dv, _ = _blocked_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, False,
                                      window, dropout)
    h_kv = k.shape[1]
    return (dq.to(q.dtype), _sum_query_heads(dk, h_kv).to(k.dtype),
            _sum_query_heads(dv, h_kv).to(v.dtype))


def attention_mask_grad(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        mask: Tensor, is_causal: bool, scale: float,
                        window: Window = NO_WINDOW, dropout: Dropout | None = None) -> Tensor:
    """Gradient of an additive float mask, (B, Hq, L, S) in float32/float64 (before broadcast sums)."""
    return _blocked_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, True, window,
                             dropout)[3]
