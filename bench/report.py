"""Tables, markdown and plots of bench/run.py's results (rows of plain dicts, as in its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import methods as m

from dash_inductor.ops.catalog import DETERMINISTIC, ORDERED  # noqa: F401  (run.py reads ORDERED)


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
    if row["method"] == "sdpa_off" and used and used != "cudnn":
        value += f" ({used})"
    elif key == "backward_tflops" and row["method"].startswith("dash_") and used and used != schedule:
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
    modelled = [x for x in methods if x.removeprefix("dash_") in DETERMINISTIC]
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
            _seq_axis(ax, f"{name} TFLOP/s", f"d{head_dim} {'causal' if causal else 'full'}")
        if axes[0].lines:
            axes[0].legend(fontsize=7)
        fig.tight_layout()
        written.append(directory / f"{name}_tflops.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    written.append(_plot_price(dense, configs, directory, plt))
    return written


def _seq_axis(ax, ylabel: str, title: str) -> None:
    """A log sequence-length x axis with the grid's lengths as ticks."""
    ax.set(xscale="log", xlabel="sequence length N", ylabel=ylabel, title=title)
    ax.set_xticks(m.SEQS, [f"{s // 1024}k" if s >= 1024 else str(s) for s in m.SEQS])
    ax.grid(alpha=0.3)


def _plot_price(dense, configs, directory: Path, plt) -> Path:
    fig, axes = _panels(plt, len(configs))
    atomic = {(r["head_dim"], r["causal"], r["seq"]): r["backward_ms"] for r in dense
              if r["method"] == "dash_atomic"}
    for ax, (head_dim, causal) in zip(axes, configs):
        for schedule in DETERMINISTIC:
            points = sorted((r["seq"], r["backward_ms"] / atomic[(head_dim, causal, r["seq"])])
                            for r in dense if r["method"] == f"dash_{schedule}"
                            and r["head_dim"] == head_dim and r["causal"] == causal
                            and (head_dim, causal, r["seq"]) in atomic)
            if points:
                ax.plot(*zip(*points), marker="o", label=schedule)
        ax.axhline(1.0, color="gray", lw=0.8)
        _seq_axis(ax, "backward time / atomic",
                  f"price of determinism, d{head_dim} {'causal' if causal else 'full'}")
    if axes[0].lines:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = directory / "price_of_determinism.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
