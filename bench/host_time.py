"""Host time of one ``dash_inductor.attention`` forward and backward, on a problem small enough
that the device is idle: what a training step pays per attention call before its kernels run.

    python bench/host_time.py [--device cuda|cpu] [--calls 50] [--profile] [--out DIR]

A compiled 12-layer step at N = 4096 (bench/step.py --profile) is host-bound with dash: its
kernels take 55.5 ms of a 68.2 ms step (docs/benchmarks.md). This times the host side alone:
the mean wall time of a call until it returns ("host") and until the device is done ("done"),
for each kernel path the device has, and with ``--profile`` the functions of ``dash_inductor``
(and Triton's launcher) that take the most cumulative time under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dash_inductor  # noqa: E402
import outdir  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(device: str, kernel: str, calls: int,
               causal: bool = True) -> tuple[dict[str, Any], Callable[[], None]]:
    """Mean host and done milliseconds of ``calls`` forward+backward calls (after a warm-up), and
    the call itself (to profile)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 2, 256, 64, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)

    def call() -> None:
        dash_inductor.attention(q, k, v, is_causal=causal, kernel=kernel).backward(grad_out)

    for _ in range(5):
        call()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    _sync(device)
    done = time.perf_counter() - start
    return {"device": device, "kernel": kernel, "calls": calls, "host_ms": 1e3 * host / calls,
            "done_ms": 1e3 * done / calls}, call


def profile_calls(call: Callable[[], None], calls: int, count: int = 25) -> list[dict[str, Any]]:
    """The ``count`` functions of dash_inductor, its kernels' launchers and Triton's runtime with
    the most cumulative time over ``calls`` calls."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    rows = []
    for (path, line, name), (_, ncalls, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        if any(part in path for part in ("dash_inductor", "/ops/", "triton/runtime")):
            rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": ncalls,
                         "ms_per_call": 1e3 * cumulative / calls})
    return sorted(rows, key=lambda r: r["ms_per_call"], reverse=True)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also cProfile the calls")
    parser.add_argument("--out", type=Path, help="folder for host_time.json (default "
                                                 "bench/results/<date>-<gpu>-<commit>)")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    kernels = ("auto", "portable") if args.device == "cuda" else ("auto",)
    rows = []
    for kernel in kernels:
        row, call = time_calls(args.device, kernel, args.calls)
        if args.profile:
            row["profile"] = profile_calls(call, args.calls)
        rows.append(row)
        print(f"{args.device} kernel={kernel}: host {row['host_ms']:.3f} ms a forward+backward, "
              f"done {row['done_ms']:.3f} ms")
        for entry in row.get("profile", [])[:12]:
            print(f"  {entry['ms_per_call']:7.3f} ms  {entry['calls']:5d}  {entry['function']}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    directory = args.out or outdir.default_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "host_time.json"
    path.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows},
                               indent=1))
    command = " ".join(["python bench/host_time.py", *(sys.argv[1:] if argv is None else argv)])
    outdir.record_command(directory, command, [path])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
