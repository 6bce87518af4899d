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
- determinism off: plain PyTorch;
- with ``--control``, determinism on in warn-only mode, where SDPA keeps cuDNN's backward: what
  deterministic mode costs the rest of the model (dash's share of a gap is dash / this).

Every variant is compiled and warmed up first, then the variants take turns for ``--rounds``
rounds of ``--steps`` steps each, so that the host's and the GPU's drift reaches them alike
(each variant compiles its own graph: ``methods.compile_own``). It prints and writes the median
step time (each step synchronised alone), the time and host time a step of steps run back to
back (median over rounds; each round's in the JSON), each variant's peak memory a step beyond
what stays allocated, and the peak memory of one attention forward+backward alone (dash against
SDPA: dash adds no N x N buffer, only O(N*d) for the fp32 dQ accumulator and the tickets). The
target is dash <= 1.05x the determinism-off step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
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

#: name -> (deterministic algorithms, warn only, dash_inductor.config.rewrite)
VARIANTS = {
    "dash (determinism on)": (True, False, "deterministic"),
    "SDPA (determinism on)": (True, False, "off"),
    "determinism off": (False, False, "off"),
}
#: With ``--control``: deterministic algorithms in warn-only mode, where SDPA keeps cuDNN's
#: non-deterministic backward while the rest of the model pays what deterministic mode costs it
#: (Inductor's deterministic lowerings, the NaN fill of new tensors).
CONTROL = {"determinism on, cuDNN attention": (True, True, "off")}


def variants(control: bool) -> dict[str, tuple[bool, bool, str]]:
    """The variants a run times: :data:`VARIANTS`, and :data:`CONTROL` with ``--control``."""
    return {**VARIANTS, **(CONTROL if control else {})}

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


class Variant:
    """One variant's compiled model, optimizer and batch, and its timings so far."""

    def __init__(self, cfg: DemoConfig, name: str, mode: str, optimize: bool) -> None:
        self.name, self.mode = name, mode
        self.deterministic, self.warn_only, self.rewrite = variants(True)[name]
        self.model = make_model(cfg)
        self.compiled = m.compile_own(self.model, name,
                                      mode=None if mode == "default" else mode)
        self.optimizer = (torch.optim.AdamW(self.model.parameters(), lr=1e-4) if optimize
                          else None)
        generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
        self.tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=cfg.device,
                                    generator=generator)
        self.times: list[float] = []
        self.back_to_back: list[tuple[float, float]] = []
        self.peak = 0.0

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """The variant's determinism and rewrite setting, under which it compiled and runs."""
        with m.determinism(self.deterministic, self.warn_only), warnings.catch_warnings(), \
                dash_inductor.config.patch(rewrite=self.rewrite), quiet_cache_key_warnings():
            if self.warn_only:  # the control's non-deterministic ops warn at every call
                warnings.simplefilter("ignore", UserWarning)
            yield

    def train(self) -> None:
        if self.mode == "reduce-overhead":  # a new iteration: the previous graphs' outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        self.compiled(self.tokens).backward()
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def step(self) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.train()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def warm_up(self, steps: int) -> int | None:
        """Compile and run ``steps`` steps; the number of attention calls rewritten (None
        without the rewrite)."""
        with self.settings():
            if self.rewrite == "off":
                for _ in range(steps):
                    self.step()
                return None
            with recorded_sites() as sites:  # the first step compiles: record the rewrite
                self.step()
            for _ in range(steps - 1):
                self.step()
        return describe_sites(sites)[0]

    def run_round(self, steps: int) -> None:
        """``steps`` steps synchronised alone, then ``steps`` back to back."""
        with self.settings():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.times += [self.step() for _ in range(steps)]
            self.peak = max(self.peak, (torch.cuda.max_memory_allocated() - base) / GIB)
            self.back_to_back.append(time_back_to_back(self.train, steps))

    def result(self, profile: bool) -> dict[str, Any]:
        with self.settings():
            kernels = m.top_kernels(self.train, "cuda", count=15) if profile else None
        return {"step_ms": 1e3 * statistics.median(self.times),
                "step_ms_all": [1e3 * t for t in self.times], "step_peak_gib": self.peak,
                "back_to_back_ms": statistics.median(b for b, _ in self.back_to_back),
                "host_ms": statistics.median(h for _, h in self.back_to_back),
                "back_to_back_ms_rounds": [b for b, _ in self.back_to_back],
                "kernels": kernels}


def time_variants(cfg: DemoConfig, mode: str, args: argparse.Namespace,
                  bar: ProgressBar) -> list[dict[str, Any]]:
    """Every variant compiled and warmed up, then timed in ``args.rounds`` rounds in which the
    variants take turns, so that a drift of the host or the GPU reaches them alike."""
    rows, running = {}, []

    def failed(name: str, error: Exception) -> None:  # record and go on without the variant
        rows[name]["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        bar.update(f"N={cfg.seq} {mode} {name}: FAILED")

    for name in variants(args.control):
        rows[name] = {"seq": cfg.seq, "batch": cfg.batch, "mode": mode, "variant": name}
        try:
            variant = Variant(cfg, name, mode, optimize=not args.no_optimizer)
            rows[name]["rewritten"] = variant.warm_up(args.warmup)
            running.append(variant)
            bar.update(f"N={cfg.seq} B={cfg.batch} {mode} {name}: compiled")
        except Exception as error:
            failed(name, error)
    for _ in range(args.rounds):
        for variant in list(running):
            try:
                variant.run_round(args.steps)
            except Exception as error:
                failed(variant.name, error)
                running.remove(variant)
    for variant in running:
        rows[variant.name].update(variant.result(args.profile))
    del running
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return list(rows.values())


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
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps a variant takes in each round (median reported)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds in which the variants take turns")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles)")
    parser.add_argument("--control", action="store_true",
                        help="also time determinism on in warn-only mode with SDPA's cuDNN "
                             "attention: deterministic mode's cost to the rest of the model")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per variant: its costliest kernels")
    parser.add_argument("--no-nan-fill", action="store_true",
                        help="torch.utils.deterministic.fill_uninitialized_memory = False: "
                             "determinism on without PyTorch filling every new tensor with NaN")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.layers, args.steps, args.warmup, args.rounds = "2048", 2, 3, 2, 1
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
    bar = ProgressBar(len(seqs) * len(modes) * len(variants(args.control)), "step")
    for seq in seqs:
        cfg = DemoConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq=seq,
                         batch=args.batch or max(args.tokens // seq, 1), steps=args.steps,
                         vocab=args.vocab, kv_group=args.gqa, device="cuda",
                         dtype=torch.bfloat16)
        for mode in modes:
            rows += time_variants(cfg, mode, args, bar)
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
    print("\nCompiled training step: median ms (x determinism off), peak memory a step beyond "
          "what stays allocated between steps")
    by = {(_case(r), r["variant"]): r for r in rows}
    for case in dict.fromkeys(_case(r) for r in rows):
        off = by.get((case, "determinism off"), {}).get("step_ms")
        cells = []
        for name in dict.fromkeys(r["variant"] for r in rows):
            r = by.get((case, name), {})
            if r.get("error"):
                cells.append(f"{name}: error ({r['error']})")
                continue
            ratio = f" ({r['step_ms'] / off:.2f}x)" if off else ""
            sites = f", {r['rewritten']} attention calls rewritten" if r.get("rewritten") is not None \
                else ""
            kernels = f", kernels {r['kernels']['total_ms']:.1f} ms" if r.get("kernels") else ""
            cells.append(f"{name}: {r['step_ms']:.1f} ms{ratio}, peak {r['step_peak_gib']:.2f} GiB"
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
             ""]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines += ["| N | B | mode | " + " | ".join(names) + " | dash / off | SDPA on / off |",
              "|---|---|---|" + "---|" * (len(names) + 2)]
    by = {(_case(r), r["variant"]): r for r in rows}
    for case in dict.fromkeys(_case(r) for r in rows):
        cells, times = [], {}
        for name in names:
            r = by.get((case, name), {})
            times[name] = r.get("step_ms")
            cells.append("error" if r.get("error") else
                         f"{r['step_ms']:.1f} ms, {r['step_peak_gib']:.1f} GiB")
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
