"""Every benchmark behind docs/benchmarks.md's tables, on one GPU at one commit, into one folder.

    python bench/regenerate.py [--out DIR] [--only grid,host,...] [--retarget] [--dry-run]

Runs the scripts the page's tables come from, each in a process of its own and one after another
(each times its methods the same way, through the public op and autograd), with the arguments of
:data:`RUNS`, writing into DIR (default ``bench/results/<date>-<gpu>-<commit>/``; name it yourself
where the checkout has no git metadata). ``fa4`` needs ``flash_attn.cute``. ``--retarget`` then
points each table whose run wrote its file at DIR and rewrites the tables
(``bench/doc_tables.py``): the page shows one GPU at one commit. The distributed table needs two
GPUs (``examples/distributed_train.py``) and keeps its source.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import doc_tables
import outdir

BENCH = Path(__file__).resolve().parent


class Run:
    """One script's run: its arguments (``{out}``: the folder) and, for each table it feeds,
    (kind, which table of that kind on the page, counted from 0, the files it reads)."""

    def __init__(self, script: str, args: list[str], tables: list[tuple[str, int, list[str]]]):
        self.script, self.args, self.tables = script, args, tables

    def command(self, out: Path) -> list[str]:
        return [sys.executable, str(BENCH / self.script), *(a.format(out=out) for a in self.args)]

    def files(self) -> list[str]:
        """The files it writes that a table reads or that its arguments name."""
        named = [a.split("/", 1)[1] for a in self.args if a.startswith("{out}/")]
        return list(dict.fromkeys(named + [f for _, _, files in self.tables for f in files]))


_FA4 = ["--seqs", "4096,16384", "--methods", "sdpa_off,fa4,fa4_det,dash_auto"]

#: The runs, in the order they go; names for ``--only``.
RUNS = {
    "grid": Run("run.py", ["--json", "{out}/bench.json", "--markdown", "{out}/bench.md"],
                [("grid", 0, ["bench.json"])]),
    "host": Run("host.py", ["--breakdown", "--no-compile", "--rounds", "3", "--calls", "200",
                            "--out", "{out}"], [("host", 0, ["host.json"])]),
    "step-b2": Run("step.py", ["--seqs", "4096", "--batch", "2", "--no-optimizer", "--no-memory",
                               "--control", "--rounds", "5", "--json", "{out}/step-b2.json",
                               "--markdown", "{out}/step-b2.md"], []),
    "step-b1": Run("step.py", ["--seqs", "4096", "--batch", "1", "--no-optimizer", "--no-memory",
                               "--control", "--rounds", "5", "--json", "{out}/step-b1.json",
                               "--markdown", "{out}/step-b1.md"],
                   [("step_control", 0, ["step-b2.json", "step-b1.json"])]),
    "step-graphs": Run("step.py", ["--seqs", "4096", "--batch", "2", "--no-optimizer",
                                   "--no-memory", "--modes", "default,reduce-overhead",
                                   "--rounds", "3", "--json", "{out}/step-graphs.json",
                                   "--markdown", "{out}/step-graphs.md"],
                       [("step", 0, ["step-graphs.json"])]),
    "step": Run("step.py", ["--seqs", "4096,8192", "--json", "{out}/step.json", "--markdown",
                            "{out}/step.md"], [("step", 1, ["step.json"])]),
    "packed": Run("packed.py", ["--rounds", "3", "--out", "{out}"],
                  [("packed", 0, ["packed.json"])]),
    "provider": Run("provider_step.py", ["--profile", "--out", "{out}"],
                    [("provider", 0, ["provider_step.json"])]),
    "determinism": Run("determinism_report.py",
                       ["--repeats", "1000", "--draws", "2", "--out",
                        "{out}/determinism-report.md", "--json", "{out}/determinism.json"],
                       [("determinism", 0, ["determinism.json"])]),
    "fa4-d128": Run("run.py", ["--head-dims", "128", *_FA4, "--json", "{out}/fa4-d128.json",
                               "--markdown", "{out}/fa4-d128.md"], []),
    "fa4-d64": Run("run.py", ["--head-dims", "64", *_FA4, "--json", "{out}/fa4-d64.json",
                              "--markdown", "{out}/fa4-d64.md"],
                   [("fa4", 0, ["fa4-d128.json", "fa4-d64.json"])]),
}


def retarget(page: str, folder: str, tables: list[tuple[str, int, list[str]]]) -> str:
    """``page`` with the markers of ``tables`` naming the files in ``folder`` (a path relative to
    the repository root); the generated tables themselves are left to ``doc_tables.render``."""
    wanted = {(kind, index): files for kind, index, files in tables}
    seen: dict[str, int] = {}

    def marker(match) -> str:
        kind = match[2]
        index = seen[kind] = seen.get(kind, -1) + 1
        files = wanted.get((kind, index))
        if files is None:
            return match[0]
        paths = " ".join(f"{folder}/{name}" for name in files)
        return f"<!-- table {kind} {paths} -->\n{match[4]}{match[5]}"

    return doc_tables.MARKER.sub(marker, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the results folder (default "
                        "bench/results/<date>-<gpu>-<commit>/)")
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated runs of "
                        f"{', '.join(RUNS)} (default: all)")
    parser.add_argument("--retarget", action="store_true",
                        help="point docs/benchmarks.md's tables at the folder and rewrite them")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(RUNS))
    if unknown:
        parser.error(f"--only: unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if args.out is None:
        import torch

        args.out = outdir.default_dir(torch.cuda.get_device_name())
    out = args.out.resolve()
    for name in chosen:
        command = RUNS[name].command(out)
        print(" ".join(command[1:]), flush=True)
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            subprocess.run(command, check=True)
            written = [out / f for f in RUNS[name].files() if (out / f).exists()]
            shown = " ".join(["python", f"bench/{RUNS[name].script}", *command[2:]])
            outdir.record_command(out, shown.replace(str(out), "DIR"), written)
    if args.retarget and not args.dry_run:
        tables = [t for name in chosen for t in RUNS[name].tables
                  if all((out / f).exists() for f in t[2])]
        folder = out.relative_to(BENCH.parent).as_posix()
        doc_tables.PAGE.write_text(doc_tables.render(retarget(doc_tables.PAGE.read_text(),
                                                              folder, tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
