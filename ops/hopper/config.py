"""What the Hopper kernels take, their tile configuration, and their compile-time arguments.

One place for the constexprs of a launch, so that the GPU launcher and the offline sm90 compile
(``ops/hopper/aot.py``, run by CI without a GPU) build exactly the same kernel variants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..catalog import ORDERED, Schedule
from ..catalog import get as get_schedule

#: Head dims (E = Ev) the Hopper kernels are built for.
HEAD_DIMS = (64, 128)

#: Schedules that ``kernel="auto"`` runs on the Hopper path. Measured on an H100 (docs/benchmarks.md,
#: bf16, d64 and d128, N 4k and 16k, full, causal and GQA): the ordered schedules run 1.1-2.2x
#: faster here than on the portable kernels, whose single warpgroup waits for its dQ turn on the
#: critical path; ``recompute`` and ``atomic`` have no waits and stayed faster on the portable path.
FASTER_ON_HOPPER = ORDERED

#: Per head dim, the shortest query length from which ``kernel="auto"`` runs the forward on the
#: Hopper path (where it takes the inputs). Measured on an H100 (bf16, TFLOP/s Hopper / portable;
#: ``bench/hopper_forward.py`` and docs/benchmarks.md for 4k and 16k): at head dim 128 faster from
#: N = 2048 (2k full 553 / 460, causal 459 / 378; 4k full 627 / 461; at 1k the ratio went from
#: 0.43 to 1.28 between four runs); at head dim 64 faster from 4096 (4k full 446 / 426, causal
#: 396 / 387), tied at N = 4095 (427 / 427, 370 / 360), slower at 2048 (409 / 416, 333 / 344).
FORWARD_MIN_SEQ = {64: 4096, 128: 2048}


def auto_on_hopper(causal: bool, packed: bool = False, head_dim: int = 128,
                   windowed: bool = False) -> str:
    """What ``schedule="auto"`` resolves to where the Hopper path takes the inputs: ``shift``
    causal and for packed sequences; unmasked dense problems ``ascending`` at head dim 64 and
    ``descending`` at 128, at every length (a window keeps ``descending``, window-aware and
    the rule before head dim 64's tile of 128 rows; not timed with it).

    Packed (dealt unpadded, ``deal.py``; H100, ``bench/packed_paths.py``,
    ``bench/results/2026-11-24-h100-e240a6b/``): ``shift`` led every deterministic schedule on
    every packing, causal and unmasked, at both head dims; d128, three documents of unequal
    length, causal: 2.77 ms against ``descending``'s 3.08 and the portable ``recompute``'s 3.01;
    unmasked: 4.46 against 4.88 and 6.55.

    Causal: ``shift``, the fastest deterministic schedule at every causal point of the H100 and
    H200 tables (65be22d: 4k 431 TFLOP/s against the portable ``recompute``'s 344, GQA 4:1 409
    against 344, 16k 512 against 397; head dim 64 4k 340 against 313).

    Unmasked at head dim 128: ``descending``. Since the grid keeps each head's items in one
    round (``ordered_programs``) it leads or ties every other schedule (H100 grids of 5b4e495
    and 77ddbaa, ``bench/hopper_tune.py``): 4k 480 and 507 against ``shift``'s 466 and 483, 16k
    507 and 527 against 506 and 525; GQA 4:1 499 against 486, then 485 against 504 (runs differ
    by a few per cent).

    Unmasked at head dim 64: ``ascending``. With 128 query rows a step (``backward_config``)
    it led in every median (H100, ``bench/hopper_tune.py``, three alternating timings,
    ``bench/results/2026-11-25-h100-fd0d86c/``): 4k 421-425 TFLOP/s against ``descending``'s
    400-413 and ``shift``'s 341-404, GQA 4:1 438-441 against 425-429 and 363-421, 16k 408-446
    against 397-428 and 393-423; the grid of the same run 425 against 409 and 404. ``shift``
    timed erratically there (an earlier run: 414-421 at 4k, above ``descending``).
    """
    if causal or packed:
        return "shift"
    return "ascending" if head_dim == 64 and not windowed else "descending"


@dataclass(frozen=True)
class HopperBackwardConfig:
    """Tile shape and partition sizes of the warp-specialized backward kernel.

    ``block_n`` KV rows per tile (split over the two compute warpgroups), ``block_m`` query rows per
    step; ``stages`` Q/dO buffers in flight; ``dq_stages`` dQ partials the compute warps may run
    ahead of the dQ writer; ``dk_in_flight``: dK's MMA reads dS^T from shared memory and stays
    in flight into the next step (else it reads registers and retires in its step); registers
    per worker partition (setmaxnreg); ``dq_tma``: the dQ writer adds each partial with one TMA
    reduce-add, else with ``red.v4`` adds from registers; ``named_handoff``: the compute warps
    hand each partial to the writer on a named barrier, every thread arriving on its own (an
    mbarrier arrive costs them two barriers over both warpgroups), and the writer frees the Q/dO
    stages, else the partial goes through an mbarrier and the stages are freed by the compute
    warps (by the writer too when dK is in flight); ``aligned_grid``: an ordered schedule with
    equally long items runs on a whole number of heads' worth of programs
    (:func:`ordered_programs`); ``heads_outer``: a causal item of a GQA group visits its two KV
    tiles once per query head, keeping the tiles' dK and dV in global memory in between
    (:func:`visit_heads`), ``visit_heads`` query heads at a visit; ``unpadded_deal``: packed
    sequences' items are dealt without the padding items of the padded deal (``deal.py``) under
    the schedules whose items of a head must run at once (``shift``): on three documents of
    7429, 3667 and 5288 tokens (H100, d128, causal) ``shift`` took 2.84-2.86 ms against 3.25,
    unmasked 4.56-4.62 against 5.34, with the same bits; ``descending`` and ``atomic`` were 3-6%
    slower unpadded there, so they keep the padded deal. ``tail_convert``: where the deal is
    unpadded, the programs that run out of items convert the finished rows of the dQ
    accumulator into the gradient (``dq_tail.py``) instead of a launch after the kernel;
    ``claimed_deal``: there, each program's items after its first are claimed from a counter as
    programs free up (``deal.py``). Three Q/dO stages and one dQ buffer
    measured faster than two and two without a mask (d128 N = 4k shift: 464 vs 433 TFLOP/s on an
    H100; with the TMA writer 465 vs 362; both take ~210 KiB of shared memory) and 3% slower
    causal in one run (411 vs 424; 16k causal 462 vs 465), so one config serves both. The TMA
    writer measured faster at d128 (H100, 4k full shift 469 vs 441, descending 421 vs 364,
    causal shift 415 vs 403) and within 2% at d64 (shift 344 vs 349, atomic 400 vs 363).
    """

    block_m: int = 64
    block_n: int = 128
    stages: int = 3
    dq_stages: int = 1
    writer_rows: int = 8
    dk_in_flight: bool = True
    dq_tma: bool = True
    named_handoff: bool = True
    load_regs: int = 24
    writer_regs: int = 48
    num_warps: int = 8
    aligned_grid: bool = True
    heads_outer: bool = True
    visit_heads: int = 2
    unpadded_deal: bool = True
    tail_convert: bool = True
    claimed_deal: bool = True


def backward_config(head_dim: int, causal: bool, packed: bool = False) -> HopperBackwardConfig:
    """The static config for a head dim, mask and layout (dense or ``packed`` sequences), never
    timing-dependent (docs/design.md).

    dK stays in flight across steps only at head dim 128 without a mask, where it measured
    faster; causal and head dim 64 ran 2-6% faster with dK retired in its step (H100,
    ``bench/hopper_tune.py``; docs/kernels-notes.md). The partial goes to the writer on a named
    barrier except at head dim 128 with a causal mask: there the writer, which then frees the
    stages, delayed the loader at 16k (shift 431-483 TFLOP/s over seven timings against
    472-487), while head dim 64 gained 3-6% (4k shift 365 against 343-346) and 128 unmasked
    about 1%. At head dim 128 the dQ writer gives up 8 registers (40: it adds by TMA and keeps
    little) so that the compute warps get 248 instead of 240, which ends their spills without a
    mask (56 bytes to none) and halves them causal: 4k ``descending`` 501-507 TFLOP/s against
    473-476, causal ``shift`` 425-428 against 406-410, GQA 4:1 unmasked 505 against 496, GQA
    causal and head dim 64 (no spills either way) tied.

    At head dim 64 with 64 query rows a step (packed sequences; dense ones too until the tile of
    the last paragraph) a step is short (64 x 128 x 64 MMAs) and the writer's fp32 round trip,
    16 KiB a partial, takes a larger share of it: four dQ buffers and four Q/dO stages (178 KiB of
    shared memory against 114) let the compute warps run ahead of a writer that waits for its
    turn. Same bits; H100, all GPU work of a packed call (profiler, ``shift``, 16k tokens, 32
    heads): three documents causal 3.05 ms to 2.73-2.75, unmasked 5.80-5.84 to 5.24-5.28, 4 x
    4096 1.96-1.98 to 1.88-1.90; dense TFLOP/s (``bench/hopper_tune.py``, 4k unless said):
    ``descending`` unmasked 382 to 398, GQA 4:1 385 to 410, 16k 398 to 419; ``shift`` causal
    358 to 361, GQA 365 to 377, 16k 386-394 to 400-402; only causal ``descending``, which
    ``auto`` does not run, lost 1-2% at 16k. Two, three, five and six buffers, and five or six
    stages, measured between (``bench/results/2026-11-24-h100-9fad014/``).

    The packed kernel converts its dQ in its own tail at head dim 128 (``tail_convert``), where
    all GPU work of a call measured 0.5-3% less (H100, ``shift``, 16k tokens, bits equal; two
    alternating rounds each): three documents causal 2.33 ms to 2.28-2.32, unmasked 4.29-4.31 to
    4.18, seven documents 1.45-1.46 to 1.43, 4 x 4096 1.59-1.60 to 1.58-1.59. At head dim 64 it
    measured 0.3-1% slower (three documents 2.74-2.76 against 2.75-2.77, 4 x 4096 1.90-1.91
    against 1.92), so there the conversion stays a launch of its own
    (``bench/results/2026-11-24-h100-939f48d-dirty/``).

    Causal packed items are claimed as programs free up (``claimed_deal``; the fixed deal gives
    program p indices p, p + P, ...). Same bits; all GPU work of a call, two alternating rounds
    (``bench/results/2026-11-25-h100-35b03e2/``): d128 three documents 2.30 ms to 2.26, seven
    documents 1.44 to 1.39-1.40, 4 x 4096 1.572 against 1.578; d64 six documents 1.92 to 1.84,
    three documents 2.74-2.76 either way, 4 x 4096 1.90 against 1.92. Unmasked, where the packed
    model (``packed_schedule.simulate_claimed``) predicts no gain, it measured 1-3% slower (d128
    three documents 4.13 against 4.20-4.25, d64 5.36-5.41 against 5.45-5.48), so it is off there.

    Dense problems at head dim 64 take FlashAttention-3's tile there, 128 query rows a step
    (``block_m``): a step's MMAs are then as long as at head dim 128 with 64 rows, and the fixed
    costs of a step (its barriers, the hand-off, the writer's turn) are paid half as often. With
    the writer on 40 registers ptxas keeps the accumulators in registers (44 bytes of spilled
    scalars unmasked, 108 causal; 220 with the writer on 48; on 24, none and 96), and two Q/dO
    stages with one dQ buffer fit (166 KiB). Same bits; H100, ``bench/hopper_tune.py``, three
    alternating timings (``bench/results/2026-11-25-h100-3ebd997/``): 4k ``shift`` unmasked
    414-421 TFLOP/s against 378-380, ``descending`` 404-409 against 395-398, causal ``shift``
    361-365 against 351-362; GQA 4:1 ``shift`` 425-432 against 392-393 and causal 391-398
    against 363-374; 16k ``shift`` 434-446 against 383-401. The writer on 40 registers with 64
    rows gained nothing (378-383 at 4k ``shift``), dK in flight lost 10-15%, and two dQ
    buffers or three stages timed erratically (368-435 at 4k). The writer then gave up 16
    registers more (24; it adds by TMA and waits): 4k causal ``shift`` 362-365 TFLOP/s against
    379, unmasked ``ascending`` 422 against 426-435, GQA 4:1 tied
    (``bench/results/2026-11-25-h100-14ea8b5/``; at head dim 128 it tied or lost, so 40 stays
    there). Packed sequences keep 64 rows and the buffers above: there the tile measured 1-6%
    slower causal (three documents 2.88-2.93 ms against 2.75-2.76, six 1.88-1.89 against 1.86)
    and tied unmasked, with 152-224 bytes of spills.
    """
    causal_128 = head_dim == 128 and causal
    deep = head_dim == 64
    if deep and not packed:
        return HopperBackwardConfig(block_m=128, stages=2, dq_stages=1, dk_in_flight=False,
                                    writer_regs=24, heads_outer=False)
    return HopperBackwardConfig(stages=4 if deep else 3, dq_stages=4 if deep else 1,
                                tail_convert=head_dim == 128, claimed_deal=causal,
                                dk_in_flight=head_dim == 128 and not causal,
                                named_handoff=not causal_128,
                                writer_regs=40 if head_dim == 128 else 48,
                                heads_outer=head_dim == 128)


@dataclass(frozen=True)
class HopperForwardConfig:
    """Tile shape of the warp-specialized forward: ``block_m`` query rows per program (half for each
    of the two softmax warpgroups), ``block_n`` keys per KV tile, ``stages`` K/V buffers;
    registers per worker partition (setmaxnreg); ``num_warps`` of each softmax partition.

    Three K/V stages fit beside the Q tile at both head dims (224 KiB at 128) and measured faster
    than two (H100, d128 4k full 610 against 546 TFLOP/s, causal 549 against 469; d64 4k causal
    395 against 370)."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    softmax_regs: int = 240
    load_regs: int = 24
    num_warps: int = 4

    @property
    def warpgroup_rows(self) -> int:
        """Query rows of one softmax warpgroup: the rows of a Q or O TMA box."""
        return self.block_m // 2


def forward_constexprs(causal: bool, group: int, cfg: HopperForwardConfig) -> dict[str, object]:
    """The forward kernel's compile-time arguments for one launch."""
    return dict(GROUP=group, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                STAGES=cfg.stages, SOFTMAX_REGS=cfg.softmax_regs,
                LOAD_REGS=cfg.load_regs, num_warps=cfg.num_warps)


def ordered_programs(items_per_head: int, sms: int) -> int:
    """How many persistent programs run an ordered schedule whose items of a head are equally long:
    the largest multiple of ``items_per_head`` that the SMs hold (all of them where no head fits).

    Program p runs items p, p + P, ... of a heads-major order, so with P a multiple of a head's
    items every head's items run in the same round, side by side. With P the SM count, some heads
    straddle two rounds, and under ``descending`` (or ``ascending``) the items of the first round
    wait for dQ turns that come only in the next. Measured on an H100 (``bench/hopper_tune.py
    --config aligned_grid=0``, bf16, ``descending`` unmasked): 4k d128 465-483 TFLOP/s against
    427-430, GQA 4:1 489-513 against 465-469, d64 368-374 against 310-311, 16k tied; ``shift``
    unchanged everywhere (it never waits long). Causal items of unequal length (unpaired) ran
    slower in rounds (descending 4k 252 against 321), so they keep every SM. The bits do not
    change: the order of the dQ adds is the schedule's, whichever program runs an item.
    """
    return sms // items_per_head * items_per_head if items_per_head <= sms else sms


def visit_heads(cfg: HopperBackwardConfig, slots: int, group: int, window: bool,
                varlen: bool) -> int:
    """The query heads a work item's visit of a KV tile covers (``walk.visit_heads``): the whole
    GQA group, or, where the heads go outermost (``cfg.heads_outer``), ``cfg.visit_heads`` of
    them (a divisor of the group), the tiles' dK and dV kept in a stash between visits.

    A causal item pairs two KV tiles whose visits differ in length. Visiting each tile for the
    whole GQA group before the other leaves the items of a KV head on different query heads at
    any time: with GQA 4:1 at 4k, the dQ accumulators, Q and dO in use no longer fit the L2,
    whose hit rate fell to 73% (91% without GQA) while DRAM traffic tripled (Nsight Compute,
    H100). Head by head, every item of a KV head spends the same time on each query head.
    Dense problems only: packed and windowed items differ in length anyway. Measured with
    ``shift`` (H100, bitwise the same gradients): GQA 4:1 at 4k 406 TFLOP/s against 373-378, at
    16k 468-501 against 468-469; at head dim 64 (32 query heads, 8 KV heads, 4k), where those
    buffers take half the room, 337 against 347-349, so ``backward_config`` keeps it to head
    dim 128. Two heads at a visit rather than one halve the stash's fp32 round trips while the
    buffers in use still fit (H100, 4k causal ``shift``, four alternating timings, bits equal;
    ``bench/results/2026-11-24-h100-9dc001b/``): GQA 4:1 394-432 TFLOP/s (median 427) against
    401-417 (409), 32:8 410-431 against 393-409, 8:1 405-430 against 376-409 (four heads:
    362-368), and 2:1, where two heads are the whole group, 405-435 against 363-418; 16k GQA 4:1
    493-502 against 484-501.
    """
    heads = math.gcd(cfg.visit_heads, group)
    outer = cfg.heads_outer and slots > 1 and heads < group and not (window or varlen)
    return heads if outer else group


def unpadded_deal(cfg: HopperBackwardConfig, schedule: str, varlen: bool) -> bool:
    """Whether packed work items are dealt without padding items (``deal.py``): under the
    schedules whose items of a head must run at once (``shift``), where it measured faster."""
    return cfg.unpadded_deal and varlen and get_schedule(schedule).coresident_head


def tail_convert(cfg: HopperBackwardConfig, schedule: str, varlen: bool) -> bool:
    """Whether the kernel converts dQ itself, in its tail (``dq_tail.py``): where the deal is
    unpadded, whose order its conversion follows."""
    return cfg.tail_convert and unpadded_deal(cfg, schedule, varlen)


def backward_constexprs(sched: Schedule, causal: bool, group: int, even_s: bool,
                        cfg: HopperBackwardConfig, window: bool = False,
                        varlen: bool = False) -> dict[str, object]:
    """The kernel's compile-time arguments for one launch."""
    schedule = sched.name
    return dict(GROUP=group, CAUSAL=causal, SCHEDULE=sched.id, NUM_SLOTS=sched.slots(causal),
                COMPUTE_DQ=not sched.separate_dq, ORDERED=sched.ordered, EVEN_S=even_s,
                WINDOW=window, VARLEN=varlen,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                DQ_STAGES=cfg.dq_stages, WRITER_ROWS=cfg.writer_rows,
                DK_IN_FLIGHT=cfg.dk_in_flight, DQ_TMA=cfg.dq_tma,
                NAMED_HANDOFF=cfg.named_handoff,
                VISIT_HEADS=visit_heads(cfg, sched.slots(causal), group, window, varlen),
                UNPADDED=unpadded_deal(cfg, schedule, varlen),
                TAIL_CONVERT=tail_convert(cfg, schedule, varlen),
                CLAIMED=cfg.claimed_deal and unpadded_deal(cfg, schedule, varlen),
                LOAD_REGS=cfg.load_regs,
                WRITER_REGS=cfg.writer_regs, num_warps=cfg.num_warps)


def backward_geometry(schedule: Schedule, cfg: HopperBackwardConfig, batch: int, hkv: int,
                      n_kv: int, is_causal: bool, group: int, even_s: bool, windowed: bool,
                      varlen: bool, sms: int) -> tuple[int, int, tuple[int], dict[str, object]]:
    """(items per head, items, grid, constexprs) of a backward launch, which shapes and options
    alone decide."""
    per_head = schedule.items_per_head(n_kv, is_causal)
    total_items = batch * hkv * per_head
    # A head's items are equally long unless a window, the packing or an unpaired causal mask
    # gives them different numbers of Q tiles.
    equal_items = not (windowed or varlen) and (not is_causal or schedule.paired_when_causal)
    aligned = cfg.aligned_grid and schedule.ordered and equal_items
    programs = ordered_programs(per_head, sms) if aligned else sms
    return per_head, total_items, (min(total_items, programs),), backward_constexprs(
        schedule, is_causal, group, even_s, cfg, windowed, varlen)
