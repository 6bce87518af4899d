"""Time the Hopper backward's (or forward's) tile configurations against each other, in one process.

    python3 bench/hopper_tune.py [--op backward|forward] [--config block_m=64,stages=3 ...]
        [--shape 4,16,4,4096,128 ...] [--causal yes|no] [--rounds 3] [--out DIR]

Each ``--config`` overrides fields of :class:`~dash_inductor.ops.hopper.config.HopperBackwardConfig`,
or with ``--op forward`` of :class:`~dash_inductor.ops.hopper.config.HopperForwardConfig`; the
default config is always timed first. ``--shape B,Hq,Hkv,N,D`` replaces the default shapes;
``--rounds`` times the configs that many times, alternating, for the spread between timings.
Prints one line per (shape, causal, schedule, round) with the backward TFLOP/s of every config,
as ``bench/hopper_check.py`` counts them, and, for deterministic schedules, whether each config's
gradients are bitwise those of the default (a config changes speed, never bits); with ``--op
forward``, one line per (shape, causal, round) with the forward TFLOP/s and whether each config's
output and logsumexp are bitwise the default's (``--schedule`` does not apply); writes
``hopper_tune.json`` to ``--out``. The tuning decisions in docs/kernels-notes.md come from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_check import _forward, _hopper, bench_tflops, inputs  # noqa: E402
from hopper_forward import _run as _forward_with  # noqa: E402
from dash_inductor.ops.hopper.config import (HopperBackwardConfig,  # noqa: E402
                                             HopperForwardConfig, backward_config,
                                             forward_config)

SHAPES = [(4, 16, 16, 4096, 128), (1, 16, 16, 16384, 128), (4, 32, 32, 4096, 64)]


def default_config(op: str, head_dim: int,
                   causal: bool) -> HopperBackwardConfig | HopperForwardConfig:
    """The config ``op`` ("backward" or "forward") launches with by default."""
    return backward_config(head_dim, causal) if op == "backward" else forward_config(head_dim)


def parse_config(text: str, op: str, head_dim: int,
                 causal: bool) -> HopperBackwardConfig | HopperForwardConfig:
    """``"block_m=64,stages=2"`` -> the launch's default config with those fields replaced
    (``softmax_under_pv=0``: a flag stays a bool)."""
    base = default_config(op, head_dim, causal)
    fields = dict(item.split("=") for item in text.split(",") if item)
    return dataclasses.replace(base, **{k: type(getattr(base, k))(int(v))
                                        for k, v in fields.items()})


def runner(op: str, q, k, v, do, causal: bool, schedule: str):
    """``run(cfg)``: one Hopper launch of ``op`` on these inputs with config ``cfg`` (None: the
    default), returning its outputs (out and lse, or dQ, dK, dV; the backward's own forward runs
    once, here)."""
    if op == "forward":
        return lambda cfg: _forward_with("hopper", q, k, v, causal, cfg)
    out, lse = _forward(q, k, v, causal)
    return lambda cfg: _hopper(q, k, v, do, out, lse, causal, schedule, cfg)


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"4,16,4,4096,128"`` -> (batch, query heads, KV heads, sequence length, head dim)."""
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 5 or min(shape) < 1 or shape[1] % shape[2]:
        raise argparse.ArgumentTypeError(
            f"--shape takes B,Hq,Hkv,N,D, positive, Hkv dividing Hq; got {text!r}")
    return shape  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("backward", "forward"), default="backward")
    parser.add_argument("--config", action="append", default=[], help="fields to override")
    parser.add_argument("--schedule", action="append", default=None)
    parser.add_argument("--shape", action="append", type=parse_shape, default=None,
                        help="B,Hq,Hkv,N,D (repeatable; default: the three shapes of SHAPES)")
    parser.add_argument("--causal", choices=("yes", "no"), default=None,
                        help="only causal, or only unmasked (default: both)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating timings per config")
    parser.add_argument("--out", default=None, help="folder for hopper_tune.json")
    args = parser.parse_args()
    forward = args.op == "forward"
    schedules = ["forward"] if forward else args.schedule or ["shift", "descending", "atomic"]
    masks = (False, True) if args.causal is None else (args.causal == "yes",)
    started = time.time()
    log = lambda line: print(f"[{time.time() - started:6.1f}s] {line}", flush=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    rows = []
    for shape in args.shape or SHAPES:
        for causal in masks:
            configs = {"default": default_config(args.op, shape[-1], causal)}
            configs.update({text: parse_config(text, args.op, shape[-1], causal)
                            for text in args.config})
            q, k, v, do = inputs(*shape)
            for schedule in schedules:
                run = runner(args.op, q, k, v, do, causal, schedule)
                same = {}
                if schedule != "atomic":  # the one schedule whose bits may change anyway
                    results = {name: run(cfg) for name, cfg in configs.items()}
                    same = {name: all(map(torch.equal, r, results["default"]))
                            for name, r in results.items() if name != "default"}
                    del results
                for round_ in range(args.rounds):
                    row = {"shape": shape, "causal": causal, "schedule": schedule,
                           "round": round_, "bits_equal_default": same}
                    for name, cfg in configs.items():
                        row[name] = bench_tflops(lambda: run(cfg), shape, causal,
                                                 1.0 if forward else 2.5)
                    rows.append(row)
                    log(f"{shape} causal={causal} {schedule:10s} " + "  ".join(
                        f"{name}={row[name]:.0f}" for name in configs)
                        + (f"  bits equal {same}" if same else ""))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(f"{args.out}/hopper_tune.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
