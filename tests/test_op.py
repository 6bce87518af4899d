"""dash.attention against SDPA's math backend in float64, for every semantic case of the op."""

from __future__ import annotations

import math

import pytest
import torch

import dash_inductor
from tests._reference import sdpa_math, tolerance


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype)


def _bool_mask(shape, gen):
    """Random keep-mask with the first query row fully masked (SDPA's math backend gives zeros)."""
    mask = torch.rand(*shape, generator=gen) > 0.4
    mask[..., 0, :] = False
    return mask


def _float_mask(shape, dtype, gen):
    mask = _randn(*shape, dtype=dtype, gen=gen)
    mask[..., 1, :] = -math.inf
    return mask


def _case(name, dtype, gen):
    """(q, k, v, kwargs) for a named case; tensors are fresh random data."""
    r = lambda *s: _randn(*s, dtype=dtype, gen=gen)  # noqa: E731
    if name == "basic":
        return r(2, 3, 37, 16), r(2, 3, 37, 16), r(2, 3, 37, 16), {}
    if name == "causal_square":
        return r(2, 2, 70, 16), r(2, 2, 70, 16), r(2, 2, 70, 16), dict(is_causal=True)
    if name == "causal_fewer_queries":
        return r(1, 2, 20, 16), r(1, 2, 90, 16), r(1, 2, 90, 16), dict(is_causal=True)
    if name == "causal_more_queries":
        return r(1, 2, 90, 16), r(1, 2, 20, 16), r(1, 2, 20, 16), dict(is_causal=True)
    if name == "bool_mask":
        return (r(2, 3, 33, 8), r(2, 3, 70, 8), r(2, 3, 70, 8),
                dict(attn_mask=_bool_mask((2, 1, 33, 70), gen)))
    if name == "float_mask":
        return (r(2, 3, 33, 8), r(2, 3, 70, 8), r(2, 3, 70, 8),
                dict(attn_mask=_float_mask((33, 70), dtype, gen)))
    if name == "scale":
        return r(1, 2, 19, 8), r(1, 2, 23, 8), r(1, 2, 23, 8), dict(scale=0.3)
    if name == "gqa":
        return r(2, 6, 21, 8), r(2, 2, 30, 8), r(2, 2, 30, 8), dict(enable_gqa=True, is_causal=True)
    if name == "one_kv_head":
        return r(2, 4, 21, 8), r(2, 1, 30, 8), r(2, 1, 30, 8), {}
    if name == "one_query_head":
        return r(2, 1, 21, 8), r(2, 3, 30, 8), r(2, 3, 30, 8), {}
    if name == "batch_broadcast":
        return r(1, 2, 21, 8), r(3, 2, 30, 8), r(3, 2, 30, 8), {}
    if name == "three_d":
        return r(3, 21, 8), r(3, 30, 8), r(3, 30, 8), dict(attn_mask=_bool_mask((21, 30), gen))
    if name == "value_dim":
        return r(2, 2, 21, 16), r(2, 2, 30, 16), r(2, 2, 30, 24), {}
    if name == "one_query":
        return r(2, 2, 1, 8), r(2, 2, 77, 8), r(2, 2, 77, 8), dict(is_causal=True)
    if name == "odd_lengths":
        return r(1, 2, 65, 12), r(1, 2, 129, 12), r(1, 2, 129, 10), {}
    if name == "transposed_views":
        q, k, v = (r(2, n, 3, 16).transpose(1, 2) for n in (29, 41, 41))
        return q, k, v, dict(is_causal=True)
    raise KeyError(name)


CASES = ["basic", "causal_square", "causal_fewer_queries", "causal_more_queries", "bool_mask",
         "float_mask", "scale", "gqa", "one_kv_head", "one_query_head", "batch_broadcast",
         "three_d", "value_dim", "one_query", "odd_lengths", "transposed_views"]
LOW_PRECISION_CASES = ["causal_square", "bool_mask", "float_mask", "gqa", "transposed_views"]


def _check_against_sdpa(name: str, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, kwargs = _case(name, dtype, gen)
    for t in (q, k, v):
        t.requires_grad_(True)
    expected, leaves = sdpa_math(q, k, v, **kwargs)
    out = dash_inductor.attention(q, k, v, **kwargs)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), expected, **tol)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=gen)
    expected.backward(grad)
    out.backward(grad.to(dtype))
    for name_, mine, ref in zip("qkv", (q, k, v), leaves):
        assert mine.grad.dtype == dtype, name_
        scale = max(1.0, ref.grad.abs().max().item())
        torch.testing.assert_close(mine.grad.double() / scale, ref.grad / scale, **tol,
                                   msg=lambda m: f"d{name_}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_matches_sdpa_float64(name):
    _check_against_sdpa(name, torch.float64, seed=CASES.index(name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", LOW_PRECISION_CASES)
def test_matches_sdpa_low_precision(name, dtype):
    _check_against_sdpa(name, dtype, seed=100 + LOW_PRECISION_CASES.index(name))


def test_logsumexp_is_natural_log_in_float32():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = _bool_mask((2, 3, 40, 40), gen)
    out, lse = torch.ops.dash.attention(q.half(), k.half(), v.half(), mask)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 40)
    scores = (q.half().double() @ k.half().double().transpose(-1, -2)) / math.sqrt(8)
    expected = scores.masked_fill(~mask, -math.inf).logsumexp(-1)
    torch.testing.assert_close(lse.double(), expected, atol=1e-4, rtol=1e-4)
    assert torch.isneginf(lse[:, :, 0]).all()  # the fully masked row
    assert out[:, :, 0].eq(0).all()


@pytest.mark.parametrize("mask_shape", [(2, 3, 20, 30), (1, 3, 1, 30), (20, 30)])
def test_float_mask_gradient(mask_shape):
    """A learned additive bias gets SDPA's gradient, summed over its broadcast dims."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (20, 30, 30))
    bias = torch.randn(*mask_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    expected, (_, _, _, ref_bias) = sdpa_math(q, k, v, attn_mask=bias)
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(grad)
    dash_inductor.attention(q, k, v, attn_mask=bias).backward(grad)
    torch.testing.assert_close(bias.grad, ref_bias.grad, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("shapes", [((2, 3, 0, 8), (2, 3, 5, 8)), ((0, 3, 4, 8), (0, 3, 5, 8)),
                                    ((2, 3, 4, 8), (2, 3, 0, 8))])
def test_empty_inputs_like_sdpa(shapes):
    q_shape, kv_shape = shapes
    q = torch.randn(q_shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    expected, _ = sdpa_math(q, k, v)
    out = dash_inductor.attention(q, k, v)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_reference_is_bitwise_reproducible():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 90, 16, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 90, 16, generator=gen)
    results = []
    for _ in range(3):
        out = dash_inductor.attention(q, k, v, is_causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_unfilled_skips_the_deterministic_fill_inside_only(deterministic_algorithms):
    """``shapes.unfilled`` turns PyTorch's NaN fill of new memory off for the op's own buffers and
    back on after, also when the body raises; with determinism off it touches nothing."""
    from dash_inductor.library.shapes import unfilled

    fill = torch.utils.deterministic
    assert torch.empty(64).isnan().all()
    with unfilled():
        assert not fill.fill_uninitialized_memory
    assert fill.fill_uninitialized_memory
    with pytest.raises(KeyError), unfilled():
        raise KeyError("the body fails")
    assert fill.fill_uninitialized_memory and torch.empty(64).isnan().all()
    torch.use_deterministic_algorithms(False)
    with unfilled():
        assert fill.fill_uninitialized_memory


@pytest.mark.parametrize("cpu_backend", ["reference", "triton"])
def test_outputs_under_deterministic_algorithms_match_sdpa(deterministic_algorithms, cpu_backend):
    """With determinism on (the op's buffers unfilled) out and every gradient still come from the
    kernels, the interpreted Triton ones included: finite, and SDPA's float64 result."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float64 if cpu_backend == "reference" else torch.float32
    q = torch.randn(2, 4, 70, 16, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 90, 16, generator=gen, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(2, 4, 70, 16, generator=gen, dtype=dtype)
    with dash_inductor.config.patch(cpu_backend=cpu_backend):
        out = dash_inductor.attention(q, k, v, is_causal=True, enable_gqa=True)
    ours = (out, *torch.autograd.grad(out, (q, k, v), grad))
    expected, leaves = sdpa_math(q, k, v, is_causal=True, enable_gqa=True)
    theirs = (expected, *torch.autograd.grad(expected, leaves[:3], grad.double()))
    for a, b in zip(ours, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, **tolerance(dtype))
