"""Rewrite the tables of docs/benchmarks.md from the raw results they name.

    python bench/doc_tables.py            # rewrite the tables in place
    python bench/doc_tables.py --check    # exit 1 if a committed table differs from its raw file
    python bench/doc_tables.py --plots docs/img/bench   # redraw the grid's figures (matplotlib)

Each table sits between a marker that names its kind and its raw files, relative to the
repository root, and an end marker::

    <!-- table step bench/results/<date>-<gpu>-<commit>/step.json -->
    ...generated...
    <!-- end table -->

Everything between the two is generated: a line naming the device, torch, Triton, date and
commit (the commit is the last part of the results folder's name), the table, and the ranges the
prose quotes, computed over that table only. So the page names its sources in one place, and
tests/test_bench_doc_tables.py checks that the committed tables match them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
MARKER = re.compile(r"(<!-- table (\S+) ([^>]*?) -->\n)(.*?)(<!-- end table -->)", re.DOTALL)
SCHEDULES = ("ascending", "descending", "shift", "recompute", "atomic")


def _load(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


def _folder(path: str) -> tuple[str, str]:
    """(date, commit) from ``bench/results/<date>-<gpu>-<commit>/...``."""
    name = Path(path).parent.name
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2})-[^-]+-([0-9a-f]{7,})", name)
    if not match:
        raise ValueError(f"{path}: the folder is not named <date>-<gpu>-<commit>")
    return match[1], match[2]


def _where(paths: list[str], device: str, torch: str, triton: str | None, extra: str = "") -> str:
    """The line above a table: device, versions, date, commit(s) and the raw folder(s)."""
    dates, commits = zip(*(_folder(p) for p in paths))
    commits = tuple(dict.fromkeys(commits))
    folders = " and ".join(dict.fromkeys(f"`{Path(p).parent.as_posix()}/`" for p in paths))
    return (f"{device} · torch {torch}{f' · Triton {triton}' if triton else ''} · "
            f"{' and '.join(dict.fromkeys(dates))} · commit{'s' * (len(commits) > 1)} "
            f"{' and '.join(commits)} · raw: "
            f"{folders}{extra}\n")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _span(values: list[float], digits: int) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}–{high}"


# ---------------------------------------------------------------------------------------------
# One function per kind of raw file.


def grid(path: str) -> str:
    """bench/run.py's JSON: backward TFLOP/s of every method on every problem."""
    data = _load(path)
    env = data["environment"]
    rows = [r for r in data["rows"] if r.get("backward_tflops") is not None]
    cell = {(r["problem"], r["method"]): r for r in rows}
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    body, big = [], {64: [], 128: []}
    for problem in problems:
        get = lambda method: cell[(problem, method)]["backward_tflops"]
        off, on, flex = get("sdpa_off"), get("sdpa_on"), get("flex")
        dash = [get(f"dash_{s}") for s in SCHEDULES]
        best = max(dash[:-1])
        body.append([problem, f"{off:.0f} ({cell[(problem, 'sdpa_off')]['backend']})", f"{on:.0f}",
                     f"{off / on:.2f}", f"{flex:.0f}", *(f"{x:.0f}" for x in dash),
                     f"{best / on:.2f}", f"{best / flex:.2f}"])
        first = cell[(problem, "sdpa_off")]
        if first["seq"] >= 4096:
            big[first["head_dim"]].append((off, on, off / on, best / on, best / flex))
    header = ["problem", "SDPA det. off", "SDPA det. on", "off / on", "Flex",
              *(f"dash {s}" for s in SCHEDULES), "best det. / on", "best det. / Flex"]
    ranges = []
    for dim in (128, 64):
        cols = list(zip(*big[dim]))
        ranges.append(f"- head dim {dim}, N ≥ 4k: SDPA determinism off {_span(cols[0], 0)} "
                      f"TFLOP/s, on {_span(cols[1], 0)}, off / on {_span(cols[2], 2)}×; dash's "
                      f"best deterministic schedule / SDPA on {_span(cols[3], 2)}×, / Flex "
                      f"{_span(cols[4], 2)}×")
    return (_where([path], f"{env['gpu']} ({env['sms']} SMs)", env["torch"], env["triton"],
                   " (backward records)") + "\n" + _table(header, body) + "\n"
            + "\n".join(ranges) + "\n")


def hopper(path: str) -> str:
    """bench/hopper_check.py's JSON: dash through its launcher, the others through autograd."""
    data = _load(path)
    body = []
    for r in data["timing"]:
        batch, hq, hkv, seq, dim = r["shape"]
        body.append([str(dim), f"{seq // 1024}k", "yes" if r["causal"] else "no", str(hq // hkv),
                     *(f"{r[f'hopper {s}']:.0f}" for s in ("shift", "descending", "ascending",
                                                          "recompute", "atomic")),
                     f"{r['portable recompute']:.0f}", f"{r['sdpa cudnn']:.0f}",
                     f"{r['sdpa deterministic']:.0f}", f"{r['flex']:.0f}"])
    header = ["D", "N", "causal", "Hq/Hkv", "shift", "descending", "ascending", "recompute",
              "atomic", "portable recompute", "cuDNN (autograd)", "SDPA det. on (autograd)",
              "Flex (autograd)"]
    return (_where([path], data["device"], data["torch"], data["triton"]) + "\n"
            + _table(header, body))


def step(path: str) -> str:
    """bench/step.py's JSON: median step time of each variant (per compile mode where it ran
    more than one), and with several modes the host time a step of steps run back to back."""
    data = _load(path)
    env, args = data["environment"], data["args"]
    steps = data["steps"]
    by = {(s["seq"], s.get("mode", "default"), s["variant"]): s for s in steps}
    modes = list(dict.fromkeys(s.get("mode", "default") for s in steps))
    body, dash_ratio, sdpa_ratio = [], [], []
    for seq, mode in dict.fromkeys((s["seq"], s.get("mode", "default")) for s in steps):
        dash, on, off = (by[(seq, mode, v)] for v in (
            "dash (determinism on)", "SDPA (determinism on)", "determinism off"))
        dash_ratio.append(dash["step_ms"] / off["step_ms"])
        sdpa_ratio.append(on["step_ms"] / off["step_ms"])
        row = [str(seq)] + [mode] * (len(modes) > 1) + [
            f"{dash['step_ms']:.1f}", f"{on['step_ms']:.1f}", f"{off['step_ms']:.1f}",
            f"{dash_ratio[-1]:.2f}", f"{sdpa_ratio[-1]:.2f}"]
        if len(modes) > 1:
            row.append(" / ".join(f"{x['host_ms']:.1f}" for x in (dash, on, off)))
        body.append(row)
    header = (["N"] + ["compile mode"] * (len(modes) > 1)
              + ["dash ms", "SDPA det. on ms", "det. off ms", "dash / off", "SDPA on / off"]
              + ["host ms a step, back to back (dash / SDPA on / off)"] * (len(modes) > 1))
    shape = (f" · {args['layers']} layers, d_model {args['d_model']}, {args['heads']} heads, "
             f"{'B = ' + str(args['batch']) if args.get('batch') else 'B·N = ' + str(args['tokens'])}"
             f"{', no optimizer' if args.get('no_optimizer') else ', AdamW'}")
    return (_where([path], env["gpu"], env["torch"], env["triton"], shape) + "\n"
            + _table(header, body)
            + (f"\n- dash / determinism off {_span(dash_ratio, 2)}×; SDPA determinism on / off "
               f"{_span(sdpa_ratio, 2)}×\n" if len(body) > 1 and len(modes) == 1 else ""))


def step_control(*paths: str) -> str:
    """bench/step.py's JSON with ``--control``, a row per run: steps timed alone and back to back,
    dash against determinism off and against the control (determinism on, cuDNN's attention):
    dash / control is attention's share of a gap, control / off what determinism costs the rest."""
    runs = [_load(p) for p in paths]
    names = ("dash (determinism on)", "SDPA (determinism on)", "determinism off",
             "determinism on, cuDNN attention")
    body = []
    for run in runs:
        by = {(s["seq"], s["batch"], s["mode"], s["variant"]): s for s in run["steps"]}
        for case in dict.fromkeys((s["seq"], s["batch"], s["mode"]) for s in run["steps"]):
            dash, on, off, control = (by[(*case, name)] for name in names)
            body.append([*map(str, case), *(f"{r['step_ms']:.1f}" for r in (dash, on, off, control)),
                         f"{dash['step_ms'] / off['step_ms']:.2f}",
                         " / ".join(f"{r['back_to_back_ms']:.1f}" for r in (dash, off, control)),
                         f"{dash['back_to_back_ms'] / off['back_to_back_ms']:.2f}",
                         f"{dash['back_to_back_ms'] / control['back_to_back_ms']:.2f}"])
    header = ["N", "B", "mode", "dash ms", "SDPA det. on ms", "det. off ms", "control ms",
              "dash / off", "back to back ms (dash / off / control)", "dash / off",
              "dash / control"]
    env, args = runs[0]["environment"], runs[0]["args"]
    shape = (f" · {args['layers']} layers, d_model {args['d_model']}, {args['heads']} heads"
             f"{', no optimizer' if args.get('no_optimizer') else ', AdamW'}")
    return (_where(list(paths), env["gpu"], env["torch"], env["triton"], shape) + "\n"
            + _table(header, body))


def fa4(*paths: str) -> str:
    """bench/run.py's JSON with FlashAttention-4's methods: backward and forward TFLOP/s of
    cuDNN, FA4 (non-deterministic and deterministic) and dash's auto schedule. A row marked
    ``excluded`` (a reason, added to the raw file after the run) keeps its numbers in the file
    and is shown as excluded, outside the ranges."""
    runs = [_load(p) for p in paths]
    rows = [row for run in runs for row in run["rows"] if not row.get("error")]
    cell = {(r["problem"], r["method"]): r for r in rows}
    body, backward, forward, excluded = [], [], [], {}
    for problem in dict.fromkeys(r["problem"] for r in rows):
        get = lambda method, what: cell[(problem, method)][f"{what}_tflops"]
        dash = cell[(problem, "dash_auto")]
        if dash.get("excluded"):
            excluded[problem] = dash["excluded"]
            bwd, bwd_ratio, fwd, fwd_ratio = "excluded", "—", "excluded", "—"
        else:
            backward.append(get("dash_auto", "backward") / get("fa4_det", "backward"))
            forward.append(get("dash_auto", "forward") / get("fa4", "forward"))
            bwd = f"{dash['backward_tflops']:.0f} ({dash['backend']})"
            bwd_ratio = f"{backward[-1]:.2f}"
            fwd, fwd_ratio = f"{get('dash_auto', 'forward'):.0f}", f"{forward[-1]:.2f}"
        body.append([problem, f"{get('sdpa_off', 'backward'):.0f}", f"{get('fa4', 'backward'):.0f}",
                     f"{get('fa4_det', 'backward'):.0f}", bwd, bwd_ratio,
                     f"{get('fa4', 'forward'):.0f}", fwd, fwd_ratio])
    header = ["problem", "bwd cuDNN (det. off)", "bwd FA4", "bwd FA4 det.", "bwd dash auto",
              "dash / FA4 det.", "fwd FA4", "fwd dash", "dash / FA4"]
    env = runs[0]["environment"]
    notes = "".join(f"- dash at {' and '.join(p for p in excluded if excluded[p] == reason)}: "
                    f"excluded, {reason}\n" for reason in dict.fromkeys(excluded.values()))
    return (_where(list(paths), env["gpu"], env["torch"], env["triton"],
                   " · TFLOP/s, B·N = 16384, H·D = 2048, bf16") + "\n"
            + _table(header, body)
            + f"\n- backward: dash / FA4 deterministic {_span(backward, 2)}×; forward: dash / FA4 "
              f"{_span(forward, 2)}×{' (the other points)' if excluded else ''}\n" + notes)


def packed(path: str) -> str:
    """bench/packed.py's JSON: backward ms of packed documents, a window, causal and full."""
    data = _load(path)
    env = data["environment"]
    ok = [r for r in data["rows"] if r.get("status") == "ok"]
    cell = {(r["problem"], r["method"]): r for r in ok}
    body = []
    for problem in dict.fromkeys(r["problem"] for r in ok):
        get = lambda method: cell[(problem, method)]["backward_ms"]
        auto = cell[(problem, "dash_auto")]
        best = min((cell[(problem, f"dash_{s}")] for s in SCHEDULES[:-1]
                    if (problem, f"dash_{s}") in cell), key=lambda r: r["backward_ms"])
        flex = get("flex")
        body.append([str(auto["head_dim"]), problem.split(" ", 1)[1].removesuffix(" T=16384"),
                     f"{auto['backward_ms']:.2f} ({auto['backend']})",
                     f"{best['backward_ms']:.2f} ({best['backend']})", f"{flex:.2f}",
                     f"{flex / auto['backward_ms']:.2f}", f"{flex / best['backward_ms']:.2f}",
                     f"{get('varlen_attn_on'):.2f}", f"{get('varlen_attn_off'):.2f}"])
    header = ["D", "problem", "dash `auto` (ran)", "dash best det. (ran)", "Flex",
              "Flex / auto", "Flex / best", "`varlen_attn` det. on", "det. off"]
    return (_where([path], env["device"], env["torch"], env["triton"]) + "\n"
            + _table(header, body))


def host(*paths: str) -> str:
    """bench/host.py's JSON, one column per run: host µs of one forward+backward. A run made
    before each compiled method had a graph of its own (no ``own_graphs``) ran SDPA det. on's
    graph as ``compiled_dash``: its cell stays empty."""
    runs = [_load(p) for p in paths]
    names = [_folder(p)[1] for p in paths]
    layers = {run.get("layers") for run in runs} - {None}
    methods = [("sdpa_off", "eager SDPA, det. off"), ("sdpa_on", "eager SDPA, det. on"),
               ("floor", "an autograd.Function that only allocates"), ("dash", "eager dash"),
               ("dash_python", "eager dash, no C++ replayer"),
               ("dash_triton_launcher", "eager dash, no replayer, Triton's launcher"),
               ("compiled_sdpa_off", "compiled SDPA, det. off"),
               ("compiled_sdpa_on", "compiled SDPA, det. on"), ("compiled_dash", "compiled dash"),
               *((f"layers_{m}", f"compiled, {n} layers a call: {title}") for n in sorted(layers)
                 for m, title in (("sdpa_off", "SDPA det. off"), ("sdpa_on", "SDPA det. on"),
                                  ("dash", "dash"))),
               ("varlen_attn_on", "`varlen_attn`, det. on"), ("varlen_dash", "dash varlen")]
    values = [{r["method"]: r["host_us"] for r in run["rows"]
               if run.get("own_graphs") or r["method"] != "compiled_dash"} for run in runs]
    body = [[title, *(f"{v[method]:.0f}" if method in v else "–" for v in values)]
            for method, title in methods if any(method in v for v in values)]
    for mine, base, title in (("dash", "sdpa_off", "eager dash / SDPA det. off"),
                              ("compiled_dash", "compiled_sdpa_off",
                               "compiled dash / SDPA det. off"),
                              ("layers_dash", "layers_sdpa_off",
                               "compiled layers, dash / SDPA det. off")):
        if any(mine in v for v in values):
            body.append([title, *(f"{v[mine] / v[base]:.2f}" if mine in v else "–"
                                  for v in values)])
    first = runs[-1]
    return (_where(list(paths), first["device"], first["torch"], first["triton"]) + "\n"
            + _table(["host µs a forward+backward", *(f"commit {n}" for n in names)], body))


def provider(path: str) -> str:
    """bench/provider_step.py's JSON: an eager Hugging Face training step."""
    data = _load(path)
    env = data["environment"]
    off = next(r["step_ms"] for r in data["rows"] if not r["deterministic"])
    body = [[r["variant"], f"{r['step_ms']:.1f}", f"{r['step_ms'] / off:.2f}",
             ", ".join(f"{k} {v:g}" for k, v in r["dash_calls_per_step"].items()) or "none"]
            for r in data["rows"]]
    return (_where([path], env["device"], env["torch"], env["triton"]) + "\n"
            + _table(["variant", "step ms", "/ det. off", "dash calls a step"], body))


def distributed(path: str) -> str:
    """examples/distributed_train.py's output: one line per mode and attention."""
    text = (ROOT / path).read_text()
    head = re.search(r"torch (\S+), (\d+ x [^,]+),", text)
    steps: dict[str, dict[str, str]] = {}
    bits: dict[str, str] = {}
    attention = None
    for line in text.splitlines():
        if line.startswith("torch "):
            attention = "dash" if "attention: dash" in line else "sdpa"
        found = re.match(r"OK\s+(\w+)\s+(.*?)\s{2,}.*step\s+([\d.]+) ms", line)
        if found:
            steps.setdefault(found[1], {})[attention] = found[3]
            bits[found[1]] = found[2]
    names = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor parallel + FSDP2"}
    body = [[names[m], bits[m], steps[m]["dash"], steps[m]["sdpa"]] for m in steps]
    return (_where([path], head[2], head[1], None, " (the log records no Triton version)") + "\n"
            + _table(["mode", "bits, run 1 vs 2", "dash step ms", "SDPA det. on step ms"], body))


def determinism(path: str) -> str:
    """bench/determinism_report.py's JSON: the checks that passed."""
    data = _load(path)
    env = data["environment"]
    records = data["records"]
    controls = [r for r in records if r["check"].startswith("negative control")]
    checks = [r for r in records if not r["check"].startswith("negative control")]
    repeats = max(r["repeats"] for r in checks)
    return (_where([path], env["device"], env["torch"], env["triton"]) + "\n"
            + f"- {sum(r['passed'] for r in checks)} of {len(checks)} checks passed (up to "
              f"{repeats} repeats each); negative controls caught {sum(r['passed'] for r in controls)}"
              f" of {len(controls)}\n")


KINDS: dict[str, Callable[..., str]] = {f.__name__: f for f in (
    grid, hopper, step, step_control, packed, host, provider, distributed, determinism, fa4)}


def render(text: str) -> str:
    """``text`` with every marked table regenerated."""
    def replace(match: re.Match) -> str:
        kind, sources = match[2], match[3].split()
        return match[1] + KINDS[kind](*sources) + match[5]
    return MARKER.sub(replace, text)


def sources(text: str) -> list[str]:
    """The raw files the page's markers name."""
    return [source for match in MARKER.finditer(text) for source in match[3].split()]


def draw(path: str, directory: Path) -> list[Path]:
    """The grid's backward figures (TFLOP/s against N; each schedule over atomic)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tempfile

    import report

    rows = [dict(r, forward_tflops=None) for r in _load(path)["rows"]
            if r.get("backward_tflops") is not None]
    directory.mkdir(parents=True, exist_ok=True)
    kept = []
    with tempfile.TemporaryDirectory() as tmp:
        for drawn in report.draw_plots(rows, Path(tmp)):
            if drawn.name != "forward_tflops.png":
                kept.append(directory / drawn.name)
                kept[-1].write_bytes(drawn.read_bytes())
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    parser.add_argument("--plots", type=Path, help="also redraw the grid's figures into this folder")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("docs/benchmarks.md's tables differ from their raw files; run "
                  "python bench/doc_tables.py")
            return 1
        return 0
    PAGE.write_text(new)
    if args.plots:
        grids = [m[3].split()[0] for m in MARKER.finditer(text) if m[2] == "grid"]
        for path in draw(grids[0], args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
