"""Eager training step of a random Hugging Face Llama through each way of getting dash attention.

    python bench/provider_step.py [--out DIR] [--steps 20] [--warmup 5] [--seq 4096] ...
    python bench/provider_step.py --smoke --out DIR   # tiny shapes, one step; runs on the CPU too
    python bench/provider_step.py --profile ...       # also each variant's costliest kernels

One step is forward, backward (loss from ``labels``) and AdamW, timed with CUDA events (the median
of ``--steps`` after ``--warmup``), in four variants:

- SDPA, determinism off: ``attn_implementation="sdpa"``, PyTorch's own kernels at full speed;
- SDPA, determinism on: the same under ``torch.use_deterministic_algorithms(True)``;
- DASH provider, determinism on: the same, with "DASH" activated as SDPA's flash backend;
- HF "dash", determinism on: ``attn_implementation="dash"``.

Each row also says how many attention calls dash ran per step, by integration
(``dash_inductor.integrations``' counts: the provider counts forward and backward calls, "hf" the
forward calls), so that a row cannot claim dash's speed without dash having run. Writes
provider_step.json and provider_step.md to ``--out`` (default
bench/results/<date>-<gpu>-<commit>/).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dash_inductor  # noqa: E402
import outdir  # noqa: E402
from methods import determinism, top_kernels  # noqa: E402
from dash_inductor import integrations  # noqa: E402
from dash_inductor.ops.shared import native  # noqa: E402
from dash_inductor.library import op as library

#: name -> (attn_implementation, deterministic algorithms, "DASH" provider active)
VARIANTS = {
    "SDPA, determinism off": ("sdpa", False, False),
    "SDPA, determinism on": ("sdpa", True, False),
    "DASH provider, determinism on": ("sdpa", True, True),
    'HF "dash", determinism on': ("dash", True, False),
}
BASELINE = "SDPA, determinism off"
GIB = 1024 ** 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for provider_step.json and "
                        "provider_step.md (default bench/results/<date>-<gpu>-<commit>)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, one timed step, on the CPU when there is no GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per variant: its costliest kernels")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.kv_heads = 2, 64, 4, 2
        args.intermediate, args.vocab, args.seq, args.batch = 128, 128, 32, 2
        args.steps, args.warmup = 1, 1
    return args


def environment(device: str) -> dict[str, Any]:
    import transformers
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "dash_inductor": dash_inductor.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


@contextlib.contextmanager
def provider(active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    integrations.activate_provider()
    try:
        yield
    finally:
        integrations.deactivate_provider()


def make_model(args: argparse.Namespace, attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq, attn_implementation=attn)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return LlamaForCausalLM(config).to(device=args.device, dtype=dtype).train()


def timer(device: str) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of one call: CUDA events on the GPU, the wall clock on the CPU."""
    def cuda(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def cpu(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)

    return cuda if device == "cuda" else cpu


def run_variant(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Time one variant; the row says why when it did not run."""
    attn, deterministic, use_provider = VARIANTS[name]
    row: dict[str, Any] = {"variant": name, "attn_implementation": attn,
                           "deterministic": deterministic, "provider": use_provider}
    if use_provider and args.device != "cuda":
        return {**row, "status": "skipped",
                "reason": "the provider replaces SDPA's flash backend, which runs on CUDA only"}
    if use_provider and integrations.provider.registry() is None:
        return {**row, "status": "skipped",
                "reason": integrations.provider.missing_registry_message()}
    model = make_model(args, attn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    time_ms = timer(args.device)
    with determinism(deterministic), provider(use_provider):
        for _ in range(args.warmup):
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        integrations.reset_counts()
        times = [time_ms(step) for _ in range(args.steps)]
        plans = sorted({_plan(p) for p in library.last_plans()})
        counts = dict(integrations.routes.counts)  # of the timed steps, before a profiled one
        top = top_kernels(step, args.device)["top"] if args.profile else []
    dash_calls = {integration: n / args.steps
                  for (integration, reason), n in counts.items() if reason is None}
    plans = plans if dash_calls else []  # the plans kept are those of an earlier variant
    fallbacks = {f"{integration}: {reason}": n
                 for (integration, reason), n in counts.items() if reason is not None}
    row.update(status="ok", step_ms=statistics.median(times), step_ms_all=times,
               dash_calls_per_step=dash_calls, fallbacks=fallbacks, dash_plans=plans,
               top_kernels=top)
    if args.device == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    return row


def _plan(plan) -> str:
    """One launch plan as "op: kernel path, schedule (why not the fastest path)"."""
    text = f"{plan.op}: {plan.kernel}" + (f", {plan.schedule.name}" if plan.schedule else "")
    return text + (f" ({plan.kernel_reason})" if plan.kernel_reason else "")


def _calls(per_step: dict[str, float]) -> str:
    """``{"provider.forward": 4.0, ...}`` as "provider.forward 4, ...", or "none"."""
    return ", ".join(f"{name} {n:g}" for name, n in sorted(per_step.items())) or "none"


def render_markdown(env: dict[str, Any], args: argparse.Namespace,
                    rows: list[dict[str, Any]]) -> str:
    head_dim = args.hidden // args.heads
    dtype = "bf16" if args.device == "cuda" else "float32"
    lines = [
        '# Eager training step: SDPA, the "DASH" provider, attn_implementation="dash"', "",
        f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, transformers "
        f"{env['transformers']}, dash_inductor {env['dash_inductor']}, {env['date']}.", "",
        f"Random LlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"({args.kv_heads} KV heads), head dim {head_dim}, vocab {args.vocab}, {dtype}; batch "
        f"{args.batch} x {args.seq} tokens; forward, backward and AdamW, eager. Median of "
        f"{args.steps} steps after {args.warmup} warm-up steps"
        f"{', CUDA events' if args.device == 'cuda' else ''}.", "",
        "| variant | step ms | vs SDPA, determinism off | dash attention calls / step "
        "| peak memory GiB |",
        "|---|---|---|---|---|"]
    base = next((r.get("step_ms") for r in rows if r["variant"] == BASELINE), None)
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']}: {r.get('reason', '')} | | | |")
            continue
        ratio = f"{r['step_ms'] / base:.2f}x" if base else ""
        memory = f"{r['peak_memory_gib']:.2f}" if "peak_memory_gib" in r else ""
        calls = _calls(r["dash_calls_per_step"])
        if r["fallbacks"]:
            calls += f" (fallbacks: {r['fallbacks']})"
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {ratio} | {calls} | {memory} |")
    plans = [f"- {r['variant']}: " + "; ".join(r["dash_plans"]) for r in rows
             if r.get("dash_plans")]
    if plans:
        lines += ["", "What dash's launches ran (the latest plans of each variant):", "", *plans]
    for r in rows:
        if r.get("top_kernels"):
            lines += ["", f"Costliest kernels of one step, {r['variant']}:", "",
                      "| kernel | calls | ms |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['calls']} | {k['ms']:.2f} |" for k in r["top_kernels"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment(args.device)
    print(f"{env['device']}, torch {env['torch']}: {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, batch {args.batch} x {args.seq}")
    if args.device == "cuda":  # time steps with dash's C++ replayer, not while it loads beside them
        native.load(wait=True)
    rows = []
    for name in VARIANTS:
        try:
            row = run_variant(args, name)
        except Exception as error:  # record and go on
            row = {"variant": name, "status": "failed",
                   "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        rows.append(row)
        if args.device == "cuda":  # the variant's model and optimizer are gone: free their memory
            torch.cuda.empty_cache()
        print(f"  {name}: " + (f"{row['step_ms']:.1f} ms, dash calls per step: "
                               f"{_calls(row['dash_calls_per_step'])}" if row["status"] == "ok"
                               else f"{row['status']} ({row['reason']})"))
    directory = args.out or outdir.default_dir(env["device"], env["date"])
    directory.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = directory / "provider_step.json", directory / "provider_step.md"
    options = {key: str(value) if isinstance(value, Path) else value
               for key, value in vars(args).items()}
    json_path.write_text(json.dumps({"environment": env, "args": options, "rows": rows},
                                    indent=1))
    markdown_path.write_text(render_markdown(env, args, rows))
    command = " ".join(["python bench/provider_step.py", *(sys.argv[1:] if argv is None else argv)])
    outdir.record_command(directory, command, [json_path, markdown_path])
    print(f"wrote {json_path} and {markdown_path}")
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
