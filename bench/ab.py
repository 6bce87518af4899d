"""Time two revisions of dash_inductor against each other: the working tree and ``--ref REV``.

    python bench/ab.py --ref HEAD~1|FOLDER [--problem B,HQ,HKV,N,D[,causal] ...] [--schedule auto]
                       [--kernel auto] [--rounds 5] [--warmup 25] [--rep 100] [--dropout P]
                       [--json PATH]

Each revision is timed the way a user calls it: ``dash_inductor.attention`` for the forward and
``torch.autograd.grad`` of its output for the backward, with the same inputs, warm-up and
repetitions (``triton.testing.do_bench`` medians on CUDA, ``time.perf_counter`` medians on a CPU).
Besides the times it reports whether the two revisions gave the same output and gradients, bit
for bit.

What alternates, and why two processes. Both revisions register the same ``torch.ops.dash.*``
operators and the same module names, so one Python process cannot hold both: the second
registration would fail or replace the first. ``git worktree add`` checks ``REV`` out into a
temporary folder (or ``--ref`` names a folder that already holds a checkout, for a machine
without the repository's history), and two worker processes import one tree each (a finder
placed first on ``sys.meta_path`` maps ``dash_inductor`` and the package folders named in that
tree's pyproject.toml onto that tree, so neither the installed copy nor the other tree can leak
in).
The parent then runs the rounds: in each round every problem is timed by one worker, then by the
other, the order swapping from round to round, while the idle worker waits on its pipe. So the two
revisions never run at the same time, and a clock or thermal drift of the GPU spreads over both
rather than over the one timed second. The report gives each revision's median over the rounds
and the spread of its rounds; differences inside the spread, or under about 5%, are noise.

``--device cpu`` runs the op's CPU path (PyTorch's reference, or whatever the tree does there):
a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROBLEMS = ("4,16,16,4096,128", "4,16,16,4096,128,causal", "4,32,32,4096,64",
                    "4,32,32,4096,64,causal")


# ---------------------------------------------------------------------------------------------
# The worker: imports one tree and times what the parent asks for.


def _package_dirs(root: Path) -> dict[str, Path]:
    """Package name -> folder in ``root``: ``dash_inductor`` and pyproject's package-dir table."""
    dirs = {"dash_inductor": root / "dash_inductor"}
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)",
                            pyproject.read_text(), re.MULTILINE | re.DOTALL)
        for name, folder in re.findall(r'^"?([\w.]+)"?\s*=\s*"([^"]+)"', section[1] if section else "",
                                       re.MULTILINE):
            dirs[name] = root / folder
    return dirs


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Resolves the tree's packages (and everything under them) to files of that tree only."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = sorted(dirs.items(), key=lambda item: -len(item[0]))  # longest name first

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        for package, folder in self.dirs:
            if fullname != package and not fullname.startswith(package + "."):
                continue
            base = folder.joinpath(*fullname[len(package) + 1:].split(".")) if fullname != package \
                else folder
            if (base / "__init__.py").exists():
                return importlib.util.spec_from_file_location(
                    fullname, base / "__init__.py", submodule_search_locations=[str(base)])
            if base.with_suffix(".py").exists():
                return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
            raise ModuleNotFoundError(f"{fullname} is not in the tree {folder}", name=fullname)
        return None


def _digest(tensors) -> str:
    """The bits of ``tensors``, hashed: equal digests, equal bits."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _timer(device: str, warmup: int, rep: int):
    if device == "cuda":
        import triton

        try:  # time the C++ replayer, not calls that wait on its build thread for the GIL
            from dash_inductor.ops.shared import native
        except ImportError:  # a tree older than the replayer
            pass
        else:
            native.load(wait=True)
        return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def median_ms(fn) -> float:  # warmup and rep count calls here, not milliseconds
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(max(rep, 1)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return median_ms


def _choices(dash_inductor, schedule: str, kernel: str):
    """The tree's way of choosing the schedule and kernel: config.patch where it has one."""
    patch = getattr(getattr(dash_inductor, "config", None), "patch", None)
    if patch is None:
        return contextlib.nullcontext()
    try:
        return patch(schedule=schedule, kernel=kernel)
    except (AttributeError, ValueError):  # a tree older than the kernel option
        return patch(schedule=schedule)


def _measure(dash_inductor, job: dict[str, Any], timer) -> dict[str, Any]:
    import torch

    batch, hq, hkv, seq, dim, causal = job["problem"]
    dtype = getattr(torch, job["dtype"])
    gen = torch.Generator(device=job["device"]).manual_seed(0)
    make = lambda heads: torch.randn(batch, heads, seq, dim, device=job["device"], dtype=dtype,
                                     generator=gen)
    q, k, v = (t.requires_grad_() for t in (make(hq), make(hkv), make(hkv)))
    grad = make(hq)
    extra = {"enable_gqa": True} if hq != hkv else {}
    if job.get("dropout_p"):  # each call draws a new mask from the default generator
        extra["dropout_p"] = job["dropout_p"]
    with _choices(dash_inductor, job["schedule"], job["kernel"]):
        forward = lambda: dash_inductor.attention(q, k, v, is_causal=causal, **extra)
        torch.manual_seed(0)  # the checked call's mask is the same in both trees
        out = forward()
        backward = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        grads = backward()
        forward_ms = timer(forward)  # with autograd recording, as in a training step
        backward_ms = timer(backward)
    return {"forward_ms": forward_ms, "backward_ms": backward_ms, "bits": _digest((out, *grads))}


def worker(root: Path) -> int:
    """Serve timing jobs, one JSON line in and one out, with ``root``'s dash_inductor."""
    sys.meta_path.insert(0, _TreeFinder(_package_dirs(root)))
    import dash_inductor

    where = Path(dash_inductor.__file__).resolve()
    if root.resolve() not in where.parents:
        raise SystemExit(f"imported {where}, not the tree {root}")
    print(json.dumps({"ready": str(where)}), flush=True)
    timer = None
    for line in sys.stdin:
        job = json.loads(line)
        if timer is None:
            timer = _timer(job["device"], job["warmup"], job["rep"])
        try:
            reply = _measure(dash_inductor, job, timer)
        except Exception as error:  # noqa: BLE001 - reported, the other revision goes on
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: checks the ref out, starts the two workers and alternates them.


def parse_problem(text: str) -> tuple[int, int, int, int, int, bool]:
    """``B,HQ,HKV,N,D`` with an optional ``,causal``: q is (B, HQ, N, D), k and v (B, HKV, N, D)."""
    parts = [p.strip() for p in text.split(",")]
    causal = parts[-1] == "causal"
    numbers = parts[:-1] if causal else parts
    if len(numbers) != 5 or not all(p.isdigit() and int(p) > 0 for p in numbers):
        raise argparse.ArgumentTypeError(f"{text!r}: want B,HQ,HKV,N,D[,causal], positive ints")
    batch, hq, hkv, seq, dim = map(int, numbers)
    if hq % hkv:
        raise argparse.ArgumentTypeError(f"{text!r}: HQ must be a multiple of HKV")
    return batch, hq, hkv, seq, dim, causal


@contextlib.contextmanager
def checked_out(rev: str) -> Iterator[tuple[Path, str]]:
    """A temporary worktree of ``rev`` (detached), removed afterwards; yields (path, commit).

    A folder holding a package tree is used as it is, its commit reported as the folder's name.
    """
    if (Path(rev) / "dash_inductor").is_dir():
        yield Path(rev).resolve(), Path(rev).name
        return
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="dash-ab-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit],
                       cwd=ROOT, check=True)
        try:
            yield path, commit
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           check=False)


class Worker:
    def __init__(self, name: str, root: Path):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(root)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=root)
        self.ready = self._read()["ready"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _label(problem) -> str:
    batch, hq, hkv, seq, dim, causal = problem
    return f"B={batch} Hq={hq} Hkv={hkv} N={seq} D={dim} {'causal' if causal else 'full'}"


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of each (problem, side, pass) over the rounds; the bits' agreement."""
    summary = {}
    for label in dict.fromkeys(r["problem"] for r in rounds):
        mine = [r for r in rounds if r["problem"] == label]
        entry: dict[str, Any] = {}
        for side in ("ref", "tree"):
            replies = [r[side] for r in mine]
            errors = [r["error"] for r in replies if "error" in r]
            if errors:
                entry[side] = {"error": errors[0]}
                continue
            entry[side] = {key: {"median": statistics.median(r[key] for r in replies),
                                 "min": min(r[key] for r in replies),
                                 "max": max(r[key] for r in replies)}
                           for key in ("forward_ms", "backward_ms")}
            entry[side]["bits"] = sorted({r["bits"] for r in replies})
        if "error" not in entry["ref"] and "error" not in entry["tree"]:
            entry["same_bits"] = entry["ref"]["bits"] == entry["tree"]["bits"]
            for key in ("forward_ms", "backward_ms"):
                entry[f"{key[:-3]}_ratio"] = (entry["ref"][key]["median"]
                                              / entry["tree"][key]["median"])
        summary[label] = entry
    return summary


def print_summary(summary: dict[str, Any], ref: str, rounds: int) -> None:
    print(f"\nmedians of {rounds} alternating rounds, ms (min-max); ratio = ref / working tree "
          "(above 1: the working tree is faster)")
    for label, entry in summary.items():
        print(label)
        for side, name in (("ref", ref), ("tree", "working tree")):
            data = entry[side]
            if "error" in data:
                print(f"  {name:14s} error: {data['error']}")
                continue
            cells = "  ".join(f"{key[:-3]} {data[key]['median']:.3f} ({data[key]['min']:.3f}-"
                              f"{data[key]['max']:.3f})" for key in ("forward_ms", "backward_ms"))
            print(f"  {name:14s} {cells}")
        if "same_bits" in entry:
            print(f"  ratio          forward {entry['forward_ratio']:.3f}  backward "
                  f"{entry['backward_ratio']:.3f}  bits {'equal' if entry['same_bits'] else 'DIFFER'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The working tree's uncommitted changes are part of its side; REV is checked out "
               "as committed.")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ref", help="the revision to compare with: a commit, branch or tag, or "
                                      "a folder holding a checkout")
    parser.add_argument("--problem", action="append", type=parse_problem, metavar="B,HQ,HKV,N,D[,causal]",
                        help="a problem, repeatable (default: head dim 128 and 64 at N = 4096, "
                             "causal and full)")
    parser.add_argument("--schedule", default="auto", help="dash's schedule (default auto)")
    parser.add_argument("--kernel", default="auto", help="dash's kernel path (default auto)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=25,
                        help="warm-up: do_bench's ms on CUDA, calls on a CPU (default 25)")
    parser.add_argument("--rep", type=int, default=100,
                        help="repetitions: do_bench's ms on CUDA, calls on a CPU (default 100)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="dropout_p of every call (default 0); the checked call is seeded")
    parser.add_argument("--json", type=Path, help="write the rounds and the summary here")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.ref:
        parser.error("--ref REV is required")
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    problems = args.problem or [parse_problem(p) for p in DEFAULT_PROBLEMS]
    job = {"device": device, "dtype": args.dtype, "schedule": args.schedule,
           "kernel": args.kernel, "warmup": args.warmup, "rep": args.rep,
           "dropout_p": args.dropout}
    with checked_out(args.ref) as (ref_root, commit):
        workers = {"ref": Worker(args.ref, ref_root), "tree": Worker("working tree", ROOT)}
        try:
            print(f"ref {args.ref} = {commit[:12]}: {workers['ref'].ready}")
            print(f"working tree: {workers['tree'].ready}")
            rounds = []
            for number in range(args.rounds):
                order = ("ref", "tree") if number % 2 == 0 else ("tree", "ref")
                for problem in problems:
                    record = {"round": number, "problem": _label(problem)}
                    for side in order:
                        record[side] = workers[side].run({**job, "problem": problem})
                    rounds.append(record)
                    print(f"round {number + 1}/{args.rounds} {record['problem']}: " + "  ".join(
                        f"{side} " + (f"{record[side]['backward_ms']:.3f} ms backward"
                                      if "error" not in record[side] else "error")
                        for side in order), flush=True)
        finally:
            for w in workers.values():
                w.close()
    summary = summarize(rounds)
    print_summary(summary, args.ref, args.rounds)
    if args.json:
        args.json.write_text(json.dumps({"ref": args.ref, "commit": commit, "job": job,
                                         "command": " ".join(sys.argv), "rounds": rounds,
                                         "summary": summary}, indent=1))
    return 1 if any("error" in e["ref"] or "error" in e["tree"] for e in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
