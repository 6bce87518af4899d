"""The Hopper kernels' tile configuration, ``auto`` rule and compile-time arguments.

One place for the constexprs of a launch, so that the GPU launcher and the offline sm90 compile
(``ops/hopper/aot.py``, run by CI without a GPU) build exactly the same kernel variants. Each
setting says why in a line; the measurements behind them are in docs/maintainers/tuning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..catalog import ORDERED, Schedule
from ..catalog import get as get_schedule

#: Head dims (E = Ev) the Hopper kernels are built for.
HEAD_DIMS = (64, 128)

#: Schedules ``kernel="auto"`` runs here: the ordered ones, 1.1-2.2x faster than on the portable
#: kernels, whose one warpgroup waits for its dQ turn; ``recompute`` and ``atomic`` never wait.
FASTER_ON_HOPPER = ORDERED

#: Per head dim, the shortest query length from which ``auto`` runs the Hopper forward: where it
#: measured faster than the portable forward.
FORWARD_MIN_SEQ = {64: 4096, 128: 2048}


def dropout_slower(op: str, head_dim: int, causal: bool) -> str | None:
    """Why ``auto`` keeps a call with dropout off the Hopper kernel ``op``, or None: measured
    against the portable kernels with the mask drawn, the Hopper forward lost where causal and
    the backward never won at head dim 64, causal."""
    if op == "forward" and causal:
        return ("dropout_p > 0, causal (the Hopper forward with dropout measured slower than the "
                "portable one there)")
    if op == "backward" and head_dim == 64 and causal:
        return ("dropout_p > 0 at head dim 64, causal (the Hopper backward with dropout measured "
                "no faster than the portable one there)")
    return None


def auto_on_hopper(causal: bool, packed: bool = False, head_dim: int = 128,
                   windowed: bool = False) -> str:
    """What ``schedule="auto"`` resolves to where the Hopper path takes the inputs, the fastest
    deterministic schedule measured there: ``shift`` causal and for packed sequences; unmasked,
    ``ascending`` at head dim 64 (with its 128-row tile) and ``descending`` otherwise, windows
    included (window-aware)."""
    if causal or packed:
        return "shift"
    return "ascending" if head_dim == 64 and not windowed else "descending"


@dataclass(frozen=True)
class HopperBackwardConfig:
    """Tile shape and partition sizes of the warp-specialized backward kernel.

    ``block_n`` KV rows per tile (split over the two compute warpgroups), ``block_m`` query rows
    per step; ``stages`` Q/dO buffers in flight; ``dq_stages`` dQ partials the compute warps may
    run ahead of the dQ writer; ``writer_rows`` rows a writer's ``red.v4`` pass adds;
    ``dk_in_flight``: dK's MMA stays in flight into the next step; ``dq_tma``: the writer adds a
    partial with one TMA reduce-add; ``dq_fragment_order``: :func:`dq_fragment`;
    ``dq_row_warps``: warps along dQ's rows (``dq_order.dq_mma_layout``; 8 needs ``block_m`` 128);
    ``named_handoff``: partials go to the writer on a named barrier (else an mbarrier);
    ``*_regs``: registers per worker partition (setmaxnreg);
    ``aligned_grid``: :func:`ordered_programs`; ``heads_outer``/``visit_heads``:
    :func:`visit_heads`; ``unpadded_deal``, ``tail_convert``, ``claimed_deal``: how packed items
    are dealt and dQ converted (``deal.py``, ``dq_tail.py``). The defaults are the d128 unmasked
    dense config; :func:`backward_config` says where the others differ and why.
    """

    block_m: int = 64
    block_n: int = 128
    stages: int = 3
    dq_stages: int = 1
    writer_rows: int = 8
    dk_in_flight: bool = True
    dq_tma: bool = True
    dq_fragment_order: bool = True
    dq_row_warps: int = 4
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
    timing-dependent (docs/design.md). Every choice below measured faster where it is taken (the
    numbers: docs/maintainers/tuning.md)."""
    causal_128 = head_dim == 128 and causal
    deep = head_dim == 64
    if deep and not packed:
        # FlashAttention-3's tile at d64: a step's MMAs as long as d128's, its fixed costs half as
        # often; two stages and one dQ buffer fit in 166 KiB; a lean writer leaves the compute
        # warps the registers that end their spills; dQ's 128 rows split over the warpgroups
        # make its MMA m64n64, one per warpgroup, as FlashAttention-4's d64 dQ.
        return HopperBackwardConfig(block_m=128, stages=2, dq_stages=1, dk_in_flight=False,
                                    writer_regs=24, heads_outer=False, dq_row_warps=8)
    return HopperBackwardConfig(
        dq_fragment_order=not packed,  # crossing sub-tiles and the tail conversion read rows
        # d64 packed keeps 64-row steps (128 spilled there), so four buffers let the compute
        # warps run ahead of a writer that waits for its turn.
        stages=4 if deep else 3, dq_stages=4 if deep else 1,
        tail_convert=head_dim == 128,  # a launch saved at d128; 0.3-1% slower at d64
        claimed_deal=causal,  # items of unequal length balance; unmasked items are equal
        dk_in_flight=head_dim == 128 and not causal,  # retiring dK in its step won elsewhere
        named_handoff=not causal_128,  # at d128 causal the writer freeing stages slowed the loader
        writer_regs=40 if head_dim == 128 else 48,  # d128: the compute warps' spills end at 248
        heads_outer=head_dim == 128)  # at d64 the GQA group's buffers fit the L2 anyway


@dataclass(frozen=True)
class HopperForwardConfig:
    """Tile shape of the warp-specialized forward: ``block_m`` query rows per program, split over
    ``softmax_groups`` softmax warpgroups of 64 rows (two, or three as FlashAttention-3's
    head-dim-64 tile), ``block_n`` keys per KV tile, ``stages`` K/V buffers; registers per worker
    partition (setmaxnreg); ``num_warps`` of each softmax partition. ``softmax_under_pv``: a step's
    softmax runs while the previous P V is in flight (FlashAttention-3's intra-warpgroup
    overlap), which keeps two P tiles in registers."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 3  # three fit beside the Q tile at both head dims and beat two
    softmax_groups: int = 2
    softmax_regs: int = 240
    load_regs: int = 24
    num_warps: int = 4
    softmax_under_pv: bool = True

    def __post_init__(self) -> None:
        # Under P V a step awaits K tile j + 1 before it frees tile j - 1's stage: with two
        # stages that is the same stage, and the loader and the softmax wait for each other.
        if self.softmax_under_pv and self.stages < 3:
            raise ValueError(f"HopperForwardConfig: softmax_under_pv needs stages >= 3 (the next "
                             f"K tile and the previous V share a stage below that); got "
                             f"stages={self.stages}")

    @property
    def warpgroup_rows(self) -> int:
        """Query rows of one softmax warpgroup: the rows of a Q or O TMA box."""
        return self.block_m // self.softmax_groups


#: Three softmax warpgroups of 64 rows, FlashAttention-3's head-dim-64 tile (192 x 128): each K/V
#: tile loaded serves 192 rows instead of 128. The loader's warp counts as a warpgroup, so each
#: gets 160 registers, which hold a 128-key step because P is carried in bf16; a second P beside
#: it (``softmax_under_pv``) ran slower on an H100: the three warpgroups cover each other's softmax.
THREE_WARPGROUPS = HopperForwardConfig(block_m=192, softmax_groups=3, softmax_regs=160,
                                       softmax_under_pv=False)


def forward_config(head_dim: int, varlen: bool = False, dropout: bool = False) -> HopperForwardConfig:
    """The forward's tile: three warpgroups at head dim 64 (where a step's MMAs are short and the
    K/V loads weigh most), two at 128 (its O accumulator does not fit 160 registers), for packed
    sequences (whose tile-crossing stores take two) and with dropout (the mask spilled 12 KB on
    three warpgroups of 160 registers)."""
    three = head_dim == 64 and not (varlen or dropout)
    # With dropout the second P beside the keep mask spills (784 B against 136 B on Triton 3.6).
    return THREE_WARPGROUPS if three else HopperForwardConfig(softmax_under_pv=not dropout)


def forward_constexprs(causal: bool, group: int, cfg: HopperForwardConfig,
                       varlen: bool = False, dropout: bool = False) -> dict[str, object]:
    """The forward kernel's compile-time arguments for one launch (``varlen``: packed sequences)."""
    return dict(GROUP=group, CAUSAL=causal, VARLEN=varlen, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                STAGES=cfg.stages, SOFTMAX_REGS=cfg.softmax_regs,
                LOAD_REGS=cfg.load_regs, DROPOUT=dropout, SOFTMAX_UNDER_PV=cfg.softmax_under_pv,
                num_warps=cfg.num_warps)


def ordered_programs(items_per_head: int, sms: int) -> int:
    """How many persistent programs run an ordered schedule whose items of a head are equally long:
    the largest multiple of ``items_per_head`` that the SMs hold (all of them where no head fits),
    so that every head's items run in the same round instead of waiting for dQ turns that come
    only in the next. The bits do not change: the order of the adds is the schedule's."""
    return sms // items_per_head * items_per_head if items_per_head <= sms else sms


def visit_heads(cfg: HopperBackwardConfig, slots: int, group: int, window: bool,
                varlen: bool) -> int:
    """The query heads a work item's visit of a KV tile covers (``walk.visit_heads``): the whole
    GQA group, or, where the heads go outermost (``cfg.heads_outer``), ``cfg.visit_heads`` of
    them (a divisor of the group), the tiles' dK and dV kept in a stash between visits. A causal
    item's two tiles differ in length, and visiting each for the whole group let a KV head's items
    drift apart over the query heads until their buffers no longer fit the L2; dense problems
    only (packed and windowed items differ in length anyway)."""
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


def dq_fragment(cfg: HopperBackwardConfig, varlen: bool) -> bool:
    """Whether the compute warps stage each dQ partial in the MMA's register order, free of bank
    conflicts, and DQACC holds its tiles in that order (``dq_order.py``): dense problems with the
    TMA writer, which adds whole tiles (the ``red.v4`` writer and packed sequences read rows)."""
    return cfg.dq_fragment_order and cfg.dq_tma and not varlen


def backward_constexprs(sched: Schedule, causal: bool, group: int, even_s: bool,
                        cfg: HopperBackwardConfig, window: bool = False,
                        varlen: bool = False, dropout: bool = False) -> dict[str, object]:
    """The kernel's compile-time arguments for one launch."""
    schedule = sched.name
    return dict(GROUP=group, CAUSAL=causal, SCHEDULE=sched.id, NUM_SLOTS=sched.slots(causal),
                COMPUTE_DQ=not sched.separate_dq, ORDERED=sched.ordered, EVEN_S=even_s,
                WINDOW=window, VARLEN=varlen,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                DQ_STAGES=cfg.dq_stages, WRITER_ROWS=cfg.writer_rows,
                DK_IN_FLIGHT=cfg.dk_in_flight, DQ_TMA=cfg.dq_tma,
                DQ_FRAGMENT=dq_fragment(cfg, varlen), DQ_ROW_WARPS=cfg.dq_row_warps,
                NAMED_HANDOFF=cfg.named_handoff,
                VISIT_HEADS=visit_heads(cfg, sched.slots(causal), group, window, varlen),
                UNPADDED=unpadded_deal(cfg, schedule, varlen),
                TAIL_CONVERT=tail_convert(cfg, schedule, varlen),
                CLAIMED=cfg.claimed_deal and unpadded_deal(cfg, schedule, varlen),
                LOAD_REGS=cfg.load_regs,
                WRITER_REGS=cfg.writer_regs, DROPOUT=dropout, num_warps=cfg.num_warps)


def backward_geometry(schedule: Schedule, cfg: HopperBackwardConfig, batch: int, hkv: int,
                      n_kv: int, is_causal: bool, group: int, even_s: bool, windowed: bool,
                      varlen: bool, sms: int,
                      dropout: bool = False) -> tuple[int, int, tuple[int], dict[str, object]]:
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
        schedule, is_causal, group, even_s, cfg, windowed, varlen, dropout)
