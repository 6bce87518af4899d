"""The eager fast path of ``dash_inductor.attention`` (an autograd.Function over the op's own
library functions, taken for plain CUDA tensors): forced here on the CPU, it gives the op path's
bits, saves its tensors where saved-tensor hooks see them, and refuses a double backward. And the
conditions under which a call must go through the op instead."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dash_inductor
from dash_inductor import config
from dash_inductor.library import entry


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(entry, "_eager_cuda", lambda *args: True)


def _inputs(seed=0, shape=(2, 3, 40, 16)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("cpu_backend", ["reference", "triton"])
def test_the_fast_path_gives_the_ops_bits(monkeypatch, cpu_backend):
    q, k, v = _inputs()
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fast in (False, True):
        monkeypatch.setattr(entry, "_eager_cuda", lambda *args, fast=fast: fast)
        with config.patch(cpu_backend=cpu_backend, schedule="shift"):
            out = dash_inductor.attention(q, k, v, is_causal=True)
        out.backward(grad)
        results.append([out.detach(), *(t.grad.clone() for t in (q, k, v))])
        for t in (q, k, v):
            t.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_saved_tensor_hooks_see_every_saved_tensor(forced):
    q, k, v = _inputs()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = dash_inductor.attention(q, k, v)
    assert len(packed) == 5  # q, k, v, out, logsumexp: the context keeps no other tensor
    out.sum().backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_a_double_backward_is_refused(forced):
    q, k, v = _inputs()
    out = dash_inductor.attention(q, k, v, is_causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="dash.attention has no double backward"):
        dq.sum().backward()


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_modes_masks_and_cpu_tensors_go_through_the_op():
    q, k, v = (t.detach() for t in _inputs())
    assert not entry._eager_cuda(q, k, v, None)  # a CPU tensor
    meta = torch.empty(1, 2, 8, 16, device="meta")
    assert not entry._eager_cuda(meta, meta, meta, None)
    with _Mode():
        assert not entry._eager_cuda(q, k, v, None)
    assert not entry._eager_cuda(q, k, v, torch.ones(40, 40, dtype=torch.bool))


@pytest.mark.parametrize("fast", [True, False], ids=["eager-function", "op"])
def test_a_repeated_signature_skips_planning_and_gives_the_same_bits(monkeypatch, fast):
    """Through either entry, the second call of a signature reuses the dispatcher's plans (no
    planning, no validation), a gradient of another layout plans once more, and the bits equal
    those of calls that planned everything. (The interpreter runs programs one after another:
    this checks reuse and order, not races.)"""
    from dash_inductor.library import signatures
    from dash_inductor.ops import dispatch

    q, k, v = _inputs(shape=(1, 2, 24, 16))
    grads = [torch.randn(q.shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    transposed = grads[1].transpose(1, 2).contiguous().transpose(1, 2)  # another stride class
    monkeypatch.setattr(entry, "_eager_cuda", lambda *args: fast)

    def run(grad):
        out = dash_inductor.attention(q, k, v, is_causal=True)
        out.backward(grad)
        result = [out.detach(), *(t.grad.clone() for t in (q, k, v))]
        for t in (q, k, v):
            t.grad = None
        return result

    with config.patch(cpu_backend="triton", schedule="shift"):
        expected = []
        for grad in (grads[0], transposed):
            signatures.clear()
            expected.append(run(grad))
        signatures.clear()
        calls = []
        for name in ("attention_forward", "attention_backward"):
            original = getattr(dispatch, name)
            monkeypatch.setattr(dispatch, name,
                                lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
        first = run(grads[0])
        assert calls == ["attention_forward", "attention_backward"]
        repeat = run(grads[0])
        other_layout = run(transposed)
        assert calls == ["attention_forward", "attention_backward", "attention_backward"]
        dispatch.cache_clear()  # the public reset forgets the signatures' plans too
        cleared = run(grads[0])
        assert calls[3:] == ["attention_forward", "attention_backward"]
    for got, want in ((first, expected[0]), (repeat, expected[0]), (other_layout, expected[1]),
                      (cleared, expected[0])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
