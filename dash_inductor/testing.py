"""Public helpers to check attention (or a whole model) for bitwise reproducibility.

- ``attention_problems()``: a hypothesis strategy of valid SDPA problems (shapes, GQA, masks with
  fully-masked rows, causal, scale, transposed layouts) drawn within caller-set bounds.
- ``assert_bitwise_reproducible``: repeated runs (forward and backward) give the same bits.
- ``assert_batch_invariant``: each sequence gives the same bits alone and inside its batch.
- ``assert_process_reproducible``: a fresh Python process gives the same bits.

A failure names the first differing tensor (an output, or the gradient of an argument or a
parameter), its index and both values with their bit patterns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "MASK_KINDS", "MASK_SHAPES", "LAYOUTS", "AttentionInputs", "AttentionProblem",
    "attention_problems", "assert_bitwise_equal", "assert_bitwise_reproducible",
    "assert_batch_invariant", "assert_process_reproducible", "tensor_digests",
]

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


# --- running a computation and comparing bits -------------------------------------------------

Named = list[tuple[str, torch.Tensor]]


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested tuples/lists/dicts, each with a readable path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}[{i}]")
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _tensors(item, f"{path}[{key!r}]" if path else str(key))


def _random_like(tensors: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype)
            for t in tensors]


def _run(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
         upstream: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]],
         ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Outputs and gradients of one call, by name; and the upstream gradients that were used."""
    out = fn(*args, **kwargs)
    outputs: Named = list(_tensors(out, "output"))
    results = {name: t.detach() for name, t in outputs}
    differentiable = [t for _, t in outputs if t.requires_grad]
    wrt: Named = [(f"grad of {name}", t) for name, t in
                  [*_tensors(list(args), "args"), *_tensors(dict(kwargs), "")] if t.requires_grad]
    if isinstance(fn, torch.nn.Module):
        wrt += [(f"grad of parameter {name!r}", p) for name, p in fn.named_parameters()
                if p.requires_grad]
    grad_outputs: list[torch.Tensor] = []
    if differentiable and wrt:
        grad_outputs = upstream(differentiable)
        grads = torch.autograd.grad(differentiable, [t for _, t in wrt], grad_outputs,
                                    allow_unused=True)
        results.update((name, g) for (name, _), g in zip(wrt, grads) if g is not None)
    return results, grad_outputs


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integers holding ``t``'s bit patterns (so NaN == NaN and -0.0 != 0.0)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _show(t: torch.Tensor, bits: torch.Tensor, index: tuple[int, ...]) -> str:
    pattern = int(bits[index].item()) & ((1 << (8 * bits.element_size())) - 1)
    return f"{t[index].item()!r} (0x{pattern:0{2 * bits.element_size()}x})"


def _difference(name: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` are bitwise equal, else where and how they first differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    bits_a, bits_b = _bits(a), _bits(b.to(a.device))
    if torch.equal(bits_a, bits_b):
        return None
    unequal = bits_a != bits_b
    index = tuple(unequal.nonzero()[0].tolist())
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    detail = f"{int(unequal.sum())} of {unequal.numel()} elements differ"
    if a.is_floating_point():
        gap = (a.double() - b.to(a.device).double()).abs()[unequal]
        gap = gap[~gap.isnan()]
        if gap.numel():
            detail += f", max |diff| {gap.max().item():.3g}"
    return (f"{name} differs at index {index}: {_show(a, bits_a, index)} vs "
            f"{_show(b.to(a.device), bits_b, index)} ({detail})")


def _compare(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor],
             header: str) -> None:
    if expected.keys() != actual.keys():
        raise AssertionError(f"{header}: it produced different tensors: "
                             f"{sorted(expected)} vs {sorted(actual)}")
    differences = [d for name in expected
                   if (d := _difference(name, expected[name], actual[name])) is not None]
    if differences:
        others = "".join(f"\n  also: {d.split(' differs')[0]}" for d in differences[1:])
        raise AssertionError(f"{header}:\n  {differences[0]}{others}")


def assert_bitwise_equal(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor],
                         what: str = "tensors differ") -> None:
    """Two name -> tensor maps (as the asserts here return) hold the same names and bits."""
    _compare(expected, actual, f"{what} (left: expected, right: actual)")


def assert_bitwise_reproducible(fn: Callable[..., Any], *args: Any, runs: int = 3,
                                grad_seed: int = 0, **kwargs: Any) -> dict[str, torch.Tensor]:
    """Call ``fn(*args, **kwargs)`` ``runs`` times; every output and gradient must match run 0.

    If outputs require grad, each run also back-propagates the same random upstream gradient
    (drawn from ``grad_seed``) into every argument that requires grad and, for an ``nn.Module``,
    into its parameters (via ``torch.autograd.grad``: ``.grad`` fields are left alone).
    Returns run 0's tensors by name.
    """
    if runs < 2:
        raise ValueError(f"assert_bitwise_reproducible: runs must be >= 2, got {runs}")
    first, upstream = _run(fn, args, kwargs, lambda outs: _random_like(outs, grad_seed))
    for run in range(1, runs):
        again, _ = _run(fn, args, kwargs, lambda outs: upstream)
        _compare(first, again, f"not bitwise reproducible: run {run} of {runs} differs from run 0")
    return first


def _in_dims(batch: Sequence[Any], in_dims: int | Sequence[int | None]) -> list[int | None]:
    if isinstance(in_dims, int):
        return [in_dims if isinstance(a, torch.Tensor) else None for a in batch]
    if len(in_dims) != len(batch):
        raise ValueError(f"assert_batch_invariant: in_dims has {len(in_dims)} entries for "
                         f"{len(batch)} arguments")
    return [d if isinstance(a, torch.Tensor) else None for a, d in zip(batch, in_dims)]


def assert_batch_invariant(fn: Callable[..., Any], batch: Sequence[Any], *,
                           in_dims: int | Sequence[int | None] = 0,
                           kwargs: Mapping[str, Any] | None = None, grad_seed: int = 0,
                           indices: Sequence[int] | None = None) -> None:
    """Each sequence's outputs and gradients are the same bits alone as inside the batch.

    ``batch`` holds ``fn``'s positional arguments; ``in_dims`` (like ``torch.vmap``'s) gives each
    one's batch dimension, ``None`` for arguments shared by all sequences (passed whole, their
    gradients not compared). ``kwargs`` are shared. Outputs must carry the batch in dimension 0.
    The sequence alone gets a fresh copy of its slice and its slice of the upstream gradient.
    ``indices`` limits the check to some sequences (default: all).
    """
    kwargs = dict(kwargs or {})
    dims = _in_dims(batch, in_dims)
    sizes = {a.shape[d] for a, d in zip(batch, dims) if d is not None}
    if len(sizes) != 1:
        raise ValueError(f"assert_batch_invariant: batched arguments must share one batch size "
                         f"along in_dims, got sizes {sorted(sizes)}")
    size = sizes.pop()
    full, upstream = _run(fn, batch, kwargs, lambda outs: _random_like(outs, grad_seed))
    arg_dims = {f"grad of args[{i}]": d for i, d in enumerate(dims)}
    for i in indices if indices is not None else range(size):
        alone_args = [a if d is None else
                      a.narrow(d, i, 1).detach().clone().requires_grad_(a.requires_grad)
                      for a, d in zip(batch, dims)]
        alone, _ = _run(fn, alone_args, kwargs, lambda outs: [g.narrow(0, i, 1) for g in upstream])
        expected = {}
        for name, t in full.items():
            if name.startswith("output"):
                expected[name] = t.narrow(0, i, 1)
            elif arg_dims.get(name) is not None:
                expected[name] = t.narrow(arg_dims[name], i, 1)
        alone = {name: t for name, t in alone.items() if name in expected}
        _compare(expected, alone, f"not batch invariant: sequence {i} of {size} inside the batch "
                                  f"(left) differs from the same sequence alone (right); "
                                  f"indices are within the sequence")


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's dtype, shape and bytes (strides do not matter)."""
    digests = {}
    for name, t in tensors.items():
        flat = _bits(t.detach()).cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
        header = f"{t.dtype}{tuple(t.shape)}".encode()
        digests[name] = hashlib.sha256(header + data.numpy().tobytes()).hexdigest()
    return digests


def _config_state() -> dict[str, Any]:
    from . import config

    return {name: value for name, value in vars(config).items()
            if name.islower() and not name.startswith("_")
            and isinstance(value, (bool, int, float, str))}


def assert_process_reproducible(fn: Callable[..., Any], *args: Any, grad_seed: int = 0,
                                timeout: float = 600.0, **kwargs: Any) -> dict[str, str]:
    """Run ``fn(*args, **kwargs)`` (forward and backward) here and in a fresh Python process;
    the digests of every output and gradient must match. Returns them by name.

    ``fn`` and the arguments travel by ``torch.save``: ``fn`` must be importable (a module-level
    function, a ``functools.partial`` of one, or a picklable ``nn.Module``). The child gets this
    process's ``sys.path``, environment, ``dash_inductor.config`` options and
    ``torch.use_deterministic_algorithms`` mode.
    """
    here, _ = _run(fn, args, kwargs, lambda outs: _random_like(outs, grad_seed))
    with tempfile.TemporaryDirectory(prefix="dash-repro-") as folder:
        payload, result = os.path.join(folder, "payload.pt"), os.path.join(folder, "result.pt")
        torch.save({"fn": fn, "args": args, "kwargs": kwargs, "grad_seed": grad_seed}, payload)
        meta = {"payload": payload, "result": result, "config": _config_state(),
                "deterministic": [torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()]}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "import sys, dash_inductor.testing as t; t._child_main(sys.argv[1])"
        done = subprocess.run([sys.executable, "-c", code, json.dumps(meta)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"the fresh process failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-4000:]}")
        there = torch.load(result, weights_only=True)
    ours, theirs = tensor_digests(here), tensor_digests(there)
    if ours != theirs:
        _compare(here, there, "not reproducible across processes: this process (left) and a "
                              "fresh one (right) differ")
        raise AssertionError(f"digests differ across processes: {ours} vs {theirs}")
    return ours


def _child_main(meta_json: str) -> None:
    """Entry point of the fresh process of ``assert_process_reproducible``."""
    from . import config

    meta = json.loads(meta_json)
    for name, value in meta["config"].items():
        setattr(config, name, value)
    enabled, warn_only = meta["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    job = torch.load(meta["payload"], weights_only=False)
    results, _ = _run(job["fn"], job["args"], job["kwargs"],
                      lambda outs: _random_like(outs, job["grad_seed"]))
    torch.save({name: t.detach().cpu() for name, t in results.items()}, meta["result"])
