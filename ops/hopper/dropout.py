"""Attention dropout's keep mask in Gluon, on the Hopper kernels' wgmma accumulator tiles.

``shared/dropout.py``'s mask bit for bit: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC 2011;
what ``tl.randint4x`` computes for an int64 counter), one call per (b, h, row // 4, col) at
counter ``offset + ((b * H + h) * ceil(L / 4) + row // 4) * S + col``, output ``row % 4``, kept
when at least the uint32 threshold.

A call's four rows lie on two lanes of the backward's S^T accumulator (queries along dim 1) and
on four lanes of the forward's S (queries along dim 0). Each call is drawn once, by the lane a
calls layout gives it, and the numbers reach their lanes by warp shuffles: one register-lane swap
in the backward, two in the forward, one at a time (both at once went through 16 KiB of shared
memory, which three K/V stages at head dim 128 leave no room for).
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
    """The layout of a (keys, calls) tile of the backward's S^T accumulator
    (``NVMMADistributedLayout`` v3, warps of 16 keys along dim 0): keys as the accumulator holds
    them; a call's rows are the accumulator's lowest query bits, so the lane bit among them
    takes a higher call bit instead and each call lands on one lane of the pair that holds it."""
    calls = block_m // 4
    key_regs = [[8, 0]] + [[16 * num_warps << k, 0]
                           for k in range((block_n // (16 * num_warps)).bit_length() - 1)]
    call_bits = [[0, 1 << k] for k in range(calls.bit_length() - 1)]
    # Query bit 0 is a register, bits 1 and 2 lanes (bit 2 is call bit 0), bits 3 and up registers.
    lanes = [call_bits[-1], [0, 1], [1, 0], [2, 0], [4, 0]]
    regs = key_regs + call_bits[1:-1]
    warps = [[16 << k, 0] for k in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_n, calls])


@gluon.constexpr_function
def forward_calls_layout(block_m, block_n, num_warps):
    """The layout of a (calls, keys) tile of the forward's S accumulator (warps of 16 queries
    along dim 0): a call's rows are the accumulator's lane bits 2 and 3, which take key bits 3
    and 4 instead, so each call lands on one lane of the four that hold it."""
    key_regs = [[0, 1 << k] for k in range(5, block_n.bit_length() - 1)]
    regs = [[0, 1], [2, 0]] + key_regs  # query bit 3 is call bit 1
    lanes = [[0, 2], [0, 4], [0, 8], [0, 16], [1, 0]]  # query bit 2 is call bit 0
    warps = [[4 << k, 0] for k in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_m // 4, block_n])


@gluon.constexpr_function
def forward_half_layout(block_m, block_n, num_warps):
    """The forward mask's layout halfway to S's: query bit 0 on its lane, bit 1 still a
    register (one register-lane swap at a time stays a warp shuffle)."""
    key_regs = [[0, 1 << k] for k in range(5, block_n.bit_length() - 1)]
    regs = [[0, 1], [8, 0]] + key_regs + [[0, 8], [2, 0]]
    lanes = [[0, 2], [0, 4], [1, 0], [0, 16], [4, 0]]
    warps = [[16 << k, 0] for k in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_m, block_n])


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
def _draw(seed, offset, bh, row0, keys, L, S, KEYS_AXIS: gl.constexpr, layout: gl.constexpr):
    """The four outputs of every (call, key) of rows [row0, row0 + 4 calls) and keys ``keys``,
    in ``layout`` (keys along ``KEYS_AXIS``)."""
    CALLS: gl.constexpr = layout.shape[1 - KEYS_AXIS]
    first = bh.to(gl.int64) * ((L + 3) // 4) + row0 // 4
    calls = first + gl.arange(0, CALLS, layout=gl.SliceLayout(KEYS_AXIS, layout)).to(gl.int64)
    keys = gl.convert_layout(keys, gl.SliceLayout(1 - KEYS_AXIS, layout)).to(gl.int64)
    counter = offset + gl.expand_dims(calls * S, KEYS_AXIS) + gl.expand_dims(keys, 1 - KEYS_AXIS)
    seed = seed.to(gl.uint64, bitcast=True)
    return philox(counter.to(gl.uint32), (counter >> 32).to(gl.uint32),
                  seed.to(gl.uint32), (seed >> 32).to(gl.uint32))


@gluon.jit
def _interleave(x0, x1, x2, x3):
    """Two trailing dims holding x0, x1, x2, x3 in that order once flattened."""
    return gl.join(gl.join(x0, x2), gl.join(x1, x3))


@gluon.jit
def keep_t(seed, offset, threshold, bh, row0, cols, L, S, BLOCK_M: gl.constexpr,
           s_layout: gl.constexpr):
    """The keep mask of rows [row0, row0 + BLOCK_M) (row0 a multiple of 4) against keys
    ``cols``, keys along dim 0, in ``s_layout`` (the backward's S^T)."""
    BLOCK_N: gl.constexpr = cols.shape[0]
    layout: gl.constexpr = backward_calls_layout(BLOCK_N, BLOCK_M, gl.num_warps())
    x0, x1, x2, x3 = _draw(seed, offset, bh, row0, cols, L, S, 0, layout)
    # The numbers, not the bits, cross lanes: converting bits packed and unpacked them.
    x = gl.convert_layout(gl.reshape(_interleave(x0, x1, x2, x3), [BLOCK_N, BLOCK_M]), s_layout)
    return x >= threshold.to(gl.uint32, bitcast=True)


@gluon.jit
def keep(seed, offset, threshold, bh, row0, cols, L, S, BLOCK_M: gl.constexpr,
         s_layout: gl.constexpr):
    """:func:`keep_t` with queries along dim 0, in ``s_layout`` (the forward's S)."""
    BLOCK_N: gl.constexpr = cols.shape[0]
    layout: gl.constexpr = forward_calls_layout(BLOCK_M, BLOCK_N, gl.num_warps())
    x0, x1, x2, x3 = _draw(seed, offset, bh, row0, cols, L, S, 1, layout)
    x = gl.reshape(_interleave(x0, x1, x2, x3), [BLOCK_M // 4, BLOCK_N, 4])
    x = gl.reshape(gl.permute(x, (0, 2, 1)), [BLOCK_M, BLOCK_N])
    x = gl.convert_layout(x, forward_half_layout(BLOCK_M, BLOCK_N, gl.num_warps()))
    return gl.convert_layout(x, s_layout) >= threshold.to(gl.uint32, bitcast=True)
