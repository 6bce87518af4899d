"""Attention dropout's keep mask in Gluon, on the Hopper kernels' wgmma accumulator tiles.

``shared/dropout.py``'s mask bit for bit: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC 2011;
what ``tl.randint4x`` computes for an int64 counter), one call per eight elements of a 16 x 16
block, each element one 16-bit half of an output, kept when at least the threshold.

A call's elements differ in q bits 0 and 3 and k bit 3. The backward's S^T accumulator (keys
along dim 0) holds all three in registers: each thread draws the calls of its own elements and
the reshape of their halves lands on the accumulator's layout, with no shuffle. The forward's S
(queries along dim 0) holds q bit 0 on a lane: its calls are drawn with k bit 0 on that lane
instead, and one register-lane swap (a warp shuffle) moves the numbers to their elements.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_ROUND_A = gl.constexpr(0xD2511F53)  # Philox4x32's multipliers
_ROUND_B = gl.constexpr(0xCD9E8D57)
_KEY_A = gl.constexpr(0x9E3779B9)  # the key's increments per round
_KEY_B = gl.constexpr(0xBB67AE85)


@gluon.jit
def load_state(RNG, DROPOUT: gl.constexpr):
    """The (seed, offset) pair, or zeros without dropout (RNG never read then)."""
    if DROPOUT:
        seed = gl.load(RNG)
        offset = gl.load(RNG + 1)
    else:
        seed = 0
        offset = 0
    return seed, offset


@gluon.constexpr_function
def backward_calls_layout(block_n, block_m, num_warps):
    """The layout of a (key call, query call) tile whose halves a thread assembles into its own
    elements of the backward's S^T accumulator (``NVMMADistributedLayout`` v3, warps of 16 keys
    along dim 0): the accumulator's bases without q bits 0 and 3 and k bit 3."""
    q_regs = [[0, 4 << j] for j in range(block_m.bit_length() - 5)]
    k_reps = (block_n // (16 * num_warps)).bit_length() - 1  # keys past the warps' 16 each
    k_regs = [[8 * num_warps << j, 0] for j in range(k_reps)]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warps = [[8 << j, 0] for j in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(q_regs + k_regs, lanes, warps, [],
                                      [block_n // 2, block_m // 4])


@gluon.constexpr_function
def forward_calls_layout(block_m, block_n, num_warps):
    """The layout of a (query call, key call) tile of the forward's S accumulator (warps of 16
    queries along dim 0): its bases without q bit 3 and k bit 3, and k bit 0 on the lane of q
    bit 0 (a call's two halves of a word lie on two lanes there)."""
    k_regs = [[0, 8 << j] for j in range(block_n.bit_length() - 5)]
    q_reps = (block_m // (16 * num_warps)).bit_length() - 1  # queries past the warps' 16 each
    q_regs = [[4 * num_warps << j, 0] for j in range(q_reps)]
    lanes = [[0, 2], [0, 4], [0, 1], [1, 0], [2, 0]]
    warps = [[4 << j, 0] for j in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(k_regs + q_regs, lanes, warps, [],
                                      [block_m // 4, block_n // 2])


@gluon.jit
def philox(c0, c1, k0, k1):
    """Philox4x32-10 of the counter (c0, c1, 0, 0) under the key (k0, k1): four uint32 tensors."""
    c2 = gl.zeros_like(c0)
    c3 = gl.zeros_like(c0)
    for _ in gl.static_range(10):
        # Each product's high and low words from one 32 x 32 -> 64-bit multiply (IMAD.WIDE.U32);
        # umulhi and a separate low multiply gave ptxas two IMADs for most.
        b = c2.to(gl.uint64) * _ROUND_B
        a = c0.to(gl.uint64) * _ROUND_A
        c0 = (b >> 32).to(gl.uint32) ^ c1 ^ k0
        c2 = (a >> 32).to(gl.uint32) ^ c3 ^ k1
        c1 = b.to(gl.uint32)
        c3 = a.to(gl.uint32)
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@gluon.jit
def _draw(seed, offset, bh, row0, col0, L, S, KEYS_AXIS: gl.constexpr, layout: gl.constexpr):
    """The four outputs of every call of rows [row0, row0 + 4 QC) and keys [col0, col0 + 2 KC)
    (both multiples of 16), in ``layout`` (key calls along ``KEYS_AXIS``)."""
    QC: gl.constexpr = layout.shape[1 - KEYS_AXIS]
    KC: gl.constexpr = layout.shape[KEYS_AXIS]
    q_first = bh.to(gl.int64) * ((L + 15) // 16 * 4) + row0 // 4
    q_calls = q_first + gl.arange(0, QC, layout=gl.SliceLayout(KEYS_AXIS, layout)).to(gl.int64)
    k_calls = col0 // 2 + gl.arange(0, KC, layout=gl.SliceLayout(1 - KEYS_AXIS, layout))
    row_calls = (S + 15) // 16 * 8  # the key calls of one query call
    counter = (offset + gl.expand_dims(q_calls * row_calls, KEYS_AXIS)
               + gl.expand_dims(k_calls.to(gl.int64), 1 - KEYS_AXIS))
    seed = seed.to(gl.uint64, bitcast=True)
    return philox(counter.to(gl.uint32), (counter >> 32).to(gl.uint32),
                  seed.to(gl.uint32), (seed >> 32).to(gl.uint32))


@gluon.jit
def _halves(x):
    """Output ``x``'s (low, high) 16-bit halves along a new last dim: q bit 0."""
    return gl.join(x & 0xFFFF, x >> 16)


@gluon.jit
def _elements(x0, x1, x2, x3):
    """A call tile's outputs as [.., q0, k3, q3]: output 2 q3 + k3, half q0."""
    return gl.join(gl.join(_halves(x0), _halves(x1)), gl.join(_halves(x2), _halves(x3)))


@gluon.jit
def keep_t(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The keep mask of rows [row0, row0 + BLOCK_M) against keys [col0, col0 + BLOCK_N), keys
    along dim 0, in ``s_layout`` (the backward's S^T)."""
    gl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "a dropout tile spans 16s")
    layout: gl.constexpr = backward_calls_layout(BLOCK_N, BLOCK_M, gl.num_warps())
    x0, x1, x2, x3 = _draw(seed, offset, bh, row0, col0, L, S, 0, layout)
    # [kc, qc, q0, k3, q3]; kc = (kh, kl), qc = (qh, qm) -> (kh, k3, kl, qh, q3, qm, q0)
    x = gl.reshape(_elements(x0, x1, x2, x3), [BLOCK_N // 16, 8, BLOCK_M // 16, 4, 2, 2, 2])
    x = gl.reshape(gl.permute(x, (0, 5, 1, 2, 6, 3, 4)), [BLOCK_N, BLOCK_M])
    return gl.convert_layout(x, s_layout) >= threshold.to(gl.uint32)


@gluon.jit
def keep(seed, offset, threshold, bh, row0, col0, L, S, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """:func:`keep_t` with queries along dim 0, in ``s_layout`` (the forward's S)."""
    gl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "a dropout tile spans 16s")
    layout: gl.constexpr = forward_calls_layout(BLOCK_M, BLOCK_N, gl.num_warps())
    x0, x1, x2, x3 = _draw(seed, offset, bh, row0, col0, L, S, 1, layout)
    # [qc, kc, q0, k3, q3]; qc = (qh, qm), kc = (kh, kl) -> (qh, q3, qm, q0, kh, k3, kl)
    x = gl.reshape(_elements(x0, x1, x2, x3), [BLOCK_M // 16, 4, BLOCK_N // 16, 8, 2, 2, 2])
    x = gl.reshape(gl.permute(x, (0, 6, 1, 4, 2, 5, 3)), [BLOCK_M, BLOCK_N])
    return gl.convert_layout(x, s_layout) >= threshold.to(gl.uint32)
