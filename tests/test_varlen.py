"""dash.varlen_attention against SDPA's math backend in float64, one sequence at a time with the
dense mask built here from varlen_attn's definition (window aligned bottom-right per sequence,
a side of at least max_k unbounded); packing invariance bit for bit; every bad input's error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from dash_inductor import config, pytest_plugin
from dash_inductor.library.varlen import AuxRequest, varlen_attention
from tests._reference import tolerance

CI = settings.get_profile(pytest_plugin.CI_PROFILE)
SIDE = st.one_of(st.just(-1), st.integers(0, 40))
LSE = AuxRequest(lse=True)


def varlen_mask(lq: int, lk: int, left: int, right: int, max_k: int) -> torch.Tensor:
    """keep[i, j] of one sequence: FlashAttention's window, bottom-right aligned."""
    left, right = (-1 if w >= max_k else w for w in (left, right))
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


@st.composite
def packings(draw, max_seqs: int = 4, max_len: int = 40):
    n = draw(st.integers(1, max_seqs))
    lens_q = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    self_attention = draw(st.booleans())
    lens_k = lens_q if self_attention else draw(
        st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    hkv = draw(st.integers(1, 2))
    window = draw(st.one_of(st.just((-1, 0)), st.tuples(SIDE, SIDE)))
    return dict(lens_q=lens_q, lens_k=lens_k, hkv=hkv, hq=hkv * draw(st.integers(1, 2)),
                e=draw(st.sampled_from([8, 16])), window=window,
                slack=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**16)))


def _offsets(lengths, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=dtype)


def _inputs(p: dict, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(p["seed"])
    tq, tk = sum(p["lens_q"]), sum(p["lens_k"])
    q, k, v, grad = (torch.randn(t, h, p["e"], generator=gen, dtype=torch.float64).to(dtype)
                     for t, h in ((tq, p["hq"]), (tk, p["hkv"]), (tk, p["hkv"]), (tq, p["hq"])))
    return q, k, v, grad


def _run(p: dict, q, k, v, grad, lens_q=None, lens_k=None):
    """(out, lse, dq, dk, dv) of varlen_attention, with the packing's max_q/max_k."""
    lens_q, lens_k = lens_q or p["lens_q"], lens_k or p["lens_k"]
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = varlen_attention(q, k, v, _offsets(lens_q), _offsets(lens_k, torch.int64),
                                max(p["lens_q"]) + p["slack"], max(p["lens_k"]) + p["slack"],
                                return_aux=LSE, window_size=p["window"],
                                enable_gqa=p["hq"] != p["hkv"])
    return (out.detach(), lse, *torch.autograd.grad(out, (q, k, v), grad))


def _oracle(p: dict, q, k, v, grad):
    """The same five tensors from float64 SDPA math (and logsumexp), sequence by sequence."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    max_k = max(p["lens_k"]) + p["slack"]
    outs, lses = [], []
    cq, ck = _offsets(p["lens_q"]).tolist(), _offsets(p["lens_k"]).tolist()
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        keep = varlen_mask(q1 - q0, k1 - k0, *p["window"], max_k)
        if k1 == k0:
            outs.append(torch.zeros(q1 - q0, p["hq"], v.shape[2], dtype=torch.float64))
            lses.append(torch.full((p["hq"], q1 - q0), -math.inf, dtype=torch.float64))
            continue
        with sdpa_kernel(SDPBackend.MATH):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep,
                                                       enable_gqa=True).transpose(0, 1))
        scores = qs @ ks.repeat_interleave(p["hq"] // p["hkv"], 0).transpose(-1, -2)
        lses.append(torch.logsumexp(scores.detach() / math.sqrt(p["e"]) + torch.zeros(
            keep.shape, dtype=torch.float64).masked_fill(~keep, -math.inf), dim=-1))
    out = torch.cat(outs)
    if out.requires_grad:
        grads = torch.autograd.grad(out, (q, k, v), grad.double(), allow_unused=True,
                                    materialize_grads=True)
    else:  # no sequence has a key
        grads = tuple(torch.zeros_like(t) for t in (q, k, v))
    return (out.detach(), torch.cat(lses, dim=1), *grads)


def _check(p: dict, dtype: torch.dtype) -> None:
    q, k, v, grad = _inputs(p, dtype)
    for name, mine, theirs in zip(("out", "lse", "dq", "dk", "dv"), _run(p, q, k, v, grad),
                                  _oracle(p, q, k, v, grad)):
        torch.testing.assert_close(mine.double(), theirs, **tolerance(dtype),
                                   msg=lambda m: f"{name} {p}: {m}")


@settings(CI, max_examples=40)
@given(p=packings())
def test_reference_varlen_matches_sdpa_math(p):
    _check(p, torch.float64)


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@settings(CI, max_examples=2)
@given(p=packings(max_seqs=3))
def test_triton_varlen_matches_sdpa_math(schedule, p):
    with config.patch(cpu_backend="triton", schedule=schedule):
        _check(p, torch.float32)


def _assert_packing_invariant(p: dict, dtype: torch.dtype) -> None:
    q, k, v, grad = _inputs(p, dtype)
    packed = _run(p, q, k, v, grad)
    cq, ck = _offsets(p["lens_q"]).tolist(), _offsets(p["lens_k"]).tolist()
    for i, (lq, lk) in enumerate(zip(p["lens_q"], p["lens_k"])):
        rows, cols = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        alone = _run(p, q[rows], k[cols], v[cols], grad[rows], [lq], [lk])
        parts = (packed[0][rows], packed[1][:, rows], packed[2][rows], packed[3][cols],
                 packed[4][cols])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), parts, alone):
            assert torch.equal(a, b), f"sequence {i} {name} differs packed and alone; {p}"


@settings(CI, max_examples=15)
@given(p=packings())
def test_reference_packing_invariance(p):
    _assert_packing_invariant(p, torch.float32)


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@settings(CI, max_examples=1)
@given(p=packings(max_seqs=3, max_len=36))
def test_triton_packing_invariance(schedule, p):
    with config.patch(cpu_backend="triton", schedule=schedule):
        _assert_packing_invariant(p, torch.float32)


def _bad(**changes):
    """Valid arguments (two sequences of 3 and 4 tokens, 2 heads), with ``changes`` applied."""
    args = dict(query=torch.randn(7, 2, 8), key=torch.randn(7, 2, 8), value=torch.randn(7, 2, 8),
                cu_seq_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                cu_seq_k=torch.tensor([0, 3, 7], dtype=torch.int32), max_q=4, max_k=4)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, match", [
    (dict(cu_seq_q=torch.tensor([0., 3., 7.])), "cu_seq_q must have dtype int32 or int64"),
    (dict(cu_seq_k=torch.tensor([[0, 3, 7]], dtype=torch.int32)), "cu_seq_k must be 1-D"),
    (dict(cu_seq_k=None), "cu_seq_k must be a Tensor"),
    (dict(cu_seq_q=torch.tensor([1, 3, 7], dtype=torch.int32)), "cu_seq_q must start at 0"),
    (dict(cu_seq_k=torch.tensor([0, 5, 3, 7])), "cu_seq_q and cu_seq_k must have the same length"),
    (dict(cu_seq_q=torch.tensor([0, 5, 3, 7]), cu_seq_k=torch.tensor([0, 1, 2, 7])),
     "cu_seq_q must be non-decreasing"),
    (dict(cu_seq_k=torch.tensor([0, 3, 6])), r"cu_seq_k\[-1\] must equal .* Tk=7"),
    (dict(max_q=3), "max_q=3 is smaller than the longest sequence in cu_seq_q"),
    (dict(max_k=2), "max_k=2 is smaller than the longest sequence in cu_seq_k"),
    (dict(max_k=-1), "max_k must be a non-negative int"),
    (dict(window_size=(-2, 0)), "window_size values must be >= -1"),
    (dict(window_size=(0, 2**63)), r"window_size values must be >= -1 and <= 2\*\*63 - 1"),
    (dict(key=torch.randn(7, 3, 8), value=torch.randn(7, 3, 8), query=torch.randn(7, 4, 8),
          enable_gqa=True), r"query heads \(4\) must be a multiple .* key/value heads \(3\)"),
    (dict(key=torch.randn(7, 1, 8), value=torch.randn(7, 1, 8)),
     "query has 2 heads and key/value 1"),
    (dict(key=torch.randn(7, 2, 4)), "query and key must have the same head dim"),
    (dict(value=torch.randn(6, 2, 8)), "key and value must agree on"),
    (dict(query=torch.randn(1, 7, 2, 8)), "query must be 3-D"),
])
def test_bad_input_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        varlen_attention(**_bad(**changes))


def test_opcheck_varlen_ops():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    args = (q, k, v, cu, cu, 4, 4, None, [2, 0], False)
    torch.library.opcheck(torch.ops.dash.varlen_attention.default, args)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.dash.varlen_attention(q, k, v, *args[3:])
    torch.library.opcheck(torch.ops.dash.varlen_attention_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu, cu, 4, 4, 0.5, [-1, -1],
                           False))


def test_gradients_take_the_layout_of_their_inputs():
    """The backward op returns (T, H, D) views of (H, T, D) memory for such inputs (so autograd
    has no copy to make to the leaves' strides), with the values of the contiguous call; opcheck
    holds for the strided inputs."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, grad_out = (torch.randn(2, 9, 8, generator=gen).transpose(0, 1) for _ in range(4))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse = torch.ops.dash.varlen_attention(q, k, v, cu, cu, 5, 5, None, [-1, 0], False)
    args = (cu, cu, 5, 5, 0.5, [-1, 0], False)
    strided = torch.ops.dash.varlen_attention_backward(grad_out, q, k, v, out, lse, *args)
    dense = torch.ops.dash.varlen_attention_backward(
        *(t.contiguous() for t in (grad_out, q, k, v, out)), lse, *args)
    for g, d, t in zip(strided, dense, (q, k, v)):
        assert g.stride() == t.stride() and torch.equal(g, d)
    torch.library.opcheck(torch.ops.dash.varlen_attention_backward.default,
                          (grad_out, q, k, v, out, lse, *args))
