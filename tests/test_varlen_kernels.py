"""The packed (VARLEN) kernels behind dash.varlen_attention's Triton path, in the interpreter.

One launch per pass over all sequences: numerics against float64 SDPA on packings the hypothesis
strategy rarely draws (several tiles per sequence, far more keys than queries or the reverse,
windows narrower and wider than a tile), packing invariance bit for bit where a sequence's place
in the virtual batch changes which program takes its items, one plan per pass, no host read of the
offsets, the device check of the offsets, and kernels that stay inside the tensors when the
offsets break their contract. The kernels also compile for sm90 (no GPU needed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from dash_inductor import config, pytest_plugin
from dash_inductor.library import op as library
from dash_inductor.ops import catalog, dispatch
from dash_inductor.ops.shared import offsets, offsets_check
from dash_inductor.ops.portable import packed
from dash_inductor.ops.shared.launch import Launches
from dash_inductor.library.varlen import varlen_attention
from tests.test_varlen import _assert_packing_invariant, _check, _offsets, packings

CI = settings.get_profile(pytest_plugin.CI_PROFILE)
ROOT = Path(__file__).resolve().parent.parent

# (lens_q, lens_k, window, hq, hkv): the interpreter's tiles are 16 (forward) and 32 (backward).
CASES = {
    "self_multi_tile_causal": ([70, 1, 0, 33], [70, 1, 0, 33], (-1, 0), 2, 1),
    "keys_far_past_queries_causal": ([3, 20], [100, 20], (-1, 0), 2, 2),
    "queries_far_past_keys_causal": ([100, 5], [4, 5], (-1, 0), 1, 1),
    "no_keys_or_no_queries": ([0, 9, 7, 0], [5, 0, 40, 0], (-1, 0), 2, 1),
    "narrow_causal_window": ([66, 17], [80, 17], (5, 0), 2, 1),
    "window_wider_than_tile": ([50, 31], [40, 64], (45, 37), 2, 2),
    "one_sided_windows": ([48, 48], [20, 90], (-1, 3), 2, 1),
    "full": ([35, 2, 67], [50, 90, 1], (-1, -1), 2, 1),
}


def _problem(case: str, seed: int = 0) -> dict:
    lens_q, lens_k, window, hq, hkv = CASES[case]
    return dict(lens_q=lens_q, lens_k=lens_k, window=window, hq=hq, hkv=hkv, e=16, slack=2,
                seed=seed)


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@pytest.mark.parametrize("case", CASES)
def test_packed_kernels_match_sdpa_math(case, schedule):
    with config.patch(cpu_backend="triton", schedule=schedule):
        _check(_problem(case), torch.float32)


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@settings(CI, max_examples=1)
@given(p=packings(max_seqs=3, max_len=80))
def test_packed_kernels_match_sdpa_math_drawn(schedule, p):
    with config.patch(cpu_backend="triton", schedule=schedule):
        _check(p, torch.float32)


INVARIANCE = {
    "full": dict(lens_q=[20, 40, 9], lens_k=[30, 100, 0], window=(-1, -1), hq=1, hkv=1, e=16,
                 slack=0, seed=1),
    "causal_window": dict(lens_q=[66, 17], lens_k=[80, 17], window=(5, 0), hq=2, hkv=1, e=16,
                          slack=2, seed=1),
}


@pytest.mark.parametrize("schedule", config.DETERMINISTIC_SCHEDULES)
@pytest.mark.parametrize("case", INVARIANCE)
def test_packed_kernels_are_packing_invariant(case, schedule):
    """Four KV tiles per head (three dQ contributions or more per Q tile) in a virtual batch whose
    other sequences move this one's items to other programs: equal bits alone and packed (a grid
    that let the interpreter's program order reach the dQ sums fails here)."""
    with config.patch(cpu_backend="triton", schedule=schedule):
        _assert_packing_invariant(INVARIANCE[case], torch.float32)


def test_one_launch_per_pass_with_a_plan_each():
    p = _problem("self_multi_tile_causal")
    q, k, v = (torch.randn(104, 2, 16, requires_grad=True) for _ in range(3))
    cu = _offsets(p["lens_q"])
    with config.patch(cpu_backend="triton", schedule="shift"):
        varlen_attention(q, k[:, :1], v[:, :1], cu, cu, 70, 70, window_size=(-1, 0),
                         enable_gqa=True).sum().backward()
    plans = library.last_plans()[-2:]
    assert [plan.op for plan in plans] == ["forward", "backward"]
    assert plans[0].grid == (4 * 2, 5)  # sequences x heads, Q tiles of max_q
    assert plans[0].kernel_reason.startswith("device 'cpu'")  # the Hopper forward would
    assert plans[1].kernel == "portable" and plans[1].schedule.name == "shift"
    assert plans[1].kernel_reason.startswith("device 'cpu'")  # the Hopper backward would


@pytest.mark.parametrize("lens_q, lens_k", [([0, 0], [30, 9]), ([12, 5], [0, 0])])
@pytest.mark.parametrize("schedule", catalog.DETERMINISTIC)
def test_no_launch_when_one_side_has_no_tokens(lens_q, lens_k, schedule):
    """With no query (or no key) token the ticket array (or K) is empty, and its base is no
    address on CUDA: nothing is launched; dQ is zeros and dK, dV keep their zeros."""
    (tq, tk), hq = (sum(lens_q), sum(lens_k)), 2
    q, do, out = (torch.randn(tq, hq, 16) for _ in range(3))
    k, v = torch.randn(tk, hq, 16), torch.randn(tk, hq, 16)
    lse = torch.full((hq, tq), float("-inf"))
    dq, dk, dv = (torch.randn_like(t) for t in (q, k, v))
    plan = dispatch.varlen_backward(do, q, k, v, out, lse, _offsets(lens_q), _offsets(lens_k),
                                  max(lens_q), max(lens_k), dq, dk, dv, is_causal=True,
                                  scale=0.25, schedule=schedule)
    assert plan.grid == ()
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("schedule", catalog.NAMES)
@pytest.mark.parametrize("case", ["no_keys_or_no_queries", "queries_far_past_keys_causal",
                                  "one_sided_windows"])
def test_packed_backward_writes_every_gradient_element(case, schedule):
    """The packed launchers take gradients whose memory holds anything (the op allocates them
    uninitialised): keys of a sequence without queries get zeros from the kernels, which give
    it KV tiles and no Q tile. On NaN-filled gradients, the result equals the one on zeros."""
    lens_q, lens_k, window, hq, hkv = CASES[case]
    gen = torch.Generator().manual_seed(3)
    (tq, tk), e = (sum(lens_q), sum(lens_k)), 16
    q, do = (torch.randn(tq, hq, e, generator=gen) for _ in range(2))
    k, v = (torch.randn(tk, hkv, e, generator=gen) for _ in range(2))
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    causal, kernel_window = window == (-1, 0), (window if window != (-1, 0) else (-1, -1))
    out, lse = torch.empty_like(q), torch.empty(hq, tq)
    dispatch.varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out, lse,
                          is_causal=causal, scale=0.25, window=kernel_window)

    def backward(fill: float):
        grads = [torch.full_like(t, fill) for t in (q, k, v)]
        dispatch.varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                               *grads, is_causal=causal, scale=0.25, schedule=schedule,
                               window=kernel_window)
        return grads

    for name, a, b in zip(("dq", "dk", "dv"), backward(0.0), backward(float("nan"))):
        assert torch.isfinite(b).all(), name
        if catalog.get(schedule).deterministic:
            assert torch.equal(a, b), name
        else:  # atomic: its adds may land in any order
            torch.testing.assert_close(b, a, msg=name)


class _Unreadable(torch.Tensor):
    """Offsets whose values the host may not read: what the CUDA path must never do."""

    HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__,
                  torch.Tensor.__index__, torch.Tensor.__bool__)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.HOST_READS:
            raise AssertionError(f"host read of the offsets: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_packed_launchers_never_read_the_offsets_on_the_host():
    lens = [30, 0, 45]
    cu = _offsets(lens).as_subclass(_Unreadable)
    q, k, v, do = (torch.randn(75, 2, 16) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(2, 75)
    dispatch.varlen_forward(q, k, v, cu, cu, 45, 45, out, lse, is_causal=True, scale=0.25)
    grads = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for schedule in catalog.DETERMINISTIC:
        dispatch.varlen_backward(do, q, k, v, out, lse, cu, cu, 45, 45, *grads, is_causal=True,
                               scale=0.25, schedule=schedule)


@pytest.mark.parametrize("cu_q, cu_k, max_q, max_k, match", [
    ([1, 3, 7], [0, 3, 7], 4, 4, "cu_seq_q must start at 0"),
    ([0, 5, 3, 7], [0, 1, 2, 7], 5, 5, "cu_seq_q must be non-decreasing"),
    ([0, 3, 7], [0, 3, 6], 4, 4, r"cu_seq_k\[-1\] must equal .* Tk=7"),
    ([0, 3, 7], [0, 3, 7], 3, 4, "max_q=3 is smaller than the longest sequence in cu_seq_q"),
    ([0, 3, 7], [0, 3, 7], 4, 2, "max_k=2 is smaller than the longest sequence in cu_seq_k"),
])
def test_device_check_of_the_offsets_names_the_breach(cu_q, cu_k, max_q, max_k, match):
    """The flag the CUDA path watches, computed here by the same kernel in the interpreter; the
    message is the host check's (the same definition), without the values."""
    cu_q, cu_k = torch.tensor(cu_q), torch.tensor(cu_k, dtype=torch.int32)
    code = int(offsets_check.offsets_flag(Launches(), cu_q, cu_k, (7, 7), (max_q, max_k))[0])
    message = offsets.device_breach(code, (7, 7), (max_q, max_k))
    assert message.startswith("dash.varlen_attention: ") and re.search(match, message)
    good = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert int(offsets_check.offsets_flag(Launches(), good, good, (7, 7), (4, 4))[0]) == 0


def test_broken_offsets_touch_nothing_outside_their_sequences():
    """Until the asynchronous error arrives, the kernels treat a sequence that breaks the contract
    (here longer than max_q) as empty: they neither read nor write past the tensors."""
    cu = torch.tensor([0, 10, 60, 70], dtype=torch.int32)
    q, k, v, do = (torch.randn(70, 1, 16) for _ in range(4))
    out, lse = torch.full_like(q, 7.0), torch.full((1, 70), 7.0)
    dispatch.varlen_forward(q, k, v, cu, cu, 16, 16, out, lse, is_causal=False, scale=0.25)
    assert (out[10:60] == 7).all() and (lse[:, 10:60] == 7).all()
    assert (out[:10] != 7).all() and (out[60:] != 7).all()
    dq, dk, dv = torch.full_like(q, 7.0), torch.zeros_like(k), torch.zeros_like(v)
    dispatch.varlen_backward(do, q, k, v, out, lse, cu, cu, 16, 16, dq, dk, dv, is_causal=True,
                           scale=0.25, schedule="ascending")
    assert (dk[10:60] == 0).all() and (dk[:10] != 0).any()


def _compile_for_sm90() -> list[dict]:
    """Run the packed launchers with every kernel launch replaced by ``triton.compile`` for sm90
    (no GPU: Triton compiles to PTX and cubin on a CPU); one summary per compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dash_inductor.ops.portable import backward, forward
    from dash_inductor.ops.shared import dq_convert, dq_pass, launch, preprocess
    from dash_inductor.ops.portable.configs import backward_config, forward_config

    types = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}
    compiled = []

    class Compile:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
                kwargs.pop("launch_cooperative_grid", None)
                signature, constexprs, values = {}, {}, iter(args)
                for param in self.kernel.params:
                    if param.is_constexpr:
                        signature[param.name], constexprs[param.name] = "constexpr", kwargs[param.name]
                        continue
                    value = next(values)
                    signature[param.name] = ("*" + types[value.dtype] if isinstance(value, torch.Tensor)
                                             else "fp32" if isinstance(value, float) else "i32")
                binary = triton.compile(ASTSource(self.kernel, signature, constexprs),
                                        target=GPUTarget("cuda", 90, 32), options=options)
                ptx = binary.asm["ptx"]
                compiled.append(dict(kernel=self.kernel.__name__, schedule=constexprs.get("SCHEDULE"),
                                     varlen=constexprs.get("VARLEN"), ptx=len(ptx),
                                     releases=ptx.count("red.release.gpu.global.add")))
            return launch

    for module, name in ((forward, "_attention_forward_kernel"), (backward, "_backward_main_kernel"),
                         (preprocess, "_preprocess_kernel"), (dq_pass, "_backward_dq_kernel"),
                         (offsets_check, "_check_offsets_kernel"),
                         (dq_convert, "_convert_kernel")):
        setattr(module, name, Compile(getattr(module, name)))
    # Launch through Triton's own ``kernel[grid]``, which the stand-ins above replace.
    launch.Launches.__call__ = lambda self, slot, kernel, grid, args, constexprs: kernel[grid](
        *args, **constexprs)
    backward.coresident_programs = lambda *args: 264
    backward.watch_spin_flag = packed.watch_spin_flag = lambda *args: None
    offsets_check.watch_value_flag = lambda *args: None
    cu = torch.tensor([0, 5, 75, 75, 108], dtype=torch.int32)
    q, k = torch.zeros(108, 4, 128, dtype=torch.bfloat16), torch.zeros(108, 2, 128, dtype=torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.zeros(4, 108)
    dispatch.varlen_forward(q, k, k, cu, cu, 70, 70, out, lse, is_causal=True, scale=0.1,
                          window=(8, -1), config=forward_config(128, q.dtype, True, 9))
    for schedule, causal, window in (("shift", True, (-1, -1)), ("ascending", False, (16, 4)),
                                     ("recompute", True, (8, -1))):
        dispatch.varlen_backward(out, q, k, k, out, lse, cu, cu, 70, 70, torch.zeros_like(q),
                               torch.zeros_like(k), torch.zeros_like(k), is_causal=causal, scale=0.1,
                               schedule=schedule, window=window,
                               config=backward_config(128, q.dtype, causal, 9))
    offsets_check.offsets_flag(Launches(), cu, cu, (108, 108), (70, 70))
    return compiled


def test_packed_kernels_compile_for_sm90():
    """Code the interpreter accepts may not compile (e.g. a global that is not a constexpr): the
    VARLEN forward, main kernel (ordered waits included), dQ pass, dQ conversion and offsets
    check compile."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    kernels = {(row["kernel"], row["schedule"]) for row in rows}
    assert ("_attention_forward_kernel", None) in kernels and ("_check_offsets_kernel", None) in kernels
    assert ("_backward_dq_kernel", None) in kernels and ("_convert_kernel", None) in kernels
    main = {row["schedule"]: row for row in rows if row["kernel"] == "_backward_main_kernel"}
    assert set(main) == {catalog.get(name).id for name in ("shift", "ascending", "recompute")}
    assert all(row["varlen"] for row in rows if row["varlen"] is not None)
    assert main[catalog.get("shift").id]["releases"] > 0  # the ordered waits are compiled in
    assert main[catalog.get("recompute").id]["releases"] == 0


if __name__ == "__main__":
    for row in _compile_for_sm90():
        print(json.dumps(row), flush=True)
