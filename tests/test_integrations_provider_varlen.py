"""``varlen_attn`` through the "DASH" provider, on CPU.

PyTorch's ``torch_attn::_varlen_attn`` ops are overridden at the CPU key here by the function the
registry calls for CUDA, so ``varlen_attn`` itself, its autograd and the dispatcher's argument
passing run as on a GPU; PyTorch's own CPU path has no flash kernel, so a call that reached it
raises, which is how the fallback is seen to land below the override. Results are checked
against float64 SDPA with a block-diagonal mask and, bit for bit, ``varlen_attention``.
"""

from __future__ import annotations

import inspect
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dash_inductor
from dash_inductor.integrations import kernel_support, provider, provider_varlen, routes

varlen = pytest.importorskip("torch.nn.attention.varlen")
pytestmark = pytest.mark.skipif(provider_varlen.unavailable_reason() is not None,
                                reason=str(provider_varlen.unavailable_reason()))
#: torch 2.11's varlen_attn has no enable_gqa (its kernels take GQA from the head counts).
HAS_GQA_FLAG = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters
LENS = ([5, 1, 9], [7, 3, 4])  # query and key lengths of three packed sequences


@pytest.fixture(autouse=True)
def _fresh_counts():
    routes.reset()
    yield


@pytest.fixture
def on_cpu():
    handle = provider._register_kernels("CPU")
    yield handle
    handle.remove()


def _offsets(lengths: list[int], dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _packed(hq: int, hkv: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = (sum(lens) for lens in LENS)
    return tuple(torch.randn(t, h, 8, generator=gen, dtype=torch.float64).to(dtype)
                 for t, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))


def block_diagonal(window: tuple[int, int]) -> torch.Tensor:
    """keep[i, j] over the packed tokens: same sequence, inside FlashAttention's window aligned
    bottom-right within the sequence (a side of at least max_k is unbounded)."""
    max_k = max(LENS[1])
    left, right = (-1 if side >= max_k else side for side in window)
    tq, tk = (sum(lens) for lens in LENS)
    keep = torch.zeros(tq, tk, dtype=torch.bool)
    for q0, q1, k0, k1 in zip(_offsets(LENS[0]).tolist(), _offsets(LENS[0]).tolist()[1:],
                              _offsets(LENS[1]).tolist(), _offsets(LENS[1]).tolist()[1:]):
        i = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0)[None, :]
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if left >= 0:
            block &= j >= i - left
        if right >= 0:
            block &= j <= i + right
        keep[q0:q1, k0:k1] = block
    return keep


def reference(q, k, v, grad_out, window):
    """(out, dq, dk, dv) of float64 SDPA math over the whole packing with the block mask."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    dense = [t.transpose(0, 1)[None] for t in leaves]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*dense, attn_mask=block_diagonal(window),
                                             enable_gqa=True)[0].transpose(0, 1)
    out.backward(grad_out.double())
    return out.detach(), *(leaf.grad for leaf in leaves)


def _varlen_attn(q, k, v, window, fn=varlen.varlen_attn):
    extra = {"enable_gqa": True} if HAS_GQA_FLAG and k.shape[1] != q.shape[1] else {}
    return fn(q, k, v, _offsets(LENS[0]), _offsets(LENS[1]), max(LENS[0]), max(LENS[1]),
              window_size=window, **extra)


def _run(q, k, v, grad_out, window, fn=varlen.varlen_attn):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _varlen_attn(*leaves, window, fn)
    out.backward(grad_out)
    return out.detach(), *(leaf.grad for leaf in leaves)


WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_attn_runs_dash_matches_float64_and_repeats_bitwise(on_cpu, window, heads):
    if heads[0] != heads[1] and not HAS_GQA_FLAG:
        pytest.skip("this torch's varlen_attn takes no enable_gqa")
    q, k, v, grad_out = _packed(*heads)
    ours = _run(q, k, v, grad_out, window)
    assert routes.dash_calls("provider.varlen_forward") == 1
    assert routes.dash_calls("provider.varlen_backward") == 1
    assert routes.fallbacks("provider.varlen_forward") == {}
    for name, got, expected in zip(("out", "dq", "dk", "dv"), ours,
                                   reference(q, k, v, grad_out, window)):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-9, msg=name)
    direct = _run(q, k, v, grad_out, window, fn=dash_inductor.varlen_attention)
    assert all(torch.equal(a, b) for a, b in zip(ours, direct))
    assert all(torch.equal(a, b) for a, b in zip(ours, _run(q, k, v, grad_out, window)))


def test_kernels_called_directly_return_pytorchs_layout():
    q, k, v, grad_out = _packed(4, 4, torch.float32, seed=3)
    cu_q, cu_k = _offsets(LENS[0]), _offsets(LENS[1], torch.int64)
    out, lse, rng = provider_varlen.varlen_forward(q, k, v, cu_q, cu_k, 9, 7, True, 0.25,
                                                   [-1, 0])
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert rng.shape == (2,) and rng.dtype == torch.uint64
    expected = dash_inductor.varlen_attention(q, k, v, cu_q, cu_k, 9, 7, scale=0.25,
                                              window_size=(-1, 0),
                                              return_aux=varlen.AuxRequest(lse=True))
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    grads = provider_varlen.varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, 9, 7, True,
                                            rng, scale=0.25, window_size=[-1, 0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dash_inductor.varlen_attention(*leaves, cu_q, cu_k, 9, 7, scale=0.25,
                                   window_size=(-1, 0)).backward(grad_out)
    assert all(torch.equal(g, leaf.grad) for g, leaf in zip(grads, leaves))


def test_unsupported_dtype_runs_pytorchs_kernel_with_the_reason_logged(on_cpu, caplog):
    q, k, v, _ = (t.to(torch.float8_e4m3fn) for t in _packed(4, 4, torch.float32))
    with caplog.at_level(logging.INFO, logger="dash_inductor"):
        for _ in range(2):
            # PyTorch's kernel was reached (below the override, no recursion): on CPU it has no
            # flash kernel to run.
            with pytest.raises(NotImplementedError, match="aten::_flash_attention_forward"):
                _varlen_attn(q, k, v, (-1, 0))
    (reason,) = routes.fallbacks("provider.varlen_forward")
    assert "float8_e4m3fn" in reason and routes.fallbacks("provider.varlen_forward")[reason] == 2
    assert routes.dash_calls("provider.varlen_forward") == 0
    logged = [r.getMessage() for r in caplog.records if "varlen_forward fell back" in
              r.getMessage()]
    assert logged == [f"dash_inductor: provider.varlen_forward fell back to PyTorch's "
                      f"attention: {reason}"]


def test_removing_the_kernels_gives_varlen_attn_back_to_pytorch():
    q, k, v, _ = _packed(4, 4)
    provider._register_kernels("CPU").remove()
    with pytest.raises(NotImplementedError, match="aten::_flash_attention_forward"):
        _varlen_attn(q, k, v, (-1, -1))
    assert routes.counts == {}


def _bound(**changes):
    q, k, v, _ = _packed(4, 4, torch.float32)
    args = (q, k, v, _offsets(LENS[0]), _offsets(LENS[1]), 9, 7)
    values, changed = kernel_support.bind(provider_varlen.FORWARD, args, {})
    values.update(changes)
    return values, changed | set(changes)


@pytest.mark.parametrize("changes, match", [
    (dict(seqused_k=torch.ones(3, dtype=torch.int32)), "seqused_k set: not supported"),
    (dict(cu_seq_k=None), "cu_seq_k=None"),
    (dict(cu_seq_q=torch.zeros(4)), "cu_seq_q of dtype torch.float32"),
    (dict(window_size=[-3, 0]), r"window_size \(-3, 0\) has a side below -1"),
    (dict(scale=math.inf), "scale must be a finite float"),
])
def test_forward_reasons(changes, match):
    assert re.search(match, provider_varlen.reason(provider_varlen.FORWARD, *_bound(**changes)))


def test_bind_fills_defaults_and_marks_what_changed():
    values, changed = _bound()
    assert values["is_causal"] is False and values["window_size"] is None
    assert changed == {"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"}
    assert provider_varlen.reason(provider_varlen.FORWARD, values, changed) is None
    values, changed = _bound(is_causal=True, num_splits=1, enable_gqa=True)
    assert provider_varlen.window(values) == (-1, 0)
    assert provider_varlen.reason(provider_varlen.FORWARD, values, changed) is None


def test_backward_checks_the_logsumexp_it_is_given():
    q, k, v, grad_out = _packed(4, 4, torch.float32)
    args = (grad_out, q, k, v, q, torch.zeros(4, 16), _offsets(LENS[0]), _offsets(LENS[1]), 9, 7,
            False, torch.zeros(2, dtype=torch.uint64))
    why = provider_varlen.reason(provider_varlen.BACKWARD,
                                 *kernel_support.bind(provider_varlen.BACKWARD, args, {}))
    assert "lse of dtype torch.float32 and shape (4, 16)" in why


def test_a_torch_without_the_varlen_ops_keeps_the_sdpa_overrides(monkeypatch):
    monkeypatch.setattr(kernel_support, "find_op", lambda name: None)
    assert provider_varlen.unavailable_reason() == \
        f"this torch has no op {provider_varlen.FORWARD}"
    assert provider.overridden() == (provider.SDPA_FORWARD, provider.SDPA_BACKWARD)
