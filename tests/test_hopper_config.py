"""The Hopper configs, pinned: each entry is a measured choice (docs/maintainers/tuning.md), and
a change to one should be a decision with a measurement, not an accident."""

import dataclasses

import pytest

from dash_inductor.ops.hopper.config import FORWARD_MIN_SEQ, backward_config, forward_config

#: (head dim, causal, packed) -> (block_m, stages, dq_stages, dk_in_flight, named_handoff,
#: writer_regs, heads_outer, tail_convert, claimed_deal, dq_row_warps)
PINNED = {
    # dense: the deal and the tail conversion apply to packed sequences only (``unpadded_deal``)
    (64, False, False): (128, 2, 1, False, True, 24, False, True, True, 8),
    (64, True, False): (128, 2, 1, False, True, 24, False, True, True, 8),
    (64, False, True): (64, 4, 4, False, True, 48, False, False, False, 4),
    (64, True, True): (64, 4, 4, False, True, 48, False, False, True, 4),
    (128, False, False): (64, 3, 1, True, True, 40, True, True, False, 4),
    (128, True, False): (64, 3, 1, False, False, 40, True, True, True, 4),
    (128, False, True): (64, 3, 1, True, True, 40, True, True, False, 4),
    (128, True, True): (64, 3, 1, False, False, 40, True, True, True, 4),
}


@pytest.mark.parametrize("key", PINNED, ids=str)
def test_backward_configs_are_the_measured_ones(key):
    cfg = backward_config(*key)
    assert (cfg.block_m, cfg.stages, cfg.dq_stages, cfg.dk_in_flight, cfg.named_handoff,
            cfg.writer_regs, cfg.heads_outer, cfg.tail_convert, cfg.claimed_deal,
            cfg.dq_row_warps) == PINNED[key]
    assert cfg.block_n == 128 and cfg.dq_tma and cfg.aligned_grid and cfg.unpadded_deal
    assert cfg.dq_fragment_order == (not key[2])  # packed tiles stay row-major (dq_order.py)


#: (head dim, packed) -> (block_m, block_n, stages, softmax warpgroups, their registers)
FORWARD_PINNED = {(64, False): (192, 128, 3, 3, 160), (64, True): (128, 128, 3, 2, 240),
                  (128, False): (128, 128, 3, 2, 240), (128, True): (128, 128, 3, 2, 240)}


@pytest.mark.parametrize("key", FORWARD_PINNED, ids=str)
def test_forward_configs_are_the_measured_ones(key):
    cfg = forward_config(*key)
    assert (cfg.block_m, cfg.block_n, cfg.stages, cfg.softmax_groups,
            cfg.softmax_regs) == FORWARD_PINNED[key]
    assert cfg.warpgroup_rows == 64 and cfg.load_regs == 24


def test_forward_threshold():
    assert FORWARD_MIN_SEQ == {64: 4096, 128: 2048}


def test_the_softmax_under_p_v_refuses_two_stages():
    """Under P V a step awaits the next K tile before it frees the previous V's stage; with two
    stages both are one stage and the kernel would wait on itself (it hung on an H100), so the
    config refuses it by name, and allows two stages without the overlap."""
    base = forward_config(128)
    with pytest.raises(ValueError, match="softmax_under_pv needs stages >= 3"):
        dataclasses.replace(base, stages=2)
    assert dataclasses.replace(base, stages=2, softmax_under_pv=False).stages == 2
