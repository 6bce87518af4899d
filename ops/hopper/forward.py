"""Attention forward for Hopper (sm90) in Gluon: one warp-specialized program per (Q tile, b*h).

Three partitions (the split of FlashAttention-3's forward, Shah et al. 2024):

- ``_load_partition`` (1 warp): TMA loads of the program's two Q halves once, then of K and V tile
  by tile through a ring of shared-memory stages; K and V have barriers of their own, so
  S = Q K^T can start before V has landed.
- ``_softmax_partition``, twice (one warpgroup each, 64 query rows each): the online softmax of
  FlashAttention-2 in the exp2 domain with wgmma. Each step issues the next tile's S = Q K^T and
  the previous tile's O += P V together, and computes the next tile's softmax while P V runs
  (FlashAttention-3's intra-warpgroup overlap). The two warpgroups meet only at the K/V ring, so
  one's softmax runs while the other's MMAs hold the tensor cores without the explicit turn-taking
  of FlashAttention-3's ping-pong (measured no faster here: docs/kernels-notes.md). Each stores its
  half of O through shared memory by TMA.

Causal attention (top-left, as the portable kernel) visits the KV tiles up to the diagonal, the
longest Q tiles first, and masks only the tiles that reach past a row's diagonal or past S.
``out`` and the natural-log ``lse`` are those of ``ops/portable/forward.py``; the bits may differ.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

from ..shared.tiles import LN2
from .primitives import partition_barrier, tma_load, tma_store


@gluon.jit
def _tile_coords(S, HQ, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """(Q tile, batch entry, query head, KV head, KV tiles to visit) of this program.

    Causal programs take the Q tiles from the last (the longest walk) to the first, so the long
    ones start in the first wave."""
    m = gl.program_id(0)
    if CAUSAL:
        m = gl.num_programs(0) - 1 - m
    bh = gl.program_id(1)
    keys = S
    if CAUSAL:
        keys = gl.minimum((m + 1) * BLOCK_M, S)
    return m, bh // HQ, bh % HQ, (bh % HQ) // GROUP, gl.cdiv(keys, BLOCK_N)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready,
                    kv_empty, S, HQ, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                    BLOCK_M: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.shape[0]
    HALF_M: gl.constexpr = q_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    m, b, h, h_kv, n_tiles = _tile_coords(S, HQ, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma_load(q_desc, [b, h, m * BLOCK_M + half * HALF_M, 0], q_ready,
                 q_bufs.index(half).reshape([1, 1, HALF_M, HEAD_D]))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [b, h_kv, j * BLOCK_N, 0], k_ready.index(s),
                 k_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [b, h_kv, j * BLOCK_N, 0], v_ready.index(s),
                 v_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))


@gluon.jit
def _masked(s, j, mask_from, rows, offs_n, S, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of KV tile ``j``, -inf past S and past a row's diagonal (causal), which only the
    tiles from ``mask_from`` on can reach. They stay unscaled: the softmax folds the scale into
    its exponent, one FMA per score (as FlashAttention-3)."""
    if j >= mask_from:
        cols = gl.expand_dims(j * BLOCK_N + offs_n, 0)
        keep = cols < S
        if CAUSAL:
            keep = keep & (cols <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _softmax_partition(q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, o_desc, LSE,
                       L, S, HQ, qk_scale, HALF: gl.constexpr, GROUP: gl.constexpr,
                       CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       num_warps: gl.constexpr):
    STAGES: gl.constexpr = k_bufs.shape[0]
    HALF_M: gl.constexpr = q_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = q_bufs.index(HALF)
    m, b, h, _, n_tiles = _tile_coords(S, HQ, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
    row0 = m * BLOCK_M + HALF * HALF_M
    rows = row0 + gl.arange(0, HALF_M, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    mask_from = S // BLOCK_N  # the first tile with keys past S (none when S is a tile multiple)
    if CAUSAL:
        mask_from = gl.minimum(mask_from, row0 // BLOCK_N)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    s = _masked(s, 0, mask_from, rows, offs_n, S, BLOCK_N, CAUSAL)
    m_i = gl.max(s, 1)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i * qk_scale, 1))
    l_i = gl.sum(p, 1)
    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
    for j in range(1, n_tiles):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        s = _masked(s, j, mask_from, rows, offs_n, S, BLOCK_N, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2((m_i - m_new) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new * qk_scale, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(last), count=1)

    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    q_smem.store(out.to(dtype))  # this half of Q is no longer read: it stages O for the TMA store
    fence_async_shared()
    partition_barrier()
    tma_store(o_desc, [b, h, row0, 0], q_smem.reshape([1, 1, HALF_M, HEAD_D]))
    lse = (m_i * qk_scale + gl.log2(l_i)) * LN2
    gl.store(LSE + (b * HQ + h).to(gl.int64) * L + rows, lse, mask=rows < L)
    tma.store_wait(0)


@gluon.jit
def forward_kernel(q_desc, k_desc, v_desc, o_desc, LSE, L, S, HQ, qk_scale,
                   GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   SOFTMAX_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """O and the natural-log logsumexp of one Q tile of one (batch, head); see the module doc.

    The descriptors are rank 4, over (B, H, N, D) in the tensors' own strides; ``q_desc`` and
    ``o_desc`` boxes hold half a Q tile (one warpgroup's rows)."""
    dtype: gl.constexpr = q_desc.dtype
    HALF_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    gl.static_assert(2 * HALF_M == BLOCK_M, "the Q/O descriptors' box is half a Q tile")
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bufs = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per softmax warpgroup

    gl.warp_specialize([
        (_softmax_partition, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                              o_desc, LSE, L, S, HQ, qk_scale, 0, GROUP, CAUSAL, BLOCK_M,
                              num_warps)),
        (_softmax_partition, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                              o_desc, LSE, L, S, HQ, qk_scale, 1, GROUP, CAUSAL, BLOCK_M,
                              num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready,
                           v_ready, kv_empty, S, HQ, GROUP, CAUSAL, BLOCK_M)),
    ], [num_warps, 1], [SOFTMAX_REGS, LOAD_REGS])
