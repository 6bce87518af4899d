"""Hypothesis-driven properties of dash.attention on the CPU.

For drawn problems (shapes, GQA, masks with fully-masked rows, causal, scale, transposed views):
the op matches SDPA's math in float64 (outputs, logsumexp, gradients), and its bits do not change
across repeats, processes, batch composition or torch.compile. The reference backend takes many
draws; the Triton kernels (in the interpreter) take a few tiny ones. Settings come from the
``dash-ci`` profile: derandomized, so a failure reproduces, with bounded example counts.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import dash_inductor
from dash_inductor import config, pytest_plugin
from dash_inductor.pytest_plugin import deterministic_algorithms_mode
from dash_inductor.testing import (
                                   AttentionInputs,
                                   AttentionProblem,
                                   assert_batch_invariant,
                                   assert_bitwise_equal,
                                   assert_bitwise_reproducible,
                                   assert_process_reproducible,
                                   attention_problems,
                                   flash_rule_errors,
                                   sdpa_math_reference,
                                   )
from tests._reference import reference_scores

CI = settings.get_profile(pytest_plugin.CI_PROFILE)
# Interpreted kernels and compiles are slow: report a failing draw as found, without shrinking it
# (the draws are tiny already), so a broken kernel costs seconds of CI time, not minutes.
SLOW = settings(CI, phases=(Phase.explicit, Phase.generate))

LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_PROBLEMS = attention_problems(dtypes=LOW_PRECISION)
# The interpreter runs one program at a time: keep draws tiny (few tiles, few heads).
TINY = dict(batch=(1, 2), q_heads=(1, 2), gqa_ratios=(1, 2), q_len=(1, 40), kv_len=(1, 40),
            head_dims=(16,), dtypes=(torch.float32, torch.bfloat16), tile=16)
TINY_PROBLEMS = attention_problems(**TINY)
# Causal and masked problems drawn apart, so that few examples still cover both kernel paths.
TINY_KINDS = {"causal": attention_problems(**TINY, causal=(True,)),
              "full-or-masked": attention_problems(**TINY, causal=(False,))}
SCHEDULES = st.sampled_from(config.DETERMINISTIC_SCHEDULES)
# Accuracy: FlashAttention's rule (dash_inductor.testing: our error at most twice that of SDPA's
# math computed in the inputs' dtype), changed on purpose in two ways. Both errors are measured
# against float64 math, not float32, so float32 draws are judged too (against float32 the rule
# degenerates to a flat 1e-3). The slack is this fraction of the reference's largest value, not an
# absolute 1e-3: a draw has few elements, so its max error is that of a handful of roundings
# (FlashAttention's tests take it over thousands), and Triton 3.9's interpreter casts fp32 to bf16
# by truncation, so the interpreted kernels' bf16 values may be a whole ulp off where a GPU's are at
# most half.
SLACK = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _grad_out(problem: AttentionProblem, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (problem.batch, problem.q_heads, problem.q_len, problem.v_head_dim)
    return torch.randn(shape, generator=gen)


def _forward_backward(fn, inputs: AttentionInputs, problem: AttentionProblem) -> list[torch.Tensor]:
    q, k, v, mask = inputs.args
    out = fn(q, k, v, attn_mask=mask, **problem.sdpa_kwargs())
    grads = torch.autograd.grad(out, (q, k, v), _grad_out(problem).to(out.dtype))
    return [out.detach(), *grads]


def _sdpa(q, k, v, attn_mask=None, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)


def _reference_logsumexp(problem: AttentionProblem, inputs: AttentionInputs) -> torch.Tensor:
    """log sum_j exp(score_ij) in float64, -inf on rows that see no key."""
    scores, mask = reference_scores(problem, inputs)
    if problem.is_causal:
        seen = torch.ones(problem.q_len, problem.kv_len, dtype=torch.bool).tril()
        scores = scores.masked_fill(~seen, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return torch.logsumexp(scores, dim=-1)


def _check_against_float64(problem: AttentionProblem, inputs: AttentionInputs) -> None:
    ours = _forward_backward(dash_inductor.attention, inputs, problem)
    q, k, v, mask = inputs.args
    kwargs = dict(problem.sdpa_kwargs(), attn_mask=mask)
    truth = sdpa_math_reference(q, k, v, _grad_out(problem), torch.float64, **kwargs)
    same = sdpa_math_reference(q, k, v, _grad_out(problem), problem.dtype, **kwargs)
    for check, ref in zip(flash_rule_errors(ours, same, truth), truth):
        bound = 2 * check.same_error + SLACK[problem.dtype] * max(1.0, ref.abs().max().item())
        assert check.error <= bound, (f"{check.name}: error {check.error:.3g} > {bound:.3g} "
                                      f"(SDPA's in {problem.dtype}: {check.same_error:.3g}) on "
                                      f"{problem}")
    lse = torch.ops.dash.attention(*inputs.args, **problem.sdpa_kwargs())[1].double()
    expected = _reference_logsumexp(problem, inputs)
    assert torch.equal(lse.isinf(), expected.isinf()), f"-inf rows differ on {problem}"
    finite = ~expected.isinf()
    torch.testing.assert_close(lse[finite], expected[finite], atol=1e-5, rtol=1e-5)


@settings(CI, max_examples=40)
@given(problem=REFERENCE_PROBLEMS, seed=st.integers(0, 2**16))
def test_reference_matches_sdpa_math(problem: AttentionProblem, seed: int):
    _check_against_float64(problem, problem.make_inputs("cpu", seed))


@settings(CI, max_examples=15)
@given(problem=REFERENCE_PROBLEMS)
def test_reference_is_bitwise_reproducible(problem: AttentionProblem):
    inputs = problem.make_inputs("cpu", seed=1)
    assert_bitwise_reproducible(dash_inductor.attention, *inputs.args, runs=3,
                                **problem.sdpa_kwargs())


@settings(CI, max_examples=15)
@given(problem=attention_problems(batch=(2, 4), dtypes=LOW_PRECISION))
def test_reference_is_batch_invariant(problem: AttentionProblem):
    inputs = problem.make_inputs("cpu", seed=2)
    assert_batch_invariant(dash_inductor.attention, inputs.args, in_dims=problem.batch_in_dims(),
                           kwargs=problem.sdpa_kwargs())


@pytest.mark.parametrize("kind", TINY_KINDS)
@settings(SLOW, max_examples=5)
@given(data=st.data(), schedule=SCHEDULES, seed=st.integers(0, 2**16))
def test_triton_matches_sdpa_math(kind: str, data: st.DataObject, schedule: str, seed: int):
    problem = data.draw(TINY_KINDS[kind], label="problem")
    with config.patch(cpu_backend="triton", schedule=schedule):
        _check_against_float64(problem, problem.make_inputs("cpu", seed))


@pytest.mark.parametrize("kind", TINY_KINDS)
@settings(SLOW, max_examples=3)
@given(data=st.data(), schedule=SCHEDULES)
def test_triton_is_reproducible_and_batch_invariant(kind: str, data: st.DataObject,
                                                    schedule: str):
    problem = data.draw(TINY_KINDS[kind], label="problem")
    inputs = problem.make_inputs("cpu", seed=3)
    with config.patch(cpu_backend="triton", schedule=schedule):
        assert_bitwise_reproducible(dash_inductor.attention, *inputs.args, runs=2,
                                    **problem.sdpa_kwargs())
        assert_batch_invariant(dash_inductor.attention, inputs.args,
                               in_dims=problem.batch_in_dims(), kwargs=problem.sdpa_kwargs())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@settings(SLOW, max_examples=1)
@given(problem=TINY_PROBLEMS)
def test_fresh_process_gives_the_same_bits(backend: str, problem: AttentionProblem):
    inputs = problem.make_inputs("cpu", seed=4)
    call = functools.partial(dash_inductor.attention, **problem.sdpa_kwargs())
    with config.patch(cpu_backend=backend):
        assert_process_reproducible(call, *inputs.args)


class _UserAttention(torch.nn.Module):
    """What a user's model holds: a plain SDPA call, which the Inductor pass rewrites."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, attn_mask=None):
        return _sdpa(q, k, v, attn_mask=attn_mask, **self.kwargs)


@settings(SLOW, max_examples=3)
@given(problem=attention_problems(batch=(1, 2), q_heads=(1, 4), q_len=(1, 24), kv_len=(1, 24)))
def test_compiled_gives_the_same_bits_as_eager(problem: AttentionProblem):
    """torch.compile of dash.attention, and of a plain SDPA call rewritten by the Inductor pass
    under deterministic algorithms, give the bits of eager dash.attention."""
    inputs = problem.make_inputs("cpu", seed=5)
    kwargs = problem.sdpa_kwargs()
    eager = assert_bitwise_reproducible(dash_inductor.attention, *inputs.args, runs=2, **kwargs)
    torch._dynamo.reset()
    with torch._inductor.utils.fresh_inductor_cache(), deterministic_algorithms_mode(True):
        compiled_op = torch.compile(dash_inductor.attention, fullgraph=True, dynamic=False)
        op_bits = assert_bitwise_reproducible(compiled_op, *inputs.args, runs=2, **kwargs)
        compiled_sdpa = torch.compile(_UserAttention(kwargs), fullgraph=True, dynamic=False)
        sdpa_bits = assert_bitwise_reproducible(compiled_sdpa, *inputs.args, runs=2)
    assert_bitwise_equal(eager, op_bits, f"compiled dash.attention != eager on {problem}")
    assert_bitwise_equal(eager, sdpa_bits, f"compiled SDPA (rewritten) != eager on {problem}")
