"""Small pieces the Hopper kernels share: partition barriers, named barriers between partitions,
TMA copies under the names of the installed Triton, the dQ writer's TMA reduce-add and vectorized
fp32 adds, the zeroing of a shared tile's rows, and the store of a KV tile's dK and dV."""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

#: A barrier over the calling partition's warps (``thread_barrier`` until Triton 3.6, ``barrier`` after).
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
#: TMA global-to-shared copy (``async_copy_global_to_shared`` until Triton 3.6, ``async_load`` after).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: TMA shared-to-global copy (``async_copy_shared_to_global`` until Triton 3.6, ``async_store`` after).
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


#: The low-numbered hardware barriers serve Triton's warp specialization (the default partition,
#: the start barrier, one per worker partition; 0 and 1 in these kernels' PTX), so the kernels'
#: own named barriers count down from the last of the sixteen.
LAST_NAMED_BARRIER = gl.constexpr(15)


@gluon.jit
def named_barrier_arrive(index, threads: gl.constexpr, num_warps: gl.constexpr):
    """Every thread of the calling ``num_warps``-warp partition arrives on named barrier ``index``
    of ``threads`` participants, without waiting (``bar.arrive``: its prior memory accesses are
    performed before the waiters go on). Unlike ``mbarrier.arrive``, which one elected thread
    issues after a barrier over the whole partition, this holds back none of the caller's warps."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    gl.inline_asm_elementwise("bar.arrive $1, $2;\n mov.b32 $0, 0;", "=r,r,r",
                              [gl.full([32 * num_warps], index, gl.int32, layout=layout),
                               gl.full([32 * num_warps], threads, gl.int32, layout=layout)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_barrier_sync(index, threads: gl.constexpr):
    """The calling one-warp partition waits on named barrier ``index`` until all ``threads``
    participants (its own 32 included) have arrived (``bar.sync``)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise("bar.sync $1, $2;\n mov.b32 $0, 0;", "=r,r,r",
                              [gl.full([32], index, gl.int32, layout=layout),
                               gl.full([32], threads, gl.int32, layout=layout)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def await_count(counter, lo, hi, ERR, max_spin):
    """Wait (acquire) until int32 ``counter``, which only grows, reads a value in [lo, hi], at most
    ``max_spin`` polls; past them set the error flag ERR, which the launcher turns into an
    exception (no wait hangs). ``hi`` is the most the counter can legitimately hold by then (a
    ticket's turn: exactly ``lo``): a poll that reads more is polled again, as under GPU
    time-slicing a poll's result has come back corrupted (docs/racecheck.md)."""
    seen = gl.atomic_add(counter, 0, sem="acquire")
    spins = 0
    while ((seen < lo) | (seen > hi)) & (spins < max_spin):
        seen = gl.atomic_add(counter, 0, sem="acquire")
        spins += 1
    gl.atomic_max(ERR, 1, mask=(seen < lo) | (seen > hi))


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared tile ``src`` into the box at ``coord`` (the op that Triton 3.9
    names ``tma.async_atomic_add``; 3.6 has the op but no Python name for it)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


#: fp32 adds of a whole shared tile into global memory by the TMA unit, one instruction per
#: 128-byte column block: ``cp.reduce.async.bulk.tensor ... .add``.
tma_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add


@gluon.jit
def tma_writes_performed():
    """Wait until this thread's TMA stores and reduce-adds have been performed in global memory,
    not only read from shared memory (``tma.store_wait`` waits for the reads): an ordered writer
    releases the next rank's turn only after its partial has landed. Called by a one-warp
    partition."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.b32 $0, 0;", "=r,r",
                              [gl.zeros([32], gl.int32, layout=layout)], dtype=gl.int32,
                              is_pure=False, pack=1)


#: The dQ writer's vectorized writes of four fp32 elements: ``red`` adds (nothing comes back
#: from L2, unlike ``atom``), or plain stores for the first rank of an ordered reduction.
_RED_ADD_V4 = gl.constexpr("red.global.gpu.relaxed.add.v4.f32")
_STORE_V4 = gl.constexpr("st.global.v4.f32")


@gluon.jit
def red_add(ptrs, vals, STORE: gl.constexpr = False):
    """Fire-and-forget fp32 adds (STORE: stores), four contiguous elements per instruction.
    ``ptrs`` must hold 16-byte aligned runs of four."""
    op: gl.constexpr = _STORE_V4 if STORE else _RED_ADD_V4
    gl.inline_asm_elementwise(
        op + " [$4], {$8, $9, $10, $11};\n"
        "mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r",
        [ptrs.to(gl.int64, bitcast=True), vals.to(gl.int32, bitcast=True)], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.jit
def red_add_rows(ptrs, vals, keep):
    """``red_add`` of the elements where ``keep`` (int32, constant over each run of four)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $12, 0;\n"
        "@p red.global.gpu.relaxed.add.v4.f32 [$4], {$8, $9, $10, $11}; }\n"
        "mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
        [ptrs.to(gl.int64, bitcast=True), vals.to(gl.int32, bitcast=True), keep], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.constexpr_function
def row_runs(cols, num_warps):
    """The layout that moves a [rows, ``cols``] 16-bit tile between shared and global memory in
    16-byte runs of a row, a warp over whole rows."""
    return gl.BlockedLayout([1, 8], [32 // (cols // 8), cols // 8], [num_warps, 1], [1, 0])


@gluon.jit
def zero_outside(buf, lo, hi, num_warps: gl.constexpr):
    """Zero the rows of shared tile ``buf`` outside [lo, hi), then make the stores visible to the
    MMAs (async proxy) of every warp of the partition."""
    ROWS: gl.constexpr = buf.shape[0]
    layout: gl.constexpr = row_runs(buf.shape[1], num_warps)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    tile = buf.load(layout)
    keep = gl.expand_dims((rows >= lo) & (rows < hi), 1)
    buf.store(gl.where(keep, tile, gl.zeros_like(tile)))
    fence_async_shared()
    partition_barrier()


@gluon.constexpr_function
def rows_layout(block_n, head_d, num_warps):
    """A layout of a (block_n, head_d) 16-bit tile that holds the wgmma accumulator's rows on the
    same warps and lanes (warps of 16 rows; a lane's rows r and r + 8) but eight adjacent columns
    a thread: the accumulator's two, and those of the three other lanes of its quad. Values move
    within a warp only (Triton stages them through 3.7 KB of shared memory), and each thread then
    stores 16 bytes at a time."""
    cols = [[0, 1], [0, 2], [0, 4]] + [[0, 32 << j] for j in range(head_d.bit_length() - 6)]
    rows = [[16 * num_warps << j, 0] for j in range((block_n // (16 * num_warps)).bit_length() - 1)]
    lanes = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << j, 0] for j in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(cols[:3] + [[8, 0]] + cols[3:] + rows, lanes, warps, [],
                                      [block_n, head_d])


@gluon.jit
def store_kv_grads(DK, DV, dk, dv, b, hkv, kv, k_start, k_lo, k_hi, stride_dkb, stride_dkh,
                   stride_dkn, stride_dvb, stride_dvh, stride_dvn, sm_scale, dv_scale,
                   dtype: gl.constexpr, num_warps: gl.constexpr):
    """Write KV tile ``kv``'s finished dK and dV, scaled (dV by dropout's 1 / (1 - p), 1.0
    without: the kept P^T summed, then scaled once, as the portable kernel), the keys of its
    sequence only; 16 bytes a thread a store (``rows_layout``): the accumulator's four bytes a
    store left half of each sector unwritten, at the end of every KV tile while the tensor cores
    wait."""
    BLOCK_N: gl.constexpr = dk.shape[0]
    HEAD_D: gl.constexpr = dk.shape[1]
    layout: gl.constexpr = rows_layout(BLOCK_N, HEAD_D, num_warps)
    offs_kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    offs_kd = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    keys = kv * BLOCK_N + offs_kn
    in_keys = gl.expand_dims((keys >= k_lo) & (keys < k_hi), 1)
    packed_keys = gl.expand_dims(k_start + keys, 1).to(gl.int64)
    dk_ptrs = (DK + b.to(gl.int64) * stride_dkb + hkv.to(gl.int64) * stride_dkh
               + packed_keys * stride_dkn + gl.expand_dims(offs_kd, 0))
    dv_ptrs = (DV + b.to(gl.int64) * stride_dvb + hkv.to(gl.int64) * stride_dvh
               + packed_keys * stride_dvn + gl.expand_dims(offs_kd, 0))
    gl.store(dk_ptrs, gl.convert_layout((dk * sm_scale).to(dtype), layout), mask=in_keys)
    gl.store(dv_ptrs, gl.convert_layout((dv * dv_scale).to(dtype), layout), mask=in_keys)
