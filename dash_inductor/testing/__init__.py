"""Public helpers to check attention (or a whole model) for bitwise reproducibility.

- ``attention_problems()``: a hypothesis strategy of valid SDPA problems (shapes, GQA, masks with
  fully-masked rows, causal, scale, transposed layouts) drawn within caller-set bounds.
- ``assert_bitwise_reproducible``: repeated runs (forward and backward) give the same bits.
- ``assert_batch_invariant``: each sequence gives the same bits alone and inside its batch.
- ``assert_process_reproducible``: a fresh Python process gives the same bits.

A failure names the first differing tensor (an output, or the gradient of an argument or a
parameter), its index and both values with their bit patterns.

Accuracy, by FlashAttention's rule (our error at most twice PyTorch's own in the same dtype, plus
1e-3): ``assert_flash_rule`` and ``flash_rule_errors``, with the references from
``sdpa_math_reference`` and ``low_precision_math_sdpa``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dash_inductor.testing.problems import (LAYOUTS, MASK_KINDS, MASK_SHAPES, AttentionInputs, AttentionProblem,
                                            attention_problems)

__all__ = [
    "MASK_KINDS", "MASK_SHAPES", "LAYOUTS", "AttentionInputs", "AttentionProblem",
    "attention_problems", "assert_bitwise_equal", "assert_bitwise_reproducible",
    "assert_batch_invariant", "assert_process_reproducible", "tensor_digests",
    "FLASH_RULE_ATOL", "FLASH_RULE_NAMES", "FlashRuleCheck", "assert_flash_rule",
    "flash_rule_errors", "low_precision_math_sdpa", "sdpa_math_reference",
]

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
    from dash_inductor import config

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
    from dash_inductor import config

    meta = json.loads(meta_json)
    for name, value in meta["config"].items():
        setattr(config, name, value)
    enabled, warn_only = meta["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    job = torch.load(meta["payload"], weights_only=False)
    results, _ = _run(job["fn"], job["args"], job["kwargs"],
                      lambda outs: _random_like(outs, job["grad_seed"]))
    torch.save({name: t.detach().cpu() for name, t in results.items()}, meta["result"])


# --- accuracy: FlashAttention's rule ----------------------------------------------------------

#: The rule's absolute slack, and the outputs it is checked on by default.
FLASH_RULE_ATOL = 1e-3
FLASH_RULE_NAMES = ("out", "dq", "dk", "dv")


@contextlib.contextmanager
def low_precision_math_sdpa() -> Iterator[None]:
    """Inside this block SDPA's math backend computes fp16/bf16 inputs in their own dtype.

    Since PyTorch 2.5 the math backend upcasts fp16/bf16 inputs to float32 and rounds only its
    results, which makes it a float32 reference, not a low-precision one. FlashAttention's tests
    compare kernels against a reference computed in the inputs' dtype; this block gives that one.
    The flag is read when the forward runs (its backward follows the recorded operations) and
    float32/float64 inputs are unaffected. The previous setting comes back on exit.
    """
    backend = torch.backends.cuda
    allow = getattr(backend, "allow_fp16_bf16_reduction_math_sdp", None)
    allowed = getattr(backend, "fp16_bf16_reduction_math_sdp_allowed", None)
    if allow is None or allowed is None:
        raise RuntimeError(
            f"low_precision_math_sdpa: torch {torch.__version__} has no "
            f"torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp; SDPA's math backend cannot "
            f"be made to compute in fp16/bf16, so FlashAttention's low-precision reference is "
            f"not available")
    previous = allowed()
    allow(True)
    try:
        yield
    finally:
        allow(previous)


def sdpa_math_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        grad_out: torch.Tensor, dtype: torch.dtype, **sdpa_kwargs: Any,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, dq, dk, dv)`` of SDPA's math backend on copies of the inputs cast to ``dtype``.

    ``sdpa_kwargs`` go to ``scaled_dot_product_attention`` (``is_causal``, ``attn_mask``,
    ``enable_gqa``, ``scale``; a float mask is cast to ``dtype`` too). fp16/bf16 are computed in
    that dtype (``low_precision_math_sdpa``): the rule's ``same``; float32 gives its ``ref``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    mask = sdpa_kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        sdpa_kwargs = {**sdpa_kwargs, "attn_mask": mask.to(dtype)}
    with low_precision_math_sdpa(), sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, **sdpa_kwargs)
        grads = torch.autograd.grad(out, leaves, grad_out.to(dtype), allow_unused=True)
    dq, dk, dv = (g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))
    return out.detach(), dq, dk, dv


class FlashRuleCheck(NamedTuple):
    """One output's errors against the reference ``ref``: ours, and PyTorch's in ``same``."""

    name: str
    error: float  # max |ours - ref|
    same_error: float  # max |same - ref|

    @property
    def bound(self) -> float:
        return 2 * self.same_error + FLASH_RULE_ATOL

    @property
    def ok(self) -> bool:
        return self.error <= self.bound  # False when either error is NaN

    def __str__(self) -> str:
        return (f"{self.name}: max|ours - ref| {self.error:.3g} "
                f"{'<=' if self.ok else '>'} 2 * max|same - ref| {self.same_error:.3g} + "
                f"{FLASH_RULE_ATOL:g} = {self.bound:.3g}")


def _max_error(name: str, a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.shape != ref.shape:
        raise ValueError(f"flash_rule_errors: {name}: shapes differ: {tuple(a.shape)} vs "
                         f"reference {tuple(ref.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - ref.detach().to(a.device).double()).abs().max().item()


def flash_rule_errors(ours: Sequence[torch.Tensor], same: Sequence[torch.Tensor],
                      ref: Sequence[torch.Tensor], *, names: Sequence[str] = FLASH_RULE_NAMES,
                      ) -> list[FlashRuleCheck]:
    """Per output, ``max|ours - ref|`` and ``max|same - ref|`` (in float64), by name.

    ``ref``: SDPA's math backend in float32; ``same``: the same in the inputs' dtype, computed in
    that dtype (``sdpa_math_reference``). A NaN anywhere gives a NaN error, which fails the rule.
    """
    if not len(ours) == len(same) == len(ref) == len(names):
        raise ValueError(f"flash_rule_errors: {len(ours)} outputs, {len(same)} same-dtype and "
                         f"{len(ref)} reference tensors for the {len(names)} names {tuple(names)}")
    return [FlashRuleCheck(name, _max_error(name, a, r), _max_error(name, s, r))
            for name, a, s, r in zip(names, ours, same, ref)]


def assert_flash_rule(ours: Sequence[torch.Tensor], same: Sequence[torch.Tensor],
                      ref: Sequence[torch.Tensor], *, names: Sequence[str] = FLASH_RULE_NAMES,
                      what: str = "") -> list[FlashRuleCheck]:
    """FlashAttention's accuracy rule, per output: max|ours - ref| <= 2 max|same - ref| + 1e-3.

    The failure names every output that breaks it, with the numbers, after ``what``.
    Returns the errors (see ``flash_rule_errors``).
    """
    errors = flash_rule_errors(ours, same, ref, names=names)
    failed = [e for e in errors if not e.ok]
    if failed:
        lines = "".join(f"\n  {e}" for e in failed)
        raise AssertionError(f"{what + ': ' if what else ''}FlashAttention's accuracy rule "
                             f"fails:{lines}")
    return errors
