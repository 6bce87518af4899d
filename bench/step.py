"""End-to-end benchmark: one compiled GPT training step with determinism on (dash), on (SDPA), off.

    python bench/step.py [--quick] [--out DIR] [--seqs 2048,4096,8192] [--layers 12] ...
    python bench/step.py --seqs 4096 --batch 2 --no-optimizer --modes default,reduce-overhead

A GPT-style model (12 layers, d_model 1024, 16 heads, causal SDPA, bf16, B*N = 16k tokens, or
``--batch`` sequences a step) is compiled with torch.compile (``--modes``: "default", and
"reduce-overhead" for CUDA graphs) and trained with AdamW (none with ``--no-optimizer``) in three
variants (``--no-nan-fill``: determinism on without PyTorch's NaN fill of every new tensor,
``torch.utils.deterministic``):

- dash: ``torch.use_deterministic_algorithms(True)``; the Inductor pass puts dash.attention in place
  of SDPA (the number of rewritten calls is printed);
- SDPA, determinism on: the same, with ``dash_inductor.config.rewrite = "off"`` (PyTorch's own
  deterministic attention backward);
- determinism off: plain PyTorch.

It prints and writes the median step time (each step synchronised alone), the time and host time
a step of steps run back to back, and the peak memory of each, and the peak memory
of one attention forward+backward alone (dash against SDPA: dash adds no N x N buffer, only O(N*d)
for the fp32 dQ accumulator and the tickets). The target is dash <= 1.05x the determinism-off step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dash_inductor  # noqa: E402
import methods as m  # noqa: E402
import outdir  # noqa: E402
from dash_inductor.demo.cli import (ProgressBar, describe_sites, quiet_cache_key_warnings,  # noqa: E402
                                    recorded_sites)
from dash_inductor.demo.tiny_gpt import DemoConfig, make_model  # noqa: E402
from dash_inductor.ops.shared import native  # noqa: E402

#: name -> (deterministic algorithms, dash_inductor.config.rewrite)
VARIANTS = {
    "dash (determinism on)": (True, "deterministic"),
    "SDPA (determinism on)": (True, "off"),
    "determinism off": (False, "off"),
}
GIB = 1024 ** 3


def time_back_to_back(train: Any, steps: int) -> tuple[float, float]:
    """(ms a step, host ms a step) over ``steps`` steps run back to back, without the sync that
    separates the timed steps: a host time below the step time means the host keeps ahead of the
    device, one close to it that the device waits for the host."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / steps, 1e3 * host / steps


def time_training(cfg: DemoConfig, deterministic: bool, rewrite: str, warmup: int,
                  record_sites: bool, profile: bool = False, mode: str = "default",
                  optimize: bool = True) -> dict[str, Any]:
    """Compile (in ``mode``) and train ``cfg``'s model; median step time after ``warmup`` steps,
    peak memory, and with ``profile`` the kernels with the most device time in one more step."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    model = make_model(cfg)
    compiled = torch.compile(model, mode=None if mode == "default" else mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimize else None
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=cfg.device,
                           generator=generator)

    def train() -> None:
        compiled(tokens).backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        train()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    sites: list[Any] = []
    with m.determinism(deterministic), dash_inductor.config.patch(rewrite=rewrite), \
            quiet_cache_key_warnings():
        if record_sites:  # the first step compiles: record what the rewrite does there
            with recorded_sites() as sites:
                step()
        for _ in range(warmup - int(record_sites)):
            step()
        torch.cuda.reset_peak_memory_stats()
        times = [step() for _ in range(cfg.steps)]
        peak = torch.cuda.max_memory_allocated() / GIB
        back_to_back_ms, host_ms = time_back_to_back(train, cfg.steps)
        kernels = m.top_kernels(train, "cuda", count=15) if profile else None
    rewritten, _ = describe_sites(sites) if record_sites else (None, [])
    result = {"step_ms": 1e3 * statistics.median(times), "step_ms_all": [1e3 * t for t in times],
              "peak_memory_gib": peak, "back_to_back_ms": back_to_back_ms, "host_ms": host_ms,
              "rewritten": rewritten, "kernels": kernels}
    return result


def attention_memory(seq: int, cfg: DemoConfig) -> list[dict[str, Any]]:
    """Peak memory of one causal attention forward+backward beyond its inputs, per method."""
    head_dim = cfg.d_model // cfg.heads
    problem = m.Problem(cfg.batch, cfg.heads, cfg.heads, seq, head_dim, True, cfg.dtype)
    inputs = m.make_inputs(problem)
    q, k, v, grad_out = inputs
    qkv_bytes = q.numel() * q.element_size()
    rows = []
    for method in (m.SDPA_OFF, m.SDPA_ON, m.DASH_AUTO):
        row: dict[str, Any] = {"seq": seq, "method": method.title}
        try:
            prepared = m.prepare(method, problem, inputs)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with prepared.mode():
                prepared.forward(q, k, v).backward(grad_out)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            row.update(backend=prepared.backend, extra_mib=extra / 2 ** 20,
                       extra_over_q_size=extra / qkv_bytes)
        except Exception as error:  # record and go on
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        for t in (q, k, v):
            t.grad = None
        rows.append(row)
    del inputs, q, k, v, grad_out
    torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N = 2048, 2 layers, 3 timed steps")
    parser.add_argument("--out", type=Path,
                        help="folder for step.json and step.md (default "
                             "bench/results/<date>-<gpu>-<commit>)")
    parser.add_argument("--json", type=Path, help="write the results here instead")
    parser.add_argument("--markdown", type=Path, help="write the tables here instead, as markdown")
    parser.add_argument("--seqs", default="2048,4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--tokens", type=int, default=16384, help="B * N per step (default 16384)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences a step (default: --tokens / N)")
    parser.add_argument("--modes", default="default",
                        help="comma-separated torch.compile modes: default, reduce-overhead")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the attention-alone peak memory measurement")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="backward only, no AdamW step: the attention's share of a step")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--gqa", type=int, default=1,
                        help="query heads per KV head in every other layer (default 1: no GQA)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per variant: its costliest kernels")
    parser.add_argument("--no-nan-fill", action="store_true",
                        help="torch.utils.deterministic.fill_uninitialized_memory = False: "
                             "determinism on without PyTorch filling every new tensor with NaN")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.layers, args.steps, args.warmup = "2048", 2, 3, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    from run import environment

    dash_inductor.enable()
    native.load(wait=True)  # time the C++ replayer, not the calls before it has built
    torch.utils.deterministic.fill_uninitialized_memory = not args.no_nan_fill
    env = environment()
    seqs = [int(x) for x in args.seqs.split(",")]
    modes = args.modes.split(",")
    print(f"{env['gpu']}, torch {env['torch']}, Triton {env['triton']}: {args.layers} layers, "
          f"d_model {args.d_model}, {args.heads} heads, bf16, modes {modes}")
    rows, memory = [], []
    bar = ProgressBar(len(seqs) * len(modes) * len(VARIANTS), "step")
    for seq in seqs:
        cfg = DemoConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq=seq,
                         batch=args.batch or max(args.tokens // seq, 1), steps=args.steps,
                         vocab=args.vocab, kv_group=args.gqa, device="cuda",
                         dtype=torch.bfloat16)
        for mode in modes:
            for name, (deterministic, rewrite) in VARIANTS.items():
                row: dict[str, Any] = {"seq": seq, "batch": cfg.batch, "mode": mode,
                                       "variant": name}
                try:
                    row.update(time_training(cfg, deterministic, rewrite, args.warmup,
                                             record_sites=rewrite != "off", profile=args.profile,
                                             mode=mode, optimize=not args.no_optimizer))
                    note = f"N={seq} B={cfg.batch} {mode} {name}: {row['step_ms']:.1f} ms"
                except Exception as error:  # record and go on
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                    note = f"N={seq} {mode} {name}: FAILED"
                rows.append(row)
                bar.update(note)
        if not args.no_memory:
            memory += attention_memory(seq, cfg)
    print_results(rows, memory)
    directory = args.out or outdir.default_dir(env["gpu"], env["date"])
    markdown_path = args.markdown or directory / "step.md"
    json_path = args.json or directory / "step.json"
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(render_markdown(env, args, rows, memory))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    options = {key: str(value) if isinstance(value, Path) else value
               for key, value in vars(args).items()}
    json_path.write_text(json.dumps({"environment": env, "args": options, "steps": rows,
                                     "attention_memory": memory}, indent=1))
    if not (args.json and args.markdown):
        command = " ".join(["python bench/step.py", *(sys.argv[1:] if argv is None else argv)])
        outdir.record_command(directory, command, [json_path, markdown_path])
    print(f"wrote {json_path} and {markdown_path}")
    return 0


def print_results(rows: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    print("\nCompiled training step: median ms (x determinism off), peak memory GiB")
    by = {(_case(r), r["variant"]): r for r in rows}
    for case in dict.fromkeys(_case(r) for r in rows):
        off = by.get((case, "determinism off"), {}).get("step_ms")
        cells = []
        for name in VARIANTS:
            r = by.get((case, name), {})
            if r.get("error"):
                cells.append(f"{name}: error ({r['error']})")
                continue
            ratio = f" ({r['step_ms'] / off:.2f}x)" if off else ""
            sites = f", {r['rewritten']} attention calls rewritten" if r.get("rewritten") is not None \
                else ""
            kernels = f", kernels {r['kernels']['total_ms']:.1f} ms" if r.get("kernels") else ""
            cells.append(f"{name}: {r['step_ms']:.1f} ms{ratio}, {r['peak_memory_gib']:.2f} GiB"
                         f"{sites}{kernels}; back to back {r['back_to_back_ms']:.1f} ms a step, "
                         f"host {r['host_ms']:.1f}")
        print(f"N={case[0]}, B={case[1]}, {case[2]}:\n  " + "\n  ".join(cells))
    print("\nOne causal attention forward+backward: peak memory beyond its inputs")
    for r in memory:
        if r.get("error"):
            print(f"  N={r['seq']} {r['method']}: error ({r['error']})")
        else:
            print(f"  N={r['seq']} {r['method']} [{r['backend']}]: {r['extra_mib']:.0f} MiB "
                  f"({r['extra_over_q_size']:.2f} x the size of q)")


def _case(row: dict[str, Any]) -> tuple[int, int, str]:
    return row["seq"], row["batch"], row["mode"]


def render_markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]],
                    memory: list[dict[str, Any]]) -> str:
    lines = [f"Measured on {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, CUDA "
             f"{env['cuda']}, {env['date']}: {args.layers} layers, d_model {args.d_model}, "
             f"{args.heads} heads, bf16, " + ("no optimizer" if args.no_optimizer else "AdamW")
             + (", determinism without the NaN fill of new tensors." if args.no_nan_fill else "."),
             "",
             "| N | B | mode | " + " | ".join(VARIANTS) + " | dash / off | SDPA on / off |",
             "|---|---|---|" + "---|" * (len(VARIANTS) + 2)]
    by = {(_case(r), r["variant"]): r for r in rows}
    for case in dict.fromkeys(_case(r) for r in rows):
        cells, times = [], {}
        for name in VARIANTS:
            r = by.get((case, name), {})
            times[name] = r.get("step_ms")
            cells.append("error" if r.get("error") else
                         f"{r['step_ms']:.1f} ms, {r['peak_memory_gib']:.1f} GiB")
        off = times["determinism off"]
        ratios = [f"{times[n] / off:.2f}" if times[n] and off else "—"
                  for n in ("dash (determinism on)", "SDPA (determinism on)")]
        lines.append("| " + " | ".join(map(str, case)) + " | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Back to back (no sync between steps): ms a step, and the host's ms a step.", "",
              "| N | B | mode | variant | ms a step | host ms a step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['batch']} | {r['mode']} | {r['variant']} | "
              f"{r['back_to_back_ms']:.1f} | {r['host_ms']:.1f} |"
              for r in rows if not r.get("error")]
    for r in rows:
        if r.get("kernels"):
            lines += ["", f"Costliest kernels of one step, N = {r['seq']}, {r['variant']} (all "
                      f"kernels: {r['kernels']['total_ms']:.1f} ms of device time):", "",
                      "| kernel | calls | ms |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.2f} |"
                      for k in r["kernels"]["top"]]
    lines += ["", "Peak memory of one causal attention forward+backward beyond its inputs:", "",
              "| N | method | backend | extra MiB | / size of q |", "|---|---|---|---|---|"]
    for r in memory:
        if r.get("error"):
            lines.append(f"| {r['seq']} | {r['method']} | error: {r['error'][:80]} | | |")
        else:
            lines.append(f"| {r['seq']} | {r['method']} | {r['backend']} | {r['extra_mib']:.0f} | "
                         f"{r['extra_over_q_size']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
