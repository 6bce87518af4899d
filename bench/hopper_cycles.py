"""The Hopper kernels' configs compared in elapsed cycles, by Nsight Compute, configs alternating:

    python3 bench/hopper_cycles.py --op forward --shape 4,16,16,4096,128 --causal no \\
        --config softmax_under_pv=0 --config softmax_under_pv=0,stages=2 --rounds 3 [--out DIR]

For each (shape, mask, schedule), every config is compiled first without ncu; then each round runs
every config (the default first) in a process of its own under ``ncu --clock-control none --metrics
gpc__cycles_elapsed.max`` on ``bench/hopper_profile.py``, which launches the kernel after two
warm-ups ``--launches`` times; the row keeps the median of the launches' cycles, and whether the
config's outputs hash to the default's (a config changes speed, never bits). Cycles rather than
milliseconds: the SM clock drifts with power and heat (1.70-1.74 GHz between two profiles of one
session) and ``bench/hopper_tune.py``'s timings of one config differed by up to 17% between two
rounds of one run, where one kernel's cycles at two shapes of equal work differed by 0.02% (ours)
and 0.9% (FlashAttention-4's). The count covers the main kernel only (``forward_kernel`` or
``backward_kernel``), not the backward's preprocess or dQ conversion. A process that runs past
``--limit`` seconds ends the run with its config's name. Writes ``hopper_cycles.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_tune import parse_shape  # noqa: E402

METRIC = "gpc__cycles_elapsed.max"
KERNELS = {"forward": "forward_kernel", "backward": "backward_kernel"}


def profile_command(op: str, shape: tuple[int, ...], causal: bool, schedule: str, config: str,
                    launches: int) -> list[str]:
    """The command that launches one config's kernel ``launches`` times after the warm-ups."""
    profile = Path(__file__).resolve().parent / "hopper_profile.py"
    return [sys.executable, str(profile), "--op", op, "--shape", ",".join(map(str, shape)),
            "--causal", "yes" if causal else "no", "--schedule", schedule,
            "--config", config, "--launches", str(launches)]


def ncu_command(op: str, shape: tuple[int, ...], causal: bool, schedule: str, config: str,
                launches: int) -> list[str]:
    """:func:`profile_command` under ncu, which profiles the ``launches`` launches after the
    warm-ups; the compiler's processes run without ncu attached."""
    return ["ncu", "--clock-control", "none", "--target-processes", "application-only",
            "--metrics", METRIC, "--csv", "-k", f"regex:^{KERNELS[op]}", "-s", "2",
            "-c", str(launches), *profile_command(op, shape, causal, schedule, config, launches)]


#: Seconds one compiling or profiled process may take, so that a config that deadlocks ends the
#: run with its name instead of holding the GPU (two K/V stages under P V once did).
LIMIT_S = 300


def run_timed(command: list[str], what: str,
              limit: float = LIMIT_S) -> subprocess.CompletedProcess:
    """Run ``command``, printing how long ``what`` took, so that a run cut short still shows
    where its time went; an error naming ``what`` past ``limit`` seconds."""
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as expired:
        raise RuntimeError(f"{what}: no result in {limit:.0f} s (a config that deadlocks, or a "
                           f"compile slower than that): {' '.join(command)}") from expired
    print(f"  {what}: {time.monotonic() - start:.0f} s", flush=True)
    return done


def failure(command: list[str], done: subprocess.CompletedProcess, what: str) -> RuntimeError:
    """The error for a ``command`` that ``what``, with the end of what it printed."""
    return RuntimeError(f"{' '.join(command)} {what}:\n{(done.stdout + done.stderr)[-2000:]}")


def compile_first(command: list[str], label: str, limit: float = LIMIT_S) -> None:
    """Run :func:`profile_command`'s ``command`` once without ncu, so that the profiled runs find
    the kernel compiled in Triton's cache."""
    done = run_timed(command, f"compiling {label}", limit)
    if done.returncode:
        raise failure(command, done, "failed")


def parse_ncu(text: str) -> tuple[list[int], str | None]:
    """(cycles of each profiled launch, the outputs' digest) from the output of
    :func:`ncu_command`: ncu's CSV rows, and the ``digest`` line of ``hopper_profile.py``."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    digest = next((line.split()[1] for line in text.splitlines()
                   if line.startswith("digest ")), None)
    cycles = []
    for row in csv.DictReader(rows):
        if row.get("Metric Name") == METRIC:
            cycles.append(int(row["Metric Value"].replace(",", "")))
    return cycles, digest


def profile(command: list[str], label: str = "",
            limit: float = LIMIT_S) -> tuple[list[int], str]:
    """Run :func:`ncu_command`'s ``command``: (cycles of each launch, the outputs' digest), or an
    error with the end of what it printed."""
    done = run_timed(command, f"profiling {label}", limit)
    cycles, digest = parse_ncu(done.stdout)
    if done.returncode or not cycles or digest is None:
        raise failure(command, done, "gave no cycles or no digest")
    return cycles, digest


def compare(runs: dict[str, tuple[list[int], str]]) -> dict[str, dict[str, object]]:
    """One round's row: each config's median cycles, its ratio to the default's, and whether its
    digest is the default's."""
    base = statistics.median(runs["default"][0])
    row = {}
    for name, (cycles, digest) in runs.items():
        median = statistics.median(cycles)
        row[name] = {"cycles": median, "ratio": median / base,
                     "bits_equal_default": digest == runs["default"][1]}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=tuple(KERNELS), default="backward")
    parser.add_argument("--config", action="append", default=[], help="fields to override")
    parser.add_argument("--shape", action="append", type=parse_shape, required=True,
                        help="B,Hq,Hkv,N,D (repeatable)")
    parser.add_argument("--causal", choices=("yes", "no"), default=None,
                        help="only causal, or only unmasked (default: both)")
    parser.add_argument("--schedule", action="append", default=None,
                        help="backward schedules (default: shift)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--launches", type=int, default=5, help="profiled launches per run")
    parser.add_argument("--out", default=None, help="folder for hopper_cycles.json")
    parser.add_argument("--limit", type=float, default=LIMIT_S,
                        help="seconds one compiling or profiled process may take")
    args = parser.parse_args()
    masks = (False, True) if args.causal is None else (args.causal == "yes",)
    schedules = ["forward"] if args.op == "forward" else args.schedule or ["shift"]
    overrides = {name: "" if name == "default" else name for name in ["default", *args.config]}
    rows = []
    for shape in args.shape:
        for causal in masks:
            for schedule in schedules:
                for name, fields in overrides.items():
                    compile_first(profile_command(args.op, shape, causal, schedule, fields, 0),
                                  name, args.limit)
                for round_ in range(args.rounds):
                    runs = {name: profile(ncu_command(args.op, shape, causal, schedule, fields,
                                                      args.launches), name, args.limit)
                            for name, fields in overrides.items()}
                    row = {"shape": shape, "causal": causal, "schedule": schedule,
                           "round": round_, "configs": compare(runs)}
                    rows.append(row)
                    print(f"{shape} causal={causal} {schedule} round {round_}: " + "  ".join(
                        f"{name} {r['cycles']:,.0f} ({r['ratio']:.3f}"
                        f"{'' if r['bits_equal_default'] else ', bits differ'})"
                        for name, r in row["configs"].items()), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "hopper_cycles.json", "w") as f:
            json.dump({"op": args.op, "launches": args.launches, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
