"""The Hopper (sm90) Gluon kernels, forward and backward, compile for capability 90 without a GPU,
every variant.

Gluon does not run in the Triton interpreter, so this is what CI can check of them: each
(dtype, head dim, schedule, causal) variant, dense and packed, goes through the whole pipeline to
PTX and cubin, and the PTX holds what the design relies on (wgmma, TMA loads, per-partition
register budgets, the packed forward's masked stores of O, the dQ writer's TMA reduce-adds, or
its vectorized adds where a packed sub-tile crosses its sequence's edge and in the ``red.v4``
writer config, the partial's hand-off on a named barrier where the config asks for it, and, for
ordered schedules only, its ticket release), and ptxas keeps
the wgmma asynchronous (when it runs short of registers it serializes them, which halves the
kernel's speed without changing a bit of its output). The compiles run in
subprocesses without TRITON_INTERPRET (this suite sets it, and Gluon cannot call interpreted
functions). Numerics and waits are checked on an H100/H200 (tests/gpu, bench/hopper_check.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dash_inductor.ops import catalog
from dash_inductor.ops.hopper import aot
from dash_inductor.ops.hopper.config import HopperForwardConfig, backward_config, forward_config
from dash_inductor.ops.hopper.dq_order import flat_box, flat_layout

DTYPES = ("bf16", "fp16")

#: The oldest Triton the package supports, installed there by .ci/run (the GPU machine runs it).
OLDEST_TRITON = "3.6.0"
OLDEST_TRITON_DIR = Path(__file__).resolve().parents[1] / ".ci" / "triton-oldest"


@pytest.fixture(scope="module")
def variants() -> dict[tuple, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    runs = [subprocess.Popen([sys.executable, "-m", "dash_inductor.ops.hopper.aot", "--dtype", dtype],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for dtype in DTYPES]
    found = {}
    for run in runs:
        out, err = run.communicate()
        assert run.returncode == 0, err[-4000:]
        for line in out.splitlines():
            row = json.loads(line)
            found[(row["dtype"], row["head_dim"], row["schedule"], row["causal"],
                   row["variant"])] = row
    return found


def _check_backward(row: dict, schedule: str, head_dim: int, causal: bool,
                    varlen: bool = False) -> None:
    sched = catalog.get(schedule)
    named = (backward_config(head_dim, causal, packed=varlen).named_handoff
             and not sched.separate_dq)
    assert (row["named_arrives"] > 0) == named
    assert row["cubin_bytes"] > 0
    assert row["wgmma"] > 0
    assert row["tma_loads"] >= 4  # K, V, Q, dO (the compiler may duplicate a load on two paths)
    assert row["setmaxnreg_inc"] > 0 and row["setmaxnreg_dec"] > 0
    # dQ partials go by TMA reduce-adds; a packed sub-tile crossing its sequence's edge by red.v4.
    assert (row["dq_tma_adds"] > 0) == (not sched.separate_dq)
    assert (row["dq_adds"] > 0) == (varlen and not sched.separate_dq)
    assert (row["ticket_release"] > 0) == sched.ordered
    if not (varlen or sched.separate_dq):  # staged in fragment order: 16-byte stores only
        assert row["shared_v2_stores"] == 0
    assert row["narrow_stores"] == 0  # dK and dV go out 16 bytes a thread
    assert row["shared"] <= 227 * 1024
    assert row["wgmma_serialized"] == 0, "ptxas serializes the wgmma (advisory C7512)"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", catalog.NAMES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_compiles_for_sm90(variants, dtype, head_dim, schedule, causal):
    _check_backward(variants[(dtype, head_dim, schedule, causal, "dense")], schedule, head_dim,
                    causal)


@pytest.mark.parametrize("schedule, causal, window, varlen", aot.MASKED_VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_window_and_packed_backward_compile_for_sm90(variants, head_dim, schedule, causal, window,
                                                     varlen):
    _check_backward(variants[("bf16", head_dim, schedule, causal, aot.variant_name(window, varlen))],
                    schedule, head_dim, causal, varlen)


@pytest.mark.parametrize("schedule, causal", aot.DROPOUT_VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_backward_compiles_for_sm90(variants, head_dim, schedule, causal):
    """The backward with dropout draws the keep mask in the kernel (ten Philox rounds of 64-bit
    products) and keeps the plain variant's pipeline and shared memory; each thread draws the
    calls of its own elements, so the mask adds no shuffle."""
    row = variants[("bf16", head_dim, schedule, causal, "dense-dropout")]
    plain = variants[("bf16", head_dim, schedule, causal, "dense")]
    _check_backward(row, schedule, head_dim, causal)
    assert row["wide_multiplies"] >= plain["wide_multiplies"] + 20
    assert row["shared"] == plain["shared"]
    assert row["shuffles"] == plain["shuffles"]


@pytest.mark.parametrize("schedule, causal", aot.DQ_COLUMNS_VARIANTS)
def test_dq_rows_split_over_the_warpgroups_compile_for_sm90(variants, schedule, causal):
    """Head dim 64's default ``dq_row_warps=8``: each warpgroup's dQ MMA covers its 64 rows and
    all 64 columns, so it takes fewer (twice as wide) wgmma than the column split."""
    row = variants[("bf16", 64, schedule, causal, "dense")]
    split = variants[("bf16", 64, schedule, causal, "dense-dq-columns")]
    _check_backward(split, schedule, 64, causal)
    assert backward_config(64, causal).dq_row_warps == 8
    assert row["wgmma"] < split["wgmma"] and row["shared"] == split["shared"]


@pytest.mark.parametrize("schedule, causal", aot.RED_WRITER_VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_red_writer_config_compiles_for_sm90(variants, head_dim, schedule, causal):
    row = variants[("bf16", head_dim, schedule, causal, "dense-red-writer")]
    assert row["dq_adds"] > 0 and row["dq_tma_adds"] == 0
    assert row["shared_v2_stores"] > 0  # row-major staging, which the red.v4 adds read
    assert (row["named_arrives"] > 0) == backward_config(head_dim, causal).named_handoff
    assert row["ticket_release"] > 0 and row["wgmma_serialized"] == 0
    assert row["shared"] <= 227 * 1024


FORWARD_VARIANTS = [(64, "dense"), (64, "varlen"), (128, "dense"), (128, "varlen"), (64, "2wg")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim, variant", FORWARD_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_compiles_for_sm90(variants, dtype, head_dim, causal, variant):
    """Every forward variant, the two-warpgroup d64 tile included: no spill, asynchronous wgmma,
    and where the config asks for it, every exponential of a step's softmax computed while the
    previous P V is in flight (a 64-row warpgroup's 128-key step takes 64 a thread)."""
    row = variants[(dtype, head_dim, "forward", causal, variant)]
    cfg = HopperForwardConfig() if variant == "2wg" else forward_config(head_dim, variant == "varlen")
    assert (row["ex2_under_pv"] >= 64) == cfg.softmax_under_pv
    assert row["cubin_bytes"] > 0
    assert row["wgmma"] > 0
    assert row["tma_loads"] >= 3 and row["tma_stores"] >= 1  # Q, K, V in; O out
    # A packed tile that crosses its sequence's end stores O by masked 16-byte stores.
    assert (row["masked_stores"] > 0) == (variant == "varlen")
    assert row["setmaxnreg_inc"] > 0 and row["setmaxnreg_dec"] > 0
    assert row["dq_adds"] == row["dq_tma_adds"] == row["ticket_release"] == 0
    assert row["shared"] <= 227 * 1024
    assert row["wgmma_serialized"] == 0 and row["spill_store_bytes"] == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_forward_compiles_for_sm90(variants, head_dim, causal):
    """The forward with dropout draws the keep mask in the kernel and spreads it over the lanes
    by warp shuffles (a conversion through shared memory would not fit beside three stages)."""
    row = variants[("bf16", head_dim, "forward", causal, "dense-dropout")]
    plain = variants[("bf16", head_dim, "forward", causal, "dense")]
    assert row["wide_multiplies"] >= plain["wide_multiplies"] + 20
    assert row["tma_loads"] >= 3 and row["tma_stores"] >= 1
    assert row["shared"] <= 227 * 1024 and row["wgmma_serialized"] == 0
    assert row["shuffles"] > plain["shuffles"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_launcher_describes_the_boxes_the_offline_compile_builds(dtype):
    """The launcher's cached shared layouts are those the offline compile (and Gluon) derive."""
    import torch
    from triton.experimental.gluon import language as gl

    from dash_inductor.ops.hopper import launch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for block in ((1, 1, 64, 128), (1, 1, 128, 64), (1, 1, 64, 64)):
        layout = launch._shared_layout(block, torch_dtype)
        assert f"tensordesc<{dtype}{list(block)},{layout!r}>" == aot._descriptor(dtype, list(block))
        assert launch._shared_layout(block, torch_dtype) is layout  # built once
    stats = launch._shared_layout((64,), torch.float32)
    assert stats == gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    for head_dim in (64, 128):  # the dQ accumulator's reduce-add boxes
        acc = launch._shared_layout((64, head_dim), torch.float32)
        assert acc == gl.NVMMASharedLayout.get_default_for([64, head_dim], gl.float32)
        flat = launch._shared_layout(flat_box(64, head_dim), torch.float32, swizzled=False)
        assert flat == flat_layout() and flat.swizzle_byte_width == 0


def test_each_kernel_path_compiles_under_the_oldest_supported_triton():
    """Gluon's API moves between releases (3.6 has no public ``aggregate``, for one): the kernels
    must build under the oldest Triton supported as well as under the installed one."""
    if not (OLDEST_TRITON_DIR / "triton").is_dir():
        assert not os.environ.get("CI"), f"CI installs Triton {OLDEST_TRITON} in {OLDEST_TRITON_DIR}"
        pytest.skip(f"no Triton {OLDEST_TRITON} in {OLDEST_TRITON_DIR} (.ci/run installs it)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(OLDEST_TRITON_DIR), str(root)])}
    run = subprocess.run([sys.executable, "-m", "dash_inductor.ops.hopper.aot", "--dtype", "bf16",
                          "--few"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(rows) == len(aot.FEW_VARIANTS)
    for row in rows:
        assert row["triton"] == OLDEST_TRITON
        assert row["wgmma"] > 0 and row["wgmma_serialized"] == 0
        if row["schedule"] == "forward":
            varlen = "varlen" in row["variant"]
            assert (row["masked_stores"] > 0) == varlen
            cfg = forward_config(row["head_dim"], varlen)
            assert (row["ex2_under_pv"] >= 64) == cfg.softmax_under_pv
        else:
            _check_backward(row, row["schedule"], row["head_dim"], row["causal"],
                            varlen="varlen" in row["variant"])
