"""Draw the schedule figures of docs/schedules.md from the DAG simulator and print its makespan table.

Run from the repository root: ``python bench/make_figures.py`` (needs matplotlib). The figures go
to docs/img/.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dash_inductor.model import schedule as S  # noqa: E402

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
C, R = 1.0, 0.4


def _draw(ax, sim: S.Simulation, title: str, makespan: float) -> None:
    colors = plt.get_cmap("tab10")
    for program, line in enumerate(sim.timelines):
        for seg in line:
            if seg.kind == "compute":
                ax.barh(program, seg.end - seg.start, left=seg.start, height=0.8, color=colors(seg.q),
                        edgecolor="black", linewidth=0.4, hatch="//" if seg.head % 2 else None)
                ax.text((seg.start + seg.end) / 2, program, f"{seg.q}", ha="center", va="center", fontsize=7)
            else:
                ax.barh(program, seg.end - seg.start, left=seg.start, height=0.8, color="0.25")
    ax.axvline(makespan, color="red", linewidth=1)
    ax.set_title(f"{title}: makespan {sim.makespan:g}", fontsize=9, loc="left")
    ax.set_yticks(range(len(sim.timelines)))
    ax.set_ylabel("program", fontsize=8)
    ax.invert_yaxis()
    ax.tick_params(labelsize=7)


def figure(causal: bool, n: int, heads: int, path: Path) -> None:
    """Per-program timelines of ascending, descending and shift on n programs."""
    schedules = ("ascending", "descending", "shift")
    sims = {s: S.simulate(s, n_tiles=n, n_heads=heads, programs=n, causal=causal, c=C, r=R)
            for s in schedules}
    longest = max(sim.makespan for sim in sims.values())
    fig, axes = plt.subplots(len(schedules), 1, figsize=(8, 1.1 + 1.0 * len(schedules) * n / 4),
                             sharex=True)
    for ax, name in zip(axes, schedules):
        _draw(ax, sims[name], name, sims[name].makespan)
        ax.set_xlim(0, longest * 1.01)
    axes[-1].set_xlabel(f"time (compute c = {C:g}, ordered dQ add r = {R:g})", fontsize=8)
    mask = "causal" if causal else "full mask"
    fig.suptitle(f"{mask}, {n} KV tiles per head, {heads} heads, {n} programs "
                 f"(number = Q tile, hatched = 2nd head, dark = dQ add)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table() -> str:
    """Markdown table: simulated makespan next to the closed form, for a few grids."""
    rows = ["| mask | n | heads | programs | group | schedule | simulated | closed form |",
            "|---|---|---|---|---|---|---|---|"]
    cases = [(False, 8, 4, 8, 1), (True, 8, 4, 8, 1), (True, 8, 4, 8, 4), (True, 16, 32, 132, 1),
             (False, 16, 32, 128, 1)]
    for causal, n, heads, programs, group in cases:
        for name in S.SCHEDULES:
            kwargs = dict(n_tiles=n, n_heads=heads, programs=programs, causal=causal, group=group,
                          c=1.0, r=0.25)
            simulated = S.simulate(name, **kwargs).makespan
            predicted = S.predicted_makespan(name, **kwargs)
            rows.append(f"| {'causal' if causal else 'full'} | {n} | {heads} | {programs} | {group} "
                        f"| {name} | {simulated:g} | {predicted:g} |")
    return "\n".join(rows)


if __name__ == "__main__":
    IMG.mkdir(exist_ok=True)
    figure(False, 4, 2, IMG / "schedule_full.png")
    figure(True, 4, 2, IMG / "schedule_causal.png")
    figure(True, 6, 2, IMG / "schedule_causal_n6.png")
    print(table())
