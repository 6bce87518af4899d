"""Attention forward for Hopper (sm90) in Gluon: one warp-specialized program per (Q tile, b*h).

Three partitions (the split of FlashAttention-3's forward, Shah et al. 2024):

- ``_load_partition`` (1 warp): TMA loads of the program's Q parts once, then of K and V tile
  by tile through a ring of shared-memory stages; K and V have barriers of their own, so
  S = Q K^T can start before V has landed.
- ``_softmax_partition``, two or three times (one warpgroup each, 64 query rows each; three at
  head dim 64, FlashAttention-3's tile there, so a K/V tile serves 192 rows): the online softmax of
  FlashAttention-2 in the exp2 domain with wgmma. Each step issues the next tile's S = Q K^T and
  the previous tile's O += P V together, and where the config has registers for a second P
  (``softmax_under_pv``) computes the next tile's softmax while P V runs (FlashAttention-3's
  intra-warpgroup overlap). The warpgroups meet only at the K/V ring, so one's
  softmax runs while another's MMAs hold the tensor cores without the explicit turn-taking of
  FlashAttention-3's ping-pong (measured no faster here: docs/kernels-notes.md). Each stores its
  part of O through shared memory by TMA.

Causal attention (top-left, as the portable kernel) visits the KV tiles up to the diagonal, the
longest Q tiles first, and masks only the tiles that reach past a row's diagonal or past S.
``out`` and the natural-log ``lse`` are those of ``ops/portable/forward.py``; the bits may differ.

VARLEN runs packed sequences in one launch over ``ops/portable/packed.py``'s virtual batch: the
grid is (sequences * Hq, Q tiles of max_q), each program reads its sequence's rows from the
offsets on the device, exits past its length, and aligns causal bottom-right (diagonal key
S - L). The descriptors span the whole packing, so a box may hold a neighbour's rows (or rows past
the tensor, which TMA reads as zeros); none of them reaches the sequence's results: the scores of
keys past the sequence are -inf before the row max, the value rows past it are zeroed in shared
memory before P V (P = 0 does not hide a NaN), query rows past it are computed but never stored
(a tile that crosses the sequence's end stores its rows by masked stores instead of TMA), and its
``lse`` goes to the (Hq, Tq) layout the packed backward reads. A Q tile that sees no key writes
zeros and an ``lse`` of -inf.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)

from ..shared.tiles import LN2, crosses_edge, sequence_rows
from . import dropout
from .primitives import partition_barrier, row_runs, tma_load, tma_store, zero_outside
from .walk import tma_batch


@gluon.jit
def _tile_coords(CU_Q, CU_K, L, S, HQ, max_q, max_k, GROUP: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 VARLEN: gl.constexpr):
    """(Q tile, batch entry or sequence, query head, KV head, first query row, queries, first key
    row, keys, diagonal key of query 0, KV tiles to visit) of this program.

    VARLEN puts sequences x heads on grid axis 0, which may pass 65535 programs. Causal programs
    take the Q tiles from the last (the longest walk) to the first, so the long ones start in
    the first wave."""
    M_AXIS: gl.constexpr = 1 if VARLEN else 0
    m = gl.program_id(M_AXIS)
    if CAUSAL:
        m = gl.num_programs(M_AXIS) - 1 - m
    bh = gl.program_id(1 - M_AXIS)
    b = bh // HQ
    h = bh % HQ
    q0, seq_l, k0, seq_s, diag = sequence_rows(CU_Q, CU_K, b, L, S, max_q, max_k, VARLEN)
    keys = seq_s
    if CAUSAL:
        keys = gl.minimum((m + 1) * BLOCK_M + diag, seq_s)
        if VARLEN:  # bottom-right: with more queries than keys, the first Q tiles see none
            keys = gl.maximum(keys, 0)
    return m, b, h, h // GROUP, q0, seq_l, k0, seq_s, diag, gl.cdiv(keys, BLOCK_N)


@gluon.jit
def _load_partition(loads, GROUP: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                    BLOCK_M: gl.constexpr):
    (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, CU_Q,
     CU_K, L, S, HQ, max_q, max_k) = loads
    STAGES: gl.constexpr = k_bufs.shape[0]
    PART_M: gl.constexpr = q_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    m, b, h, h_kv, q0, _, k0, _, _, n_tiles = _tile_coords(CU_Q, CU_K, L, S, HQ, max_q, max_k,
                                                           GROUP, BLOCK_M, BLOCK_N, CAUSAL,
                                                           VARLEN)
    PARTS: gl.constexpr = q_bufs.shape[0]
    batch = tma_batch(b, VARLEN)
    mbarrier.expect(q_ready, PARTS * q_desc.block_type.nbytes)
    for part in gl.static_range(PARTS):
        tma_load(q_desc, [batch, h, q0 + m * BLOCK_M + part * PART_M, 0], q_ready,
                 q_bufs.index(part).reshape([1, 1, PART_M, HEAD_D]))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [batch, h_kv, k0 + j * BLOCK_N, 0], k_ready.index(s),
                 k_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [batch, h_kv, k0 + j * BLOCK_N, 0], v_ready.index(s),
                 v_bufs.index(s).reshape([1, 1, BLOCK_N, HEAD_D]))


@gluon.jit
def _masked(s, j, mask_from, diagonal, offs_n, S, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of KV tile ``j``, -inf past S and past a row's ``diagonal`` key (causal), which
    only the tiles from ``mask_from`` on can reach. They stay unscaled: the softmax folds the
    scale into its exponent, one FMA per score (as FlashAttention-3)."""
    if j >= mask_from:
        cols = gl.expand_dims(j * BLOCK_N + offs_n, 0)
        keep = cols < S
        if CAUSAL:
            keep = keep & (cols <= gl.expand_dims(diagonal, 1))
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _row_max(m, KEYLESS: gl.constexpr):
    """The running max the exponents subtract; KEYLESS (rows that may see no key): 0 where a
    row's is still -inf, so that its P is exp2(-inf) = 0 and not NaN. Such a row sees no key
    in a later tile either: every row that sees keys sees key 0, in the first tile."""
    if KEYLESS:
        m = gl.where(m == float("-inf"), 0.0, m)
    return m


@gluon.jit
def _lse_row0(LSE, b, h, q0, HQ, L, VARLEN: gl.constexpr):
    """Where row 0 of (batch entry ``b``, head ``h``) goes in the natural-log logsumexp: (B, Hq,
    L), or VARLEN the (Hq, Tq) plane of the packed backward, by packed row."""
    if VARLEN:
        row0 = LSE + h.to(gl.int64) * L + q0
    else:
        row0 = LSE + (b * HQ + h).to(gl.int64) * L
    return row0


@gluon.jit
def _store_rows(values, O, row, n_rows, h, stride_oh, stride_om):
    """Rows [0, ``n_rows``) of tile ``values`` (laid out in ``row_runs``) into head ``h`` of
    ``O`` from row ``row`` on, by masked stores: for a tile that crosses its sequence's end,
    where a TMA store would also write the next sequence's rows."""
    layout: gl.constexpr = values.type.layout
    r = gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = (O + h.to(gl.int64) * stride_oh + gl.expand_dims((row + r).to(gl.int64) * stride_om, 1)
            + gl.expand_dims(c, 0))
    gl.store(ptrs, values, mask=gl.expand_dims(r < n_rows, 1))


@gluon.jit
def _softmax_partition(shared, PART: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                       VARLEN: gl.constexpr, BLOCK_M: gl.constexpr, DROPOUT: gl.constexpr,
                       UNDER_PV: gl.constexpr, num_warps: gl.constexpr):
    """Rows [PART * PART_M, (PART + 1) * PART_M) of the program's Q tile; ``shared``: the
    kernel's buffers, barriers and arguments, the same for every softmax warpgroup. DROPOUT:
    P V takes the kept probabilities (``dropout.py``), the row sums all of them. UNDER_PV: a
    step's softmax runs while the previous step's P V is in flight."""
    (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, v_clear, o_desc, O, LSE, CU_Q,
     CU_K, stride_oh, stride_om, L, S, HQ, max_q, max_k, qk_scale, RNG, drop_threshold,
     drop_scale) = shared
    STAGES: gl.constexpr = k_bufs.shape[0]
    PART_M: gl.constexpr = q_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    KEYLESS: gl.constexpr = VARLEN and CAUSAL  # bottom-right: with L > S the first rows see none
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = q_bufs.index(PART)
    m, b, h, _, q0, seq_l, _, seq_s, diag, n_tiles = _tile_coords(
        CU_Q, CU_K, L, S, HQ, max_q, max_k, GROUP, BLOCK_M, BLOCK_N, CAUSAL, VARLEN)
    row0 = m * BLOCK_M + PART * PART_M
    rows = row0 + gl.arange(0, PART_M, layout=row_layout)
    diagonal = rows + diag
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    mask_from = seq_s // BLOCK_N  # the first tile with keys past S (none when S is a tile multiple)
    if CAUSAL:  # (a negative diagonal, bottom-right, masks every tile)
        mask_from = gl.minimum(mask_from, (row0 + diag) // BLOCK_N)
    s_zero = gl.zeros([PART_M, BLOCK_N], gl.float32, layout=s_layout)

    seed, offset = dropout.load_state(RNG, DROPOUT)
    bh = b * HQ + h
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DROPOUT:  # drawn while the MMA runs
        kept = dropout.keep(seed, offset, drop_threshold, bh, row0, 0, L, S, PART_M, BLOCK_N,
                            s_layout)
    s = warpgroup_mma_wait(0, deps=(s, ))
    s = _masked(s, 0, mask_from, diagonal, offs_n, seq_s, BLOCK_N, CAUSAL)
    m_i = _row_max(gl.max(s, 1), KEYLESS)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i * qk_scale, 1))
    l_i = gl.sum(p, 1)
    if DROPOUT:
        p = gl.where(kept, p, 0.0)
    p = p.to(dtype)  # carried into the next step as the MMA operand: half the registers of fp32
    acc = gl.zeros([PART_M, HEAD_D], gl.float32, layout=o_layout)
    gl.static_assert(STAGES >= 3 or not UNDER_PV, "under P V, K tile j + 1 and V tile j - 1 "
                     "need stages of their own")
    if UNDER_PV:
        mbarrier.wait(k_ready.index(1 % STAGES), (1 // STAGES) & 1, pred=n_tiles > 1)
    for j in range(1, n_tiles):
        st = j % STAGES
        prev = (j - 1) % STAGES
        if not UNDER_PV:
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p, p_layout)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        if DROPOUT:
            kept = dropout.keep(seed, offset, drop_threshold, bh, row0, j * BLOCK_N, L, S,
                                PART_M, BLOCK_N, s_layout)
        s = warpgroup_mma_wait(1, deps=(s, ))
        s = _masked(s, j, mask_from, diagonal, offs_n, seq_s, BLOCK_N, CAUSAL)
        m_new = _row_max(gl.maximum(m_i, gl.max(s, 1)), KEYLESS)
        alpha = gl.exp2((m_i - m_new) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new * qk_scale, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        if DROPOUT:
            p = gl.where(kept, p, 0.0)
        p = p.to(dtype)
        m_i = m_new
        if UNDER_PV:  # ptxas hoists a wgmma wait to the top of its basic block: this spin loop
            # on the next K tile ends the block after the softmax, so the softmax runs under P V
            nxt = j + 1
            mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_tiles)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    last = (n_tiles - 1) % STAGES
    v_last = v_bufs.index(last)
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    if VARLEN:  # only the last tile reaches past the sequence's keys: into a neighbour's values
        first_key = (n_tiles - 1) * BLOCK_N
        if crosses_edge(first_key, BLOCK_N, 0, seq_s):
            if PART == 0:  # one warpgroup clears the rows, the others wait for them
                zero_outside(v_last, 0, seq_s - first_key, num_warps)
                mbarrier.arrive(v_clear, count=1)
            else:
                mbarrier.wait(v_clear, 0)
    p_op = gl.convert_layout(p, p_layout)
    acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(last), count=1)

    total = l_i
    if KEYLESS:  # a row that saw no key: l_i = 0, acc = 0, so out 0 (and lse -inf: m_i is 0)
        total = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(total, gl.SliceLayout(1, o_layout)), 1)
    if DROPOUT:  # as the portable forward: the kept sum over all, then 1 / (1 - p)
        out = out * drop_scale
    q_smem.store(out.to(dtype))  # this part of Q is no longer read: it stages O for the store
    fence_async_shared()
    partition_barrier()
    o_box = q_smem.reshape([1, 1, PART_M, HEAD_D])
    if VARLEN:
        if crosses_edge(row0, PART_M, 0, seq_l):
            _store_rows(q_smem.load(row_runs(HEAD_D, num_warps)), O, q0 + row0, seq_l - row0, h,
                        stride_oh, stride_om)
        else:
            tma_store(o_desc, [0, h, q0 + row0, 0], o_box)
    else:
        tma_store(o_desc, [b, h, row0, 0], o_box)
    lse = (m_i * qk_scale + gl.log2(l_i)) * LN2
    gl.store(_lse_row0(LSE, b, h, q0, HQ, L, VARLEN) + rows, lse, mask=rows < seq_l)
    tma.store_wait(0)


@gluon.jit
def _store_keyless(O, LSE, q0, seq_l, row0, b, h, stride_oh, stride_om, HQ, L,
                   BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, num_warps: gl.constexpr):
    """A VARLEN Q tile whose rows see no key (its sequence has none, or causal leaves them none):
    out 0 and lse -inf, as ``dash.attention`` gives such rows."""
    layout: gl.constexpr = row_runs(HEAD_D, num_warps)
    zeros = gl.zeros([BLOCK_M, HEAD_D], O.dtype.element_ty, layout=layout)
    _store_rows(zeros, O, q0 + row0, seq_l - row0, h, stride_oh, stride_om)
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    gl.store(_lse_row0(LSE, b, h, q0, HQ, L, True) + rows,
             gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows.type.layout),
             mask=rows < seq_l)


@gluon.jit(do_not_specialize=["drop_threshold"])  # its value changes with p, not the plan
def forward_kernel(q_desc, k_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, stride_oh, stride_om, L,
                   S, HQ, max_q, max_k, qk_scale, RNG, drop_threshold, drop_scale,
                   GROUP: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   SOFTMAX_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, DROPOUT: gl.constexpr,
                   SOFTMAX_UNDER_PV: gl.constexpr, num_warps: gl.constexpr):
    """O and the natural-log logsumexp of one Q tile of one (batch, head); see the module doc.

    The descriptors are rank 4, over (B, H, N, D) in the tensors' own strides (VARLEN: the packed
    tensors as (1, H, T, D), L = Tq and S = Tk; ``O`` with its head and row strides for the
    masked stores); ``q_desc`` and ``o_desc`` boxes hold one softmax warpgroup's rows, a half
    or a third of the Q tile."""
    dtype: gl.constexpr = q_desc.dtype
    PART_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    PARTS: gl.constexpr = BLOCK_M // PART_M
    gl.static_assert(PARTS * PART_M == BLOCK_M and (PARTS == 2 or PARTS == 3),
                     "the Q/O descriptors' box is a half or a third of the Q tile")
    gl.static_assert(PARTS == 2 or not VARLEN, "packed sequences take two softmax warpgroups")
    if VARLEN:
        m, b, h, _, q0, seq_l, _, _, _, n_tiles = _tile_coords(
            CU_Q, CU_K, L, S, HQ, max_q, max_k, GROUP, BLOCK_M, BLOCK_N, CAUSAL, VARLEN)
        if m * BLOCK_M >= seq_l:
            return
        if n_tiles == 0:  # no partition would have a key to wait for
            _store_keyless(O, LSE, q0, seq_l, m * BLOCK_M, b, h, stride_oh, stride_om, HQ, L,
                           BLOCK_M, HEAD_D, num_warps)
            return
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PART_M, HEAD_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bufs = gl.allocate_shared_memory(dtype, [PARTS, PART_M, HEAD_D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_ready, count=1)
    v_clear = q_ready  # dense: never touched
    if VARLEN:  # a packed tile's value rows past its sequence are cleared once for all parts
        v_clear = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(v_clear, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=PARTS)  # one arrival per softmax warpgroup

    shared = (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, v_clear, o_desc, O, LSE,
              CU_Q, CU_K, stride_oh, stride_om, L, S, HQ, max_q, max_k, qk_scale, RNG,
              drop_threshold, drop_scale)
    loads = (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
             CU_Q, CU_K, L, S, HQ, max_q, max_k)
    if PARTS == 2:
        gl.warp_specialize([
            (_softmax_partition, (shared, 0, GROUP, CAUSAL, VARLEN, BLOCK_M, DROPOUT,
                                  SOFTMAX_UNDER_PV, num_warps)),
            (_softmax_partition, (shared, 1, GROUP, CAUSAL, VARLEN, BLOCK_M, DROPOUT,
                                  SOFTMAX_UNDER_PV, num_warps)),
            (_load_partition, (loads, GROUP, CAUSAL, VARLEN, BLOCK_M)),
        ], [num_warps, 1], [SOFTMAX_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_softmax_partition, (shared, 0, GROUP, CAUSAL, VARLEN, BLOCK_M, DROPOUT,
                                  SOFTMAX_UNDER_PV, num_warps)),
            (_softmax_partition, (shared, 1, GROUP, CAUSAL, VARLEN, BLOCK_M, DROPOUT,
                                  SOFTMAX_UNDER_PV, num_warps)),
            (_softmax_partition, (shared, 2, GROUP, CAUSAL, VARLEN, BLOCK_M, DROPOUT,
                                  SOFTMAX_UNDER_PV, num_warps)),
            (_load_partition, (loads, GROUP, CAUSAL, VARLEN, BLOCK_M)),
        ], [num_warps, num_warps, 1], [SOFTMAX_REGS, SOFTMAX_REGS, LOAD_REGS])
