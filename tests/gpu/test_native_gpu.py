"""GPU tests of the C++ replayer (ops/shared/tape.py, native.cpp): an eager call replayed from its
recorded program gives the bits of the Python path that recorded it.

A mistake there (a pointer patched into the wrong slot, a stale TMA map, a step left out) shows as
different bits, or garbage, on inputs at new addresses; the tests also check that the replayer ran
(its backward journal), that a replayed step never syncs, and that a gradient of another layout
falls back to Python, is recorded and replayed in turn.
"""

import pytest
import torch

import dash_inductor
from dash_inductor.library import signatures
from dash_inductor.library.op import last_plans
from dash_inductor.ops import cache_clear
from dash_inductor.ops.shared import native

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (q shape, k/v heads, keys, causal, kernel, schedule)
CASES = [((2, 16, 1024, 64), 16, 1024, True, "auto", None),
         ((1, 16, 2048, 128), 16, 2048, False, "auto", None),
         ((2, 8, 700, 128), 2, 900, True, "auto", None),
         ((2, 8, 700, 64), 8, 900, False, "portable", "shift"),
         ((1, 4, 333, 128), 4, 333, True, "auto", "recompute")]


@pytest.fixture(scope="module")
def module():
    loaded = native.load(wait=True)
    if loaded is None:
        pytest.fail(f"the replayer did not build: {native.failure()}")
    return loaded


def _inputs(shape, hkv, keys, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((shape[0], hkv, keys, shape[3]), device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    return q, k, v, torch.randn(shape, device="cuda", dtype=q.dtype, generator=gen)


def _call(inputs, case, grad=None):
    """One forward+backward on fresh copies of ``inputs`` (new addresses each call)."""
    shape, hkv, _, causal, kernel, schedule = case
    q, k, v, g = (t.clone() for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dash_inductor.attention(q, k, v, is_causal=causal, enable_gqa=hkv != shape[1],
                                  kernel=kernel, schedule=schedule)
    out.backward(g if grad is None else grad(g))
    return out.detach(), q.grad, k.grad, v.grad


def _assert_bits(expected, *runs):
    for got in runs:
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b)


def _signature(inputs, case):
    shape, hkv, _, causal, kernel, schedule = case
    flags = (causal, None, hkv != shape[1], (-1, -1))
    choices = tuple(dash_inductor.config.choices(schedule=schedule, kernel=kernel).values())
    return signatures.lookup(signatures.key(*inputs[:3], flags, choices))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[4]}-{c[5]}")
def test_replayed_calls_give_the_python_bits(module, case):
    cache_clear()
    inputs = _inputs(*case[:3], seed=sum(case[0]))
    python = _call(inputs, case)  # plans made
    recorded = _call(inputs, case)  # recorded while it runs
    signature = _signature(inputs, case)
    assert signature is not None and signature.handle is not None and signature.handle >= 0
    before = module.journal()
    replays = [_call(inputs, case) for _ in range(3)]
    torch.cuda.synchronize()
    ran = module.journal()[-3:]  # the backwards ran in the replayer, under this signature
    assert [handle for _, handle, _ in ran] == [signature.handle] * 3
    assert not before or ran[0][0] > before[-1][0]
    assert last_plans()[-1].op == "backward" and last_plans()[-2].op == "forward"
    _assert_bits(python, recorded, *replays)


def test_inputs_that_come_back_to_earlier_addresses_read_their_own_memory(module):
    """A step calls one signature once per layer, each at its own addresses, and the replayer
    keeps each TMA map's encodings of earlier addresses: three input sets of different values,
    alive together and called in turn, each give the Python path's bits for their own values
    (a map kept for the wrong address would read another set's memory)."""
    case = CASES[0]
    leaves = [_inputs(*case[:3], seed=10 + i) for i in range(3)]

    def call(inputs):
        q, k, v = (t.requires_grad_() for t in inputs[:3])  # the same tensors every call
        out = dash_inductor.attention(q, k, v, is_causal=True)
        q.grad = k.grad = v.grad = None
        out.backward(inputs[3])
        return out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    enabled, native.ENABLED = native.ENABLED, False
    cache_clear()
    try:
        expected = [call(inputs) for inputs in leaves]
    finally:
        native.ENABLED = enabled
        cache_clear()
    before = module.journal()[-1][0] if module.journal() else -1
    for _ in range(4):
        for inputs, bits in zip(leaves, expected):
            _assert_bits(bits, call(inputs))
    assert module.journal()[-1][0] > before  # the last backwards were replayed


def test_a_replayed_step_never_syncs(module):
    case = CASES[0]
    inputs = _inputs(*case[:3], seed=1)
    for _ in range(2):
        _call(inputs, case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            _call(inputs, case)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_new_gradient_layout_falls_back_then_replays(module):
    case = CASES[0]
    inputs = _inputs(*case[:3], seed=2)
    transposed = lambda g: g.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    expected = _call(inputs, case, transposed)
    for _ in range(2):
        _call(inputs, case)  # recorded with the contiguous gradient
    journal = module.journal()
    fallback = _call(inputs, case, transposed)  # no program for this layout: Python, recorded
    assert module.journal() == journal
    replayed = _call(inputs, case, transposed)
    assert module.journal() != journal
    _assert_bits(expected, fallback, replayed)


def test_a_second_derivative_is_refused_as_on_the_python_path(module):
    case = CASES[0]
    inputs = _inputs(*case[:3], seed=3)
    for _ in range(2):
        _call(inputs, case)
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    out = dash_inductor.attention(q, k, v, is_causal=True)
    (grad_q,) = torch.autograd.grad(out, q, inputs[3], create_graph=True)
    with pytest.raises(RuntimeError, match="second|double|twice"):
        grad_q.sum().backward()


def test_compiled_calls_replay_the_op_with_the_same_bits(module):
    """Inductor calls ``dash::attention`` and its backward op, whose C++ kernels replay a recorded
    signature too (no autograd function of ours there, no Python kernel)."""
    case = CASES[0]
    inputs = _inputs(*case[:3], seed=4)

    def step(q, k, v):
        return dash_inductor.attention(q, k, v, is_causal=True)

    compiled = torch.compile(step, dynamic=False)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
        out = compiled(q, k, v)
        out.backward(inputs[3])
        return out.detach(), q.grad, k.grad, v.grad

    first = run()
    runs = [run() for _ in range(4)]
    signature = _signature(inputs, case)
    assert signature is not None and signature.handle >= 0 and signature.native_plans
    _assert_bits(first, *runs)
    # the last run's forward and backward ran in the ops' C++ kernels (native_ops.h), which
    # journal a forward as index -1; the Python kernels journal nothing there
    (_, fwd_handle, fwd_index), (_, bwd_handle, bwd_index) = module.journal()[-2:]
    assert (fwd_handle, fwd_index) == (signature.handle, -1)
    assert bwd_handle == signature.handle and bwd_index >= 0
