"""The benchmark grid runner: TFLOP/s of dash.attention's schedules against SDPA and FlexAttention.

    python bench/run.py [--quick] [--json PATH] [--markdown PATH] [--plots DIR]

Follows DESIGN.md's performance protocol: one process, one GPU, random bf16 inputs, do_bench
medians; the grid is head dim 64 and 128, H*D = 2048, B*N = 16384, N from 512 to 16k, causal and
full, plus GQA (Hq/Hkv = 4) at N = 4k and 8k. A baseline that fails on a problem is recorded with
its error and the run goes on. Next to each ordered schedule's backward time it prints the DASH
model's critical-path prediction (dash_inductor.schedule), scaled by the measured atomic time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import methods as m  # noqa: E402
from dash_inductor.demo import ProgressBar  # noqa: E402

ORDERED = ("ascending", "descending", "shift")


def environment() -> dict[str, Any]:
    """What the numbers depend on: GPU, software versions, date."""
    import triton

    import dash_inductor

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "dash_inductor": dash_inductor.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def predicted_backward_ms(problem: m.Problem, schedule: str, atomic_ms: float | None,
                          programs: int) -> float | None:
    """The model's backward time of ``schedule``, calibrated so that ``atomic`` matches its
    measurement (one persistent program per SM; dQ reduction cost r = c/4, the model's default)."""
    if atomic_ms is None:
        return None
    try:
        from dash_inductor.ops.configs import backward_config
        from dash_inductor.schedule import predicted_makespan
    except ImportError:
        return None
    arch = torch.cuda.get_device_capability()[0]
    block_n = backward_config(problem.head_dim, problem.dtype, problem.causal, arch).block_n
    shape = dict(n_tiles=math.ceil(problem.seq / block_n), n_heads=problem.batch * problem.heads_kv,
                 programs=programs, causal=problem.causal, group=problem.group)
    try:
        return atomic_ms * predicted_makespan(schedule, **shape) / predicted_makespan("atomic", **shape)
    except ValueError:  # the schedule cannot run this shape on this many programs
        return None


def auto_choice(problem: m.Problem) -> str:
    from dash_inductor.ops.configs import auto_schedule, backward_config

    arch = torch.cuda.get_device_capability()[0]
    block_n = backward_config(problem.head_dim, problem.dtype, problem.causal, arch).block_n
    return auto_schedule(problem.head_dim, problem.dtype, problem.causal,
                         math.ceil(problem.seq / block_n), arch)


def run_problem(problem: m.Problem, selected: list[m.Method], bar: ProgressBar, warmup: int,
                rep: int) -> list[dict[str, Any]]:
    """Every selected method on one problem; a failure becomes a row with its error."""
    inputs = m.make_inputs(problem)
    rows = []
    dash_forward_ms = None
    for method in selected:
        row: dict[str, Any] = {**problem.as_dict(), "problem": problem.label,
                               "method": method.name, "title": method.title}
        try:
            prepared = m.prepare(method, problem, inputs)
            # dash's forward does not depend on the schedule: time it once.
            timing = m.measure(prepared, inputs, forward=not method.is_dash or dash_forward_ms is None,
                               warmup=warmup, rep=rep)
            if method.is_dash:
                dash_forward_ms = dash_forward_ms or timing.forward
            row.update(backend=prepared.backend,
                       forward_ms=timing.forward if not method.is_dash else dash_forward_ms,
                       backward_ms=timing.backward)
            row["forward_tflops"] = m.tflops(problem.flops_forward, row["forward_ms"])
            row["backward_tflops"] = m.tflops(problem.flops_backward, row["backward_ms"])
            note = f"{problem.label} {method.name}: {_fmt(row['backward_tflops'])} TFLOP/s bwd"
        except Exception as error:  # record and go on: one failing baseline must not stop the grid
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            note = f"{problem.label} {method.name}: FAILED"
            torch.cuda.empty_cache()
        rows.append(row)
        bar.update(note)
    _add_predictions(problem, rows)
    del inputs
    torch.cuda.empty_cache()
    return rows


def _add_predictions(problem: m.Problem, rows: list[dict[str, Any]]) -> None:
    by_method = {row["method"]: row for row in rows}
    atomic = by_method.get("dash_atomic", {}).get("backward_ms")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for schedule in ORDERED + ("recompute",):
        row = by_method.get(f"dash_{schedule}")
        if row is not None and row.get("backward_ms") is not None:
            used = row.get("backend", schedule)
            row["predicted_backward_ms"] = predicted_backward_ms(problem, used, atomic, programs)
            row["auto"] = auto_choice(problem)


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cell(row: dict[str, Any] | None, key: str) -> str:
    if row is None:
        return "n/a"
    if row.get("error"):
        return "error"
    value = _fmt(row.get(key))
    used = row.get("backend")
    schedule = row["method"].removeprefix("dash_")
    if key == "backward_tflops" and row["method"].startswith("dash_") and used and used != schedule:
        value += f" ({used})"
    return value


def tables(rows: list[dict[str, Any]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, body) of the result tables: backward, forward, price of determinism, model."""
    problems = list(dict.fromkeys(row["problem"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    titles = {row["method"]: row["title"] for row in rows}
    cell = {(row["problem"], row["method"]): row for row in rows}
    backward = [[p] + [_cell(cell.get((p, x)), "backward_tflops") for x in methods] for p in problems]
    first_dash = next((x for x in methods if x.startswith("dash_")), None)
    forward_methods = [x for x in methods if not x.startswith("dash_")] + [first_dash] * bool(first_dash)
    forward = [[p] + [_cell(cell.get((p, x)), "forward_tflops") for x in forward_methods]
               for p in problems]
    price_header, price = _price_table(problems, methods, cell)
    model_header, model = _model_table(problems, methods, cell)
    return [("Backward TFLOP/s", ["problem"] + [titles[x] for x in methods], backward),
            ("Forward TFLOP/s (dash's forward is the same for every schedule)",
             ["problem"] + [_forward_title(x, titles) for x in forward_methods], forward),
            ("Price of determinism: backward time of each schedule / atomic, and the best "
             "deterministic schedule / SDPA with determinism off", price_header, price),
            ("DASH model vs measurement: measured / predicted backward time", model_header, model)]


def _forward_title(method: str, titles: dict[str, str]) -> str:
    return "dash" if method.startswith("dash_") else titles[method]


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _price_table(problems, methods, cell):
    det = [x for x in methods if x.startswith("dash_") and x != "dash_atomic"]
    header = ["problem"] + [x.removeprefix("dash_") for x in det] + ["best det / SDPA off"]
    body = []
    for p in problems:
        atomic = (cell.get((p, "dash_atomic")) or {}).get("backward_ms")
        times = [(cell.get((p, x)) or {}).get("backward_ms") for x in det]
        measured = [t for t in times if t is not None]
        sdpa_off = (cell.get((p, "sdpa_off")) or {}).get("backward_ms")
        best = min(measured) if measured else None
        body.append([p] + [_ratio(t, atomic) for t in times] + [_ratio(best, sdpa_off)])
    return header, body


def _model_table(problems, methods, cell):
    modelled = [x for x in methods if x.removeprefix("dash_") in ORDERED + ("recompute",)]
    header = ["problem", "auto picks"] + [x.removeprefix("dash_") for x in modelled]
    body = []
    for p in problems:
        rows = [cell.get((p, x)) or {} for x in modelled]
        auto = next((r.get("auto") for r in rows if r.get("auto")), "—")
        body.append([p, auto] + [_ratio(r.get("backward_ms"), r.get("predicted_backward_ms"))
                                 for r in rows])
    return header, body


def render_text(table: tuple[str, list[str], list[list[str]]]) -> str:
    title, header, body = table
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in body]
    return "\n".join(lines)


def render_markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"Measured on {env['gpu']} ({env['sms']} SMs), torch {env['torch']}, Triton "
             f"{env['triton']}, CUDA {env['cuda']}, dash_inductor {env['dash_inductor']}, "
             f"{env['date']}. Command: `{command}`.", ""]
    for title, header, body in tables(rows):
        lines += [f"#### {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        lines.append("")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["#### Failures", ""]
        lines += [f"- {r['problem']}, {r['title']}: `{r['error']}`" for r in errors]
        lines.append("")
    return "\n".join(lines)


def _panels(plt, count: int):
    """A grid of up to two panels per row (head dim per row, mask per column in the full grid)."""
    cols = min(count, 2) or 1
    rows = max(-(-count // cols), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    return fig, [ax for line in axes for ax in line]


def draw_plots(rows: list[dict[str, Any]], directory: Path) -> list[Path]:
    """TFLOP/s vs N per (head dim, mask) for every method; backward price of determinism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    dense = [r for r in rows if r["heads_q"] == r["heads_kv"] and not r.get("error")]
    configs = sorted({(r["head_dim"], r["causal"]) for r in dense})
    methods = list(dict.fromkeys(r["method"] for r in dense))
    titles = {r["method"]: r["title"] for r in dense}
    written = []
    for key, name in (("backward_tflops", "backward"), ("forward_tflops", "forward")):
        fig, axes = _panels(plt, len(configs))
        for ax, (head_dim, causal) in zip(axes, configs):
            first_dash = next((x for x in methods if x.startswith("dash_")), None)
            for method in methods:
                if key == "forward_tflops" and method.startswith("dash_") and method != first_dash:
                    continue
                points = sorted((r["seq"], r[key]) for r in dense if r["method"] == method
                                and r["head_dim"] == head_dim and r["causal"] == causal
                                and r.get(key) is not None)
                if points:
                    label = _forward_title(method, titles) if key == "forward_tflops" \
                        else titles[method]
                    ax.plot(*zip(*points), marker="o", label=label,
                            linestyle="-" if method.startswith("dash_") else "--")
            ax.set(xscale="log", xlabel="sequence length N", ylabel=f"{name} TFLOP/s",
                   title=f"d{head_dim} {'causal' if causal else 'full'}")
            ax.set_xticks(m.SEQS, [f"{s // 1024}k" if s >= 1024 else str(s) for s in m.SEQS])
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        written.append(directory / f"{name}_tflops.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    written.append(_plot_price(dense, configs, directory, plt))
    return written


def _plot_price(dense, configs, directory: Path, plt) -> Path:
    fig, axes = _panels(plt, len(configs))
    atomic = {(r["head_dim"], r["causal"], r["seq"]): r["backward_ms"] for r in dense
              if r["method"] == "dash_atomic"}
    for ax, (head_dim, causal) in zip(axes, configs):
        for schedule in ORDERED + ("recompute",):
            points = sorted((r["seq"], r["backward_ms"] / atomic[(head_dim, causal, r["seq"])])
                            for r in dense if r["method"] == f"dash_{schedule}"
                            and r["head_dim"] == head_dim and r["causal"] == causal
                            and (head_dim, causal, r["seq"]) in atomic)
            if points:
                ax.plot(*zip(*points), marker="o", label=schedule)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="sequence length N", ylabel="backward time / atomic",
               title=f"price of determinism, d{head_dim} {'causal' if causal else 'full'}")
        ax.set_xticks(m.SEQS, [f"{s // 1024}k" if s >= 1024 else str(s) for s in m.SEQS])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = directory / "price_of_determinism.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configs, for a smoke run")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--markdown", type=Path, help="write the markdown tables here")
    parser.add_argument("--plots", type=Path, help="draw PNG plots into this directory")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated (default 64,128)")
    parser.add_argument("--seqs", default=",".join(map(str, m.SEQS)), help="comma-separated")
    parser.add_argument("--methods", default=",".join(x.name for x in m.METHODS),
                        help="comma-separated subset of: " + ", ".join(x.name for x in m.METHODS))
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench measuring time, ms (default 40)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    by_name = {x.name: x for x in m.METHODS}
    unknown = [x for x in args.methods.split(",") if x not in by_name]
    if unknown:
        print(f"error: --methods: unknown {unknown}; choose from {list(by_name)}", file=sys.stderr)
        return 2
    selected = [by_name[x] for x in args.methods.split(",")]
    problems = m.grid(args.quick, tuple(int(x) for x in args.head_dims.split(",")),
                      tuple(int(x) for x in args.seqs.split(",")))
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, Triton {env['triton']}: {len(problems)} problems x "
          f"{len(selected)} methods")
    start = time.perf_counter()
    bar = ProgressBar(len(problems) * len(selected), "bench")
    rows = [row for problem in problems
            for row in run_problem(problem, selected, bar, args.warmup, args.rep)]
    env["seconds"] = round(time.perf_counter() - start, 1)
    for table in tables(rows):
        print()
        print(render_text(table))
    failures = [r for r in rows if r.get("error")]
    for row in failures:
        print(f"FAILED {row['problem']} {row['method']}: {row['error']}")
    command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "command": command.strip(),
                                         "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(env, rows, command.strip()))
    if args.plots:
        try:
            for path in draw_plots(rows, args.plots):
                print(f"wrote {path}")
        except ImportError:
            print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
    print(f"done in {env['seconds']} s; {len(failures)} failed measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
