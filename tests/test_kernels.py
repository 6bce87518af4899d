"""Numerics of the Triton kernels against an independent float64 PyTorch attention.

On a machine without CUDA the kernels run in the Triton interpreter (programs one after another,
so the ordered dQ waits are compiled out and the sequential order is itself deterministic). The
shapes are tiny and the interpreter's tile table is small (16x32), so many tiles, sub-tiles and
ragged edges are exercised within seconds.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dash_inductor.ops import attention_backward, attention_forward  # noqa: E402
from dash_inductor.ops.catalog import DETERMINISTIC, NAMES  # noqa: E402
from dash_inductor.ops.portable.configs import PORTABLE_AUTO  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
SCHEDULES = NAMES
# Max-abs error allowed, as a fraction of the reference's max-abs value, per input dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int = 1
    hq: int = 2
    hkv: int = 2
    seq_q: int = 37
    seq_k: int = 37
    e: int = 32
    ev: int = 32
    causal: bool = False
    mask: str = "none"  # "none", "bool" or "float" (each with one fully masked row)
    dtype: torch.dtype = torch.float32
    transposed: bool = False  # inputs and gradients as (B, L, H, E) memory viewed as (B, H, L, E)


CASES = [
    Case("full_odd_fp32"),
    Case("causal_square", causal=True, seq_q=45, seq_k=45),
    Case("causal_short_q", causal=True, seq_q=19, seq_k=70),
    Case("causal_long_q", causal=True, seq_q=70, seq_k=23),
    Case("bool_mask", mask="bool", seq_q=33, seq_k=50),
    Case("float_mask_causal", mask="float", causal=True, seq_q=40, seq_k=40),
    Case("gqa", hq=4, hkv=1, seq_q=35, seq_k=41),
    Case("gqa_causal_bf16", hq=4, hkv=2, causal=True, seq_q=50, seq_k=50, dtype=torch.bfloat16),
    Case("d64_fp16", e=64, ev=64, seq_q=30, seq_k=33, dtype=torch.float16),
    Case("d96_bf16", e=96, ev=96, hq=1, hkv=1, seq_q=21, seq_k=40, dtype=torch.bfloat16),
    Case("d128_fp16", e=128, ev=128, hq=1, hkv=1, seq_q=33, seq_k=20, dtype=torch.float16),
    Case("ev_ne_e", e=24, ev=40, seq_q=17, seq_k=29),
    Case("transposed_batch", batch=2, transposed=True, seq_q=20, seq_k=36, mask="float"),
    Case("single_token", seq_q=1, seq_k=1, causal=True),
]


def _tensor(case: Case, heads: int, seq: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    if case.transposed:
        data = torch.randn(case.batch, seq, heads, dim, generator=generator).transpose(1, 2)
    else:
        data = torch.randn(case.batch, heads, seq, dim, generator=generator)
    return data.to(DEVICE, case.dtype)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """An output with ``t``'s shape and strides, poisoned with NaN to catch unwritten elements."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).fill_(float("nan"))


def _mask(case: Case, generator: torch.Generator) -> torch.Tensor | None:
    if case.mask == "none":
        return None
    keep = torch.rand(case.batch, 1, case.seq_q, case.seq_k, generator=generator) > 0.3
    keep[..., 0] = True
    keep[:, :, case.seq_q // 2, :] = False  # a row that sees no key
    if case.mask == "bool":
        mask = keep
    else:
        bias = torch.randn(case.batch, 1, case.seq_q, case.seq_k, generator=generator)
        mask = torch.where(keep, bias, torch.tensor(float("-inf"))).to(case.dtype)
    return mask.to(DEVICE).expand(case.batch, case.hq, case.seq_q, case.seq_k)


def _reference(q, k, v, mask, do, causal, scale):
    """softmax(q k^T scale + mask) v and its gradients, in float64 with autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.double())
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    dead = (scores == float("-inf")).all(dim=-1, keepdim=True)  # rows that see no key
    scores = scores.masked_fill(dead, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(dead.squeeze(-1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(dead, 0.0)
    out = probs @ v.repeat_interleave(group, 1)
    out.backward(do.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _run_case(case: Case, schedule: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = _tensor(case, case.hq, case.seq_q, case.e, generator)
    k = _tensor(case, case.hkv, case.seq_k, case.e, generator)
    v = _tensor(case, case.hkv, case.seq_k, case.ev, generator)
    do = _tensor(case, case.hq, case.seq_q, case.ev, generator)
    mask = _mask(case, generator)
    scale = case.e ** -0.5
    out = _empty_like(do)
    lse = torch.full((case.batch, case.hq, case.seq_q), float("nan"), device=DEVICE)
    attention_forward(q, k, v, mask, out, lse, is_causal=case.causal, scale=scale)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    plan = attention_backward(do, q, k, v, out, lse, mask, dq, dk, dv, is_causal=case.causal,
                              scale=scale, schedule=schedule)
    expected = _reference(q, k, v, mask, do, case.causal, scale)
    return plan, (out, lse, dq, dk, dv), expected


def _assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    ours = ours.double().cpu()
    ref = ref.cpu()
    assert not torch.isnan(ours).any(), f"{name}: NaN (unwritten or invalid) elements"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), finite), f"{name}: infinities differ from the reference"
    err = (ours[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    bound = TOLERANCE[dtype] * max(ref[finite].abs().max().item() if finite.any() else 0.0, 1.0)
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_and_backward_match_float64(case: Case, schedule: str) -> None:
    plan, ours, expected = _run_case(case, schedule)
    assert (plan.schedule_requested, plan.schedule.name, plan.fallback) == (schedule, schedule, None)
    assert plan.op == "backward" and plan.kernel == "portable" and plan.grid[0] >= 1
    for name, mine, ref in zip(("out", "lse", "dq", "dk", "dv"), ours, expected):
        _assert_close(name, mine, ref, case.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c.mask != "none"], ids=lambda c: c.name)
def test_rows_that_see_no_key_are_zero(case: Case) -> None:
    _, (out, lse, dq, _, _), _ = _run_case(case, SCHEDULES[0], seed=1)
    row = case.seq_q // 2
    assert torch.all(lse[:, :, row] == float("-inf"))
    assert torch.all(out[:, :, row] == 0)
    assert torch.all(dq[:, :, row] == 0)


def test_schedules_agree_closely_and_runs_repeat_bitwise() -> None:
    case = Case("gqa_mask", hq=4, hkv=2, seq_q=40, seq_k=70, mask="bool", causal=True)
    first = {s: _run_case(case, s)[1] for s in SCHEDULES}
    again = _run_case(case, "shift")[1]
    assert all(torch.equal(a, b) for a, b in zip(first["shift"], again))
    for schedule in SCHEDULES[1:]:
        for mine, base in zip(first[schedule][2:], first[SCHEDULES[0]][2:]):
            torch.testing.assert_close(mine, base, rtol=1e-5, atol=1e-5)


def test_auto_resolves_to_a_deterministic_schedule() -> None:
    case = Case("auto", causal=True, seq_q=20, seq_k=20)
    plan, _, _ = _run_case(case, "auto")
    assert plan.schedule.name == PORTABLE_AUTO
    assert plan.schedule.name in DETERMINISTIC and plan.schedule_requested == "auto"


def test_unknown_schedule_is_rejected() -> None:
    with pytest.raises(ValueError, match="schedule"):
        _run_case(Case("bad", seq_q=4, seq_k=4), "fastest")
