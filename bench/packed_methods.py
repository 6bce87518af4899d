"""What bench/packed.py measures: the packed and windowed problems, their masks, and the methods.

Each problem is attention over packed documents, causal with an optional window of ``left`` keys
back, except "full": one sequence, every query on every key (the issue's "full 16k" that a 4k
window is held against). The documents' offsets, FlexAttention's mask_mod and SDPA's dense mask all derive from
(lengths, left) through one definition (``allowed``), so every method computes the same mask.
All inputs live in (T, H, D) storage. The varlen APIs (dash's ``varlen_attention``, PyTorch's
``varlen_attn``) take their leaves as the packed (T, H, D) view, as their users hold them; the
other methods take (1, H, T, D) views of the same memory. Feeding a varlen API the (1, H, T, D)
view instead would time autograd's layout glue with it (a ``select_backward`` and a stride copy
per gradient), which the dense methods never pay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor

import dash_inductor
import methods as m
from dash_inductor.ops import catalog

Inputs = tuple[Tensor, Tensor, Tensor, Tensor]
Forward = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The problem sizes: the issue's, or tiny ones for ``--smoke``."""

    tokens: int
    width: int  #: H * D
    doc_min: int
    doc_max: int
    window: int
    seed: int = 0


FULL = Sizes(m.TOKENS, m.WIDTH, 512, 8192, 4096)
SMOKE = Sizes(512, 256, 32, 256, 128)


def pack(sizes: Sizes) -> tuple[int, ...]:
    """Document lengths in [doc_min, doc_max], drawn with ``sizes.seed``, summing to the tokens."""
    rng, lengths, left = random.Random(sizes.seed), [], sizes.tokens
    while left > sizes.doc_max:  # keep at least doc_min for the last document
        lengths.append(rng.randint(sizes.doc_min, min(sizes.doc_max, left - sizes.doc_min)))
        left -= lengths[-1]
    return (*lengths, left)


def causal_pairs(length: int, left: int) -> int:
    """Pairs (i, j) of one sequence with j <= i and i - j <= left (left < 0: no window)."""
    banded = length if left < 0 else min(length, left + 1)
    return banded * (banded + 1) // 2 + (length - banded) * (left + 1)


@dataclasses.dataclass(frozen=True)
class Case:
    """Attention over packed documents: causal with a window of ``left`` keys back (-1: none),
    or for "full" neither causal nor windowed."""

    kind: str  #: "docs", "window", "causal" or "full"
    head_dim: int
    heads: int
    lengths: tuple[int, ...]
    left: int

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def causal(self) -> bool:
        return self.kind != "full"

    @property
    def pairs(self) -> int:
        if not self.causal:
            return sum(n * n for n in self.lengths)
        return sum(causal_pairs(n, self.left) for n in self.lengths)

    @property
    def flops_forward(self) -> float:
        return 4.0 * self.heads * self.head_dim * self.pairs

    @property
    def label(self) -> str:
        what = {"docs": f"{len(self.lengths)} docs", "window": f"window {self.left}",
                "causal": "causal", "full": "full"}[self.kind]
        return f"d{self.head_dim} {what} T={self.tokens}"


def cases(sizes: Sizes, head_dims: tuple[int, ...]) -> list[Case]:
    """Per head dim: the packed documents, the windowed sequence, the same sequence causal and
    full."""
    whole = (sizes.tokens,)
    shapes = (("docs", pack(sizes), -1), ("window", whole, sizes.window), ("causal", whole, -1),
              ("full", whole, -1))
    return [Case(kind, d, sizes.width // d, lengths, left)
            for d in head_dims for kind, lengths, left in shapes]


def allowed(q_idx: Tensor, kv_idx: Tensor, doc: Tensor, left: int, causal: bool) -> Tensor:
    """The mask, shared by FlexAttention's mask_mod and SDPA's dense mask: same document, causal
    (unless not), within the window."""
    keep = doc[q_idx] == doc[kv_idx]
    keep = keep & (q_idx >= kv_idx) if causal else keep
    return keep if left < 0 else keep & (q_idx - kv_idx <= left)


class Skipped(Exception):
    """The method cannot run here (not a failure): the message says why."""


def _packed(x: Tensor) -> Tensor:
    """(1, H, T, D) over (T, H, D) storage -> the (T, H, D) view varlen APIs take."""
    return x[0].transpose(0, 1)


@dataclasses.dataclass
class Setup:
    """What the methods of one case share: device, offsets, document ids, the dense mask."""

    case: Case
    device: str
    cu_seq: Tensor
    doc: Tensor
    dense: Tensor | None = None

    @classmethod
    def of(cls, case: Case, device: str) -> "Setup":
        lengths = torch.tensor(case.lengths, device=device)
        cu_seq = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return cls(case, device, cu_seq, torch.repeat_interleave(
            torch.arange(len(case.lengths), device=device), lengths))

    def dense_mask(self) -> Tensor:
        if self.dense is None:
            pos = torch.arange(self.case.tokens, device=self.device)
            self.dense = allowed(pos[:, None], pos[None, :], self.doc, self.case.left,
                                 self.case.causal)
        return self.dense


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a method: its backend's name and its forward; ``packed``: the forward
    takes and returns the packed (T, H, D) view (see the module doc)."""

    backend: str
    forward: Forward
    packed: bool = False


Candidates = list[Candidate]


def inputs_for(candidate: Candidate, inputs: Inputs) -> Inputs:
    """``inputs`` in the layout ``candidate`` takes: for a packed one, fresh leaves viewing the
    same memory as (T, H, D)."""
    if not candidate.packed:
        return inputs
    q, k, v, grad_out = inputs
    return (*(_packed(t).detach().requires_grad_() for t in (q, k, v)), _packed(grad_out))


def dash_candidates(setup: Setup) -> Candidates:
    """``varlen_attention`` for packed documents, ``attention(..., window_size=...)`` for one
    sequence; the schedule comes from ``mode``."""
    case, window = setup.case, (setup.case.left, 0)
    if case.kind == "docs":
        longest = max(case.lengths)
        return [Candidate("dash", lambda q, k, v: dash_inductor.varlen_attention(
            q, k, v, setup.cu_seq, setup.cu_seq, longest, longest, window_size=window), True)]
    window = window if case.left >= 0 else (-1, -1)
    return [Candidate("dash", lambda q, k, v: dash_inductor.attention(
        q, k, v, is_causal=case.causal, window_size=window))]


_FLEX: list[Callable[..., Tensor]] = []


def flex_candidates(setup: Setup) -> Candidates:
    if setup.device != "cuda":
        raise Skipped("FlexAttention is timed on CUDA only (compiling it for the CPU is beyond a "
                      "smoke run)")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not _FLEX:
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    doc, left, causal, tokens = setup.doc, setup.case.left, setup.case.causal, setup.case.tokens
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: allowed(q_idx, kv_idx, doc, left,
                                                                       causal),
                                   None, None, tokens, tokens, device=setup.device)
    return [Candidate("flex", lambda q, k, v: _FLEX[0](q, k, v, block_mask=block_mask))]


def sdpa_candidates(setup: Setup, deterministic: bool) -> Candidates:
    """Every backend that may take a dense mask, PyTorch's preference first; the first that runs
    is timed. On the CPU PyTorch picks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = setup.dense_mask()

    def run(backend: SDPBackend | None) -> Forward:
        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return forward

    if setup.device != "cuda":
        return [Candidate("cpu", run(None))]
    order = ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"] if deterministic else \
        ["CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    return [Candidate(name.split("_")[0].lower(), run(getattr(SDPBackend, name))) for name in order]


def varlen_attn_candidates(setup: Setup) -> Candidates:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        raise Skipped(f"not available: torch {torch.__version__} has no "
                      "torch.nn.attention.varlen.varlen_attn") from None
    if setup.device != "cuda":
        raise Skipped("varlen_attn runs FlashAttention, on CUDA only")
    longest = max(setup.case.lengths)
    window = (setup.case.left, 0) if setup.case.causal else (-1, -1)
    return [Candidate("flash", lambda q, k, v: varlen_attn(
        q, k, v, setup.cu_seq, setup.cu_seq, longest, longest, window_size=window), True)]


@dataclasses.dataclass(frozen=True)
class Way:
    """A method (name, title, determinism mode, dash schedule) and how it is bound to a case."""

    method: m.Method
    candidates: Callable[[Setup], Candidates]


DASH_SCHEDULES = (*catalog.DETERMINISTIC, catalog.AUTO)
WAYS = (
    *(Way(m.Method(f"dash_{s}", f"dash {s}", True, s), dash_candidates) for s in DASH_SCHEDULES),
    Way(m.Method("flex", "FlexAttention (compiled)", False), flex_candidates),
    Way(m.Method("sdpa_off", "SDPA dense mask, det. off", False),
        lambda s: sdpa_candidates(s, False)),
    Way(m.Method("sdpa_on", "SDPA dense mask, det. on", True), lambda s: sdpa_candidates(s, True)),
    Way(m.Method("varlen_attn_off", "varlen_attn, det. off", False), varlen_attn_candidates),
    Way(m.Method("varlen_attn_on", "varlen_attn, det. on", True), varlen_attn_candidates),
)


def mode(method: m.Method) -> ContextManager[None]:
    """Determinism on or off; dash's schedule (its CPU path is the reference); for FlexAttention,
    no donated buffers, which forbid the retained graph the backward timing needs."""
    stack = contextlib.ExitStack()
    stack.enter_context(m.determinism(method.deterministic))
    if method.is_dash:
        stack.enter_context(dash_inductor.config.patch(schedule=method.schedule,
                                                       cpu_backend="reference"))
    if method.name == "flex":
        from torch._functorch import config as functorch_config

        stack.enter_context(functorch_config.patch(donated_buffer=False))
    return stack


def make_inputs(case: Case, device: str, seed: int) -> Inputs:
    """Random q, k, v, grad_out (methods.make_inputs) shaped (1, H, T, D) over (T, H, D) storage:
    the packed layout, which the dense methods see as the usual transposed view."""
    problem = m.Problem(1, case.heads, case.heads, case.tokens, case.head_dim, True)
    tensors = m.make_inputs(problem, device=device, seed=seed)
    relaid = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    return (*(t.requires_grad_() for t in relaid[:3]), relaid[3])
