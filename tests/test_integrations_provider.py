"""The "DASH" flash-attention provider: registration, activation, and its SDPA kernels.

SDPA's flash backend runs only on CUDA. On CPU the kernels are checked two ways: called directly
with CPU tensors (dash's op has a CPU kernel), and through the dispatcher, registered at the CPU
key by the same function the registry calls for CUDA, so that autograd, the dispatcher's argument
passing and the fallback to PyTorch's kernel below the override are exercised as on a GPU.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dash_inductor
from dash_inductor.integrations import kernel_support, provider, routes

api = provider.registry()
needs_registry = pytest.mark.skipif(api is None, reason="this torch has no provider registry")


@pytest.fixture(autouse=True)
def _fresh_counts():
    routes.reset()
    yield
    if api is not None and api.current_flash_attention_impl() == provider.NAME:
        api.restore_flash_attention_impl()


@pytest.fixture
def on_cpu():
    """The provider's kernels registered at the CPU key for the test, removed afterwards."""
    handle = provider._register_kernels("CPU")
    yield handle
    handle.remove()


def _ours_at(op: str, key: str = "CUDA") -> bool:
    dump = torch._C._dispatch_dump(op)
    return any(line.startswith(f"{key}:") and "integrations/provider" in line.replace("\\", "/")
               for line in dump.splitlines())


@needs_registry
def test_registered_on_import_and_not_active():
    assert provider.NAME in api.list_flash_attention_impls()
    assert api.current_flash_attention_impl() != provider.NAME
    assert not any(_ours_at(op) for op in provider.overridden())


@needs_registry
def test_activate_and_deactivate_every_overridden_op():
    ops = provider.overridden()
    assert ops[:2] == (provider.SDPA_FORWARD, provider.SDPA_BACKWARD)
    message = dash_inductor.integrations.activate_provider()
    assert "activated flash-attention implementation 'DASH'" in message
    assert provider.active() and all(_ours_at(op) for op in ops)
    # The aten flash ops, which PyTorch's varlen kernels and fallbacks call, stay PyTorch's.
    assert not _ours_at("aten::_flash_attention_forward")
    assert not _ours_at("aten::_flash_attention_backward")
    assert "deactivated 'DASH'" in dash_inductor.integrations.deactivate_provider()
    assert not provider.active() and not any(_ours_at(op) for op in ops)
    assert kernel_support._ORIGINALS == {}
    assert "nothing changed" in dash_inductor.integrations.deactivate_provider()
    api.activate_flash_attention_impl(provider.NAME)  # PyTorch's own switch works as well
    assert provider.active() and all(_ours_at(op) for op in ops)


def test_torch_without_the_registry_gets_a_clear_message(monkeypatch):
    import torch.nn.attention

    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert provider.registry() is None and provider.register() is False
    with pytest.raises(RuntimeError, match="has no flash-attention provider registry"):
        dash_inductor.integrations.activate_provider()
    assert "rewrite" in dash_inductor.integrations.deactivate_provider()


def test_torch_without_get_kernel_has_no_provider(monkeypatch):
    monkeypatch.delattr(torch.library, "get_kernel", raising=False)
    assert provider.registry() is None


def _qkv(heads_kv: int, transposed: bool, dtype=torch.float64):
    torch.manual_seed(0)
    shape = (2, 4, 9, 8)
    q = torch.randn(shape, dtype=dtype)
    if transposed:  # (B, L, H, E) storage, as attention modules usually produce
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(2, heads_kv, 9, 8, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True], ids=["bhle", "blhe"])
def test_kernels_compute_sdpa_and_its_gradients(heads_kv, is_causal, transposed):
    q, k, v = _qkv(heads_kv, transposed)
    result = provider.sdpa_flash_forward(q, k, v, 0.0, is_causal, False, scale=0.3)
    out, lse, _, _, max_q, max_k, seed, offset, debug = result
    gqa = heads_kv != 4
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.3,
                                              enable_gqa=gqa)
    torch.testing.assert_close(out, expected.detach())
    assert out.stride() == torch.empty_like(q).stride()  # what the meta kernel promises
    assert (max_q, max_k) == (9, 9) and seed.shape == (2,) and offset.shape == ()
    assert lse.shape == (2, 4, 9) and debug.numel() == 0

    grad_out = torch.randn_like(out)
    expected.backward(grad_out)
    grads = provider.sdpa_flash_backward(grad_out, q, k, v, out, lse, None, None, max_q, max_k,
                                         0.0, is_causal, seed, offset, scale=0.3)
    for grad, leaf in zip(grads, leaves):
        torch.testing.assert_close(grad, leaf.grad)
        assert grad.stride() == torch.empty_like(leaf).stride()
    assert routes.dash_calls("provider.forward") == 1
    assert routes.dash_calls("provider.backward") == 1


def _through_the_dispatcher(q, k, v, grad_out):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, is_causal=True,
                                                              scale=0.3)[0]
    out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in leaves]


def test_dispatcher_and_autograd_reach_the_kernels_and_repeat_bitwise(on_cpu):
    q, k, v = _qkv(2, transposed=True)
    grad_out = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    out, grads = _through_the_dispatcher(q, k, v, grad_out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3,
                                              enable_gqa=True)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected.detach())
    for grad, leaf in zip(grads, leaves):
        torch.testing.assert_close(grad, leaf.grad)
    again_out, again_grads = _through_the_dispatcher(q, k, v, grad_out)
    assert torch.equal(out, again_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, again_grads))
    assert routes.dash_calls("provider.forward") == 2
    assert routes.dash_calls("provider.backward") == 2


def test_dropout_runs_dash_and_its_state_reaches_the_backward(on_cpu):
    """The forward's (seed, offset) travels in philox_seed; the backward recomputes its mask."""
    q, k, v = _qkv(4, transposed=False)
    grad_out = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, 0.3, scale=0.3)[0]
        out.backward(grad_out)
        runs.append((out.detach(), *(leaf.grad for leaf in leaves)))
    torch.manual_seed(1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    direct = dash_inductor.attention(*leaves, dropout_p=0.3, scale=0.3)
    direct.backward(grad_out)
    for ours, again, want in zip(*runs, (direct.detach(), *(leaf.grad for leaf in leaves))):
        assert torch.equal(ours, again) and torch.equal(ours, want)
    assert routes.dash_calls("provider.forward") == 2
    assert routes.dash_calls("provider.backward") == 2


class _Recorder:
    """Stands in for PyTorch's kernel below the override (a CPU build has no flash kernel)."""

    def __init__(self, result):
        self.calls, self.result = [], result

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        return self.result


def test_what_dash_cannot_take_runs_pytorchs_kernel_below_the_override(on_cpu, monkeypatch,
                                                                       caplog):
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    canned = (torch.zeros_like(q), torch.zeros(2, 4, 9), torch.zeros(0), torch.zeros(0), 9, 9,
              torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
              torch.zeros(0))
    pytorch = _Recorder(canned)
    monkeypatch.setitem(kernel_support._ORIGINALS, (provider.SDPA_FORWARD, "CPU"),
                        (pytorch, keyset))
    with caplog.at_level(logging.INFO, logger="dash_inductor"):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.25, True,
                                                                  scale=math.inf)[0]
    assert len(pytorch.calls) == 1  # once: the fallback did not come back to the override
    called_keyset, args, kwargs = pytorch.calls[0]
    assert called_keyset == keyset and args[3:] == (0.25, True, False)
    assert kwargs == {"scale": math.inf}
    assert all(a is b for a, b in zip(args[:3], (q, k, v)))
    assert torch.equal(out, canned[0])
    reason = "dash.attention: scale must be a finite float or None (1/sqrt(E)), got inf"
    assert routes.fallbacks("provider.forward") == {reason: 1}
    assert routes.dash_calls("provider.forward") == 0
    assert f"provider.forward fell back to PyTorch's attention: {reason}" in caplog.text


def test_a_fallback_without_pytorchs_kernel_raises_instead_of_recursing(on_cpu):
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="PyTorch has no CPU kernel of "
                                           "aten::_scaled_dot_product_flash_attention"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, return_debug_mask=True)
    assert routes.fallbacks("provider.forward") == {
        "return_debug_mask=True asks for the attention probabilities": 1}


def test_backward_checks_the_logsumexp_it_is_given():
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    bad_lse = torch.zeros(2, 4, 16)  # padded, as a kernel other than flash would give
    assert "logsumexp" in provider.backward_reason(q, k, v, bad_lse, 0.0, False, None)
    assert provider.backward_reason(q, k, v, torch.zeros(2, 4, 9), 0.0, False, None) is None


class _DashArgs(TorchDispatchMode):
    """Records the arguments of dash's ops called inside the block, by name (the dispatcher
    leaves trailing defaults out)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("dash."):
            names = [argument.name for argument in func._schema.arguments]
            self.calls[str(func)] = {**dict(zip(names, args)), **(kwargs or {})}
        return func(*args, **(kwargs or {}))


def test_the_configured_schedule_reaches_dash_and_atomic_is_refused_under_determinism(
        restore_deterministic_algorithms):
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    torch.use_deterministic_algorithms(True)
    with dash_inductor.config.patch(schedule="shift"), _DashArgs() as mode:
        out, lse, *rest = provider.sdpa_flash_forward(q, k, v, 0.0, True, False)
        provider.sdpa_flash_backward(torch.ones_like(out), q, k, v, out, lse, None, None, 9, 9,
                                     0.0, True, rest[4], rest[5])
    for name in ("dash.attention.default", "dash.attention_backward.default"):
        assert mode.calls[name]["schedule"] == "shift"
    # On CPU only the Triton backend runs the schedules, so only there is "atomic" refused.
    with dash_inductor.config.patch(schedule="atomic", cpu_backend="triton"), \
            pytest.raises(RuntimeError, match="not deterministic"):
        provider.sdpa_flash_forward(q, k, v, 0.0, True, False)
