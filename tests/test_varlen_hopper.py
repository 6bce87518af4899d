"""``kernel="hopper"`` on packed sequences, planned and launched on the CPU with the Hopper support
check stubbed and the launches recorded (Gluon runs only on the GPU; tests/gpu checks the
numbers): one launch of the packed Hopper forward, its offsets never read on the host, the packed
Hopper backward for the schedules that path is asked, and the op routing both passes there."""

from __future__ import annotations

import inspect

import pytest
import torch

from dash_inductor import config
from dash_inductor.library import varlen
from dash_inductor.ops import catalog, dispatch, rules
from dash_inductor.ops.hopper import launch
from dash_inductor.ops.hopper.forward import forward_kernel
from dash_inductor.ops.shared.launch import Launches
from tests.test_varlen_kernels import _Unreadable

LENS_Q, LENS_K = [100, 0, 200, 37], [130, 50, 0, 37]  # a sequence without queries, one without keys
_HOPPER_UNSUPPORTED = rules.hopper_unsupported


class _NoHostRead(_Unreadable):
    HOST_READS = _Unreadable.HOST_READS + (torch.Tensor.cpu, torch.Tensor.numpy,
                                           torch.Tensor.tolist)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture(autouse=True)
def hopper_takes_it(monkeypatch):
    monkeypatch.setattr(rules, "hopper_unsupported", lambda *args: None)
    monkeypatch.setattr(dispatch, "_sms", lambda q: 132)
    dispatch.cache_clear()
    yield
    dispatch.cache_clear()


@pytest.fixture
def launches(monkeypatch) -> list[tuple]:
    """Every kernel launch, recorded instead of run: (slot, kernel, grid, args, constexprs)."""
    recorded = []
    monkeypatch.setattr(Launches, "__call__", lambda self, slot, kernel, grid, args, constexprs:
                        recorded.append((slot, kernel, grid, args, constexprs)))
    return recorded


def _packed(head_dim=128, hq=4, hkv=1):
    gen = torch.Generator().manual_seed(0)
    tq, tk = sum(LENS_Q), sum(LENS_K)
    q = torch.randn(tq, hq, head_dim, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(tk, hkv, head_dim, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("head_dim, hq, hkv", [(64, 2, 2), (128, 4, 1)], ids=["d64", "d128-gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_hopper_packed_forward_is_one_launch_that_reads_no_offset(launches, head_dim, hq,
                                                                      hkv, causal):
    q, k, v = _packed(head_dim, hq, hkv)
    cu_q, cu_k = (_offsets(lens).as_subclass(_NoHostRead) for lens in (LENS_Q, LENS_K))
    out, lse = torch.empty_like(q), torch.empty(hq, q.shape[0])
    plan = dispatch.varlen_forward(q, k, v, cu_q, cu_k, 200, 130, out, lse, is_causal=causal,
                                   scale=0.1, kernel="hopper")
    assert plan.kernel == "hopper" and plan.kernel_reason is None
    assert plan.run is launch.run_varlen_forward
    assert plan.grid == (len(LENS_Q) * hq, 2)  # sequences x heads, Q tiles of max_q = 200
    (slot, kernel, grid, args, constexprs), = launches  # on CUDA the offsets' check comes first
    assert (slot, kernel, grid) == ("forward", forward_kernel, plan.grid)
    assert constexprs["VARLEN"] and constexprs["CAUSAL"] == causal
    assert constexprs["GROUP"] == hq // hkv
    names = list(inspect.signature(forward_kernel.fn).parameters)
    bound = dict(zip(names, args))
    assert bound["CU_Q"] is cu_q and bound["CU_K"] is cu_k and bound["LSE"] is lse
    assert (bound["L"], bound["S"], bound["HQ"], bound["max_q"], bound["max_k"]) == (
        q.shape[0], k.shape[0], hq, 200, 130)
    # O is stored by rows of the packed tensor (masked stores where a tile crosses its end).
    assert (bound["stride_oh"], bound["stride_om"]) == (out.stride(1), out.stride(0))
    assert list(bound["q_desc"].shape) == [1, hq, q.shape[0], head_dim]


def test_without_keys_nothing_launches_and_every_query_gets_zero(launches):
    q = torch.randn(9, 2, 64, dtype=torch.bfloat16)
    k = v = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    out, lse = torch.full_like(q, 7.0), torch.full((2, 9), 7.0)
    plan = dispatch.varlen_forward(q, k, v, _offsets([4, 5]), _offsets([0, 0]), 5, 0, out, lse,
                                   is_causal=True, scale=0.1, kernel="hopper")
    assert plan.grid == () and not launches
    assert not out.any() and (lse == float("-inf")).all()


def test_the_hopper_packed_forward_refuses_a_window(monkeypatch):
    monkeypatch.setattr(rules, "hopper_unsupported", _HOPPER_UNSUPPORTED)  # it names the window
    q, k, v = _packed()
    with pytest.raises(ValueError, match=r"dash.varlen_attention: kernel='hopper' cannot run .*"
                                         r"the Hopper forward takes no sliding window"):
        dispatch.varlen_forward(q, k, v, _offsets(LENS_Q), _offsets(LENS_K), 200, 130,
                                torch.empty_like(q), torch.empty(4, q.shape[0]),
                                is_causal=False, scale=0.1, window=(64, 0), kernel="hopper")


def test_auto_keeps_the_portable_packed_forward_and_says_why():
    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = _offsets([3, 5])
    plan = dispatch.varlen_forward(q, q, q, cu, cu, 5, 5, torch.empty_like(q), torch.empty(2, 8),
                                   is_causal=True, scale=0.1)
    assert plan.kernel == "portable" and plan.kernel_reason == rules.PACKED_FORWARD_UNMEASURED


@pytest.mark.parametrize("schedule", [catalog.AUTO, *catalog.ORDERED])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_hopper_packed_backward_takes_what_kernel_hopper_asks(monkeypatch, schedule, causal):
    """The packed Hopper backward runs the ordered schedules and ``auto`` (``shift`` there) as
    asked, through its launcher's own signature."""
    called = []

    def run(*args, **kwargs):
        inspect.signature(launch.run_varlen_backward).bind(*args, **kwargs)
        called.append(args[0])

    monkeypatch.setattr(launch, "run_varlen_backward", run)
    q, k, v = _packed()
    cu_q, cu_k = (_offsets(lens).as_subclass(_NoHostRead) for lens in (LENS_Q, LENS_K))
    lse = torch.empty(4, q.shape[0])
    grads = [torch.empty_like(t) for t in (q, k, v)]
    plan = dispatch.varlen_backward(q, q, k, v, q, lse, cu_q, cu_k, 200, 130, *grads,
                                    is_causal=causal, scale=0.1, schedule=schedule,
                                    kernel="hopper")
    assert called == [plan] and plan.kernel == "hopper" and plan.fallback is None
    assert plan.schedule.name == ("shift" if schedule == catalog.AUTO else schedule)


def test_the_op_runs_kernel_hopper_as_one_packed_launch_per_pass(monkeypatch):
    """``varlen_attention`` with ``kernel="hopper"`` hands the whole packing to the dispatcher's
    packed forward and backward, once each, and never a dense launch per sequence."""
    passes = []

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, out, lse, **options):
        passes.append(("forward", options["kernel"]))
        out.zero_()
        lse.zero_()
        return dispatch.Plan("forward", options["kernel"], None, None, None, None, (1,))

    def backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, **options):
        passes.append(("backward", options["kernel"]))
        for grad in (dq, dk, dv):
            grad.zero_()
        return dispatch.Plan("backward", options["kernel"], None, None, None, None, (1,))

    def dense(*args, **kwargs):
        raise AssertionError("a dense launch for one sequence")

    monkeypatch.setattr(dispatch, "varlen_forward", forward)
    monkeypatch.setattr(dispatch, "varlen_backward", backward)
    monkeypatch.setattr(dispatch, "attention_forward", dense)
    monkeypatch.setattr(dispatch, "attention_backward", dense)
    q, k, v = (t.float().requires_grad_() for t in _packed(64, 2, 2))
    with config.patch(cpu_backend="triton", kernel="hopper", schedule="shift"):
        out = varlen.varlen_attention(q, k, v, _offsets(LENS_Q), _offsets(LENS_K), 200, 130,
                                      window_size=(-1, 0))
    out.sum().backward()
    assert passes == [("forward", "hopper"), ("backward", "hopper")]
