"""Attention problems for property-based tests: a hypothesis strategy of valid SDPA calls.

``attention_problems()`` draws shapes, GQA ratios, masks (with fully-masked rows), causal, scale and
transposed layouts within caller-set bounds; an ``AttentionProblem`` makes fresh random inputs for
it. Re-exported by ``dash_inductor.testing``, which is where users import it from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

MASK_KINDS = ("none", "bool", "float")
#: How a mask broadcasts: (B, Hq, L, S), (B, 1, L, S), (1, Hq, L, S) or (L, S).
MASK_SHAPES = ("full", "batch", "heads", "2d")
#: "transposed" inputs are (B, H, L, E) views of contiguous (B, L, H, E) tensors.
LAYOUTS = ("contiguous", "transposed")


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Leaf tensors of one attention call; ``args`` is SDPA's positional order."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None

    @property
    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.query, self.key, self.value, self.attn_mask

    def cast(self, dtype: torch.dtype) -> AttentionInputs:
        """The same values in ``dtype`` as fresh leaves (float masks follow; bool masks stay)."""
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).requires_grad_(t.requires_grad)
        mask = self.attn_mask
        if mask is not None and mask.is_floating_point():
            mask = mask.to(dtype)
        return AttentionInputs(leaf(self.query), leaf(self.key), leaf(self.value), mask)


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """One SDPA problem: shapes and options, never tensors (``make_inputs`` draws those)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype = torch.float32
    is_causal: bool = False
    mask: str = "none"
    mask_shape: str = "full"
    masked_rows: tuple[int, ...] = ()
    scale: float | None = None
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "v_head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"AttentionProblem.{name} must be a positive int, "
                                 f"got {getattr(self, name)!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"AttentionProblem.q_heads ({self.q_heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads})")
        for name, choices in (("mask", MASK_KINDS), ("mask_shape", MASK_SHAPES),
                              ("layout", LAYOUTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"AttentionProblem.{name} must be one of {choices}, "
                                 f"got {getattr(self, name)!r}")
        if self.is_causal and self.mask != "none":
            raise ValueError("AttentionProblem: SDPA takes either attn_mask or is_causal, not both")
        if self.masked_rows and self.mask == "none":
            raise ValueError("AttentionProblem.masked_rows needs mask='bool' or 'float'")
        if any(not 0 <= row < self.q_len for row in self.masked_rows):
            raise ValueError(f"AttentionProblem.masked_rows must lie in [0, {self.q_len}), "
                             f"got {self.masked_rows}")

    @property
    def enable_gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def __str__(self) -> str:
        mask = "no mask" if self.mask == "none" else f"{self.mask} mask {self.mask_shape}"
        if self.masked_rows:
            mask += f" fully-masked rows {list(self.masked_rows)}"
        return (f"B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} L={self.q_len} "
                f"S={self.kv_len} E={self.head_dim} Ev={self.v_head_dim} "
                f"{str(self.dtype).removeprefix('torch.')} {'causal' if self.is_causal else 'full'}"
                f" {mask} scale={self.scale} {self.layout}")

    def sdpa_kwargs(self) -> dict[str, Any]:
        """Keyword arguments shared by SDPA and ``dash_inductor.attention``."""
        return {"is_causal": self.is_causal, "scale": self.scale, "enable_gqa": self.enable_gqa}

    def batch_in_dims(self) -> tuple[int | None, ...]:
        """``in_dims`` for ``assert_batch_invariant(fn, inputs.args, ...)``."""
        mask_dim = 0 if self.mask != "none" and self.mask_shape in ("full", "batch") else None
        return 0, 0, 0, mask_dim

    def make_inputs(self, device: str | torch.device = "cpu", seed: int = 0, *,
                    dtype: torch.dtype | None = None,
                    requires_grad: bool = True) -> AttentionInputs:
        """Fresh random inputs, a pure function of (problem, seed, dtype), on ``device``."""
        dtype = dtype or self.dtype
        gen = torch.Generator().manual_seed(seed)

        def tensor(heads: int, length: int, dim: int) -> torch.Tensor:
            t = torch.randn(self.batch, length, heads, dim, generator=gen)
            t = t.to(device=device, dtype=dtype).transpose(1, 2)
            if self.layout == "contiguous":
                t = t.contiguous()
            return t.detach().requires_grad_(requires_grad)

        q = tensor(self.q_heads, self.q_len, self.head_dim)
        k = tensor(self.kv_heads, self.kv_len, self.head_dim)
        v = tensor(self.kv_heads, self.kv_len, self.v_head_dim)
        return AttentionInputs(q, k, v, self._make_mask(gen, device, dtype))

    def _make_mask(self, gen: torch.Generator, device: str | torch.device,
                   dtype: torch.dtype) -> torch.Tensor | None:
        if self.mask == "none":
            return None
        batch, heads = self.batch, self.q_heads
        lead = {"full": (batch, heads), "batch": (batch, 1), "heads": (1, heads), "2d": ()}
        shape = (*lead[self.mask_shape], self.q_len, self.kv_len)
        rows = list(self.masked_rows)
        if self.mask == "bool":
            mask = torch.rand(shape, generator=gen) < 0.75
            mask[..., rows, :] = False
        else:
            mask = torch.randn(shape, generator=gen)
            mask[torch.rand(shape, generator=gen) < 0.15] = float("-inf")
            mask[..., rows, :] = float("-inf")
            mask = mask.to(dtype)
        return mask.to(device)


def _lengths(low: int, high: int, tile: int) -> st.SearchStrategy[int]:
    """Lengths in [low, high], often at tile edges (1, tile +- 1, 2 * tile +- 1)."""
    edges = [x for x in (1, tile - 1, tile, tile + 1, 2 * tile - 1, 2 * tile + 1, low, high)
             if low <= x <= high]
    return st.one_of(st.sampled_from(sorted(set(edges))), st.integers(low, high))


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"attention_problems: {name} must be (low, high) with 1 <= low <= high, "
                         f"got {bounds!r}")


def attention_problems(
    *, batch: tuple[int, int] = (1, 2), q_heads: tuple[int, int] = (1, 4),
    gqa_ratios: Sequence[int] = (1, 2, 4), q_len: tuple[int, int] = (1, 40),
    kv_len: tuple[int, int] = (1, 40), head_dims: Sequence[int] = (8, 16, 32),
    v_head_dims: Sequence[int] | None = None, dtypes: Sequence[torch.dtype] = (torch.float32,),
    causal: Sequence[bool] = (False, True), masks: Sequence[str] = MASK_KINDS,
    mask_shapes: Sequence[str] = MASK_SHAPES, layouts: Sequence[str] = LAYOUTS,
    scales: Sequence[float | None] = (None, 0.0625, 0.3, 1.0),
    fully_masked_rows: bool = True, tile: int = 16,
) -> st.SearchStrategy[AttentionProblem]:
    """A strategy of ``AttentionProblem``s valid for SDPA, within the given bounds.

    Ranges are inclusive ``(low, high)``; ``gqa_ratios`` are the allowed Hq/Hkv (Hq is a multiple);
    ``v_head_dims`` defaults to ``head_dims``; ``tile`` steers lengths toward tile edges. A problem
    has a mask or is causal, never both (SDPA takes one or the other): ``causal=(True,)`` draws
    only causal problems without masks.
    """
    for name, bounds in (("batch", batch), ("q_heads", q_heads), ("q_len", q_len),
                         ("kv_len", kv_len)):
        _check_range(name, bounds)
    heads = [(hq, hq // r) for hq in range(q_heads[0], q_heads[1] + 1) for r in gqa_ratios
             if r >= 1 and hq % r == 0]
    if not heads:
        raise ValueError(f"attention_problems: no head count in {q_heads} is a multiple of a "
                         f"ratio in gqa_ratios={tuple(gqa_ratios)}")
    for name, values, choices in (("masks", masks, MASK_KINDS), ("layouts", layouts, LAYOUTS),
                                  ("mask_shapes", mask_shapes, MASK_SHAPES)):
        if not values or any(v not in choices for v in values):
            raise ValueError(f"attention_problems: {name} must be a non-empty subset of "
                             f"{choices}, got {tuple(values)!r}")
    # causal problems take no mask: draw "causal" or a mask kind (including "none") as one choice
    kinds = ["causal"] * (True in causal) + list(masks) * (False in causal)
    if not kinds:
        raise ValueError(f"attention_problems: causal must hold True and/or False, got {causal!r}")
    if not head_dims or any(d < 1 for d in head_dims):
        raise ValueError(f"attention_problems: head_dims must be positive, got {head_dims!r}")

    @st.composite
    def draw_problem(draw: Callable[[st.SearchStrategy[Any]], Any]) -> AttentionProblem:
        hq, hkv = draw(st.sampled_from(heads))
        length = draw(_lengths(*q_len, tile))
        kind = draw(st.sampled_from(kinds))
        is_causal, mask = kind == "causal", "none" if kind == "causal" else kind
        rows: tuple[int, ...] = ()
        if mask != "none" and fully_masked_rows:
            drawn = draw(st.lists(st.integers(0, length - 1), max_size=2, unique=True))
            rows = tuple(sorted(drawn))
        return AttentionProblem(
            batch=draw(st.integers(*batch)), q_heads=hq, kv_heads=hkv, q_len=length,
            kv_len=draw(_lengths(*kv_len, tile)), head_dim=draw(st.sampled_from(list(head_dims))),
            v_head_dim=draw(st.sampled_from(list(v_head_dims or head_dims))),
            dtype=draw(st.sampled_from(list(dtypes))), is_causal=is_causal, mask=mask,
            mask_shape=draw(st.sampled_from(list(mask_shapes))) if mask != "none" else "full",
            masked_rows=rows, scale=draw(st.sampled_from(list(scales))),
            layout=draw(st.sampled_from(list(layouts))))

    return draw_problem()
