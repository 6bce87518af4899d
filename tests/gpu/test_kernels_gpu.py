"""GPU tests of the kernels: accuracy by FlashAttention's rule (``dash_inductor.testing``), bitwise
repeatability, batch invariance, no hang on many tiles or long sequences, and the bounded-spin
error; on both kernel paths (portable, and the Hopper Gluon kernels, forward and backward, where
the GPU is sm90; the Hopper forward is tested here before dispatch is allowed to run it).

Only a GPU runs the programs concurrently, so only here are the ordered dQ waits really exercised.
"""

import warnings

import pytest
import torch

import dash_inductor
from dash_inductor.ops import attention_backward, attention_forward
from dash_inductor.ops import catalog
from dash_inductor.ops.catalog import DETERMINISTIC, ORDERED
from dash_inductor.ops.hopper.config import HEAD_DIMS, THREE_WARPGROUPS
from dash_inductor.ops.shared.errors import LOOK_EVERY, check_spin_flags
from dash_inductor.pytest_plugin import deterministic_algorithms_mode
from dash_inductor.testing import assert_flash_rule, sdpa_math_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _inputs(batch, hq, hkv, seq, dim, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, hq, seq, dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, hkv, seq, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, hkv, seq, dim, device="cuda", dtype=dtype, generator=gen)
    do = torch.randn(batch, hq, seq, dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, do


@pytest.fixture(params=["portable", "hopper"], autouse=True)
def kernel(request):
    """Every test runs on both kernel paths; the Hopper one only on sm90."""
    if request.param == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernels need an sm90 GPU")
    global KERNEL
    KERNEL = request.param
    return request.param


KERNEL = "portable"


def _ours(q, k, v, do, causal, schedule, max_spin=1 << 26):
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(do)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale, kernel=KERNEL)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal, scale=scale,
                       schedule=schedule, max_spin=max_spin, kernel=KERNEL)
    return out, dq, dk, dv


def _sdpa_math(q, k, v, do, causal, dtype):
    return sdpa_math_reference(q, k, v, do, dtype, is_causal=causal,
                               enable_gqa=q.shape[1] != k.shape[1])


ACCURACY_SHAPES = [(2, 8, 8, 1024, 64), (1, 16, 16, 2048, 128), (2, 8, 2, 1000, 128), (1, 4, 4, 777, 96)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ACCURACY_SHAPES, ids=str)
def test_flash_rule_every_schedule(shape, causal, dtype):
    if KERNEL == "hopper" and shape[-1] not in HEAD_DIMS:
        pytest.skip(f"the Hopper kernels take head dims {HEAD_DIMS}")
    q, k, v, do = _inputs(*shape, dtype=dtype)
    ref = _sdpa_math(q, k, v, do, causal, torch.float32)
    same = _sdpa_math(q, k, v, do, causal, dtype)
    for schedule in catalog.NAMES:
        assert_flash_rule(_ours(q, k, v, do, causal, schedule), same, ref, what=schedule)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 8, 1000, 64), (1, 8, 2, 777, 64)], ids=str)
def test_the_three_warpgroup_forward_follows_the_flash_rule_with_the_same_bits(shape, causal):
    """The 192-row Hopper forward (``THREE_WARPGROUPS``, the dense head-dim-64 tile): out by
    FlashAttention's rule, the logsumexp within 1e-3 of float32's, the same bits over 20 repeats;
    rows not a multiple of 192, GQA."""
    if KERNEL != "hopper":
        pytest.skip("a Hopper forward config")
    q, k, v, do = _inputs(*shape, seed=3)

    def run():
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=shape[-1] ** -0.5,
                          kernel="hopper", config=THREE_WARPGROUPS)
        return out, lse

    out, lse = run()
    ref, same = (_sdpa_math(q, k, v, do, causal, dtype)[0] for dtype in (torch.float32, q.dtype))
    assert_flash_rule([out], [same], [ref], names=("out", ), what="three warpgroups")
    keys = k.float().repeat_interleave(shape[1] // shape[2], 1)
    scores = (q.float() @ keys.transpose(-1, -2)) * shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), -torch.inf)
    assert (lse - torch.logsumexp(scores, -1)).abs().max().item() <= 1e-3
    for _ in range(20):
        assert all(map(torch.equal, run(), (out, lse)))


BITWISE_SHAPES = [(2, 8, 8, 1024, 64), (1, 16, 16, 4096, 128), (2, 16, 4, 2048, 128)]


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BITWISE_SHAPES, ids=str)
def test_bitwise_equal_over_100_repeats(shape, causal, schedule):
    q, k, v, do = _inputs(*shape, seed=1)
    first = _ours(q, k, v, do, causal, schedule)
    for _ in range(100):
        again = _ours(q, k, v, do, causal, schedule)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_batch_invariance(schedule):
    q, k, v, do = _inputs(8, 8, 8, 1024, 64, seed=2)
    for causal in (False, True):
        batched = _ours(q, k, v, do, causal, schedule)
        alone = _ours(q[3:4], k[3:4], v[3:4], do[3:4], causal, schedule)
        assert all(torch.equal(a, b[3:4]) for a, b in zip(alone, batched))


@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_bits_do_not_depend_on_the_layout_or_the_batch(schedule):
    """The public op on a model's (B, L, H, D) views, on contiguous copies and on one batch element
    alone: the same path and the same bits (the Hopper launcher copies what TMA cannot read)."""
    q, k, v, do = _inputs(3, 8, 2, 1000, 128, seed=4)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do)]

    def run(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with dash_inductor.config.patch(kernel=KERNEL, schedule=schedule):
            out = dash_inductor.attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)]

    contiguous = run(q, k, v, do)
    for name, got in (("(B, L, H, D) views", run(*views)),
                      ("batch element 1 alone", run(*(t[1:2] for t in views)))):
        want = contiguous if got[0].shape[0] == 3 else [t[1:2] for t in contiguous]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def _close_to_recompute(q, k, v, do, causal, schedule):
    base = _ours(q, k, v, do, causal, "recompute")[1:]
    grads = _ours(q, k, v, do, causal, schedule)[1:]
    for a, b in zip(grads, base):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("schedule", (*ORDERED, "atomic"))
def test_many_tiles_no_hang(schedule):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = -(-30 * sms // (4 * 32))  # batch 4, 32 KV tiles of 128 per head: 30x the SM count
    q, k, v, do = _inputs(4, heads, heads, 4096, 64, seed=3)
    for causal in (False, True):
        _close_to_recompute(q, k, v, do, causal, schedule)


@pytest.mark.parametrize("schedule", ORDERED)
def test_seq_65536_no_hang(schedule):
    q, k, v, do = _inputs(1, 2, 2, 65536, 64, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # shift may fall back on long heads
        for causal in (False, True):
            _close_to_recompute(q, k, v, do, causal, schedule)


def test_exceeded_spin_bound_raises():
    q, k, v, do = _inputs(2, 16, 16, 4096, 64, seed=5)
    with pytest.raises(RuntimeError, match="max_spin.*schedule 'ascending'"):
        _ours(q, k, v, do, False, "ascending", max_spin=1)
        check_spin_flags(wait=True)
    _close_to_recompute(q, k, v, do, False, "ascending")  # the next call is unaffected


def test_exceeded_spin_bound_raises_at_a_later_backward():
    """Without a check of its own, a failed wait is raised by a later ordered backward, once the
    host has looked at the device's flag (every ``LOOK_EVERY`` watched launches)."""
    q, k, v, do = _inputs(2, 16, 16, 4096, 64, seed=5)
    with pytest.raises(RuntimeError, match="max_spin.*schedule 'ascending'"):
        _ours(q, k, v, do, False, "ascending", max_spin=1)
        for _ in range(2 * LOOK_EVERY + 1):
            torch.cuda.synchronize()  # the look lands before the next call
            _ours(q, k, v, do, False, "ascending")
    check_spin_flags(wait=True)  # cleared by the raise


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_the_same_outputs_and_gradients_as_sdpa(where):
    """One NaN input entry spreads to exactly the entries of out, dq, dk, dv it reaches in SDPA."""
    q, k, v, do = _inputs(1, 4, 4, 512, 64, seed=6)
    {"q": q, "k": k, "v": v}[where][0, 1, 100, 7] = float("nan")
    ours = _ours(q, k, v, do, False, "shift")
    theirs = _sdpa_math(q, k, v, do, False, torch.float32)
    assert ours[0].isnan().any()
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert torch.equal(a.isnan(), b.isnan()), name


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("window,causal", [((300, 0), True), ((200, 150), False)], ids=str)
def test_window_follows_the_flash_rule(window, causal, schedule):
    """A sliding window on the GPU (the kernels skip the tiles outside it) against SDPA's math with
    the equivalent dense mask. The forward is the portable one on both paths (the Hopper forward
    takes no window); the backward runs on the path under test."""
    q, k, v, do = _inputs(2, 4, 2, 1000, 64, seed=7)
    left, right = window
    rows, cols = torch.arange(1000, device="cuda")[:, None], torch.arange(1000, device="cuda")[None]
    keep = (cols >= rows - left) & (cols <= rows + (0 if causal else right))

    def dense(dtype):
        return sdpa_math_reference(q, k, v, do, dtype, attn_mask=keep, enable_gqa=True)

    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(do)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale, kernel="portable",
                      window=window)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    plan = attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                              scale=scale, schedule=schedule, kernel=KERNEL, window=window)
    assert plan.kernel == KERNEL
    assert_flash_rule((out, dq, dk, dv), dense(q.dtype), dense(torch.float32), what=schedule)


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (96, 40))],
                         ids=str)
def test_unfilled_buffers_are_written_in_full(causal, window, schedule, poison_allocator):
    """The op allocates its outputs and buffers without PyTorch's deterministic NaN fill
    (``shapes.unfilled``), so a kernel must write every element: on NaN-poisoned memory, with
    L != S, keys that no query sees, and a window, the public op gives the launchers' bits on
    buffers that determinism filled with NaN."""
    if KERNEL == "hopper" and window != (-1, -1):
        pytest.skip("the Hopper forward takes no window")
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 2, 700, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = q.shape[-1] ** -0.5
    with deterministic_algorithms_mode(True):
        out = torch.empty_like(do)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        if KERNEL == "hopper":
            attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale, kernel=KERNEL)
        else:
            attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale,
                              kernel=KERNEL, window=window)
        filled = [out, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
        attention_backward(do, q, k, v, out, lse, None, *filled[1:], is_causal=causal,
                           scale=scale, schedule=schedule, kernel=KERNEL, window=window)
        poison_allocator()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with dash_inductor.config.patch(kernel=KERNEL, schedule=schedule):
            got = dash_inductor.attention(*leaves, is_causal=causal, enable_gqa=True,
                                          window_size=window)
        got.backward(do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *(t.grad for t in leaves)), filled):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("seq_q,seq_k,causal,window", [
    (700, 200, False, (96, 40)), (200, 700, False, (96, 40)), (700, 200, True, (-1, -1)),
    (333, 333, True, (64, 0)), (512, 512, False, (-1, -1))], ids=str)
def test_backward_writes_every_gradient_on_poisoned_memory(seq_q, seq_k, causal, window,
                                                           schedule, poison_allocator):
    """The ordered Hopper writer stores each row's first dQ partial, so its accumulator is cleared
    only where a row may see no key (a window with more queries than keys): on NaN-poisoned
    memory, the launcher's gradients equal those it gives on zeroed memory, and are finite."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(2, 4, seq_q, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, seq_k, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = q.shape[-1] ** -0.5
    out, lse = torch.empty_like(do), torch.empty(q.shape[:3], device="cuda")
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale, kernel="portable",
                      window=window)

    def backward(allocate):
        grads = [allocate(t) for t in (q, k, v)]
        attention_backward(do, q, k, v, out, lse, None, *grads, is_causal=causal, scale=scale,
                           schedule=schedule, kernel=KERNEL, window=window)
        return grads

    clean = backward(torch.zeros_like)
    poison_allocator()
    for name, a, b in zip(("dq", "dk", "dv"), clean, backward(torch.empty_like)):
        assert torch.isfinite(b).all() and torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["bhle", "blhe", "packed"])
def test_dq_conversion_equals_pytorchs_copy_in_bf16(layout):
    """The launchers' conversion of the fp32 dQ accumulator rounds to nearest even, as PyTorch's
    copy does (the CPU interpreter truncates, so tests/test_dq_convert.py checks other dtypes)."""
    from dash_inductor.ops.shared.dq_convert import convert_dq
    from dash_inductor.ops.shared.launch import Launches

    acc = torch.randn(8, 1024, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    heads, seq = 4 if layout != "packed" else 8, 1000
    batch = 8 // heads
    new = dict(device="cuda", dtype=torch.bfloat16)
    dq = {"bhle": lambda: torch.empty(batch, heads, seq, 128, **new),
          "blhe": lambda: torch.empty(batch, seq, heads, 128, **new).transpose(1, 2),
          "packed": lambda: torch.empty(seq, heads, 128, **new).transpose(0, 1).unsqueeze(0),
          }[layout]()
    convert_dq(Launches(), acc, dq)
    assert torch.equal(dq, acc.view(batch, heads, 1024, 128)[:, :, :seq].to(torch.bfloat16))


@pytest.mark.parametrize("schedule", ORDERED)
def test_bits_do_not_depend_on_the_number_of_programs(schedule):
    """The Hopper launcher runs ordered schedules with equally long items on a whole number of
    heads' worth of programs (``config.ordered_programs``); on all SMs instead, some heads
    straddle two rounds of programs, and the bits are the same all the same (GQA, causal and
    full)."""
    if KERNEL != "hopper":
        pytest.skip("the grid choice is the Hopper launcher's")
    import dataclasses

    from dash_inductor.ops.hopper.config import backward_config

    q, k, v, do = _inputs(4, 16, 4, 4096, 128, seed=9)
    for causal in (False, True):
        out, lse = torch.empty_like(do), torch.empty(q.shape[:3], device="cuda")
        attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=128 ** -0.5,
                          kernel="hopper")
        grads = []
        for aligned in (True, False):
            cfg = dataclasses.replace(backward_config(128, causal), aligned_grid=aligned)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            plan = attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                                      scale=128 ** -0.5, schedule=schedule, kernel="hopper",
                                      config=cfg)
            grads.append((plan.grid, dq, dk, dv))
        (grid_a, *a), (grid_b, *b) = grads
        if not causal or schedule == "shift":  # equally long items: 128 programs, not 132
            assert grid_a != grid_b
        assert all(torch.equal(x, y) for x, y in zip(a, b))
