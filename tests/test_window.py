"""``window_size`` on dash.attention against SDPA's math backend in float64 with the equivalent
dense mask, built here from the definition (top-left aligned; ``is_causal`` intersects)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dash_inductor
from dash_inductor import config, pytest_plugin
from dash_inductor.library.window import check_window
from tests._reference import sdpa_math, tolerance

CI = settings.get_profile(pytest_plugin.CI_PROFILE)
SIDE = st.one_of(st.just(-1), st.integers(0, 40))


def window_mask(l: int, s: int, left: int, right: int, is_causal: bool) -> torch.Tensor:
    """keep[i, j]: key j within (left, right) of query i, and j <= i when causal."""
    i = torch.arange(l)[:, None]
    j = torch.arange(s)[None, :]
    keep = torch.ones(l, s, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if is_causal:
        keep &= j <= i
    return keep


@st.composite
def problems(draw, max_len: int = 70):
    hkv = draw(st.integers(1, 2))
    return dict(batch=draw(st.integers(1, 2)), hq=hkv * draw(st.integers(1, 2)), hkv=hkv,
                l=draw(st.integers(1, max_len)), s=draw(st.integers(1, max_len)),
                e=draw(st.sampled_from([8, 16])), window=(draw(SIDE), draw(SIDE)),
                is_causal=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _check(p: dict, dtype: torch.dtype, **choices) -> None:
    gen = torch.Generator().manual_seed(p["seed"])
    q, k, v, grad = (torch.randn(p["batch"], h, n, p["e"], generator=gen, dtype=torch.float64)
                     for h, n in ((p["hq"], p["l"]), (p["hkv"], p["s"]), (p["hkv"], p["s"]),
                                  (p["hq"], p["l"])))
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    out = dash_inductor.attention(q, k, v, is_causal=p["is_causal"], window_size=p["window"],
                                  enable_gqa=True, **choices)
    mask = window_mask(p["l"], p["s"], *p["window"], p["is_causal"])
    expected, leaves = sdpa_math(q, k, v, attn_mask=mask, enable_gqa=True)
    mine = (out, *torch.autograd.grad(out, (q, k, v), grad.to(dtype)))
    theirs = (expected, *torch.autograd.grad(expected, leaves[:3], grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), mine, theirs):
        torch.testing.assert_close(a.double(), b, **tolerance(dtype),
                                   msg=lambda m: f"{name} {p}: {m}")


@settings(CI, max_examples=40)
@given(p=problems())
def test_reference_window_matches_sdpa_math(p):
    _check(p, torch.float64)


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@settings(CI, max_examples=3)
@given(p=problems(max_len=45))
def test_triton_window_matches_sdpa_math(schedule, p):
    with config.patch(cpu_backend="triton"):
        _check(p, torch.float32, schedule=schedule)


def test_window_with_a_mask_intersects():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(30, 30, generator=gen) > 0.3
    out = dash_inductor.attention(q, k, v, attn_mask=mask, window_size=(4, 0))
    expected, _ = sdpa_math(q, k, v, attn_mask=mask & window_mask(30, 30, 4, 0, False))
    torch.testing.assert_close(out, expected, **tolerance(torch.float64))


def test_causal_window_is_right_side_zero():
    """(W, 0) alone, (W, 0) with is_causal and (W, 5) with is_causal are one mask: bits equal."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen) for _ in range(3))
    runs = [dash_inductor.attention(q, k, v, is_causal=c, window_size=w)
            for c, w in ((False, (7, 0)), (True, (7, 0)), (True, (7, 5)))]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("window, match", [
    ((-2, 0), "window_size values must be >= -1"),
    ((0, -5), "window_size values must be >= -1"),
    ((3,), "window_size must be a pair"),
    ("ab", "window_size must be a pair"),
    ((1.5, 0), "window_size left must be an int"),
    ((2**63, 0), r"window_size values must be >= -1 and <= 2\*\*63 - 1 \(int64"),
    ((0, -2**70), r"window_size values must be >= -1 and <= 2\*\*63 - 1 \(int64"),
])
def test_bad_window_raises(window, match):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=match):
        dash_inductor.attention(q, q, q, window_size=window)


def test_check_window_takes_every_int64_side():
    assert check_window((2**63 - 1, -1), "dash.attention") == (2**63 - 1, -1)
    with pytest.raises(ValueError, match=r"^dash.varlen_attention: window_size values must be "):
        check_window((-1, 2**63), "dash.varlen_attention")


def test_opcheck_attention_with_window():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 19, 8, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.randn(19, 19, generator=gen, requires_grad=True)
    torch.library.opcheck(torch.ops.dash.attention.default, (q, k, v),
                          dict(is_causal=True, window_size=[5, -1]))
    torch.library.opcheck(torch.ops.dash.attention.default, (q, k, v, mask),
                          dict(window_size=[3, 2]))


@pytest.mark.parametrize("schedule", config.SCHEDULES[1:])
@pytest.mark.parametrize("window, is_causal", [((8, 0), False), ((8, 8), False), ((5, 40), True)])
def test_triton_skips_tiles_outside_the_window(schedule, window, is_causal):
    """A NaN in one value row reaches only the rows and keys whose tiles meet its key's tiles:
    SDPA math (0 * NaN) and a kernel that loaded every tile would spread it everywhere."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 160, 16, generator=gen) for _ in range(3))
    v[0, 1, 10, 3] = float("nan")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with config.patch(cpu_backend="triton"):
        out = dash_inductor.attention(q, k, v, is_causal=is_causal, window_size=window,
                                      schedule=schedule)
        out.backward(torch.randn(out.shape, generator=gen))
    far = slice(10 + 8 + 2 * 32 + 8, None)  # beyond the window and two tiles of any size
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert t[:, :, far].isfinite().all(), f"{name} has NaN far from the poisoned key"
    assert out[0, 1, 10].isnan().any()  # the NaN does reach the rows that see it


@pytest.mark.parametrize("is_causal, fallback", [(False, "ascending"), (True, "descending")])
def test_shift_falls_back_under_a_window_and_says_so(is_causal, fallback):
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    with config.patch(cpu_backend="triton"):
        dash_inductor.attention(q, q, q, is_causal=is_causal, window_size=(6, -1),
                                schedule="shift").sum().backward()
    plan = dash_inductor.library.op.last_plans()[-1]
    assert (plan.schedule_requested, plan.schedule.name) == ("shift", fallback)
    assert "no sliding-window ranks" in plan.fallback
