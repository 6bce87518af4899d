"""A whole compiled training step on the GPU: no host synchronisation, and CUDA graphs.

A small causal transformer (dense SDPA, rewritten into dash.attention under deterministic
algorithms; or packed documents through dash_inductor.varlen_attention) trains under
``torch.compile``: its steps run under ``torch.cuda.set_sync_debug_mode("error")``, which raises
on any host synchronisation, and the same steps captured with CUDA graphs
(``mode="reduce-overhead"``) give the bits of the uncaptured ones. Fresh random weights and data.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dash_inductor
from dash_inductor.ops import cache_clear
from dash_inductor.library import op as library
from dash_inductor.ops.shared import errors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, DIM, VOCAB = 4, 64, 128
LENGTHS = (300, 1000, 212, 536)  # packed documents, 2048 tokens


class Block(nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
        self.proj = nn.Linear(HEADS * DIM, HEADS * DIM, bias=False)
        self.packed = packed

    def forward(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM)).unbind(-3)
        if self.packed:  # x is (T, C): documents packed along T
            longest = max(LENGTHS)
            y = dash_inductor.varlen_attention(q, k, v, cu, cu, longest, longest,
                                               window_size=(-1, 0))
        else:  # x is (B, L, C)
            y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                               is_causal=True).transpose(1, 2)
        return x + self.proj(y.flatten(-2))


class Model(nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HEADS * DIM)
        self.blocks = nn.ModuleList(Block(packed) for _ in range(2))
        self.head = nn.Linear(HEADS * DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu)
        return F.cross_entropy(self.head(x).flatten(0, -2).float(), tokens.flatten())


def _train(packed: bool, mode: str | None, steps: int = 4, sync_debug: bool = False):
    """Losses and final weights of ``steps`` SGD steps from a fixed start, compiled in ``mode``."""
    torch.manual_seed(0)
    model = Model(packed).to("cuda", torch.bfloat16)
    shape = (sum(LENGTHS),) if packed else (2, 1024)
    tokens = torch.randint(0, VOCAB, shape, device="cuda")
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    step = torch.compile(model, mode=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for index in range(steps):
        debug = sync_debug and index > 0  # the first step compiles, which may synchronise
        with _sync_debug() if debug else contextlib.nullcontext():
            loss = step(tokens, cu)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def _sync_debug():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_a_compiled_step_never_synchronises_and_graphs_give_the_same_bits(packed):
    losses, weights = _train(packed, None, sync_debug=True)
    assert torch.isfinite(losses).all()
    kernels = {(p.op, p.kernel) for p in library.last_plans()}
    assert ("backward", "reference") not in kernels and kernels, kernels
    torch._dynamo.reset()
    graph_losses, graph_weights = _train(packed, "reduce-overhead")
    assert torch.equal(losses, graph_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, graph_weights))


def test_a_first_backward_under_cuda_graph_trees_leaves_nothing_in_their_pool(monkeypatch):
    """The device's spin flag, made at its first backward, outlives every graph: made during a
    graph tree's warm-up it must not come from the tree's pool (whose check raises on a tensor
    it did not return). The plans and recorded programs of earlier tests hold the old flag: a new
    process would have none."""
    monkeypatch.setattr(errors, "_SPIN", {})
    cache_clear()
    losses, _ = _train(False, "reduce-overhead")
    assert torch.isfinite(losses).all() and errors._SPIN
    errors.check_spin_flags(wait=True)


def test_a_launch_hook_sees_every_bound_launch():
    """Bound launches skip Triton's empty hook chain, and a recorded signature's calls skip
    Python; a hook a profiler adds still sees each launch."""
    from triton import knobs

    from dash_inductor.ops.shared import native

    native.load(wait=True)
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    for _ in range(3):  # binds the launches, records them, replays them
        dash_inductor.attention(q, k, v, is_causal=True).sum().backward()
    seen: list[str] = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        dash_inductor.attention(q, k, v, is_causal=True).sum().backward()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) >= 2 and all(seen), seen
