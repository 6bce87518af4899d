"""The benchmark grid runner: TFLOP/s of dash.attention's schedules against SDPA and FlexAttention.

    python bench/run.py [--quick] [--out DIR] [--json PATH] [--markdown PATH] [--plots DIR]

Raw results go to DIR (default bench/results/<date>-<gpu>-<commit>/): bench.json and bench.md, and
the command in its README.md; --json and --markdown write those two elsewhere instead.

Follows the protocol of docs/benchmarks.md ("How it is measured"): one process, one GPU, random
bf16 inputs, do_bench medians; the grid is head dim 64 and 128, H*D = 2048, B*N = 16384, N from 512
to 16k, causal and full, plus GQA (Hq/Hkv = 4) at N = 4k and 8k. Next to each schedule's backward
time it gives the DASH model's critical-path prediction (dash_inductor.model.schedule), scaled by the
measured atomic time.

A measurement that fails is recorded with its error and the run goes on. The measuring runs in a
worker process; if a kernel kills the CUDA context (an illegal memory access, say), the worker
records the error and exits, and a fresh worker carries on with the next measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import methods as m  # noqa: E402
import outdir  # noqa: E402
import report  # noqa: E402
from dash_inductor.demo.cli import ProgressBar, quiet_cache_key_warnings  # noqa: E402
from dash_inductor.ops import catalog  # noqa: E402

CONTEXT_LOST = 3  #: the worker's exit status after a CUDA error that poisons the process
#: What runs without a GPU, for the message of a CPU-only machine.
CPU_COMMAND = "python -m dash_inductor bench --packed --smoke --device cpu"


def environment() -> dict[str, Any]:
    """What the numbers depend on: GPU, software versions, date."""
    import triton

    import dash_inductor

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "arch": props.major,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "dash_inductor": dash_inductor.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _tiles(problem: m.Problem, arch: int) -> int:
    from dash_inductor.ops.portable.configs import backward_config

    block_n = backward_config(problem.head_dim, problem.dtype, problem.causal, arch).block_n
    return math.ceil(problem.seq / block_n)


def predicted_backward_ms(problem: m.Problem, schedule: str, atomic_ms: float | None,
                          programs: int, arch: int) -> float | None:
    """The model's backward time of ``schedule``, calibrated so that ``atomic`` matches its
    measurement (one persistent program per SM; dQ reduction cost r = c/4, the model's default)."""
    if atomic_ms is None:
        return None
    from dash_inductor.model.schedule import predicted_makespan

    shape = dict(n_tiles=_tiles(problem, arch), n_heads=problem.batch * problem.heads_kv,
                 programs=programs, causal=problem.causal, group=problem.group)
    try:
        return atomic_ms * predicted_makespan(schedule, **shape) / predicted_makespan("atomic", **shape)
    except ValueError:  # the schedule cannot run this shape on this many programs
        return None


def auto_choice(problem: m.Problem, arch: int) -> str:
    """The schedule ``config.schedule = "auto"`` resolves to for this problem (unmasked or causal,
    on the kernel path the dispatcher takes for it)."""
    from dash_inductor.ops import rules
    from dash_inductor.ops.hopper.config import HEAD_DIMS
    from dash_inductor.ops.hopper.support import DTYPES

    hopper = arch == 9 and problem.dtype in DTYPES and problem.head_dim in HEAD_DIMS
    path = rules.HOPPER if hopper else rules.PORTABLE
    return rules.auto_schedule(path, problem.causal, False, problem.head_dim, False).name


def add_predictions(rows: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """Give each schedule's row the model's prediction and the auto schedule of its problem."""
    problems = {row["problem"]: m.Problem(**{**{k: row[k] for k in (
        "batch", "heads_q", "heads_kv", "seq", "head_dim", "causal")}}) for row in rows}
    for label, problem in problems.items():
        by_method = {row["method"]: row for row in rows if row["problem"] == label}
        atomic = by_method.get("dash_atomic", {}).get("backward_ms")
        for schedule in report.ORDERED + ("recompute",):
            row = by_method.get(f"dash_{schedule}")
            if row is not None and row.get("backward_ms") is not None:
                used = row.get("backend", schedule)
                row["predicted_backward_ms"] = predicted_backward_ms(
                    problem, used, atomic, env["sms"], env["arch"])
                row["auto"] = auto_choice(problem, env["arch"])


def _context_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:  # any CUDA error here means the context is unusable
        return False


def measure_one(problem: m.Problem, method: m.Method, inputs, dash_forward_ms: float | None,
                warmup: int, rep: int) -> dict[str, Any]:
    """One method on one problem, as a row; an error becomes the row's ``error``."""
    row: dict[str, Any] = {**problem.as_dict(), "problem": problem.label, "method": method.name,
                           "title": method.title}
    try:
        prepared = m.prepare(method, problem, inputs)
        # dash's forward does not depend on the schedule: it is timed once per problem.
        timing = m.measure(prepared, inputs, forward=not method.is_dash or dash_forward_ms is None,
                           warmup=warmup, rep=rep)
        forward_ms = dash_forward_ms if method.is_dash and dash_forward_ms else timing.forward
        row.update(backend=prepared.backend, forward_ms=forward_ms, backward_ms=timing.backward,
                   forward_tflops=m.tflops(problem.flops_forward, forward_ms),
                   backward_tflops=m.tflops(problem.flops_backward, timing.backward))
    except Exception as error:  # record and go on: one failing method must not stop the grid
        row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"
    return row


def worker(args: argparse.Namespace, tasks: list[tuple[m.Problem, m.Method]]) -> int:
    """Measure ``tasks[args.start:]``, appending JSON lines to ``args.rows_file``."""
    import dash_inductor

    dash_inductor.config.kernel = args.kernel  # dash's kernel path for every dash method
    with open(args.rows_file, "a") as sink, quiet_cache_key_warnings():
        sink.write(json.dumps({"environment": {**environment(), "kernel": args.kernel}}) + "\n")
        bar = ProgressBar(len(tasks), "bench")
        bar.done = args.start
        current, inputs, dash_forward_ms = None, None, None
        for index in range(args.start, len(tasks)):
            problem, method = tasks[index]
            if problem != current:
                inputs = None
                torch._dynamo.reset()  # FlexAttention compiles per shape; stay under the recompile limit
                torch.cuda.empty_cache()
                current, inputs, dash_forward_ms = problem, m.make_inputs(problem), None
            row = measure_one(problem, method, inputs, dash_forward_ms, args.warmup, args.rep)
            if method.is_dash and row.get("forward_ms") is not None:
                dash_forward_ms = row["forward_ms"]
            sink.write(json.dumps({"index": index, "row": row}) + "\n")
            sink.flush()
            bar.update(f"{problem.label} {method.name}: " + (
                f"FAILED ({row['error'][:90]})" if row.get("error")
                else f"{report._fmt(row['backward_tflops'])} TFLOP/s bwd"))
            if row.get("error") and not _context_alive():
                return CONTEXT_LOST
    return 0


def orchestrate(argv: list[str], tasks: list[tuple[m.Problem, m.Method]]
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run workers until every task has a row; a worker that dies costs one task, not the grid."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        rows: dict[int, dict[str, Any]] = {}
        env: dict[str, Any] = {}
        start, stalled = 0, 0
        while start < len(tasks):
            status = subprocess.call([sys.executable, __file__, *argv, "--worker",
                                      "--rows-file", str(rows_file), "--start", str(start)])
            for line in rows_file.read_text().splitlines():
                record = json.loads(line)
                env = env or record.get("environment", {})
                if "row" in record:
                    rows[record["index"]] = record["row"]
            done = next((i for i in range(start, len(tasks)) if i not in rows), len(tasks))
            stalled = stalled + 1 if done == start else 0
            failed = range(done, len(tasks) if stalled >= 3 else min(done + 1, len(tasks)))
            for index in failed:
                problem, method = tasks[index]
                rows[index] = {**problem.as_dict(), "problem": problem.label,
                               "method": method.name, "title": method.title,
                               "error": f"the measuring process died (exit status {status})"}
            if failed:
                print(f"worker exited with status {status} at task {done}; "
                      f"{'giving up' if stalled >= 3 else 'going on in a fresh process'}",
                      file=sys.stderr)
            start = failed.stop if failed else done
        return env, [rows[i] for i in sorted(rows)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configs, for a smoke run")
    parser.add_argument("--out", type=Path,
                        help="folder for bench.json and bench.md (default "
                             "bench/results/<date>-<gpu>-<commit>)")
    parser.add_argument("--json", type=Path, help="write the raw results here instead")
    parser.add_argument("--markdown", type=Path, help="write the markdown tables here instead")
    parser.add_argument("--plots", type=Path, help="draw PNG plots into this directory")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated (default 64,128)")
    parser.add_argument("--seqs", default=",".join(map(str, m.SEQS)), help="comma-separated")
    parser.add_argument("--methods", default=",".join(x.name for x in m.METHODS),
                        help="comma-separated subset of: " + ", ".join(x.name for x in _choosable())
                        + " (fa4 and fa4_det where flash_attn.cute imports)")
    parser.add_argument("--kernel", default="auto", choices=catalog.KERNELS,
                        help="dash's kernel path (dash_inductor.config.kernel; default auto)")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench measuring time, ms (default 40)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _choosable() -> tuple[m.Method, ...]:
    """Every method --methods names: the default ones, dash's auto schedule, FlashAttention-4."""
    return (*m.METHODS, m.DASH_AUTO, m.FA4, m.FA4_DET)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench/run.py times the grid on a CUDA GPU; none is visible. On a CPU, "
              f"`{CPU_COMMAND}` runs the packed-document benchmark at tiny sizes (a smoke test of "
              f"the scripts, not a measurement).", file=sys.stderr)
        return 2
    by_name = {x.name: x for x in _choosable()}
    unknown = [x for x in args.methods.split(",") if x not in by_name]
    if unknown:
        print(f"error: --methods: unknown {unknown}; choose from {list(by_name)}", file=sys.stderr)
        return 2
    if {"fa4", "fa4_det"} & set(args.methods.split(",")) and not m.fa4_available():
        print("error: --methods fa4/fa4_det: flash_attn.cute (FlashAttention-4) does not import "
              "here", file=sys.stderr)
        return 2
    problems = m.grid(args.quick, tuple(int(x) for x in args.head_dims.split(",")),
                      tuple(int(x) for x in args.seqs.split(",")))
    tasks = [(p, by_name[x]) for p in problems for x in args.methods.split(",")]
    if args.worker:
        return worker(args, tasks)
    print(f"{len(problems)} problems x {len(tasks) // max(len(problems), 1)} methods")
    started = time.perf_counter()
    env, rows = orchestrate(argv, tasks)
    if not env:
        print("no worker got as far as reading the GPU; see the errors above", file=sys.stderr)
        return 1
    env["seconds"] = round(time.perf_counter() - started, 1)
    add_predictions(rows, env)
    write_outputs(args, argv, env, rows)
    return 0


def write_outputs(args: argparse.Namespace, argv: list[str], env: dict[str, Any],
                  rows: list[dict[str, Any]]) -> None:
    print(f"\n{env['gpu']}, torch {env['torch']}, Triton {env['triton']}, {env['date']}")
    for table in report.tables(rows):
        print()
        print(report.render_text(table))
    failures = [r for r in rows if r.get("error")]
    for row in failures:
        print(f"FAILED {row['problem']} {row['method']}: {row['error']}")
    command = " ".join(["python bench/run.py", *argv])
    directory = args.out or outdir.default_dir(env["gpu"], env["date"])
    json_path = args.json or directory / "bench.json"
    markdown_path = args.markdown or directory / "bench.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"environment": env, "command": command, "rows": rows},
                                    indent=1))
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(report.render_markdown(env, rows, command))
    if not (args.json and args.markdown):
        outdir.record_command(directory, command, [json_path, markdown_path])
    print(f"wrote {json_path} and {markdown_path}")
    if args.plots:
        try:
            for path in report.draw_plots(rows, args.plots):
                print(f"wrote {path}")
        except ImportError:
            print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
    print(f"done in {env['seconds']} s; {len(failures)} failed measurements")


if __name__ == "__main__":
    sys.exit(main())
