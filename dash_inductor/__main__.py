"""``python -m dash_inductor {demo,bench,info}``: the command line (argument parsing only)."""

from __future__ import annotations

import argparse
import os
import platform
import runpy
import sys
from pathlib import Path
from typing import Callable, Sequence

#: The demo's size flags; their defaults are DemoConfig's.
DEMO_SIZE_FLAGS = ("layers", "d_model", "heads", "seq", "batch", "steps")


def _parser() -> argparse.ArgumentParser:
    from dash_inductor.demo.tiny_gpt import CUDA_DEFAULTS, DemoConfig

    parser = argparse.ArgumentParser(prog="python -m dash_inductor",
                                     description="Fast, bitwise-reproducible attention for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small GPT under torch.compile, twice per way: on a GPU with "
                     "determinism off, with SDPA under determinism and with dash (bits and step "
                     "times), on a CPU with dash (the rewrite and the bits)")
    for name in DEMO_SIZE_FLAGS:
        demo.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                          help=f"default {getattr(DemoConfig, name)} on CPU, "
                               f"{CUDA_DEFAULTS[name]} on CUDA")
    demo.add_argument("--device", default=None,
                      help="cpu or cuda (default: cuda when available, else cpu)")
    demo.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="default float32 on CPU, bfloat16 on CUDA")
    demo.add_argument("--seed", type=int, default=0)
    commands.add_parser(
        "bench", help="the benchmark grid runner (bench/run.py of a source checkout); the "
                      "arguments that follow go to it (try: bench --help); bench --packed ARGS "
                      "runs bench/packed.py (packed documents and sliding windows) instead")
    commands.add_parser("info", help="versions, device, config, available kernels and schedules")
    return parser


def _demo(args: argparse.Namespace) -> int:
    import torch

    from dash_inductor.demo.cli import run_demo
    from dash_inductor.demo.tiny_gpt import CUDA_DEFAULTS, DemoConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        on_cuda = torch.device(device).type == "cuda"
    except RuntimeError:
        print(f"error: --device must be cpu or cuda[:N], got {device!r}", file=sys.stderr)
        return 2
    if on_cuda and (torch.device(device).index or 0) >= torch.cuda.device_count():
        print(f"error: --device {device}, but this torch ({torch.__version__}) sees "
              f"{torch.cuda.device_count()} CUDA devices; --device cpu runs the demo on the CPU",
              file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bfloat16" if on_cuda else "float32")
    sizes = {name: getattr(args, name) for name in DEMO_SIZE_FLAGS
             if getattr(args, name) is not None}
    try:
        cfg = DemoConfig(**{**(CUDA_DEFAULTS if on_cuda else {}), **sizes}, seed=args.seed,
                         device=device, dtype=getattr(torch, dtype_name))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_demo(cfg)


def bench_script() -> Path | None:
    """bench/run.py beside the package when it is installed from a source checkout."""
    script = Path(__file__).resolve().parent.parent / "bench" / "run.py"
    return script if script.is_file() else None


def _bench(bench_args: Sequence[str]) -> int:
    script = bench_script()
    if script is None:
        print("bench/run.py ships with the source, not the package: clone the repository, "
              "install it with `pip install -e .[bench]`, then run `python bench/run.py --help`.")
        return 2
    if bench_args[:1] == ["--packed"]:
        script, bench_args = script.with_name("packed.py"), bench_args[1:]
    saved = sys.argv
    sys.argv = [str(script), *bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def info_lines() -> list[str]:
    """What ``info`` prints: versions, device, config, kernels, schedules, and in a running
    process the plans of the latest forward and backward launches."""
    import torch

    import dash_inductor
    from dash_inductor import config

    lines = [f"dash_inductor {dash_inductor.__version__}",
             f"python {platform.python_version()}, torch {torch.__version__}, "
             f"triton {_version_of('triton')}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"device: {props.name} (sm_{props.major}{props.minor}, "
                     f"{props.multi_processor_count} SMs)")
        kernels = "Triton kernels (CUDA)"
    else:
        lines.append("device: cpu (no CUDA device visible)")
        kernels = ("PyTorch reference on CPU" if config.get("cpu_backend") == "reference"
                   else "Triton kernels through the interpreter (TRITON_INTERPRET="
                        f"{os.environ.get('TRITON_INTERPRET', 'unset')})")
    lines.append(f"kernels: {kernels}; {_ops_status()}")
    options = ", ".join(f"{name}={config.get(name)!r}"
                        for name in (*config.CHOICES, "rewrite"))
    lines.append(f"config: {options}")
    lines.append(f"schedules: {', '.join(config.SCHEDULES)} "
                 f"(deterministic: {', '.join(config.DETERMINISTIC_SCHEDULES)})")
    lines.append(f"rewrite: {_rewrite_status()}; deterministic algorithms now "
                 f"{'on' if torch.are_deterministic_algorithms_enabled() else 'off'}")
    from dash_inductor.library.op import last_plans

    lines += [f"last launch: {plan}" for plan in last_plans()[-2:]]
    return lines


def _version_of(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _ops_status() -> str:
    try:
        from dash_inductor import ops
    except Exception as error:  # report why the kernels cannot load, whatever it is
        return f"dash_inductor.ops cannot be imported ({type(error).__name__}: {error})"
    return f"dash_inductor.ops provides {', '.join(ops.__all__)}"


def _rewrite_status() -> str:
    try:
        from dash_inductor.inductor import rewrite
    except Exception as error:  # report why the pass cannot load, whatever it is
        return f"the Inductor pass cannot be imported ({type(error).__name__}: {error})"
    return ("Inductor pass installed" if rewrite.installed() else
            "Inductor pass not installed (call dash_inductor.enable())")


def _info(_: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"demo": _demo, "info": _info}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after "bench" belongs to bench/run.py (or packed.py)
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
