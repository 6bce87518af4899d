"""GPU tests of the driver launches (ops/shared/driver.py): every launch of a plan goes through
the driver, and the bits equal those of Triton's launcher, whose arguments it packs itself.

What a mistake there would do is pass a wrong pointer, scalar or TMA map: garbage or an error,
caught by equality with the same kernels launched by Triton on the same inputs.
"""

import pytest
import torch

import dash_inductor
from dash_inductor.library.op import last_plans
from dash_inductor.ops import cache_clear
from dash_inductor.ops.shared import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _dense(kernel, causal, dim, hkv):
    gen = torch.Generator(device="cuda").manual_seed(dim + hkv + causal)
    q = torch.randn((2, 8, 700, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((2, hkv, 900, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dash_inductor.attention(q, k, v, is_causal=causal, enable_gqa=hkv != 8, kernel=kernel)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def _varlen(kernel):
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths = [300, 1000, 129, 700]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k, v = (torch.randn((sum(lengths), 4, 128), device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    with dash_inductor.config.patch(kernel=kernel):
        out = dash_inductor.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths),
                                             window_size=(-1, 0))
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def _both(monkeypatch, run):
    """``run()`` twice from fresh plans, launched by Triton then by the driver: (bits of each,
    whether every launch of the second took the driver)."""
    monkeypatch.setattr(launch, "LAUNCHER", "triton")
    cache_clear()
    expected = run()
    monkeypatch.setattr(launch, "LAUNCHER", "driver")
    cache_clear()
    got = run()
    torch.cuda.synchronize()
    direct = [all(plan.launches.via_driver().values()) for plan in last_plans()[-2:]
              if plan.launches is not None]
    return expected, got, direct


CASES = [("portable", False, 64, 8), ("portable", True, 128, 2)]
if HOPPER:
    CASES += [("hopper", False, 128, 8), ("hopper", True, 64, 8), ("hopper", True, 128, 2)]


@pytest.mark.parametrize("kernel,causal,dim,hkv", CASES)
def test_dense_bits_equal_triton_launches(monkeypatch, kernel, causal, dim, hkv):
    expected, got, direct = _both(monkeypatch, lambda: _dense(kernel, causal, dim, hkv))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert direct and all(direct)


@pytest.mark.parametrize("kernel", ["portable", "hopper"] if HOPPER else ["portable"])
def test_varlen_bits_equal_triton_launches(monkeypatch, kernel):
    expected, got, direct = _both(monkeypatch, lambda: _varlen(kernel))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert direct and all(direct)
