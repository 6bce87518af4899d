"""The dQ partial's fragment order: where each element of a (BLOCK_M, HEAD_D) dQ tile sits in the
backward's staging buffer and in the fp32 accumulator (DQACC) of the dense Hopper path.

The wgmma accumulator gives each thread pairs of adjacent columns in two rows eight apart. Staged
row-major, a warp's stores hit each bank twice (8-byte stores, 2-way conflicts). Staged in the
order the registers hold it, offset bits follow the register bits: the two lowest register bits
(four floats, one 16-byte store), the five lane bits (a warp's 512 contiguous bytes), the other
register bits, the warp bits, the warpgroup bit last. The writer adds the tile to DQACC through a
flat view of rows of :data:`FLAT` floats, so DQACC holds each tile in the same order and the dQ
conversion (``ops/shared/dq_convert.py``) reads it back through the inverse permutation.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin

#: Floats per row of the flat view: one TMA box row (a box dimension holds at most 256 elements).
FLAT = 256


@gluon.constexpr_function
def dq_mma_layout(block_m, head_d, num_warps, row_warps=4):
    """The dQ MMA's accumulator layout: ``row_warps`` warps along the rows, the rest split the
    columns. Four (a warpgroup): both warpgroups take every row, half the columns each; eight
    (``block_m`` >= 128): each warpgroup takes its 64 rows, all columns, so its MMAs are twice as
    wide and read half the dS^T and all of K once instead of all of dS^T and half of K."""
    groups = num_warps // row_warps
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[row_warps, groups],
                                     instr_shape=[16, head_d // groups, 16])


@gluon.constexpr_function
def fragment_bases(block_m, head_d, num_warps, row_warps=4):
    """[row, col] of the element at offset 2**i of a tile in fragment order, for every offset bit
    i: the bases of :func:`dq_mma_layout`'s registers, lanes and warps (the wgmma accumulator
    fragment; ``tests/test_dq_fragment.py`` checks them against Triton's linear layout) in the
    order of the module doc."""
    groups = num_warps // row_warps
    n = head_d // groups  # columns of one warp
    rows = 16 * row_warps  # rows the warps cover once
    regs = [[0, 1], [8, 0]]
    regs += [[0, 8 << k] for k in range((n // 8).bit_length() - 1)]
    regs += [[rows << k, 0] for k in range((block_m // rows).bit_length() - 1)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << k, 0] for k in range(row_warps.bit_length() - 1)]
    warps += [[0, n << k] for k in range(groups.bit_length() - 1)]
    return regs[:2] + lanes + regs[2:] + warps


@gluon.constexpr_function
def staging_layout(block_m, head_d, num_warps, row_warps=4):
    """The shared layout of a [block_m, head_d] partial staged in fragment order."""
    return gl.SharedLinearLayout(fragment_bases(block_m, head_d, num_warps, row_warps))


def flat_layout() -> gl.NVMMASharedLayout:
    """The flat view's box layout: unswizzled, so that a box row is FLAT contiguous floats."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def flat_box(block_m: int, head_d: int) -> tuple[int, int]:
    """The TMA box of one tile in the flat view."""
    return block_m * head_d // FLAT, FLAT


@builtin
def as_flat(buf, desc, _semantic=None):
    """Staged tile ``buf`` as the flat box of ``desc`` (``reinterpret``; ``_reinterpret`` in
    Triton 3.6)."""
    view = getattr(buf, "reinterpret", None) or buf._reinterpret
    return view(gl.float32, desc.block_type.shape, desc.layout, _semantic=_semantic)
