"""NaN and inf propagate through dash.attention exactly as through SDPA's math backend.

A diverging run must show up as NaN, not as a plausible zero. Hypothesis draws problems (GQA,
boolean and float masks with fully masked rows, causal) and a few NaN/+inf/-inf entries placed in
q, k, v or a float mask. The NaN positions of out, logsumexp, dq, dk, dv and the mask gradient must
equal those of SDPA's math backend in float64 (logsumexp: that of its scores, NaN on rows whose
softmax is NaN), and every other value must agree with it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import dash_inductor
from dash_inductor import config, pytest_plugin
from dash_inductor.testing import AttentionInputs, AttentionProblem, attention_problems
from tests._reference import reference_scores, sdpa_math

CI = settings.get_profile(pytest_plugin.CI_PROFILE)
# The interpreter is slow: report a failing draw without shrinking it (the draws are tiny).
SLOW = settings(CI, phases=(Phase.explicit, Phase.generate))
SMALL = dict(batch=(1, 2), q_heads=(1, 4), q_len=(1, 20), kv_len=(1, 20), head_dims=(4, 8),
             tile=8)
TINY = dict(batch=(1, 1), q_heads=(1, 2), gqa_ratios=(1, 2), q_len=(1, 24), kv_len=(1, 24),
            head_dims=(16,), tile=16)
POISON = st.sampled_from([math.nan, math.inf, -math.inf])
NAMES = ("out", "logsumexp", "dq", "dk", "dv", "dmask")


@st.composite
def poisoned(draw, problems: st.SearchStrategy[AttentionProblem]):
    """A problem, a seed for its inputs and 1-3 (tensor, flat index, NaN/inf) entries to set."""
    problem = draw(problems)
    targets = ["query", "key", "value"] + ["attn_mask"] * (problem.mask == "float")
    seed = draw(st.integers(0, 2**16))
    sizes = {name: getattr(problem.make_inputs(seed=0, requires_grad=False), name).numel()
             for name in targets}
    entries = draw(st.lists(st.sampled_from(targets).flatmap(
        lambda name: st.tuples(st.just(name), st.integers(0, sizes[name] - 1), POISON)),
        min_size=1, max_size=3))
    return problem, seed, entries


def _inputs(problem: AttentionProblem, seed: int, entries, dtype: torch.dtype) -> AttentionInputs:
    """Fresh inputs with the poison set; a float mask requires grad so its gradient is checked."""
    inputs = problem.make_inputs("cpu", seed, dtype=dtype, requires_grad=False)
    for name, index, value in entries:
        t = getattr(inputs, name)
        t[torch.unravel_index(torch.tensor(index), t.shape)] = value
    mask = inputs.attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().requires_grad_(True)
    return AttentionInputs(*(t.requires_grad_(True) for t in inputs.args[:3]), mask)


def _upstream(problem: AttentionProblem, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (problem.batch, problem.q_heads, problem.q_len, problem.v_head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _grads(out: torch.Tensor, inputs: AttentionInputs, grad_out: torch.Tensor) -> list:
    wrt = [t for t in inputs.args if t is not None and t.requires_grad]
    grads = list(torch.autograd.grad(out, wrt, grad_out.to(out.dtype)))
    return grads + [None] * (4 - len(grads))


def _math_logsumexp(problem: AttentionProblem, inputs: AttentionInputs,
                    hide_future: bool = False) -> torch.Tensor:
    """logsumexp of the scores as SDPA's math backend forms them (masks *added* as -inf), NaN
    where a +inf score makes its softmax NaN (``torch.logsumexp`` would say +inf).
    ``hide_future`` sets the scores above the causal diagonal to -inf instead."""
    scores, mask = reference_scores(problem, inputs)
    if problem.is_causal:
        mask = torch.ones(problem.q_len, problem.kv_len, dtype=torch.bool).tril()
        if hide_future:
            scores, mask = scores.masked_fill(~mask, -math.inf), None
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    scores = scores if mask is None else scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return lse.masked_fill((scores == math.inf).any(-1), math.nan)


def _expected(problem: AttentionProblem, inputs: AttentionInputs, grad_out: torch.Tensor) -> list:
    out, leaves = sdpa_math(*inputs.args[:3], attn_mask=inputs.attn_mask, **problem.sdpa_kwargs())
    grads = _grads(out, AttentionInputs(*leaves), grad_out)
    return [out.detach(), _math_logsumexp(problem, inputs), *grads]


def _actual(problem: AttentionProblem, inputs: AttentionInputs, grad_out: torch.Tensor) -> list:
    """dash.attention's out and gradients (the backend in ``config``), and the op's logsumexp."""
    out = dash_inductor.attention(*inputs.args, **problem.sdpa_kwargs())
    lse = torch.ops.dash.attention(*inputs.args, **problem.sdpa_kwargs())[1]
    return [out.detach(), lse, *_grads(out, inputs, grad_out)]


def _row_by_row(problem: AttentionProblem, inputs: AttentionInputs,
                grad_out: torch.Tensor) -> list:
    """Causal attention with each query row run against only the keys it sees (SDPA math, no
    mask), so that no NaN crosses the diagonal: the least a causal kernel must propagate."""
    q, k, v = (t.detach().requires_grad_(True) for t in inputs.args[:3])
    kwargs = dict(problem.sdpa_kwargs(), is_causal=False)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.cat([F.scaled_dot_product_attention(q[..., i:i + 1, :], k[..., :i + 1, :],
                                                        v[..., :i + 1, :], **kwargs)
                         for i in range(problem.q_len)], dim=-2)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return [out.detach(), _math_logsumexp(problem, inputs, hide_future=True), *grads, None]


def _check(problem: AttentionProblem, seed: int, entries, dtype: torch.dtype, tol: dict) -> None:
    """NaN exactly where SDPA's math backend has it; causal kernels that skip the tiles above the
    diagonal (the Triton ones) only between the row-by-row oracle and SDPA's math backend."""
    inputs = _inputs(problem, seed, entries, dtype)
    exact = inputs.cast(torch.float64)
    grad_out = _upstream(problem, seed)
    expected = _expected(problem, exact, grad_out)
    skips_tiles = problem.is_causal and config.get("cpu_backend") == "triton"
    least = _row_by_row(problem, exact, grad_out) if skips_tiles else expected
    where = f"{problem} poison {entries}"
    for name, mine, low, high in zip(NAMES, _actual(problem, inputs, grad_out), least, expected):
        if high is None:
            continue
        mine = mine.double()
        nan = mine.isnan()
        missed, extra = low.isnan() & ~nan, nan & ~high.isnan()
        assert not missed.any() and not extra.any(), (
            f"{name}: {int(missed.sum())} NaN missing, {int(extra.sum())} extra; NaN at "
            f"{nan.nonzero().tolist()}, SDPA math at {high.isnan().nonzero().tolist()}; {where}")
        torch.testing.assert_close(mine[~nan], low[~nan], **tol,
                                   msg=lambda m: f"{name}: {m}; {where}")


@settings(CI, max_examples=60)
@given(case=poisoned(attention_problems(**SMALL, dtypes=(torch.float64,))))
def test_reference_propagates_nan_like_sdpa_math(case):
    _check(*case, torch.float64, dict(atol=1e-9, rtol=1e-7))


@pytest.mark.parametrize("causal", [False, True], ids=["masked-or-full", "causal"])
@settings(SLOW, max_examples=12)
@given(data=st.data(), schedule=st.sampled_from(config.DETERMINISTIC_SCHEDULES))
def test_triton_propagates_nan_like_sdpa_math(causal: bool, data: st.DataObject, schedule: str):
    case = data.draw(poisoned(attention_problems(**TINY, causal=(causal,))), label="case")
    with config.patch(cpu_backend="triton", schedule=schedule):
        _check(*case, torch.float32, dict(atol=1e-4, rtol=1e-4))
