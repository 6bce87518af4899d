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

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .problems import (LAYOUTS, MASK_KINDS, MASK_SHAPES, AttentionInputs, AttentionProblem,
                       attention_problems)

__all__ = [
    "MASK_KINDS", "MASK_SHAPES", "LAYOUTS", "AttentionInputs", "AttentionProblem",
    "attention_problems", "assert_bitwise_equal", "assert_bitwise_reproducible",
    "assert_batch_invariant", "assert_process_reproducible", "tensor_digests",
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
