"""CPU tests of the ops' C++ kernels (ops/shared/native_ops.h), installed here at the CPU key.

What these show: a call bound to a signature runs its programs with no Python kernel (the
journal names them, and the bits are the programs'); a call with any other argument, an unbound
layout, or a profiler's launch hook goes to the Python kernel with every argument intact (the
reference's bits, its errors); clearing the caches unbinds, uninstalling restores the Python
kernels. What they cannot: CUDA launches from those kernels (tests/gpu/test_native_gpu.py).
"""

import pytest
import torch

import dash_inductor  # noqa: F401  (registers the ops)
from dash_inductor.library import native_kernels, signatures
from dash_inductor.ops.shared import native, tape

from test_native import _backward, _forward, _inputs, module  # noqa: F401  (a fixture)


@pytest.fixture
def installed(module):
    """The ops' C++ kernels at the CPU key, over the Python ones, for one test."""
    native_kernels.install(module, "CPU", signatures._watch)
    try:
        yield module
    finally:
        module.unbind_all()
        module.uninstall_ops()


def _bound(module):
    """A signature whose programs are causal attention in plain ATen calls, bound to the calls
    dash.attention(q, k, v, is_causal=True) of (2, 3, 40, 16) float64 inputs."""
    q, k, v, g = _inputs(3)
    (out, lse), forward = tape.record(lambda: _forward(q, k, v), (q, k, v))
    _, backward = tape.record(lambda: _backward(g, q, k, v, out, lse), (g, q, k, v, out, lse))
    handle = module.new_signature(module.Program(*forward))
    index = module.add_backward(handle, module.layout_key(g, out, lse), module.Program(*backward))
    module.bind(handle, q=q, k=k, v=v, is_causal=True)
    return handle, index



def test_a_bound_call_runs_its_programs_without_python(installed):
    handle, index = _bound(installed)
    q, k, v, g = _inputs(7)
    out, lse = torch.ops.dash.attention(q, k, v, None, 0.0, True)
    assert installed.journal()[-1][1:] == [handle, -1]
    expected_out, expected_lse = _forward(q, k, v)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    grads = torch.ops.dash.attention_backward(g, q, k, v, out, lse, None, True, None, False)
    assert installed.journal()[-1][1:] == [handle, index]
    for got, expected in zip(grads, _backward(g, q, k, v, out, lse)):
        assert torch.equal(got, expected)
    # the programs' math is the reference's: within float64 rounding of the Python kernel's
    reference = torch.ops.dash.attention(q, k, v, None, 0.0, True, cpu_backend="reference",
                                         schedule="ascending")
    torch.testing.assert_close(out, reference[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change", ["not causal", "scale", "window", "schedule", "shape", "mask"])
def test_any_other_call_goes_to_the_python_kernel(installed, change):
    handle, _ = _bound(installed)
    q, k, v, _g = _inputs(8)
    args, kwargs = [q, k, v, None, 0.0, True], {}
    if change == "not causal":
        args[5] = False
    elif change == "scale":
        kwargs["scale"] = 0.25  # the default's value, given: another signature, as in Python
    elif change == "window":
        kwargs["window_size"] = [8, 0]
    elif change == "schedule":
        kwargs["schedule"] = "descending"
    elif change == "shape":
        args[:3] = [t[:, :, :32] for t in args[:3]]
    else:  # a mask (which causal excludes)
        args[3], args[5] = torch.zeros(40, 40, dtype=torch.float64), False
    before = installed.journal()
    got = torch.ops.dash.attention(*args, **kwargs)
    assert installed.journal() == before
    installed.uninstall_ops()
    try:
        expected = torch.ops.dash.attention(*args, **kwargs)
    finally:
        native_kernels.install(installed, "CPU", signatures._watch)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_the_python_kernels_errors_come_through(installed):
    q, k, v, _ = _inputs(9)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        torch.ops.dash.attention(q, k, v, None, 1.5, True)
    with pytest.raises(ValueError, match="rng_state"):
        torch.ops.dash.attention(q, k, v, None, 0.5, True)


def test_a_gradient_layout_without_a_program_goes_to_python(installed):
    handle, index = _bound(installed)
    q, k, v, g = _inputs(10)
    out, lse = torch.ops.dash.attention(q, k, v, None, 0.0, True)
    g = g.transpose(2, 3).contiguous().transpose(2, 3)
    before = installed.journal()
    grads = torch.ops.dash.attention_backward(g, q, k, v, out, lse, None, True, None, False)
    assert installed.journal() == before
    for got, expected in zip(grads, _backward(g, q, k, v, out, lse)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_a_launch_hook_clearing_and_uninstalling_each_stop_the_replay(installed):
    from triton import knobs

    handle, _ = _bound(installed)
    q, k, v, _g = _inputs(11)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        before = installed.journal()
        torch.ops.dash.attention(q, k, v, None, 0.0, True)
        assert installed.journal() == before
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.ops.dash.attention(q, k, v, None, 0.0, True)
    assert installed.journal()[-1][1:] == [handle, -1]
    signatures.clear()  # as dash_inductor.ops.cache_clear()
    before = installed.journal()
    torch.ops.dash.attention(q, k, v, None, 0.0, True)
    assert installed.journal() == before
    installed.bind(handle, q=q, k=k, v=v, is_causal=True)
    installed.uninstall_ops()
    torch.ops.dash.attention(q, k, v, None, 0.0, True)
    assert installed.journal() == before
    native_kernels.install(installed, "CPU", signatures._watch)


def test_the_autograd_kernel_passes_gradients_and_skips_python_without_them(module):
    """Below torch.library's Python autograd kernel: a call that wants no gradient goes below
    autograd in C++ (that kernel never runs); one that wants them gets its gradients from it, the
    same bits as without the C++ kernels; the backward op still refuses a double backward."""
    forward, backward, forward_autograd, backward_autograd = native_kernels._KERNELS
    if forward_autograd is None:
        pytest.skip("this torch has no torch._library.autograd.make_autograd_impl")
    calls = []

    def counted(*args):
        calls.append(len(args))
        return forward_autograd(*args)

    q, k, v, g = _inputs(12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.ops.dash.attention(*leaves, None, 0.0, True)[0].backward(g)
    expected = [leaf.grad for leaf in leaves]
    module.install_ops("CPU", forward, backward, native.launch_hooked, signatures._watch,
                       counted, backward_autograd)
    try:
        out = torch.ops.dash.attention(q, k, v, None, 0.0, True)[0]
        assert calls == []
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = torch.ops.dash.attention(*leaves, None, 0.0, True)[0]
        assert len(calls) == 1 and torch.equal(got.detach(), out)
        got.backward(g)
        for leaf, grad in zip(leaves, expected):
            assert torch.equal(leaf.grad, grad)
        _, lse = torch.ops.dash.attention(q, k, v, None, 0.0, True)
        wanted = g.clone().requires_grad_()
        grads = torch.ops.dash.attention_backward(wanted, q, k, v, out, lse, None, True, None,
                                                  False)
        with pytest.raises(RuntimeError, match="no double backward"):
            grads[0].sum().backward()
    finally:
        module.uninstall_ops()
