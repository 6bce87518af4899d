"""Host time of one attention forward+backward: what a training step pays per call on the host.

    python bench/host.py [--device cuda|cpu] [--calls 300] [--rounds 3] [--profile] [--out DIR]

A problem small enough that the GPU idles, (2, 16, 1024, 64) causal in bf16, so the host decides
the wall time (on the CPU, float32 and tiny shapes: a check of the script, not a measurement). Every method runs through its public entry and
``torch.autograd``: ``--calls`` forward+backward calls back to back without a sync; "host" is
the wall time of the loop over the calls, "done" the same after a final sync. The methods take
turns for ``--rounds`` rounds, and the median round is reported. Methods:

- ``sdpa_off`` / ``sdpa_on``: ``F.scaled_dot_product_attention``, determinism off / on;
- ``dash``: ``dash_inductor.attention``, determinism on;
- ``floor``: a ``torch.autograd.Function`` that allocates what dash's returns and gradients
  need and launches nothing: what a Python autograd function costs alone;
- ``dash_python`` (CUDA): ``dash`` without the C++ replayer (``ops/shared/native.cpp``): its
  Python autograd function and launches; ``dash_triton_launcher``: the same with the kernels
  launched by Triton's launcher instead of the CUDA driver calls of ``ops/shared/driver.py``;
- the same three through ``torch.compile``, each on a graph of its own (``compiled_*``; the
  rewrite puts ``dash.attention`` in ``compiled_dash``), and ``layers_*``: ``--layers`` attention
  calls in one compiled graph, each on inputs of its own, as a model's layers are;
- packed documents (4 of random length, 8192 tokens): ``varlen_attn`` determinism on, against
  ``dash_inductor.varlen_attention`` (CUDA only).

``--profile`` adds cProfile's functions with the most own time in dash's eager call;
``--launches`` (CUDA) the host time of each of dash's kernel launches alone, replayed with its
last arguments, by the driver and by Triton's launcher; ``--breakdown`` the host time of dash's
forward and backward ops called alone, as a compiled graph calls them, and (CUDA) of the
replayer's programs alone, on one input set and cycling through ``--layers`` sets.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

Call = Callable[[], None]
Setup = Callable[[], None] | None  # run before a method's timing, after the others'


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--launches", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="host µs of dash's ops and of the replayer's programs called alone")
    parser.add_argument("--no-compile", action="store_true", help="eager methods only")
    parser.add_argument("--layers", type=int, default=12,
                        help="attention calls in the layers_* methods' graph (default 12)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def _launcher(name: str | None, replay: bool = True) -> Call:
    """A setup that makes dash launch through ``name`` (None: the launcher in force now), from
    the C++ replayer or not, planning anew where that changes either."""
    from dash_inductor.ops import cache_clear
    from dash_inductor.ops.shared import launch, native

    wanted = name or launch.LAUNCHER
    replay = replay and native.ENABLED

    def setup() -> None:
        if replay:
            native.load(wait=True)
        if launch.LAUNCHER != wanted or native.ENABLED != replay:
            launch.LAUNCHER, native.ENABLED = wanted, replay
            cache_clear()
    return setup


def _dense_methods(device: str, compile_too: bool, layers: int
                   ) -> dict[str, tuple[bool, Call, Setup]]:
    """(determinism on, call, setup) by method name."""
    import torch
    import torch.nn.functional as F

    import dash_inductor

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = (2, 16, 1024, 64) if device == "cuda" else (1, 2, 64, 16)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def eager(fn) -> Call:
        return lambda: fn(q, k, v, is_causal=True).backward(grad)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty_like(q)
            ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:3], dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def floor(q, k, v, is_causal):
        return Floor.apply(q, k, v)

    dash = _launcher(None)
    methods = {"sdpa_off": (False, eager(F.scaled_dot_product_attention), None),
               "sdpa_on": (True, eager(F.scaled_dot_product_attention), None),
               "floor": (True, eager(floor), None),
               "dash": (True, eager(dash_inductor.attention), dash)}
    if device == "cuda":
        methods["dash_python"] = (True, eager(dash_inductor.attention), _launcher(None, False))
        methods["dash_triton_launcher"] = (True, eager(dash_inductor.attention),
                                           _launcher("triton", False))
    if compile_too:
        methods.update(_compiled_methods(shape, dtype, device, layers, dash))
    return methods


def _compiled_methods(shape: tuple[int, ...], dtype, device: str, layers: int, dash: Setup
                      ) -> dict[str, tuple[bool, Call, Setup]]:
    """SDPA determinism off and on, and dash (the rewrite of determinism on), through
    ``torch.compile``, each variant on a graph of its own (``methods.compile_own``):
    ``compiled_*`` one attention on the same inputs at every call, ``layers_*`` ``layers``
    attentions in one graph, each on inputs of its own as a model's layers are (a call's host
    time covers them all)."""
    import torch
    import torch.nn.functional as F

    import dash_inductor
    import methods as m

    sets = [tuple(torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                  for _ in range(3)) for _ in range(layers)]
    grads = [torch.randn(shape, device=device, dtype=dtype) for _ in range(layers)]

    def attend(*tensors):
        return [F.scaled_dot_product_attention(*tensors[i:i + 3], is_causal=True)
                for i in range(0, len(tensors), 3)]

    methods = {}
    for name, det in (("sdpa_off", False), ("sdpa_on", True), ("dash", True)):
        # dash.attention comes from the rewrite; the SDPA baselines run with it off.
        rewrite = "deterministic" if name == "dash" else "off"
        for prefix, count in (("compiled", 1), ("layers", layers)):
            inputs = [t for s in sets[:count] for t in s]
            compiled = m.compile_own(attend, f"{prefix}_{name}", dynamic=False)

            def call(c=compiled, inputs=inputs, count=count) -> None:
                torch.autograd.backward(c(*inputs), grads[:count])
            with dash_inductor.config.patch(rewrite=rewrite):
                torch.use_deterministic_algorithms(det)
                call()  # compiles under this method's settings
            methods[f"{prefix}_{name}"] = (det, call, dash if name == "dash" else None)
    return methods


def _varlen_methods(device: str) -> dict[str, tuple[bool, Call, Setup]]:
    import torch

    import dash_inductor

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    lengths = torch.tensor([1536, 2560, 1024, 3072])  # 8192 tokens, fixed for repeatability
    if device == "cpu":
        lengths //= 64
    cu = torch.zeros(5, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    cu = cu.to(device)
    max_len = int(lengths.max())
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens, heads, dim = int(lengths.sum()), 16 if device == "cuda" else 2, 128
    q, k, v = (torch.randn(tokens, heads, dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def call(fn) -> Call:
        return lambda: fn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0)).backward(grad)

    methods = {"varlen_dash": (True, call(dash_inductor.varlen_attention), _launcher(None))}
    if varlen_attn is not None and device == "cuda":
        methods["varlen_attn_on"] = (True, call(varlen_attn), None)
    return methods


def _time(device: str, det: bool, call: Call, setup: Setup, calls: int) -> tuple[float, float]:
    import torch

    torch.use_deterministic_algorithms(det)
    if setup is not None:
        setup()
    for _ in range(3):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter() - start
    return 1e6 * host / calls, 1e6 * done / calls


def _profile(det: bool, call: Call, setup: Setup, calls: int, count: int = 30) -> list[str]:
    import torch

    torch.use_deterministic_algorithms(det)
    setup()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:count]
    return [f"{1e6 * own / calls:8.1f} us own {1e6 * cum / calls:8.1f} us cum {n // calls:4d}x "
            f"{Path(path).name}:{line}({name})" for (path, line, name), (_, n, own, cum, _) in rows]


def main(argv: list[str] | None = None) -> int:
    import torch

    saved = torch.are_deterministic_algorithms_enabled()
    try:
        return _main(_parse(argv))
    finally:
        torch.use_deterministic_algorithms(saved)


def _launches(call: Call, calls: int, rounds: int) -> list[dict]:
    """Each launch slot of dash's forward and backward plans, replayed alone ``calls`` times a
    round with the arguments of its last launch, under each launcher: median host µs a launch."""
    import torch

    from dash_inductor.library.op import last_plans

    torch.use_deterministic_algorithms(True)
    restore, rows = _launcher(None), []
    for launcher in ("driver", "triton"):
        _launcher(launcher)()
        for _ in range(3):
            call()
        seen: dict[str, tuple] = {}
        plans = [plan for plan in last_plans()[-2:] if plan.launches is not None]
        for plan in plans:  # the bound launches are private: wrap them to see their arguments
            bound = plan.launches._bound
            for slot, launch in list(bound.items()):
                def spy(grid, args, launch=launch, slot=slot):
                    seen[slot] = (launch, grid, args)
                    launch(grid, args)
                bound[slot] = spy
        call()
        for plan in plans:
            for slot in plan.launches._bound:
                plan.launches._bound[slot] = seen[slot][0]
        for slot, (launch, grid, args) in seen.items():
            times = []
            for _ in range(rounds):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    launch(grid, args)
                times.append(1e6 * (time.perf_counter() - start) / calls)
            rows.append({"launcher": launcher, "slot": slot, "grid": list(grid),
                         "host_us": statistics.median(times), "host_us_rounds": times})
    restore()
    return rows


def _breakdown(device: str, calls: int, rounds: int, layers: int) -> list[dict]:
    """Where a compiled call's host time goes: host µs of dash's forward and backward ops called
    alone (as Inductor's graph calls them: the dispatcher, the op's Python kernel, the replay),
    and on CUDA of the replayer's programs alone, each on one input set and cycling through
    ``layers`` sets (new addresses at every call, as a model's layers give)."""
    import torch

    import dash_inductor
    from dash_inductor.library import signatures
    from dash_inductor.library.op import op_options
    from dash_inductor.ops.shared import native

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = (2, 16, 1024, 64) if device == "cuda" else (1, 2, 64, 16)
    torch.use_deterministic_algorithms(True)
    _launcher(None)()
    choices = dash_inductor.config.choices()
    options = op_options(choices)
    sets = [[torch.randn(shape, device=device, dtype=dtype) for _ in range(4)]
            for _ in range(layers)]
    with torch.no_grad():
        for t in sets:  # out and logsumexp; the signature's programs recorded (third call on)
            for _ in range(3):
                t[4:] = torch.ops.dash.attention(*t[:3], None, 0.0, True, **options)
                torch.ops.dash.attention_backward(t[3], *t[:3], *t[4:], None, True, None, False,
                                                  **options)
    flags = (True, None, False, tuple(options["window_size"]))
    signature = signatures.lookup(signatures.key(*sets[0][:3], flags, tuple(choices.values())))
    module = native.loaded()
    handle = signature.handle if signature is not None and module is not None else -1
    steps = {
        "op forward": lambda t: torch.ops.dash.attention(*t[:3], None, 0.0, True, **options),
        "op backward": lambda t: torch.ops.dash.attention_backward(
            t[3], *t[:3], *t[4:], None, True, None, False, **options)}
    if handle >= 0:
        steps["replayed forward program"] = lambda t: module.run_forward(handle, *t[:3])
        steps["replayed backward program"] = lambda t: module.run_backward(handle, t[3], *t[:3],
                                                                           *t[4:])
    rows = []
    with torch.no_grad():
        for name, step in steps.items():
            for cycle in (sets[:1], sets):
                times = []
                for _ in range(rounds):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    for i in range(calls):
                        step(cycle[i % len(cycle)])
                    times.append(1e6 * (time.perf_counter() - start) / calls)
                rows.append({"step": name, "input_sets": len(cycle),
                             "host_us": statistics.median(times), "host_us_rounds": times})
    return rows


def _main(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    methods = _dense_methods(device, not args.no_compile, args.layers)
    methods.update(_varlen_methods(device))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, (det, call, setup) in methods.items():
            samples[name].append(_time(device, det, call, setup, args.calls))
    rows = []
    for name, runs in samples.items():
        host = statistics.median(r[0] for r in runs)
        done = statistics.median(r[1] for r in runs)
        rows.append({"method": name, "host_us": host, "done_us": done,
                     "host_us_rounds": [r[0] for r in runs]})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    import triton

    print(f"{name}, torch {torch.__version__}, Triton {triton.__version__}, {args.calls} calls, "
          f"median of {args.rounds} rounds")
    print(f"{'method':<22}{'host us/call':>14}{'done us/call':>14}")
    for row in rows:
        print(f"{row['method']:<22}{row['host_us']:>14.1f}{row['done_us']:>14.1f}")
    profile = _profile(*methods["dash"], calls=min(args.calls, 100)) if args.profile else []
    for line in profile:
        print(line)
    launches = (_launches(methods["dash"][1], args.calls, args.rounds)
                if args.launches and device == "cuda" else [])
    for row in launches:
        print(f"{row['launcher']:<8}{row['slot']:<14}{str(row['grid']):<12}"
              f"{row['host_us']:>8.1f} us a launch alone")
    breakdown = (_breakdown(device, args.calls, args.rounds, args.layers) if args.breakdown
                 else [])
    for row in breakdown:
        print(f"{row['step']:<28}{row['input_sets']:>3} input sets{row['host_us']:>9.1f} us a call")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__,
             "calls": args.calls, "rounds": args.rounds, "layers": args.layers,
             "own_graphs": True, "rows": rows, "profile": profile, "launches": launches,
             "breakdown": breakdown},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
