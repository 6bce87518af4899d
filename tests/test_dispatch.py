"""The dispatcher (ops/dispatch.py): its kernel-path and ``auto`` rules with the Hopper support
check stubbed (no GPU here), and its plan cache: a signature is planned once."""

import dataclasses

import pytest
import torch

from dash_inductor.ops import catalog, dispatch, rules
from dash_inductor.ops.hopper import support
from dash_inductor.ops.hopper.config import FASTER_ON_HOPPER, FORWARD_MIN_SEQ


def _qkv(seq=64, dim=64, device="cpu"):
    return tuple(torch.randn(1, 2, seq, dim, device=device) for _ in range(3))


@pytest.fixture
def hopper_takes_it(monkeypatch):
    monkeypatch.setattr(rules, "hopper_unsupported", lambda *args: None)


@pytest.fixture(autouse=True)
def fresh_cache():
    dispatch.cache_clear()
    yield
    dispatch.cache_clear()


@pytest.mark.parametrize("schedule", catalog.NAMES)
def test_auto_backward_takes_hopper_exactly_for_the_measured_schedules(hopper_takes_it, schedule):
    path, reason = rules.backward_path("auto", schedule, *_qkv(), None, (-1, -1))
    assert (path == dispatch.HOPPER) == (schedule in FASTER_ON_HOPPER)
    assert (reason is None) == (path == dispatch.HOPPER)
    if reason is not None:
        assert schedule in reason


def test_ordered_schedules_are_the_hopper_ones():
    assert set(FASTER_ON_HOPPER) == {s for s in catalog.NAMES if catalog.is_ordered(s)}


@pytest.mark.parametrize("shape, takes_hopper", [
    ((1, 2, 2, 4096, 128), True), ((1, 8, 2, 4096, 128), True), ((1, 2, 2, 2048, 128), True),
    ((1, 2, 2, 1024, 128), False), ((1, 2, 2, 4095, 64), False), ((1, 2, 2, 8192, 64), True)],
    ids=["d128-4k", "gqa", "d128-2k", "1k", "d64-just-short", "d64"])
def test_auto_forward_takes_hopper_where_it_measured_faster(hopper_takes_it, shape, takes_hopper):
    batch, hq, hkv, seq, dim = shape
    q = torch.empty(batch, hq, seq, dim, device="meta")
    k = v = torch.empty(batch, hkv, seq, dim, device="meta")
    path, reason = rules.forward_path("auto", q, k, v, None, (-1, -1))
    assert (path == dispatch.HOPPER) == takes_hopper
    assert (reason is None) == takes_hopper
    if reason is not None:
        assert f"from N = {FORWARD_MIN_SEQ[dim]}" in reason
    assert rules.forward_path("hopper", q, k, v, None, (-1, -1)) == (dispatch.HOPPER, None)


def test_named_paths(hopper_takes_it):
    assert rules.backward_path("portable", "shift", *_qkv(), None, (-1, -1)) == (
        dispatch.PORTABLE, None)
    assert rules.backward_path("hopper", "recompute", *_qkv(), None, (-1, -1)) == (
        dispatch.HOPPER, None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        rules.backward_path("fast", "shift", *_qkv(), None, (-1, -1))


def test_a_window_keeps_the_forward_portable_and_the_backward_on_hopper():
    with pytest.raises(ValueError, match="Hopper forward takes no sliding window"):
        rules.forward_path("hopper", *_qkv(), None, (128, 0))
    path, reason = rules.forward_path("auto", *_qkv(), None, (128, 0))
    assert path == dispatch.PORTABLE and "window_size=(128, 0)" in reason
    # Here the backward is refused for the CPU only, not for the window.
    reason = rules.hopper_unsupported(*_qkv(), None, (128, 0), "backward")
    assert reason.startswith("device 'cpu'")


def test_hopper_refused_with_the_reason_on_cpu():
    with pytest.raises(ValueError, match="kernel='hopper' cannot run this attention: device 'cpu'"):
        rules.forward_path("hopper", *_qkv(), None, (-1, -1))
    path, reason = rules.backward_path("auto", "shift", *_qkv(), None, (-1, -1))
    assert path == dispatch.PORTABLE and "device 'cpu'" in reason


@pytest.mark.parametrize("batch", [1, 2])
def test_hopper_reads_model_layouts_in_place_and_copies_only_what_tma_cannot_read(batch):
    """Rank-4 descriptors read a model's (B, L, H, D) views as they are, at any batch size; a
    misaligned view or a stride TMA cannot take is copied, with the same values (so the path, and
    the bits, never depend on the layout or the batch size)."""
    contiguous = torch.randn(batch, 4, 32, 64, dtype=torch.bfloat16)
    transposed = torch.randn(batch, 32, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    fused = torch.randn(batch, 32, 3, 4, 64, dtype=torch.bfloat16)[:, :, 1].transpose(1, 2)
    for t in (contiguous, transposed, fused):
        assert support.tma_strided(t)
    misaligned = torch.randn(batch * 4 * 32 * 64 + 1, dtype=torch.bfloat16)[1:].view(
        batch, 4, 32, 64)
    odd_rows = torch.randn(batch, 4, 32, 68, dtype=torch.bfloat16)[..., :64]  # 136-byte rows
    broadcast = torch.randn(1, 1, 32, 64, dtype=torch.bfloat16).expand(batch, 4, 32, 64)
    for t in (misaligned, odd_rows, broadcast):
        assert not support.tma_strided(t)
        copy = support.tma_copy(t)
        assert copy.is_contiguous() and support.tma_strided(copy) and torch.equal(copy, t)


def test_descriptors_walk_the_tensors_own_strides():
    """The rank-4 descriptors step through (B, H, N, D) in the tensor's strides, whatever its
    layout; a dim of length 1, never stepped along, gets a stride TMA accepts (16 bytes)."""
    from dash_inductor.ops.hopper.launch import _descriptor

    transposed = torch.randn(2, 32, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    desc = _descriptor(transposed, 64)
    assert list(desc.shape) == [2, 4, 32, 64] and list(desc.strides) == list(transposed.stride())
    assert list(desc.block_shape) == [1, 1, 64, 64]
    single = torch.randn(1, 32, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert list(_descriptor(single, 64).strides) == [8, 64, 256, 1]  # 8 bf16 = 16 bytes


@pytest.mark.parametrize("dim, seq, causal, window, expected", [
    (128, 16384, False, (-1, -1), "descending"), (128, 4096, False, (-1, -1), "descending"),
    (128, 4096, True, (-1, -1), "shift"), (128, 4096, False, (300, 200), "descending"),
    (64, 8192, False, (-1, -1), "ascending"), (64, 4096, True, (-1, -1), "shift"),
    (64, 16384, True, (-1, -1), "shift"), (64, 8192, False, (300, 200), "descending"),
    (64, 16384, False, (-1, -1), "ascending"), (64, 20000, False, (-1, -1), "ascending"),
    (64, 4096, False, (-1, -1), "ascending"), (64, 8191, False, (300, 200), "descending")])
def test_auto_on_hopper_follows_the_measured_rule(dim, seq, causal, window, expected):
    """The measured rule (H100 tables): ``shift`` causal; unmasked ``ascending`` at head dim 64
    and ``descending`` at 128, at every length; a window keeps ``descending`` where the problem
    is unmasked (it is window-aware); off the Hopper path ``auto`` stays the portable rule's."""
    schedule = rules.requested_schedule("auto", dispatch.HOPPER, causal, False, dim, window)
    assert rules.window_fallback(schedule, causal, window)[0].name == expected
    assert rules.requested_schedule("auto", dispatch.PORTABLE, causal, False, dim,
                               window).name == "recompute"


@pytest.mark.parametrize("causal", [False, True])
def test_packed_auto_runs_hopper_shift(causal):
    """On packed sequences ``shift`` led every deterministic schedule, causal and unmasked (H100,
    bench/packed_paths.py): "auto" runs it on the Hopper kernel."""
    for dim in (64, 128):
        assert rules.auto_schedule(dispatch.HOPPER, causal, True, dim, False).name == "shift"


def test_a_schedule_that_does_not_fit_falls_back_and_says_why():
    shift = catalog.get("shift")
    with pytest.warns(RuntimeWarning, match="needs 40 co-resident programs"):
        fitted, reason = rules.fit_schedule(shift, False, (-1, -1), 40, lambda s: 32, "q (x)")
    assert fitted.name == catalog.fallback(False) and "the GPU holds 32" in reason
    assert rules.fit_schedule(shift, False, (-1, -1), 32, lambda s: 32, "q") == (shift, None)
    fitted, reason = rules.fit_schedule(shift, True, (64, 0), 4, lambda s: 1 << 30, "q")
    assert fitted.name == catalog.fallback(True) and "no sliding-window ranks" in reason


def test_hopper_grid_keeps_each_heads_equal_items_in_one_round():
    """Ordered schedules whose items of a head are equally long run on a multiple of a head's
    items (``config.ordered_programs``); unequal ones (causal unpaired, windows, packed) and the
    unordered ones keep every SM (132 here, as an H100)."""
    from dash_inductor.ops.hopper.config import backward_config, backward_geometry

    def programs(name, causal, n_kv=32, windowed=False, varlen=False, aligned=True):
        cfg = dataclasses.replace(backward_config(128, causal), aligned_grid=aligned)
        per_head, items, grid, _ = backward_geometry(catalog.get(name), cfg, 4, 16, n_kv, causal,
                                                     1, True, windowed, varlen, 132)
        assert items == 4 * 16 * per_head
        return grid[0]

    assert programs("descending", False) == programs("shift", False) == 128  # 4 heads of 32
    assert programs("shift", True) == 128  # 8 heads of 16 pairs
    assert programs("ascending", False, n_kv=24) == 120
    assert programs("descending", True) == programs("descending", False, windowed=True) == 132
    assert programs("shift", False, varlen=True) == programs("atomic", False) == 132
    assert programs("recompute", False) == programs("descending", False, aligned=False) == 132
    assert programs("descending", False, n_kv=200) == 132  # no head fits: every SM
    assert programs("shift", False, n_kv=1) == 64  # fewer items than SMs


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("schedule", ["shift", "descending", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_heads_outer_only_for_paired_gqa_items_at_head_dim_128(dim, schedule, causal, group):
    """Items visit their tiles two query heads at a time only where it measured faster: two KV
    tiles a (causal ``shift``) item, a GQA group of more than two heads, head dim 128, a dense
    problem."""
    from dash_inductor.ops.hopper.config import backward_config, backward_constexprs

    cfg = backward_config(dim, causal)
    sched = catalog.get(schedule)
    expected = dim == 128 and schedule == "shift" and causal and group > 2
    constexprs = backward_constexprs(sched, causal, group, True, cfg)
    assert constexprs["VISIT_HEADS"] == (2 if expected else group)
    for window, varlen in ((True, False), (False, True)):
        assert backward_constexprs(sched, causal, group, True, cfg, window,
                                   varlen)["VISIT_HEADS"] == group


def _call(q, k, v, **options):
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    return dispatch.attention_forward(q, k, v, None, out, lse, is_causal=True, scale=0.125,
                                      **options)


def test_a_signature_seen_before_is_a_cache_hit_that_runs_no_dispatch_logic(monkeypatch):
    """The second call of a signature takes its plan from the cache: none of the decisions runs
    again (here they would raise), and the cache counts one miss and one hit."""
    q, k, v = _qkv()
    first = _call(q, k, v)
    assert dispatch.cache_info() == dispatch.CacheInfo(0, 1, dispatch._MAXSIZE, 1)

    def planned_again(*args, **kwargs):
        raise AssertionError("dispatch logic ran for a signature already planned")

    monkeypatch.setattr(dispatch, "_plan_forward", planned_again)
    monkeypatch.setattr(dispatch, "forward_config", planned_again)
    for name in ("forward_path", "hopper_unsupported", "check_kernel"):
        monkeypatch.setattr(rules, name, planned_again)
    q2, k2, v2 = _qkv()  # other tensors, the same signature
    assert _call(q2, k2, v2) is first
    assert dispatch.cache_info() == dispatch.CacheInfo(1, 1, dispatch._MAXSIZE, 1)


def test_each_part_of_the_signature_plans_anew():
    """Shapes, strides, alignment, dtype and the options each make a new signature."""
    q, k, v = _qkv()
    _call(q, k, v)
    _call(*_qkv(seq=65))
    _call(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    _call(torch.randn(2 * q.numel() + 1)[1:q.numel() + 1].view(q.shape), k, v)
    _call(q, k, v, kernel="portable")
    _call(q, k, v, window=(8, -1))
    assert dispatch.cache_info().misses == 6 and dispatch.cache_info().hits == 0
    dispatch.cache_clear()
    assert dispatch.cache_info() == dispatch.CacheInfo(0, 0, dispatch._MAXSIZE, 0)


def test_the_cache_keeps_at_most_its_size(monkeypatch):
    monkeypatch.setattr(dispatch, "_MAXSIZE", 3)
    for seq in range(16, 21):
        _call(*_qkv(seq=seq))
    assert dispatch.cache_info().currsize == 3


def test_every_launcher_is_called_with_its_own_signature(hopper_takes_it, monkeypatch):
    """The dispatcher calls each plan's launcher the same way, the portable launcher's arguments,
    for every path: checked against the Hopper launchers' real signatures (which the CPU cannot
    run), with the plans a Hopper call makes."""
    import inspect

    from dash_inductor.ops.hopper import launch

    called = []
    for name in ("run_forward", "run_backward", "run_varlen_forward", "run_varlen_backward"):
        real = getattr(launch, name)

        def record(*args, real=real, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)  # raises TypeError on a mismatch
            called.append(real.__name__)

        monkeypatch.setattr(launch, name, record)
    monkeypatch.setattr(dispatch, "_sms", lambda q: 132)
    q, k, v, do = (torch.randn(1, 2, 2048, 128, dtype=torch.bfloat16) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 2048)
    dispatch.attention_forward(q, k, v, None, out, lse, is_causal=True, scale=0.1)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    dispatch.attention_backward(do, q, k, v, out, lse, None, *grads, is_causal=True, scale=0.1)
    cu = torch.tensor([0, 700, 2048], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k, v, do, out)]
    dispatch.varlen_forward(*packed[:3], cu, cu, 1348, 1348, packed[4], lse[0], is_causal=True,
                            scale=0.1, kernel="hopper")
    dispatch.varlen_backward(*packed[3:4], *packed[:3], packed[4], lse[0], cu, cu, 1348, 1348,
                             *(torch.empty_like(t) for t in packed[:3]), is_causal=True,
                             scale=0.1)
    assert called == ["run_forward", "run_backward", "run_varlen_forward", "run_varlen_backward"]


def test_an_empty_launch_hook_chain_costs_a_bound_launch_nothing():
    """Triton keeps its launch hooks in a chain that is never None; a bound launch passes None
    for an empty chain (no metadata record), and the chain itself once a profiler adds a hook."""
    from triton import knobs

    from dash_inductor.ops.shared.driver import active as _active

    chain = type(knobs.runtime.launch_enter_hook)()
    assert _active(None) is None and _active(chain) is None
    chain.add(print)
    assert _active(chain) is chain
    assert _active(print) is print  # a Triton whose hook is a plain callable


@pytest.mark.parametrize("dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_auto_with_dropout_takes_the_paths_that_measured_faster(hopper_takes_it, dim, causal):
    """With dropout ``auto`` runs the Hopper forward unmasked and the portable one causal, and
    the Hopper backward except at head dim 64 causal; a named kernel runs as named."""
    q, k, v = _qkv(seq=8192, dim=dim)
    path, reason = rules.forward_path("auto", q, k, v, None, (-1, -1), dropout=True,
                                      causal=causal)
    assert path == (dispatch.PORTABLE if causal else dispatch.HOPPER)
    assert (reason is not None and "dropout" in reason) == causal
    assert rules.forward_path("hopper", q, k, v, None, (-1, -1), dropout=True,
                              causal=causal) == (dispatch.HOPPER, None)
    path, reason = rules.backward_path("auto", "auto", q, k, v, None, (-1, -1), dropout=True,
                                       causal=causal)
    slower = dim == 64 and causal
    assert path == (dispatch.PORTABLE if slower else dispatch.HOPPER)
    assert (reason is not None and "dropout" in reason) == slower
    assert rules.backward_path("hopper", "auto", q, k, v, None, (-1, -1), dropout=True,
                               causal=causal) == (dispatch.HOPPER, None)
    path, _ = rules.backward_path("auto", "auto", q, k, v, None, (-1, -1), causal=causal)
    assert path == dispatch.HOPPER
