"""CPU tests of the recorded programs (ops/shared/tape.py) and their C++ replayer
(ops/shared/native.cpp), which the first test builds (about a minute).

What these show: a recorded call replays with new inputs to the same bits (ATen calls in schema
order, results as slots, numbers where the schema wants a tensor); a call that touches a tensor it
did not make is not recorded; the replayer's autograd function runs a signature's forward and
backward programs (fresh data, against the same math run directly and against PyTorch's autograd
of SDPA in float64), journals its backwards, and
falls back to Python for a gradient layout it has no program for. What they cannot: the kernel
launches, which only a GPU runs (tests/gpu/test_native_gpu.py; the recording of a launch's
parameter block is checked with a stand-in driver in tests/test_driver_launch.py).
"""

import pytest
import torch

from dash_inductor.library import signatures
from dash_inductor.ops.shared import native, tape


@pytest.fixture(scope="module")
def module():
    if not native.ENABLED:
        pytest.skip("DASH_INDUCTOR_NATIVE=0")
    loaded = native.load(wait=True)
    assert loaded is not None, native.failure()
    return loaded


def _inputs(seed, shape=(2, 3, 40, 16), dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype) for _ in range(4))


def _probabilities(q, k, lse=None):
    scores = (q @ k.transpose(-1, -2)) * 0.25
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    if lse is None:
        lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp(), lse


def _forward(q, k, v):
    """Causal attention's (out, logsumexp), in plain ATen calls (the reference's blocked loop
    reads sizes on the host, which a program cannot)."""
    p, lse = _probabilities(q, k)
    return p @ v, lse


def _backward(g, q, k, v, out, lse):
    p, _ = _probabilities(q, k, lse)
    dp = g @ v.transpose(-1, -2)
    ds = p * (dp - (g * out).sum(-1, keepdim=True)) * 0.25
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g


def test_a_recorded_call_replays_with_new_inputs(module):
    def call(q, k, v):
        scores = (q @ k.transpose(-1, -2)) * 0.25  # a number where mul.Tensor wants a tensor
        out = torch.empty_like(q)
        out.copy_(scores.softmax(-1) @ v)
        out[:, :, :3].zero_()
        return out, scores.logsumexp(-1)

    q, k, v, _ = _inputs(0)
    results, program = tape.record(lambda: call(q, k, v), (q, k, v))
    assert program is not None
    replay = module.Program(*program)
    for seed in (1, 2):
        fresh = _inputs(seed)[:3]
        for got, expected in zip(replay.run(list(fresh)), call(*fresh)):
            assert torch.equal(got, expected)


def test_a_tensor_the_call_did_not_make_is_not_recorded(module):
    outside = torch.ones(4)
    q = torch.randn(4)
    _, program = tape.record(lambda: [q + outside], (q,))
    assert program is None


@pytest.fixture
def signature(module):
    """A replayer signature whose programs are the reference's forward and backward."""
    q, k, v, g = _inputs(3)
    (out, lse), forward = tape.record(lambda: _forward(q, k, v), (q, k, v))
    _, backward = tape.record(lambda: _backward(g, q, k, v, out, lse), (g, q, k, v, out, lse))
    assert forward is not None and backward is not None
    handle = module.new_signature(module.Program(*forward))
    return handle, g, out, lse, backward


def test_the_replayed_autograd_function_runs_both_programs(module, signature):
    handle, g, out, lse, backward = signature
    index = module.add_backward(handle, module.layout_key(g, out, lse), module.Program(*backward))
    q, k, v, g = _inputs(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = module.attention(*leaves, handle)
    got.backward(g)
    out, lse = _forward(q, k, v)
    assert torch.equal(got.detach(), out)
    for leaf, expected in zip(leaves, _backward(g, q, k, v, out, lse)):
        assert torch.equal(leaf.grad, expected)
    assert module.journal()[-1][1:] == [handle, index]
    # and against autograd through plain PyTorch math, in float64
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).backward(g)
    for leaf, expected in zip(leaves, ref):
        torch.testing.assert_close(leaf.grad, expected.grad, rtol=1e-10, atol=1e-10)


def test_a_layout_without_a_program_falls_back(module, signature, monkeypatch):
    handle, *_ = signature
    seen = []

    def fallback(at, grad_out, q, k, v, out, lse):
        seen.append((at, grad_out.stride()))
        return _backward(grad_out, q, k, v, out, lse)

    module.set_fallback(fallback)
    try:
        q, k, v, g = _inputs(5)
        g = g.transpose(2, 3).contiguous().transpose(2, 3)  # not the recorded gradient's layout
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        module.attention(*leaves, handle).backward(g)
    finally:
        module.set_fallback(signatures._FALLBACK[0])
    assert seen == [(handle, g.stride())]
    out, lse = _forward(q, k, v)
    for leaf, expected in zip(leaves, _backward(g, q, k, v, out, lse)):
        assert torch.equal(leaf.grad, expected)


def test_a_profilers_launch_hook_turns_the_replay_off():
    """Triton's launch hooks see Python's launches only: while one is set, calls take that path."""
    from triton import knobs

    assert not native.launch_hooked()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert native.launch_hooked()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not native.launch_hooked()


def test_waiting_for_the_replayer_blocks_until_it_loads(module, monkeypatch):
    assert signatures.wait_for_replayer() is True and native.loaded() is module
    asked = []
    monkeypatch.setattr(native, "load", lambda wait=False: asked.append(wait))
    assert signatures.wait_for_replayer() is False  # off, or it failed to build
    assert asked == [True]
