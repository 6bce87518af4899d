"""DTensor sharding rules for dash's ops (``dash::attention``, ``dash::varlen_attention`` and
their backward ops).

Without a rule, DTensor has no strategy for a custom op and tensor parallelism stops at attention.
These rules offer what attention can compute locally with no communication: heads sharded (the
tensor-parallel layout; GQA key/value heads sharded in step with the query heads), batch sharded
(dense inputs only), or everything replicated. For any other input placement (sequence sharded,
``Partial``), DTensor redistributes the inputs to the cheapest of these. The remaining arguments
(``is_causal``, ``scale``, ``enable_gqa``, ``window_size``, the backward's choices) pass through to
the local op unchanged.

They are registered with ``torch.distributed.tensor.experimental.register_sharding`` (public,
experimental; torch 2.13 has it, and it is feature-detected) when ``torch.distributed.tensor`` is
imported, so importing dash_inductor does not import DTensor for programs that never use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dash_inductor.integrations.import_hook import after_import

#: One single-mesh-dim strategy: (output placements, input placements), as register_sharding takes.
Strategy = tuple[list[Any], list[Any]]
_registered = False


def api() -> Callable[..., Any] | None:
    """``register_sharding`` if this PyTorch has DTensor and the custom-op sharding API."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:
        return None
    return register_sharding


def install() -> None:
    """Register the rules once ``torch.distributed.tensor`` is imported (now, if it already is)."""
    if torch.distributed.is_available():
        after_import("torch.distributed.tensor", lambda _module: register())


def register() -> bool:
    """Register the rules for dash's ops now; False where PyTorch has no API for it."""
    global _registered
    register_sharding = api()
    if register_sharding is None:
        return False
    if not _registered:
        register_sharding(torch.ops.dash.attention.default)(forward_rule)
        register_sharding(torch.ops.dash.attention_backward.default)(backward_rule)
        register_sharding(torch.ops.dash.attention_mask_grad.default)(mask_grad_rule)
        if hasattr(torch.ops.dash, "varlen_attention"):
            register_sharding(torch.ops.dash.varlen_attention.default)(varlen_forward_rule)
            register_sharding(torch.ops.dash.varlen_attention_backward.default)(
                varlen_backward_rule)
        _registered = True
    return True


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


class _Layout:
    """Where the batch and head dims of q, k and the mask are, and which shardings keep every
    query head with its key/value head and every sequence with its keys."""

    def __init__(self, q: Any, k: Any, mask: Any, packed: bool = False) -> None:
        self.q_shape, self.k_shape = tuple(q.shape), tuple(k.shape)
        self.mask_shape = None if mask is None else tuple(mask.shape)
        self.mesh_size = q.mesh.size()
        self.packed = packed  # varlen: (T, H, E), sequences packed along T
        # Dense: (B, H, L, E) or (H, L, E), the head dim also of out and logsumexp.
        self.head = 1 if packed else len(self.q_shape) - 3

    def kv_dim(self, dim: int) -> str | None:
        """"shard" or "replicate" for key/value along q's ``dim`` (batch or heads), or None when
        sharding that dim cannot be computed locally."""
        nq, nk = self.q_shape[dim], self.k_shape[dim]
        if nk == nq:
            return "shard"
        if nk == 1:
            return "replicate"  # one key/value head (or sequence) shared by all: every rank has it
        if dim == self.head and nq % nk == 0 and nk % self.mesh_size == 0:
            # GQA: each rank's query heads must map onto its own key/value heads. Uneven chunks
            # would not, so the KV heads must divide evenly; on a mesh of several dims this asks
            # for the whole mesh size (the rule cannot tell which mesh dims shard heads).
            return "shard"
        return None

    def mask_dim(self, dim: int) -> int | None:
        """The mask's dim aligned with q's ``dim``, or None where the mask broadcasts over it."""
        if self.mask_shape is None:
            return None
        index = dim - (len(self.q_shape) - len(self.mask_shape))
        if index < 0 or self.mask_shape[index] == 1:
            return None
        return index

    def dims(self) -> list[int]:
        """q's dims that can be sharded: heads, and batch for 4-D inputs (packed sequences
        cannot be split at shard boundaries, so varlen shards heads only)."""
        candidates = [self.head] + ([0] if len(self.q_shape) == 4 and not self.packed else [])
        return [d for d in candidates if self.kv_dim(d) is not None]


def _sides(layout: _Layout, dim: int) -> tuple[Any, Any, Any]:
    """Placements of (q-like tensors, k/v, mask) when q is sharded on ``dim``."""
    _, replicate, shard = _placements()
    kv = shard(dim) if layout.kv_dim(dim) == "shard" else replicate()
    mask_dim = layout.mask_dim(dim)
    mask = None if layout.mask_shape is None else (
        replicate() if mask_dim is None else shard(mask_dim))
    return shard(dim), kv, mask


def forward_rule(q, k, v, attn_mask=None, *_args, **_kwargs) -> list[Strategy]:
    """(out, logsumexp) from (q, k, v, attn_mask): replicated, or sharded like q on heads or
    batch; logsumexp, shaped (B, Hq, L), shares q's batch and head dims."""
    _, replicate, _ = _placements()
    layout = _Layout(q, k, attn_mask)
    mask = None if attn_mask is None else replicate()
    strategies = [([replicate(), replicate()], [replicate(), replicate(), replicate(), mask])]
    for dim in layout.dims():
        q_side, kv_side, mask_side = _sides(layout, dim)
        strategies.append(([q_side, q_side], [q_side, kv_side, kv_side, mask_side]))
    return strategies


def backward_rule(grad_out, q, k, v, out, logsumexp, attn_mask, *_args,
                  **_kwargs) -> list[Strategy]:
    """(dq, dk, dv): sharded like their inputs. A replicated key/value shared by sharded query
    heads (or sequences) gets a partial gradient on each rank, summed when DTensor reduces it."""
    partial, replicate, _ = _placements()
    layout = _Layout(q, k, attn_mask)
    mask = None if attn_mask is None else replicate()
    everything = [replicate()] * 6
    strategies = [([replicate()] * 3, everything + [mask])]
    for dim in layout.dims():
        q_side, kv_side, mask_side = _sides(layout, dim)
        grad_kv = partial() if layout.kv_dim(dim) == "replicate" else kv_side
        strategies.append(([q_side, grad_kv, grad_kv],
                           [q_side, q_side, kv_side, kv_side, q_side, q_side, mask_side]))
    return strategies


def mask_grad_rule(grad_out, q, k, v, out, logsumexp, attn_mask, *_args,
                   **_kwargs) -> list[Strategy]:
    """The float mask's gradient: sharded with the mask, or partial where the mask broadcasts
    over the sharded dim (each rank sums over its own heads or sequences)."""
    partial, replicate, _ = _placements()
    layout = _Layout(q, k, attn_mask)
    strategies = [([replicate()], [replicate()] * 7)]
    for dim in layout.dims():
        q_side, kv_side, mask_side = _sides(layout, dim)
        grad_mask = partial() if layout.mask_dim(dim) is None else mask_side
        strategies.append(([grad_mask],
                           [q_side, q_side, kv_side, kv_side, q_side, q_side, mask_side]))
    return strategies


def varlen_forward_rule(query, key, value, cu_seq_q, cu_seq_k, *_args,
                        **_kwargs) -> list[Strategy]:
    """(out, logsumexp) of packed (T, H, E) sequences: replicated, or sharded on heads, with
    the offsets replicated; logsumexp is (H, T), so its heads are dim 0."""
    _, replicate, shard = _placements()
    layout = _Layout(query, key, None, packed=True)
    strategies = [([replicate()] * 2, [replicate()] * 5)]
    if layout.head in layout.dims():
        q_side, kv_side, _ = _sides(layout, layout.head)
        strategies.append(([q_side, shard(0)],
                           [q_side, kv_side, kv_side, replicate(), replicate()]))
    return strategies


def varlen_backward_rule(grad_out, query, key, value, out, logsumexp, cu_seq_q, cu_seq_k,
                         *_args, **_kwargs) -> list[Strategy]:
    """(dq, dk, dv) of packed sequences, as ``backward_rule`` for the heads layout."""
    partial, replicate, shard = _placements()
    layout = _Layout(query, key, None, packed=True)
    strategies = [([replicate()] * 3, [replicate()] * 8)]
    if layout.head in layout.dims():
        q_side, kv_side, _ = _sides(layout, layout.head)
        grad_kv = partial() if layout.kv_dim(layout.head) == "replicate" else kv_side
        strategies.append(([q_side, grad_kv, grad_kv],
                           [q_side, q_side, kv_side, kv_side, q_side, shard(0), replicate(),
                            replicate()]))
    return strategies
