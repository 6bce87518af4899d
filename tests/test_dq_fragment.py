"""The dense Hopper backward's dQ in fragment order (``ops/hopper/dq_order.py``), on the CPU.

The compute warps stage each dQ partial in the order the wgmma accumulator's registers hold it,
the writer adds it to DQACC through a flat view, and the conversion (``ops/shared/dq_convert.py``,
in the Triton interpreter) reads it back through the inverse permutation. Checked here against a
model of the staging built from the PTX ISA's wgmma accumulator fragment, not from the code under
test: the staging layout's bits, the registers Triton gives the dQ MMA, and a converted gradient
bit for bit. The GPU run (bench/hopper_tune.py, ``dq_fragment_order=0`` against the default)
checks that the kernel's gradients are bitwise those of the row-major staging.
"""

import pytest
import torch

from dash_inductor.ops import catalog
from dash_inductor.ops.hopper import dq_order
from dash_inductor.ops.hopper.config import backward_config, backward_constexprs
from dash_inductor.ops.hopper.launch import _fragment_order
from dash_inductor.ops.shared.dq_convert import convert_dq
from dash_inductor.ops.shared.launch import Launches

#: (block_m, head dim, warps along dQ's rows) of the dense configs, whose compute partition has 8
#: warps: four split the columns over the warpgroups, eight (block_m 128) split the rows.
TILES = [(64, 128, 4), (128, 64, 4), (128, 64, 8)]
WARPS = 8


def _wgmma_staging(block_m: int, head_d: int, row_warps: int) -> torch.Tensor:
    """For each offset of a staged tile, the row-major index of the element there. The fragment of
    wgmma m64nNk16 with an f32 accumulator: lane t of warp w holds d[i] at row 16 (w % R) + t / 4
    + 8 (i / 2 % 2), column 2 (t % 4) + i % 2 + 8 (i / 4), for R = ``row_warps`` warps along the
    rows; warp w // R takes the (w // R)-th N columns, and a tile taller than the 16 R rows the
    warps cover repeats the instruction 16 R rows down (its registers after the first rows').
    Each thread stages its registers in runs of four, lane after lane, warp after warp."""
    n = head_d // (WARPS // row_warps)
    per_mma = n // 2
    regs = per_mma * (block_m // (16 * row_warps))
    perm = torch.empty(block_m * head_d, dtype=torch.long)
    for warp in range(WARPS):
        for lane in range(32):
            for j in range(regs):
                m, i = divmod(j, per_mma)
                row = 16 * row_warps * m + 16 * (warp % row_warps) + lane // 4 + 8 * (i // 2 % 2)
                col = n * (warp // row_warps) + 2 * (lane % 4) + i % 2 + 8 * (i // 4)
                offset = ((warp * regs // 4 + j // 4) * 32 + lane) * 4 + j % 4
                perm[offset] = row * head_d + col
    return perm


@pytest.mark.parametrize("block_m, head_d, row_warps", TILES)
def test_the_staging_layout_is_the_wgmma_fragment(block_m, head_d, row_warps):
    bases = dq_order.fragment_bases(block_m, head_d, WARPS, row_warps)
    staged = torch.zeros(block_m * head_d, dtype=torch.long)
    for bit, (row, col) in enumerate(bases):
        staged[1 << bit:2 << bit] = staged[:1 << bit] ^ (row * head_d + col)
    assert torch.equal(staged, _wgmma_staging(block_m, head_d, row_warps))


@pytest.mark.parametrize("block_m, head_d, row_warps", TILES)
def test_the_staging_follows_the_registers_triton_gives_the_mma(block_m, head_d, row_warps):
    """Registers, lanes, warps of the dQ MMA's layout, as Triton's linear layout has them: the
    staging's offset bits take the two lowest register bits, the lanes, the other registers, the
    warps (so each thread stores 16 bytes at once, each warp 512 contiguous bytes)."""
    gluon_ir = pytest.importorskip("triton._C.libtriton.gluon_ir")
    from triton._C.libtriton import ir

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    mma = dq_order.dq_mma_layout(block_m, head_d, WARPS, row_warps)
    linear = builder.to_linear_layout(mma._to_ir(builder), [block_m, head_d])
    regs = linear.reg_bases
    assert dq_order.fragment_bases(block_m, head_d, WARPS, row_warps) == (
        regs[:2] + linear.lane_bases + regs[2:] + linear.warp_bases)


LAYOUTS = {
    "bhle": lambda b, h, l, e, dt: torch.empty(b, h, l, e, dtype=dt),
    "blhe": lambda b, h, l, e, dt: torch.empty(b, l, h, e, dtype=dt).transpose(1, 2),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_m, head_d, row_warps", TILES)
def test_conversion_reads_the_fragment_order(block_m, head_d, row_warps, layout, dtype):
    batch, heads, seq, rows = 2, 3, 200, 256  # a last tile the sequence ends inside
    ref = torch.randn(batch * heads, rows, head_d, generator=torch.Generator().manual_seed(0))
    perm = _wgmma_staging(block_m, head_d, row_warps)
    assert not torch.equal(perm, torch.arange(perm.numel()))
    acc = ref.view(batch * heads, rows // block_m, -1)[:, :, perm].reshape(ref.shape)
    expected = ref.view(batch, heads, rows, head_d)[:, :, :seq].to(dtype)
    dq = LAYOUTS[layout](batch, heads, seq, head_d, dtype).fill_(float("nan"))
    convert_dq(Launches(), acc, dq, _fragment_order(block_m, head_d, WARPS, row_warps))
    assert torch.equal(dq, expected)
    convert_dq(Launches(), acc, dq)  # read row-major, the same accumulator is another gradient
    assert not torch.equal(dq, expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dense_configs_stage_in_fragment_order_and_packed_do_not(head_dim, causal):
    """Packed sequences keep row-major tiles: a sub-tile crossing its sequence's edge adds row by
    row, and the kernel's tail conversion (``dq_tail.py``) reads rows. So does the ``red.v4``
    writer."""
    shift = catalog.get("shift")
    dense, packed = backward_config(head_dim, causal), backward_config(head_dim, causal, True)
    assert dense.dq_fragment_order and not packed.dq_fragment_order
    assert backward_constexprs(shift, causal, 1, True, dense)["DQ_FRAGMENT"]
    assert not backward_constexprs(shift, causal, 1, False, packed, varlen=True)["DQ_FRAGMENT"]
    red = backward_config(head_dim, causal).__class__(**{**dense.__dict__, "dq_tma": False})
    assert not backward_constexprs(shift, causal, 1, True, red)["DQ_FRAGMENT"]
