"""bench/hopper_tune.py's arguments, on the CPU (timing needs an H100/H200): a shape and a config
override (of the backward's or the forward's config) parse into what the A/B runs launch, and a
malformed shape is refused by name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import hopper_tune  # noqa: E402
from dash_inductor.ops.hopper.config import backward_config, forward_config  # noqa: E402


def test_shape_parses_to_batch_heads_length_and_head_dim() -> None:
    assert hopper_tune.parse_shape("4,16,4,4096,128") == (4, 16, 4, 4096, 128)


@pytest.mark.parametrize("text", ["4,16,3,4096,128", "4,16,4,4096", "0,16,4,4096,128"])
def test_malformed_shape_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--shape takes B,Hq,Hkv,N,D"):
        hopper_tune.parse_shape(text)


def test_config_override_replaces_only_the_named_fields() -> None:
    cfg = hopper_tune.parse_config("named_handoff=0,stages=2", "backward", 64, True)
    assert cfg.named_handoff is False and cfg.stages == 2
    default = backward_config(64, True)
    assert cfg.dk_in_flight == default.dk_in_flight and cfg.block_m == default.block_m


def test_forward_config_override_keeps_each_fields_type() -> None:
    cfg = hopper_tune.parse_config("softmax_under_pv=0,stages=2", "forward", 128, False)
    assert cfg.softmax_under_pv is False and cfg.stages == 2
    assert cfg.block_m == forward_config(128).block_m
