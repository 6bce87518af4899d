"""The op as torch sees it: opcheck, gradcheck, fake-kernel strides, torch.compile with dynamic shapes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dash_inductor


def _inputs(q_shape, kv_shape, v_dim=None, dtype=torch.float64, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    v_shape = (*kv_shape[:-1], v_dim or kv_shape[-1])

    def make(shape):
        if transposed:  # (B, L, H, E) memory, viewed as (B, H, L, E)
            b, h, n, e = shape
            return torch.randn(b, n, h, e, generator=gen, dtype=dtype).transpose(1, 2)
        return torch.randn(shape, generator=gen, dtype=dtype)

    return make(q_shape), make(kv_shape), make(v_shape)


OPCHECK_CASES = [
    dict(q=(2, 2, 9, 8), kv=(2, 2, 13, 8), kwargs={}),
    dict(q=(1, 4, 9, 8), kv=(1, 2, 13, 8), v_dim=5, kwargs=dict(enable_gqa=True, is_causal=True)),
    dict(q=(2, 2, 9, 8), kv=(2, 2, 13, 8), kwargs=dict(attn_mask="bool", scale=0.5)),
    dict(q=(2, 2, 9, 8), kv=(2, 2, 13, 8), kwargs=dict(attn_mask="float"), transposed=True),
]


def _materialise(case, dtype=torch.float64):
    q, k, v = _inputs(case["q"], case["kv"], case.get("v_dim"), dtype=dtype,
                      transposed=case.get("transposed", False))
    kwargs = dict(case["kwargs"])
    mask_kind = kwargs.pop("attn_mask", None)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(case["q"][2], case["kv"][2]) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(1, case["q"][1], case["q"][2], case["kv"][2], dtype=dtype)
    return q, k, v, mask, kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=range(len(OPCHECK_CASES)))
def test_opcheck_attention(case, dtype):
    q, k, v, mask, kwargs = _materialise(case, dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.dash.attention.default, (q, k, v, mask), kwargs)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=range(len(OPCHECK_CASES)))
def test_opcheck_backward_ops(case):
    q, k, v, mask, kwargs = _materialise(case)
    out, lse = torch.ops.dash.attention(q, k, v, mask, **kwargs)
    grad = torch.randn_like(out)
    is_causal, scale, gqa = (kwargs.get("is_causal", False), kwargs.get("scale"),
                             kwargs.get("enable_gqa", False))
    torch.library.opcheck(torch.ops.dash.attention_backward.default,
                          (grad, q, k, v, out, lse, mask, is_causal, scale, gqa))
    if mask is not None and mask.is_floating_point():
        torch.library.opcheck(torch.ops.dash.attention_mask_grad.default,
                              (grad, q, k, v, out, lse, mask, scale, gqa))


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(enable_gqa=True),
                                    dict(attn_mask="float")])
def test_gradcheck_float64(kwargs):
    kwargs = dict(kwargs)
    q, k, v = _inputs((1, 2, 6, 4), (1, 1 if kwargs.get("enable_gqa") else 2, 7, 4), seed=3)
    args = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    if kwargs.pop("attn_mask", None):
        args.append(torch.randn(1, 2, 6, 7, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: dash_inductor.attention(*a, **kwargs), args)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("three_d", [False, True])
def test_fake_strides_equal_real(transposed, three_d):
    q, k, v = _inputs((2, 3, 9, 8), (2, 3, 11, 8), v_dim=6, dtype=torch.float32,
                      transposed=transposed)
    if three_d:
        q, k, v = q[0], k[0], v[0]
    real = torch.ops.dash.attention(q, k, v)
    real_grads = torch.ops.dash.attention_backward(real[0], q, k, v, *real, None, False, None, False)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.dash.attention(fq, fk, fv)
        fake_grads = torch.ops.dash.attention_backward(fake[0], fq, fk, fv, *fake, None, False,
                                                       None, False)
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_compile_fullgraph_dynamic_sequence_length():
    torch._dynamo.reset()

    def f(q, k, v):
        return torch.ops.dash.attention(q, k, v, is_causal=True)[0].sin().sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=None)
    for length in (17, 33, 50):
        q, k, v = (t.requires_grad_() for t in _inputs((1, 2, length, 8), (1, 2, length, 8),
                                                       dtype=torch.float32, seed=length))
        torch._dynamo.mark_dynamic(q, 2)
        torch._dynamo.mark_dynamic(k, 2)
        torch._dynamo.mark_dynamic(v, 2)
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        ref_loss = f(q, k, v)
        ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
        torch.testing.assert_close(loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
