"""The public helpers of dash_inductor.testing: they pass on deterministic code and fail, with a
report naming the tensor and index, on code that is not."""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from dash_inductor import pytest_plugin
from dash_inductor.testing import (
                                   AttentionProblem,
                                   assert_batch_invariant,
                                   assert_bitwise_reproducible,
                                   assert_flash_rule,
                                   assert_process_reproducible,
                                   attention_problems,
                                   flash_rule_errors,
                                   low_precision_math_sdpa,
                                   sdpa_math_reference,
                                   tensor_digests,
                                   )

CI = settings(settings.get_profile(pytest_plugin.CI_PROFILE), max_examples=15)


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain per-sequence attention: deterministic on CPU."""
    return torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v


def noisy_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention plus a tiny random bump at element (1, 2, 3): differs run to run."""
    out = attention_math(q, k, v)
    bump = torch.zeros_like(out)
    bump[1, 2, 3] = torch.rand(()).item() * 1e-3 + 1e-3
    return out + bump


class _NoisyBackward(torch.autograd.Function):
    """Identity forward; the backward perturbs element (0, 1, 2) of the gradient at random."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 1, 2] += torch.rand(()).item() * 1e-3 + 1e-3
        return grad


def noisy_key_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention_math(q, _NoisyBackward.apply(k), v)


def pid_dependent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Differs between processes (not between runs): a bump that depends on the process id."""
    out = attention_math(q, k, v)
    bump = torch.zeros_like(out)
    bump[0, 0, 1] = (os.getpid() % 9973 + 1) * 1e-4
    return out + bump


def batch_mixing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Leaks a batch statistic into every sequence, so a sequence alone gives other bits."""
    return attention_math(q, k, v) + 1e-3 * q.mean(0, keepdim=True)[..., :1]


def make_qkv(seed: int = 0, batch: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 4, 6, generator=gen).requires_grad_() for _ in range(3))


def test_reproducible_passes_and_returns_outputs_and_grads():
    q, k, v = make_qkv()
    tensors = assert_bitwise_reproducible(attention_math, q, k, v, runs=4)
    assert set(tensors) == {"output", "grad of args[0]", "grad of args[1]", "grad of args[2]"}
    expected = attention_math(q, k, v)
    assert torch.equal(tensors["output"], expected)
    assert q.grad is None, "the helper must not accumulate into .grad"


def test_reproducible_fails_naming_output_and_index():
    q, k, v = make_qkv()
    with pytest.raises(AssertionError) as failure:
        assert_bitwise_reproducible(noisy_output, q, k, v, runs=3)
    message = str(failure.value)
    assert "run 1 of 3 differs from run 0" in message
    assert "output differs at index (1, 2, 3)" in message
    assert re.search(r"\(0x[0-9a-f]{8}\) vs .*\(0x[0-9a-f]{8}\)", message)


def test_reproducible_fails_on_gradient_only_noise_naming_the_keyword():
    q, k, v = make_qkv()
    with pytest.raises(AssertionError, match=r"grad of k differs at index \(0, 1, 2\)"):
        assert_bitwise_reproducible(noisy_key_grad, q=q, k=k, v=v, runs=2)


def test_reproducible_covers_module_parameters():
    layer = torch.nn.Linear(6, 5)
    x = torch.randn(3, 6)
    tensors = assert_bitwise_reproducible(layer, x, runs=2)
    assert "grad of parameter 'weight'" in tensors
    noisy = torch.nn.Sequential(layer, _Noisy2d())
    with pytest.raises(AssertionError, match=r"grad of parameter '0.weight' differs at index"):
        assert_bitwise_reproducible(noisy, x, runs=2)


class _Noisy2d(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoisyBackward.apply(x.unsqueeze(0)).squeeze(0)


def test_bits_not_values_are_compared():
    nan = torch.tensor([float("nan"), 1.0])
    assert_bitwise_reproducible(lambda: nan * 1.0, runs=2)
    signs = iter([0.0, -0.0])
    with pytest.raises(AssertionError, match=r"index \(0,\): 0.0 \(0x00000000\) vs -0.0"):
        assert_bitwise_reproducible(lambda: torch.tensor([next(signs)]), runs=2)


def test_reproducible_rejects_a_single_run():
    with pytest.raises(ValueError, match="runs must be >= 2"):
        assert_bitwise_reproducible(attention_math, *make_qkv(), runs=1)


def test_batch_invariant_passes_on_per_sequence_code():
    assert_batch_invariant(attention_math, make_qkv(batch=4))


def test_batch_invariant_fails_naming_sequence_and_index():
    with pytest.raises(AssertionError) as failure:
        assert_batch_invariant(batch_mixing, make_qkv(batch=3))
    message = str(failure.value)
    assert "sequence 0 of 3" in message
    assert "output differs at index (0, 0, 0)" in message


def test_batch_invariant_catches_gradients_and_honours_shared_arguments():
    def shared_key(q, k, v):
        return attention_math(q, _NoisyBackward.apply(k).expand(q.shape[0], -1, -1), v)

    q, k, v = make_qkv(batch=2)
    shared = k[:1].detach().requires_grad_()
    # the shared key's gradient sums over the batch, so it is not compared: this passes
    assert_batch_invariant(shared_key, (q, shared, v), in_dims=(0, None, 0))
    with pytest.raises(AssertionError, match=r"grad of args\[1\] differs at index \(0, 1, 2\)"):
        assert_batch_invariant(noisy_key_grad, (q, k, v))


def test_batch_invariant_rejects_mismatched_batch_sizes():
    q, k, v = make_qkv(batch=3)
    with pytest.raises(ValueError, match="one batch size"):
        assert_batch_invariant(attention_math, (q, k[:2], v))


def test_process_reproducible_passes_and_fails():
    q, k, v = make_qkv()
    digests = assert_process_reproducible(functools.partial(attention_math, q=q), k=k, v=v)
    # q is inside the partial, so its gradient is not tracked; the others match in-process runs
    assert set(digests) == {"output", "grad of k", "grad of v"}
    here = tensor_digests(assert_bitwise_reproducible(attention_math, q=q, k=k, v=v))
    assert digests.items() <= here.items()
    with pytest.raises(AssertionError, match=r"output differs at index \(0, 0, 1\)"):
        assert_process_reproducible(pid_dependent, q, k, v)


def test_digests_see_bits_and_shape_only():
    a = torch.randn(4, 3)
    b = a.t().contiguous().t()  # same values, other strides
    assert tensor_digests({"x": a}) == tensor_digests({"x": b})
    assert tensor_digests({"x": a}) != tensor_digests({"x": a.reshape(3, 4)})
    assert tensor_digests({"x": a}) != tensor_digests({"x": torch.nextafter(a, a + 1)})


@CI
@given(attention_problems())
def test_drawn_problems_are_valid_for_sdpa(problem: AttentionProblem):
    inputs = problem.make_inputs("cpu", seed=3)
    q, k, v, mask = inputs.args
    assert q.shape == (problem.batch, problem.q_heads, problem.q_len, problem.head_dim)
    assert v.shape == (problem.batch, problem.kv_heads, problem.kv_len, problem.v_head_dim)
    assert q.is_leaf and q.requires_grad and q.count_nonzero() == q.numel()
    assert (q.is_contiguous() if problem.layout == "contiguous"
            else q.transpose(1, 2).is_contiguous())
    for row in problem.masked_rows:
        assert not (mask[..., row, :] != float("-inf") if mask.is_floating_point()
                    else mask[..., row, :]).any()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, **problem.sdpa_kwargs())
    assert out.shape == (problem.batch, problem.q_heads, problem.q_len, problem.v_head_dim)
    again = problem.make_inputs("cpu", seed=3)
    other = problem.make_inputs("cpu", seed=4)
    assert torch.equal(again.query, q) and not torch.equal(other.query, q)


@pytest.mark.parametrize("condition", [
    lambda p: p.q_len == 1, lambda p: p.kv_len == 1, lambda p: p.q_heads == 4 * p.kv_heads,
    lambda p: p.q_len % 16 != 0 and p.kv_len > 16, lambda p: p.masked_rows and p.mask == "float",
    lambda p: p.layout == "transposed" and p.is_causal, lambda p: p.head_dim != p.v_head_dim,
    lambda p: p.mask == "bool" and p.mask_shape == "2d", lambda p: p.scale is not None,
], ids=["L=1", "S=1", "gqa4", "ragged", "masked-rows", "transposed-causal", "Ev!=E", "2d-mask",
        "scale"])
def test_strategy_reaches_edge_cases(condition):
    found = find(attention_problems(), condition,
                 settings=settings(database=None, max_examples=1000))
    assert condition(found)


def test_bounds_are_honoured_and_bad_bounds_rejected():
    strategy = attention_problems(batch=(2, 2), q_heads=(8, 8), gqa_ratios=(8,), q_len=(5, 5),
                                  kv_len=(7, 9), head_dims=(64,), dtypes=(torch.bfloat16,),
                                  causal=(True,), layouts=("transposed",))
    problem = find(strategy, lambda p: True)
    assert (problem.batch, problem.q_heads, problem.kv_heads, problem.q_len) == (2, 8, 1, 5)
    assert 7 <= problem.kv_len <= 9 and problem.is_causal and problem.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="q_len must be"):
        attention_problems(q_len=(0, 4))
    with pytest.raises(ValueError, match="masks must be"):
        attention_problems(masks=("causal",))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        AttentionProblem(1, 3, 2, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        AttentionProblem(1, 1, 1, 4, 4, 8, 8, is_causal=True, mask="bool")


def test_deterministic_mode_context_restores(restore_deterministic_algorithms):
    torch.use_deterministic_algorithms(False)
    with pytest_plugin.deterministic_algorithms_mode(True):
        assert torch.are_deterministic_algorithms_enabled()
        with pytest_plugin.deterministic_algorithms_mode(True, warn_only=True):
            assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_fixture_and_profiles(deterministic_algorithms):
    assert torch.are_deterministic_algorithms_enabled()
    profile = settings.get_profile(pytest_plugin.CI_PROFILE)
    assert profile.derandomize and profile.deadline is None and profile.max_examples <= 20
    assert settings.get_profile(pytest_plugin.GPU_PROFILE).derandomize


# --- FlashAttention's accuracy rule -------------------------------------------------------------

LOW_PRECISION = st.sampled_from([torch.bfloat16, torch.float16])


def flash_problem(seed: int, dtype: torch.dtype, hkv: int = 2) -> tuple[torch.Tensor, ...]:
    """q, k, v (GQA 4/``hkv`` heads) and an upstream gradient, fresh random values in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, 48, 32, generator=gen).to(dtype) for h in (4, hkv, hkv, 4))


def math_sdpa(q, k, v, grad_out, **kwargs) -> list[torch.Tensor]:
    """(out, dq, dk, dv) of SDPA's math backend in the inputs' dtype, as the caller set it up."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


@CI
@given(seed=st.integers(0, 2**16), dtype=LOW_PRECISION)
def test_flash_rule_passes_for_good_results_and_fails_for_a_perturbed_gradient(seed, dtype):
    q, k, v, do = flash_problem(seed, dtype)
    kwargs = dict(is_causal=True, enable_gqa=True)
    ref = sdpa_math_reference(q, k, v, do, torch.float32, **kwargs)
    same = sdpa_math_reference(q, k, v, do, dtype, **kwargs)
    # PyTorch's own low-precision result, and the float32 result rounded once: both pass
    errors = assert_flash_rule(same, same, ref)
    assert [e.name for e in errors] == ["out", "dq", "dk", "dv"]
    assert all(e.error == e.same_error and e.ok for e in errors)
    assert_flash_rule([r.to(dtype) for r in ref], same, ref)
    # one element of dq off by three times its bound: dq, and only dq, fails, with its numbers
    bad = list(same)
    bad[1] = bad[1].clone()
    bad[1][1, 2, 3, 4] += 3 * errors[1].bound
    with pytest.raises(AssertionError) as caught:
        assert_flash_rule(bad, same, ref, what="perturbed dq")
    message = str(caught.value)
    assert message.startswith("perturbed dq: FlashAttention's accuracy rule fails")
    assert "\n  dq: max|ours - ref| " in message and f"{errors[1].same_error:.3g}" in message
    assert not any(f"\n  {name}:" in message for name in ("out", "dk", "dv"))
    assert [e.ok for e in flash_rule_errors(bad, same, ref)] == [True, False, True, True]


def test_flash_rule_fails_on_nan_and_rejects_mismatched_inputs():
    q, k, v, do = flash_problem(0, torch.bfloat16)
    ref = sdpa_math_reference(q, k, v, do, torch.float32, enable_gqa=True)
    same = sdpa_math_reference(q, k, v, do, torch.bfloat16, enable_gqa=True)
    nan = [same[0], same[1], same[2].clone(), same[3]]
    nan[2][0, 0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"\n  dk: max\|ours - ref\| nan > "):
        assert_flash_rule(nan, same, ref)
    with pytest.raises(ValueError, match="3 outputs, 4 same-dtype and 4 reference"):
        flash_rule_errors(same[1:], same, ref)
    assert [e.name for e in flash_rule_errors(same[1:], same[1:], ref[1:],
                                              names=("dq", "dk", "dv"))] == ["dq", "dk", "dv"]
    with pytest.raises(ValueError, match="out: shapes differ"):
        flash_rule_errors([same[0][:1], *same[1:]], same, ref)


@CI
@given(seed=st.integers(0, 2**16), dtype=LOW_PRECISION)
def test_low_precision_math_sdpa_computes_in_the_inputs_dtype(seed, dtype):
    """By default the math backend upcasts fp16/bf16: its results are the float32 ones rounded
    once (bit for bit, on this CPU too). Inside the block they are computed in the dtype."""
    q, k, v, do = flash_problem(seed, dtype)
    kwargs = dict(is_causal=True, enable_gqa=True)
    in_float32 = math_sdpa(*(t.float() for t in (q, k, v, do)), **kwargs)
    upcast = math_sdpa(q, k, v, do, **kwargs)
    assert all(torch.equal(a, r.to(dtype)) for a, r in zip(upcast, in_float32))
    with low_precision_math_sdpa():
        low = math_sdpa(q, k, v, do, **kwargs)
    assert not any(torch.equal(a, r.to(dtype)) for a, r in zip(low, in_float32))
    # sdpa_math_reference gives those two references
    ours = sdpa_math_reference(q, k, v, do, dtype, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ours, low))
    ours = sdpa_math_reference(q, k, v, do, torch.float32, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ours, in_float32))


def test_sdpa_math_reference_takes_masks():
    q, k, v, do = flash_problem(1, torch.bfloat16, hkv=4)
    gen = torch.Generator().manual_seed(2)
    float_mask = torch.randn(48, 48, generator=gen)  # cast to the dtype along with q, k, v
    keep = float_mask > -1
    for mask in (float_mask, keep):
        out, dq, dk, dv = sdpa_math_reference(q, k, v, do, torch.bfloat16, attn_mask=mask)
        assert out.dtype == dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
        with low_precision_math_sdpa():
            expected = math_sdpa(q, k, v, do, attn_mask=mask.to(torch.bfloat16)
                                 if mask.is_floating_point() else mask)
        assert all(torch.equal(a, b) for a, b in zip((out, dq, dk, dv), expected))


def test_low_precision_math_sdpa_restores_the_flag():
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed
    before = allowed()
    try:
        for previous in (False, True):
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
            with low_precision_math_sdpa():
                assert allowed()
            assert allowed() is previous
            with pytest.raises(KeyError), low_precision_math_sdpa():
                assert allowed()
                raise KeyError("inside")
            assert allowed() is previous
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


def test_low_precision_math_sdpa_says_when_torch_lacks_the_flag(monkeypatch):
    monkeypatch.delattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp")
    with pytest.raises(RuntimeError, match="no torch.backends.cuda.allow_fp16_bf16_reduction"):
        with low_precision_math_sdpa():
            pass
