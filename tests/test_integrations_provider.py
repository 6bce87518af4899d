"""The "DASH" flash-attention provider: registration, activation, and its kernels called directly.

SDPA's flash backend runs only on CUDA, so on CPU the registered kernels are called by hand with
CPU tensors (dash's op has a CPU kernel) and checked against ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import dash_inductor
from dash_inductor.integrations import provider, routes

api = provider.registry()
needs_registry = pytest.mark.skipif(api is None, reason="this torch has no provider registry")


@pytest.fixture(autouse=True)
def _fresh_counts():
    routes.reset()
    yield
    if api is not None and api.current_flash_attention_impl() == provider.NAME:
        api.restore_flash_attention_impl()


def _our_kernel_registered() -> bool:
    dump = torch._C._dispatch_dump(f"aten::{provider.OVERRIDDEN[0]}")
    return any(line.startswith("CUDA:") and "integrations/provider.py" in line.replace("\\", "/")
               for line in dump.splitlines())


@needs_registry
def test_registered_on_import_and_not_active():
    assert provider.NAME in api.list_flash_attention_impls()
    assert api.current_flash_attention_impl() != provider.NAME
    assert not _our_kernel_registered()


@needs_registry
def test_activate_and_deactivate():
    message = dash_inductor.integrations.activate_provider()
    assert "activated flash-attention implementation 'DASH'" in message
    assert provider.active() and _our_kernel_registered()
    assert "deactivated 'DASH'" in dash_inductor.integrations.deactivate_provider()
    assert not provider.active() and not _our_kernel_registered()
    assert "nothing changed" in dash_inductor.integrations.deactivate_provider()
    api.activate_flash_attention_impl(provider.NAME)  # PyTorch's own switch works as well
    assert provider.active() and _our_kernel_registered()


def test_torch_without_the_registry_gets_a_clear_message(monkeypatch):
    import torch.nn.attention

    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert provider.registry() is None and provider.register() is False
    with pytest.raises(RuntimeError, match="has no flash-attention provider registry"):
        dash_inductor.integrations.activate_provider()
    assert "rewrite" in dash_inductor.integrations.deactivate_provider()


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


def test_what_dash_cannot_take_goes_to_pytorchs_flash_kernel(monkeypatch, caplog):
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    calls = []

    def pytorch_flash(q_t, k_t, v_t, *args, scale=None):
        calls.append((q_t.shape, args, scale))
        out = torch.zeros_like(q_t)
        return out, torch.zeros(2, 4, 9), torch.zeros(2), torch.zeros(()), torch.empty(0)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", pytorch_flash)
    with caplog.at_level(logging.INFO, logger="dash_inductor"):
        out = provider.sdpa_flash_forward(q, k, v, 0.25, True, False, scale=None)[0]
    assert calls == [((2, 9, 4, 8), (None, None, 9, 9, 0.25, True, False), None)]
    assert out.shape == q.shape
    reason = "dropout_p=0.25 > 0: dash.attention has no dropout"
    assert routes.fallbacks("provider.forward") == {reason: 1}
    assert f"provider.forward fell back to PyTorch's attention: {reason}" in caplog.text


def test_backward_checks_the_logsumexp_it_is_given():
    q, k, v = _qkv(4, transposed=False, dtype=torch.float32)
    bad_lse = torch.zeros(2, 4, 16)  # padded, as a kernel other than flash would give
    assert "logsumexp" in provider.backward_reason(q, k, v, bad_lse, 0.0, False, None)
    assert provider.backward_reason(q, k, v, torch.zeros(2, 4, 9), 0.0, False, None) is None
