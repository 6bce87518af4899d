"""The kernel-path rule of ops/dispatch.py, with the Hopper support check stubbed (no GPU here)."""

import dataclasses

import pytest
import torch

from dash_inductor.ops import catalog, dispatch
from dash_inductor.ops.hopper.config import FASTER_ON_HOPPER, FORWARD_MIN_SEQ


def _qkv():
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    return q, k, v


@pytest.fixture
def hopper_takes_it(monkeypatch):
    monkeypatch.setattr(dispatch, "_hopper_unsupported", lambda *args: None)


@pytest.mark.parametrize("schedule", catalog.NAMES)
def test_auto_backward_takes_hopper_exactly_for_the_measured_schedules(hopper_takes_it, schedule):
    path, reason = dispatch.select_kernel("auto", "backward", *_qkv(), None, False, schedule)
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
    q = torch.empty(batch, hq, seq, dim)
    k = v = torch.empty(batch, hkv, seq, dim)
    path, reason = dispatch.select_kernel("auto", "forward", q, k, v, None, True)
    assert (path == dispatch.HOPPER) == takes_hopper
    assert (reason is None) == takes_hopper
    if reason is not None:
        assert f"from N = {FORWARD_MIN_SEQ[dim]}" in reason
    assert dispatch.select_kernel("hopper", "forward", q, k, v, None, True) == (dispatch.HOPPER,
                                                                                None)


def test_named_paths(hopper_takes_it):
    assert dispatch.select_kernel("portable", "backward", *_qkv(), None, False, "shift") == (
        dispatch.PORTABLE, None)
    assert dispatch.select_kernel("hopper", "backward", *_qkv(), None, False, "recompute") == (
        dispatch.HOPPER, None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        dispatch.select_kernel("fast", "backward", *_qkv(), None, False, "shift")


def test_a_window_keeps_the_forward_portable_and_the_backward_on_hopper():
    with pytest.raises(ValueError, match="Hopper forward takes no sliding window"):
        dispatch.select_kernel("hopper", "forward", *_qkv(), None, True, window=(128, 0))
    path, reason = dispatch.select_kernel("auto", "forward", *_qkv(), None, True, window=(128, 0))
    assert path == dispatch.PORTABLE and "window_size=(128, 0)" in reason
    # Here the backward is refused for the CPU only, not for the window.
    reason = dispatch._hopper_unsupported(*_qkv(), None, (128, 0), "backward")
    assert reason.startswith("device 'cpu'")


def test_hopper_refused_with_the_reason_on_cpu():
    with pytest.raises(ValueError, match="kernel='hopper' cannot run this attention: device 'cpu'"):
        dispatch.select_kernel("hopper", "forward", *_qkv(), None, False)
    path, reason = dispatch.select_kernel("auto", "backward", *_qkv(), None, False, "shift")
    assert path == dispatch.PORTABLE and "device 'cpu'" in reason


@pytest.mark.parametrize("batch", [1, 2])
def test_hopper_reads_model_layouts_in_place_and_copies_only_what_tma_cannot_read(batch):
    """Rank-4 descriptors read a model's (B, L, H, D) views as they are, at any batch size; a
    misaligned view or a stride TMA cannot take is copied, with the same values (so the path, and
    the bits, never depend on the layout or the batch size)."""
    from dash_inductor.ops.hopper.launch import tma_readable

    contiguous = torch.randn(batch, 4, 32, 64, dtype=torch.bfloat16)
    transposed = torch.randn(batch, 32, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    fused = torch.randn(batch, 32, 3, 4, 64, dtype=torch.bfloat16)[:, :, 1].transpose(1, 2)
    for t in (contiguous, transposed, fused):
        assert tma_readable(t) is t
    misaligned = torch.randn(batch * 4 * 32 * 64 + 1, dtype=torch.bfloat16)[1:].view(
        batch, 4, 32, 64)
    odd_rows = torch.randn(batch, 4, 32, 68, dtype=torch.bfloat16)[..., :64]  # 136-byte rows
    broadcast = torch.randn(1, 1, 32, 64, dtype=torch.bfloat16).expand(batch, 4, 32, 64)
    for t in (misaligned, odd_rows, broadcast):
        readable = tma_readable(t)
        assert readable is not t and readable.is_contiguous() and torch.equal(readable, t)


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


@pytest.mark.parametrize("causal", [False, True])
def test_packed_auto_runs_hopper_shift(hopper_takes_it, monkeypatch, causal):
    """On packed sequences, dealt unpadded, ``shift`` led every deterministic schedule causal and
    unmasked (H100, bench/packed_paths.py): "auto" runs it on the Hopper kernel, as does a
    named ordered schedule; a named ``recompute`` stays portable (``FASTER_ON_HOPPER``)."""
    from dash_inductor.ops import packed
    from dash_inductor.ops.hopper import launch

    ran = []
    monkeypatch.setattr(launch, "varlen_backward",
                        lambda *args, **kwargs: ran.append(kwargs["schedule"].name) or "hopper")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v, do = (torch.randn(12, 2, 16) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(2, 12)
    packed.varlen_forward(q, k, v, cu, cu, 7, 7, out, lse, is_causal=causal, scale=0.25)

    def backward(schedule):
        grads = (torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v))
        return packed.varlen_backward(do, q, k, v, out, lse, cu, cu, 7, 7, *grads,
                                      is_causal=causal, scale=0.25, schedule=schedule)

    assert backward("descending") == "hopper" and ran == ["descending"]
    assert backward("auto") == "hopper" and ran == ["descending", "shift"]
    plan = backward("recompute")
    assert (plan.kernel, plan.schedule) == ("portable", "recompute")
    assert ran == ["descending", "shift"]


@pytest.mark.parametrize("dim, seq, causal, window, expected", [
    (128, 16384, False, (-1, -1), "descending"), (128, 4096, False, (-1, -1), "descending"),
    (128, 4096, True, (-1, -1), "shift"), (128, 4096, False, (300, 200), "descending"),
    (64, 8192, False, (-1, -1), "ascending"), (64, 4096, True, (-1, -1), "shift"),
    (64, 16384, True, (-1, -1), "shift"), (64, 8192, False, (300, 200), "descending"),
    (64, 16384, False, (-1, -1), "ascending"), (64, 20000, False, (-1, -1), "ascending"),
    (64, 4096, False, (-1, -1), "ascending"), (64, 8191, False, (300, 200), "descending")])
def test_auto_on_hopper_follows_the_measured_rule(hopper_takes_it, dim, seq, causal, window,
                                                  expected):
    """The measured rule (H100 tables): ``shift`` causal; unmasked ``ascending`` at head dim 64
    and ``descending`` at 128, at every length; a window keeps ``descending`` where the problem
    is unmasked (it is window-aware); off the Hopper path ``auto`` stays the portable rule's."""
    from dash_inductor.ops.backward import choose_path, window_fallback

    q, k, v = (torch.empty(1, 2, seq, dim, device="meta") for _ in range(3))
    portable = catalog.get("recompute")
    path, reason, schedule = choose_path("auto", catalog.AUTO, portable, q, k, v, None, causal,
                                         window)
    assert (path, reason) == (dispatch.HOPPER, None)
    assert window_fallback(schedule, causal, window)[0].name == expected
    path, _, schedule = choose_path("portable", catalog.AUTO, portable, q, k, v, None, causal,
                                    (-1, -1))
    assert (path, schedule.name) == (dispatch.PORTABLE, "recompute")


def test_hopper_grid_keeps_each_heads_equal_items_in_one_round():
    """Ordered schedules whose items of a head are equally long run on a multiple of a head's
    items (``config.ordered_programs``); unequal ones (causal unpaired, windows, packed) and the
    unordered ones keep every SM (132 here, as an H100)."""
    from dash_inductor.ops import catalog
    from dash_inductor.ops.hopper.config import backward_config
    from dash_inductor.ops.hopper.launch import _geometry

    def programs(name, causal, n_kv=32, windowed=False, varlen=False, aligned=True):
        cfg = dataclasses.replace(backward_config(128, causal), aligned_grid=aligned)
        per_head, items, grid, _ = _geometry(catalog.get(name), cfg, 4, 16, n_kv, causal, 1,
                                             True, windowed, varlen, 132)
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
    expected = dim == 128 and schedule == "shift" and causal and group > 2
    constexprs = backward_constexprs(schedule, causal, group, True, cfg)
    assert constexprs["VISIT_HEADS"] == (2 if expected else group)
    for window, varlen in ((True, False), (False, True)):
        assert backward_constexprs(schedule, causal, group, True, cfg, window,
                                   varlen)["VISIT_HEADS"] == group
