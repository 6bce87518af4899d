"""What the benchmarks measure: the problem grid, the attention implementations, and the timers.

Shared by the grid runner (run.py) and the pytest-benchmark suite (test_bench_attention.py) so both
measure the same thing the same way (docs/benchmarks.md's protocol): random bf16 inputs, one
process, one GPU, ``triton.testing.do_bench`` medians, FLOPs counted as FlashAttention does
(forward 4*B*H*N^2*D, halved when causal; backward 2.5x the forward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Callable, ContextManager, Iterator

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402  (after the cuBLAS setting, which must precede CUDA's start)
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import dash_inductor  # noqa: E402
from dash_inductor.library.op import last_plans  # noqa: E402
from dash_inductor.ops import catalog  # noqa: E402
from dash_inductor.ops.shared import native  # noqa: E402

TOKENS = 16384  #: B * N of every grid problem
WIDTH = 2048  #: H * D of every grid problem
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
GQA_SEQS = (4096, 8192)
GQA_GROUP = 4
SCHEDULES = catalog.NAMES


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention shape: q (B, Hq, N, D), k and v (B, Hkv, N, D)."""

    batch: int
    heads_q: int
    heads_kv: int
    seq: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.bfloat16

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def flops_forward(self) -> float:
        flops = 4.0 * self.batch * self.heads_q * self.seq ** 2 * self.head_dim
        return flops / 2 if self.causal else flops

    @property
    def flops_backward(self) -> float:
        return 2.5 * self.flops_forward

    @property
    def label(self) -> str:
        gqa = f" gqa{self.group}" if self.group > 1 else ""
        return f"d{self.head_dim} {'causal' if self.causal else 'full'}{gqa} N={self.seq}"

    def as_dict(self) -> dict[str, object]:
        fields = dataclasses.asdict(self)
        fields["dtype"] = str(self.dtype).removeprefix("torch.")
        return fields


def grid(quick: bool = False, head_dims: tuple[int, ...] = (64, 128),
         seqs: tuple[int, ...] = SEQS) -> list[Problem]:
    """The grid of docs/benchmarks.md (or, quick, a few of its configs for a smoke run)."""
    if quick:
        head_dims, seqs = head_dims[-1:], (1024, 4096)
    problems = []
    for head_dim in head_dims:
        heads = WIDTH // head_dim
        for causal in (False, True):
            for seq in seqs:
                problems.append(Problem(TOKENS // seq, heads, heads, seq, head_dim, causal))
            for seq in GQA_SEQS if not quick else ():
                if seq in seqs:
                    problems.append(Problem(TOKENS // seq, heads, heads // GQA_GROUP, seq,
                                            head_dim, causal))
    if quick:
        problems.append(Problem(TOKENS // 4096, WIDTH // 128, WIDTH // 128 // GQA_GROUP, 4096,
                                128, True))
    return problems


def make_inputs(problem: Problem, device: str = "cuda", seed: int = 0
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random q, k, v (requiring grad) and an upstream gradient, never zeros."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(heads: int) -> Tensor:
        shape = (problem.batch, heads, problem.seq, problem.head_dim)
        return torch.randn(shape, device=device, dtype=problem.dtype, generator=generator)

    q, k, v = randn(problem.heads_q), randn(problem.heads_kv), randn(problem.heads_kv)
    grad_out = randn(problem.heads_q)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


@dataclasses.dataclass(frozen=True)
class Method:
    """An attention implementation and the modes it runs under.

    ``schedule`` is dash's backward schedule (None for the baselines); ``deterministic`` is the
    ``torch.use_deterministic_algorithms`` mode during forward and backward.
    """

    name: str
    title: str
    deterministic: bool
    schedule: str | None = None

    @property
    def is_dash(self) -> bool:
        return self.schedule is not None


SDPA_OFF = Method("sdpa_off", "SDPA, determinism off", False)
#: FlashAttention-4 (CuTe DSL), when ``flash_attn.cute`` imports: an optional peer, not a
#: dependency. Its own ``deterministic`` flag picks its ordered dQ backward.
FA4 = Method("fa4", "FlashAttention-4", False)
FA4_DET = Method("fa4_det", "FlashAttention-4, deterministic", False)
SDPA_ON = Method("sdpa_on", "SDPA, determinism on", True)
FLEX = Method("flex", "FlexAttention (compiled)", False)
BASELINES = (SDPA_OFF, SDPA_ON, FLEX)
DASH = tuple(Method(f"dash_{s}", f"dash {s}", catalog.get(s).deterministic, s) for s in SCHEDULES)
METHODS = BASELINES + DASH
DASH_AUTO = Method("dash_auto", "dash (auto schedule)", True, "auto")


@contextlib.contextmanager
def determinism(enabled: bool, warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(enabled, warn_only=...)`` for the block, restored
    afterwards."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def compile_own(fn: Callable[..., Any], name: str, **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)`` under a code object of its own. Dynamo keeps compiled
    graphs per code object and guards neither on a model instance nor on dash's rewrite setting,
    so two variants compiled from one function or model class under determinism would otherwise
    both run the first one's graph (SDPA with the rewrite off, say, in place of dash)."""
    def own(*args: Any) -> Any:
        return fn(*args)

    own.__code__ = own.__code__.replace(co_name="compiled_" + re.sub(r"\W", "_", name))
    return torch.compile(own, **options)


def sdpa_pinned(backend_name: str) -> Callable[..., Tensor]:
    """SDPA with one of PyTorch's kernels pinned (``sdpa_kernel``), resolved once, not per call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def _sdpa(backend_name: str) -> Callable[[Tensor, Tensor, Tensor, Problem], Tensor]:
    pinned = sdpa_pinned(backend_name)

    def run(q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> Tensor:
        return pinned(q, k, v, is_causal=problem.causal, enable_gqa=problem.group > 1)

    return run


def fa4_available() -> bool:
    """Whether FlashAttention-4's CuTe interface imports here (a GPU machine it was installed on)."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception:  # not installed, or its CUDA libraries are missing
        return False
    return True


def _fa4(deterministic: bool) -> Callable[[Tensor, Tensor, Tensor, Problem], Tensor]:
    from flash_attn.cute import flash_attn_func

    def run(q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> Tensor:
        result = flash_attn_func(q, k, v, causal=problem.causal, deterministic=deterministic)
        return result[0] if isinstance(result, tuple) else result

    return run


def fa4_layout(inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The same values in FlashAttention-4's (B, N, H, D) layout, contiguous, as its users hold
    them (a transposed view would time a copy inside FA4, not its kernels)."""
    return tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                 for t in inputs)


_FLEX_COMPILED: list[Callable[..., Tensor]] = []


def _flex(q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _FLEX_COMPILED:
        _FLEX_COMPILED.append(torch.compile(flex_attention, dynamic=False))
    block_mask = None
    if problem.causal:
        block_mask = _causal_block_mask(problem.seq, q.device.type, create_block_mask)
    return _FLEX_COMPILED[0](q, k, v, block_mask=block_mask, enable_gqa=problem.group > 1)


_BLOCK_MASKS: dict[tuple[int, str], object] = {}


def _causal_block_mask(seq: int, device: str, create_block_mask: Callable[..., object]) -> object:
    key = (seq, device)
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                              None, None, seq, seq, device=device)
    return _BLOCK_MASKS[key]


def _dash(q: Tensor, k: Tensor, v: Tensor, problem: Problem) -> Tensor:
    return dash_inductor.attention(q, k, v, is_causal=problem.causal, enable_gqa=problem.group > 1)


@dataclasses.dataclass
class Prepared:
    """A method bound to a problem: the callable, its mode, and what actually ran."""

    method: Method
    problem: Problem
    forward: Callable[[Tensor, Tensor, Tensor], Tensor]
    mode: Callable[[], ContextManager[None]]
    backend: str  #: the SDPA backend, "flex", or the dash schedule the kernels actually used
    #: The method's own copy of the inputs where it wants another layout (FlashAttention-4).
    inputs: tuple[Tensor, Tensor, Tensor, Tensor] | None = None


def prepare(method: Method, problem: Problem, inputs: tuple[Tensor, Tensor, Tensor, Tensor]
            ) -> Prepared:
    """Bind ``method`` to ``problem`` and run it once (forward and backward) to pick the backend.

    SDPA with determinism off prefers cuDNN and falls back to flash where cuDNN refuses the problem;
    dash reports the schedule its launcher used (it may fall back, e.g. shift to recompute).
    Raises what the implementation raises when it cannot run the problem.
    """
    own = fa4_layout(inputs) if method in (FA4, FA4_DET) else None
    q, k, v, grad_out = own or inputs

    def mode() -> ContextManager[None]:
        stack = contextlib.ExitStack()
        stack.enter_context(determinism(method.deterministic))
        if method.is_dash:
            stack.enter_context(dash_inductor.config.patch(schedule=method.schedule))
        if method is FLEX:
            # Donated buffers (a memory saving of compiled backwards) forbid
            # backward(retain_graph=True), which the backward timing needs; they do not change the
            # kernels. AOTAutograd reads the flag when it compiles and again at each backward.
            from torch._functorch import config as functorch_config

            stack.enter_context(functorch_config.patch(donated_buffer=False))
        return stack

    candidates: list[tuple[str, Callable[..., Tensor]]]
    if method is SDPA_OFF:
        candidates = [("cudnn", _sdpa("CUDNN_ATTENTION")), ("flash", _sdpa("FLASH_ATTENTION"))]
    elif method is SDPA_ON:
        candidates = [("flash", _sdpa("FLASH_ATTENTION"))]
    elif method is FLEX:
        candidates = [("flex", _flex)]
    elif method in (FA4, FA4_DET):
        candidates = [(method.name, _fa4(method is FA4_DET))]
    else:
        candidates = [(method.schedule or "", _dash)]
    errors = []
    for backend, fn in candidates:
        prepared = Prepared(method, problem, lambda a, b, c, fn=fn: fn(a, b, c, problem), mode,
                            backend, own)
        try:
            with mode():
                prepared.forward(q, k, v).backward(grad_out)
            torch.cuda.synchronize()
        except Exception as error:  # try the next backend; report all if none can run it
            errors.append(f"{backend}: {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        finally:
            for t in (q, k, v):
                t.grad = None
        if method.is_dash:  # the plan of the backward that just ran
            prepared.backend = last_plans()[-1].schedule.name
        return prepared
    raise RuntimeError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class Timing:
    """Milliseconds (do_bench medians); None where not measured."""

    forward: float | None = None
    backward: float | None = None
    forward_backward: float | None = None


def time_ms(fn: Callable[[], object], grad_to_none: list[Tensor] | None = None,
            warmup: int = 10, rep: int = 40) -> float:
    """The median of ``triton.testing.do_bench`` in ms (it synchronises and flushes L2).

    Waits for dash's C++ replayer first: it loads in a thread of its own that shares the GIL with
    the timed calls, and a grid's first problem, timed meanwhile, read 2-5x slow.
    """
    from triton.testing import do_bench

    native.load(wait=True)
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                          return_mode="median"))


def measure(prepared: Prepared, inputs: tuple[Tensor, Tensor, Tensor, Tensor], *,
            forward: bool = True, backward: bool = True, forward_backward: bool = False,
            warmup: int = 10, rep: int = 40) -> Timing:
    """Time the forward, the backward (of a retained graph) and/or both together."""
    q, k, v, grad_out = prepared.inputs or inputs
    leaves = [q, k, v]
    results: dict[str, float] = {}
    with prepared.mode():
        if forward:
            results["forward"] = time_ms(lambda: prepared.forward(q, k, v), None, warmup, rep)
        if backward:
            out = prepared.forward(q, k, v)
            results["backward"] = time_ms(lambda: out.backward(grad_out, retain_graph=True),
                                          leaves, warmup, rep)
            del out
        if forward_backward:
            results["forward_backward"] = time_ms(
                lambda: prepared.forward(q, k, v).backward(grad_out), leaves, warmup, rep)
    for t in leaves:
        t.grad = None
    return Timing(**results)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / ms / 1e9


def top_kernels(step: Callable[[], None], device: str, count: int = 12) -> dict[str, Any]:
    """One profiled ``step``: its ``count`` kernels with the most device time ("top") and the
    device time of all its kernels ("total_ms"; against the step's wall time, the idle share)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 or device != "cuda"]
    key = (lambda e: e.device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)
    top = [{"name": e.key[:120], "calls": e.count, "ms": key(e) / 1e3}
           for e in sorted(events, key=key, reverse=True)[:count]]
    self_time = (lambda e: e.self_device_time_total) if device == "cuda" else key
    return {"total_ms": sum(self_time(e) for e in events) / 1e3, "top": top}
