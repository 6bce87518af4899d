"""Deterministic attention in plain PyTorch, tiled by query blocks: the CPU kernel and the tests'
readable twin.

Each block of ``BLOCK_M`` query rows scores the keys its rows may see in one matrix product and
takes an exact softmax of each row (a row is whole in the tile: no online rescaling). Keys that
causality or a window hides from every row of the block are left out where that changes no value
(``_Problem.may_skip``). The backward recomputes the probabilities from the logsumexp; a block
makes its rows' dQ whole, and dK, dV add the blocks' parts in ascending block order. A sum over
keys or rows adds products of ``SUM_CHUNK`` terms in order. Accumulation is in float32 (float64
for float64 inputs), so the result depends only on the inputs (and, through MKL's products, the
thread count), never on timing.

GQA stacks the G query heads of a KV head as G * BLOCK_M rows of one product against that head:
k and v are never copied per query head, and dK, dV sum the group inside the product. Every
product and reduction stays within one (batch, KV head) and one row, and on the CPU each matrix
gets calls of its own on aligned memory (``_product``), so a sequence gets the same bits alone
or in any batch.

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
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dash_inductor.library.dropout import keep_mask
from dash_inductor.library.window import NO_WINDOW, Window, keep

if TYPE_CHECKING:
    from dash_inductor.ops.shared.dropout import Dropout

#: Query rows per block: few products per call, and little causal waste on the diagonal
#: (docs/kernels-notes.md has the measurements).
BLOCK_M = 128
#: Terms per product in a sum over keys (or, for dK and dV, query rows): a longer sum adds the
#: products of such chunks, as the kernels add their 64-key tiles, which keeps float32's error at
#: theirs. The bits depend on both sizes, so they are fixed.
SUM_CHUNK = 64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything narrower accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Block(NamedTuple):
    """Query rows [r0, r1) and the keys [c0, c1) they compute, of which every row sees
    [seen0, seen1) and some row masks the rest."""

    r0: int
    r1: int
    c0: int
    c1: int
    seen0: int
    seen1: int


def _block(r0: int, r1: int, s: int, is_causal: bool, window: Window, skip: bool) -> _Block:
    """Rows [r0, r1) and their keys: with ``skip`` those that some row sees, else all S."""
    left, right = window[0], 0 if is_causal else window[1]

    def first(i: int) -> int:
        return 0 if left < 0 else min(max(i - left, 0), s)

    def stop(i: int) -> int:
        return s if right < 0 else min(i + right + 1, s)

    c0, c1 = (first(r0), max(first(r0), stop(r1 - 1))) if skip else (0, s)
    seen0 = min(max(first(r1 - 1), c0), c1)
    return _Block(r0, r1, c0, c1, seen0, min(max(stop(r0), seen0), c1))


def _masked_as_minus_inf(masked: Tensor, dtype: torch.dtype) -> Tensor:
    """-inf where ``masked``, 0 elsewhere: the additive form of a boolean mask."""
    return torch.zeros((), dtype=dtype, device=masked.device).masked_fill(masked, -math.inf)


def _largest(t: Tensor) -> float:
    """max |t| on the host: NaN if t holds a NaN, 0 for an empty tensor."""
    if not t.numel():
        return 0.0
    low, high = torch.aminmax(t)
    return torch.maximum(-low, high).item()


#: Every matrix of a batch starts on this many bytes: MKL rounds a product differently at different
#: alignments, so a matrix must sit at the same one alone as in any batch.
_ALIGN = 64


def _empty_matrices(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty (..., R, C) tensor whose (R, C) matrices are contiguous and start aligned."""
    *batch, r, c = shape
    per = _ALIGN // dtype.itemsize
    stride = -(-r * c // per) * per
    strides = [stride * math.prod(batch[i + 1:]) for i in range(len(batch))]
    storage = torch.empty(max(math.prod(batch) * stride, 1), dtype=dtype, device=device)
    return storage.as_strided(shape, (*strides, c, 1))


def _product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for (N, R, K) and (N, K, C) batches, into aligned matrices. On the CPU one product
    per matrix: MKL picks its kernel by the batch size, so a batched product would give a matrix
    other bits alone than in a batch."""
    if a.device.type != "cpu":
        return torch.bmm(a, b)
    out = _empty_matrices((a.shape[0], a.shape[1], b.shape[2]), a.dtype, a.device)
    for i in range(a.shape[0]):
        torch.mm(a[i], b[i], out=out[i])
    return out


def _chunked_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with its sum over K taken ``SUM_CHUNK`` terms at a time, the chunks' products added
    in order. On the CPU a matrix's chunk products are one batched call: their count depends on K
    alone, so the call is the same in any batch."""
    k = a.shape[2]
    if k < 2 * SUM_CHUNK:
        return _product(a, b)
    whole = k // SUM_CHUNK * SUM_CHUNK
    parts_a = a[:, :, :whole].unflatten(2, (-1, SUM_CHUNK)).transpose(1, 2)  # (N, chunks, R, 64)
    parts_b = b[:, :whole].unflatten(1, (-1, SUM_CHUNK))
    if a.device.type != "cpu":
        out = torch.matmul(parts_a, parts_b).sum(dim=1)
    else:
        out = _empty_matrices((a.shape[0], a.shape[1], b.shape[2]), a.dtype, a.device)
        for i in range(a.shape[0]):
            torch.sum(torch.bmm(parts_a[i], parts_b[i]), dim=0, out=out[i])
    if whole < k:
        out += _product(a[:, :, whole:], b[:, whole:])
    return out


def _aligned(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A copy of ``t`` in ``dtype`` with aligned matrices (the last two dims)."""
    return _empty_matrices(tuple(t.shape), dtype, t.device).copy_(t)


class _Problem:
    """One call in the grouped layout: q-shaped tensors as (B, Hkv, G, L, D) views, k and v as
    (B * Hkv, S, D) in the accumulation dtype."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                 scale: float, window: Window, dropout: Dropout | None) -> None:
        self.acc = accumulation_dtype(q.dtype)
        b, self.heads, self.l, _ = q.shape
        self.kv_heads, self.s = k.shape[1], k.shape[2]
        self.q = self.grouped(q)
        self.k = _aligned(k, self.acc).flatten(0, 1)
        self.v = _aligned(v, self.acc).flatten(0, 1)
        self.mask = (None if mask is None
                     else self.grouped(mask.expand(b, self.heads, self.l, self.s)))
        self.is_causal, self.scale, self.window, self.dropout = is_causal, scale, window, dropout

    def grouped(self, t: Tensor) -> Tensor:
        """(B, Hq, L, D) as (B, Hkv, G, L, D): query head h is member h % G of KV head h // G."""
        return t.unflatten(1, (self.kv_heads, -1))

    def may_skip(self, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None = None,
                 out: Tensor | None = None, lse: Tensor | None = None) -> bool:
        """Whether a block may leave out the keys that all its rows mask: their terms are then
        exactly zero.

        SDPA's math backend adds masks as -inf, so a NaN or +inf score, an inf in v or dO
        (0 * inf) or a NaN logsumexp spreads through a masked key: that needs every key. The
        bounds keep every score and dP far from overflow. They are read on the host, so only on
        the CPU, where that costs no sync.
        """
        if not (self.is_causal or self.window != NO_WINDOW) or q.device.type != "cpu":
            return False
        if (self.mask is not None and self.mask.dtype != torch.bool
                and not bool((self.mask < math.inf).all())):
            return False
        if lse is not None and not bool((lse < math.inf).all()):
            return False
        bounds = [self.scale * q.shape[-1] * _largest(q) * _largest(k)]
        if grad_out is None:
            bounds.append(_largest(v))
        else:
            largest_do = _largest(grad_out)
            bounds += [v.shape[-1] * largest_do * _largest(v),
                       v.shape[-1] * largest_do * _largest(out)]
        limit = torch.finfo(self.acc).max / 4  # a product's rounding stays far inside the slack
        return all(bound < limit for bound in bounds)  # False for NaN

    def blocks(self, skip: bool) -> list[_Block]:
        """The query blocks that compute a key, in ascending order. The others' rows see none:
        their output stays zero and their logsumexp -inf."""
        blocks = (_block(r0, min(r0 + BLOCK_M, self.l), self.s, self.is_causal, self.window, skip)
                  for r0 in range(0, self.l, BLOCK_M))
        return [blk for blk in blocks if blk.c0 < blk.c1]

    def rows(self, t: Tensor, blk: _Block) -> Tensor:
        """A grouped tensor's rows of the block as one matrix per KV head: (B * Hkv, G * m, D)."""
        b, h_kv, g, _, d = t.shape
        m = blk.r1 - blk.r0
        block = _empty_matrices((b * h_kv, g * m, d), self.acc, t.device)
        block.view(b, h_kv, g, m, d).copy_(t[:, :, :, blk.r0:blk.r1])
        return block

    def scores(self, qb: Tensor, blk: _Block) -> Tensor:
        """Scaled scores (B, Hkv, G, m, c1 - c0) of the block's rows ``qb`` against its keys.

        Boolean, causal and window masks are *added* as -inf, as SDPA's math backend does, so a
        NaN or +inf score at a masked key stays NaN instead of being hidden.
        """
        r0, r1, c0, c1, seen0, seen1 = blk
        s = _product(qb, self.k[:, c0:c1].transpose(1, 2)).mul_(self.scale)
        s = s.view(*self.q.shape[:3], r1 - r0, c1 - c0)
        if self.mask is not None:
            m = self.mask[..., r0:r1, c0:c1]
            s.add_(_masked_as_minus_inf(~m, s.dtype) if m.dtype == torch.bool else m)
        for x, y in ((c0, seen0), (seen1, c1)):  # the keys that some row of the block masks
            if x < y:
                s[..., x - c0:y - c0].add_(self._window_bias(r0, r1, x, y))
        return s

    def _window_bias(self, r0: int, r1: int, x: int, y: int) -> Tensor:
        """-inf where causality or the window hides keys [x, y) from queries [r0, r1)."""
        rows = torch.arange(r0, r1, device=self.k.device)[:, None]
        cols = torch.arange(x, y, device=self.k.device)[None, :]
        reach = r1 + y  # a side this long masks nothing here; capped so that int64 never overflows
        left, right = self.window
        side = (min(left, reach), 0 if self.is_causal else min(right, reach))
        return _masked_as_minus_inf(~keep(rows, cols, side), self.acc)

    def kept(self, blk: _Block) -> Tensor | None:
        """The dropout keep mask of the block's tile (B, Hkv, G, m, c1 - c0), or None."""
        if self.dropout is None:
            return None
        shape = (self.q.shape[0], self.heads, self.l, self.s)
        return self.grouped(keep_mask(self.dropout.rng, self.dropout.p, shape,
                                      slice(blk.c0, blk.c1), slice(blk.r0, blk.r1)))


def _matrices(t: Tensor) -> Tensor:
    """A (B, Hkv, G, m, n) tile as one (G * m, n) matrix per KV head (a view)."""
    return t.flatten(0, 1).flatten(1, 2)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                      scale: float, window: Window = NO_WINDOW,
                      dropout: Dropout | None = None) -> tuple[Tensor, Tensor]:
    """Returns ``out`` (B, Hq, L, Ev) in q's dtype and ``lse`` (B, Hq, L) in the accumulation dtype.

    Rows that see no key get ``lse = -inf`` and ``out = 0 @ v``: zero, or NaN where ``v`` holds a
    NaN or inf, as SDPA's math backend gives. A NaN or +inf score (masked or not) makes its row's
    softmax NaN, as in SDPA's; ``out`` and ``lse`` are NaN there, and the backward follows.
    """
    p = _Problem(q, k, v, mask, is_causal, scale, window, dropout)
    out = torch.zeros((*p.q.shape[:4], v.shape[-1]), dtype=p.acc, device=q.device)
    lse = torch.full(p.q.shape[:4], -math.inf, dtype=p.acc, device=q.device)
    for blk in p.blocks(p.may_skip(q, k, v)):
        s = p.scores(p.rows(p.q, blk), blk)
        row_max = s.amax(dim=-1, keepdim=True)
        # Rows that see no key keep a -inf maximum; shift them by 0 instead (no NaN). A +inf
        # maximum stays: inf - inf makes the row NaN, as in SDPA's softmax.
        probs = s.sub_(torch.where(row_max == -math.inf, 0.0, row_max)).exp_()
        row_sum = probs.sum(dim=-1, keepdim=True)
        kept = p.kept(blk)
        if kept is not None:
            probs.mul_(kept)
        o = _chunked_product(_matrices(probs), p.v[:, blk.c0:blk.c1]).view(*probs.shape[:4], -1)
        # Only a row that saw no key has row_sum == 0 (NaN is not 0: NaN rows stay NaN); its
        # row_max + log(row_sum) is -inf.
        torch.div(o, torch.where(row_sum == 0, 1.0, row_sum), out=out[..., blk.r0:blk.r1, :])
        lse[..., blk.r0:blk.r1] = (row_max + torch.log(row_sum)).squeeze(-1)
    if dropout is not None:
        out.mul_(1.0 / (1.0 - dropout.p))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _blocked_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      mask: Tensor | None, is_causal: bool, scale: float, want_mask_grad: bool,
                      window: Window, dropout: Dropout | None):
    """(dq, dk, dv, dmask) in the accumulation dtype, dk and dv per KV head; query blocks in
    ascending order."""
    p = _Problem(q, k, v, mask, is_causal, scale, window, dropout)
    do, lse = p.grouped(grad_out), p.grouped(lse.to(p.acc)[..., None])
    delta = p.grouped((grad_out.to(p.acc) * out.to(p.acc)).sum(dim=-1, keepdim=True))
    dq = torch.zeros((*p.q.shape[:4], q.shape[-1]), dtype=p.acc, device=q.device)
    dk, dv = torch.zeros_like(p.k), torch.zeros_like(p.v)
    dmask = (torch.zeros((*p.q.shape[:4], p.s), dtype=p.acc, device=q.device) if want_mask_grad
             else None)
    for blk in p.blocks(p.may_skip(q, k, v, grad_out, out, lse)):
        r0, r1, c0, c1 = blk[:4]
        qb, dob = p.rows(p.q, blk), p.rows(do, blk)
        s = p.scores(qb, blk)
        # exp(s - lse), with rows of lse = -inf (no key seen) at probability 0, not NaN; rows of
        # lse = NaN (a NaN or +inf score) give NaN, as SDPA's softmax does.
        rows_lse = lse[..., r0:r1, :]
        probs = s.sub_(torch.where(rows_lse == -math.inf, math.inf, rows_lse)).exp_()
        dp = _product(dob, p.v[:, c0:c1].transpose(1, 2)).view(probs.shape)
        kept = p.kept(blk)
        dropped = probs
        if kept is not None:  # dV sees the dropped, scaled P; dP is dropped and scaled alike
            drop_scale = 1.0 / (1.0 - dropout.p)
            dp.mul_(kept).mul_(drop_scale)
            dropped = _empty_matrices(_matrices(probs).shape, p.acc, q.device).view(probs.shape)
            torch.mul(probs, kept, out=dropped).mul_(drop_scale)
        dv[:, c0:c1] += _chunked_product(_matrices(dropped).transpose(1, 2), dob)
        ds = dp.sub_(delta[..., r0:r1, :]).mul_(probs)
        torch.mul(_chunked_product(_matrices(ds), p.k[:, c0:c1]).view(*ds.shape[:4], -1), scale,
                  out=dq[..., r0:r1, :])
        dk[:, c0:c1] += _chunked_product(_matrices(ds).transpose(1, 2), qb).mul_(scale)
        if dmask is not None:
            dmask[..., r0:r1, c0:c1] = ds
    kv_shape = (q.shape[0], p.kv_heads, p.s, -1)
    return (dq.flatten(1, 2), dk.view(kv_shape), dv.view(kv_shape),
            None if dmask is None else dmask.flatten(1, 2))


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Tensor | None, is_causal: bool, scale: float,
                       window: Window = NO_WINDOW,
                       dropout: Dropout | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) in the dtypes of q, k, v."""
    dq, dk, dv, _ = _blocked_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, False,
                                      window, dropout)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_mask_grad(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        mask: Tensor, is_causal: bool, scale: float,
                        window: Window = NO_WINDOW, dropout: Dropout | None = None) -> Tensor:
    """Gradient of an additive float mask, (B, Hq, L, S) in float32/float64 (before broadcast sums)."""
    return _blocked_backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, True, window,
                             dropout)[3]
