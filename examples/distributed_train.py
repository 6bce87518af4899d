"""Bitwise-reproducible distributed training with dash: DDP, FSDP2, tensor parallel + FSDP2.

    torchrun --nproc-per-node 2 examples/distributed_train.py                # 2 GPUs (nccl), dash
    torchrun --nproc-per-node 2 examples/distributed_train.py --sdpa         # PyTorch's SDPA
    torchrun --nproc-per-node 2 examples/distributed_train.py --device cpu --modes ddp --steps 2

The package's small GPT (``dash_inductor.demo.tiny_gpt``: causal SDPA, grouped-query attention in every
other layer, q, k and v projected separately) is compiled and trained under
``torch.use_deterministic_algorithms(True)``, so dash_inductor's pass runs ``dash.attention``
in place of SDPA (``--sdpa`` turns the rewrite off: PyTorch's deterministic SDPA, for the step
times). Each mode trains twice from the same seed; every rank checks that losses and its own
parameters (shards) are bit-identical between the runs. The modes:

  ddp   DistributedDataParallel over all ranks.
  fsdp  FSDP2 (``fully_shard``) over all ranks.
  tp    tensor parallel on a 2-D mesh (dp, tp): q/k/v projections column-parallel with DTensor
        outputs, so attention runs on DTensors sharded on heads (dash's sharding rule), then FSDP2
        over dp. ``--tp`` sets the tp size (default 2; on 2 ranks the mesh is 1 x 2).

Prints, per mode: the bits, dash's and SDPA's attention calls in one profiled step, step times.
Exit status 0 when every mode reproduced on every rank (and, without --sdpa, ran dash only).
The bits depend on the world size and layout: they repeat for the same command, not across
different ``--nproc-per-node`` or ``--tp``.
"""

from __future__ import annotations

import os

# Set before NCCL starts. NVLink SHARP (NVLS) reduces in the switch, and NCCL's maintainers call it
# less deterministic than the software algorithms; symmetric-memory multicast is the same hardware.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
# NCCL picks algorithm and protocol from message size and topology, and each reduces in its own
# order; pinning Ring keeps it fixed by the rank ring (as Megatron's deterministic mode does).
os.environ.setdefault("NCCL_ALGO", "Ring")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

import dash_inductor  # noqa: E402
from dash_inductor.demo.tiny_gpt import DemoConfig, TinyGPT, chain_batch, make_model  # noqa: E402

MODES = ("ddp", "fsdp", "tp")


#: The model's sizes and the training run, on CPU (small, float32) and on CUDA (where the step times
#: should show attention: head dim 64). ``seq`` is the attention length: each row of a batch holds
#: seq + 1 tokens, the inputs and the next-token targets. ``kv_heads`` is the KV head count of the
#: GQA layers, tiny_gpt's odd ones; ``batch`` is per data-parallel rank.
DEFAULTS = {
    "cpu": {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2, "seq": 64, "batch": 2,
            "steps": 4, "lr": 1e-2, "dtype": "float32"},
    "cuda": {"layers": 4, "d_model": 1024, "heads": 16, "kv_heads": 8, "seq": 2048, "batch": 4,
             "steps": 8, "lr": 3e-3, "dtype": "bfloat16"},
}
SIZES = ("steps", "layers", "d_model", "heads", "kv_heads", "seq", "batch")


def make_config(options: dict, device: torch.device) -> DemoConfig:
    """tiny_gpt's config for the example's options, with q, k and v projected separately so that
    the tp mode can shard each of them on heads."""
    options = dict(options)
    heads, kv_heads = options["heads"], options.pop("kv_heads")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"--kv-heads ({kv_heads}) must divide --heads ({heads})")
    if options["seq"] < 1:
        raise ValueError(f"--seq must be at least 1, got {options['seq']}")
    options.update(seq=options["seq"] + 1, kv_group=heads // kv_heads, device=str(device),
                   dtype=getattr(torch, options["dtype"]))
    return DemoConfig(**options, separate_qkv=True)


def compile_blocks(model: TinyGPT) -> None:
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block)


def parallelize(model: TinyGPT, mode: str, mesh: DeviceMesh) -> nn.Module:
    """Wrap ``model`` for ``mode``; blocks are compiled after tensor parallelism, before FSDP."""
    from torch.distributed.fsdp import fully_shard

    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        compile_blocks(model)
        device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if mode == "tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        heads = ColwiseParallel(use_local_output=False)  # attention sees DTensors, heads sharded
        plan = {"attn.q_proj": heads, "attn.k_proj": heads, "attn.v_proj": heads,
                "attn.proj": RowwiseParallel(), "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
        mesh = mesh["dp"]
    compile_blocks(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def allow_sdpa_on_cpu_dtensors() -> None:
    """Give SDPA's CPU kernel dash's sharding rules (heads, batch, replicated).

    PyTorch 2.13's DTensor has strategies for SDPA's CUDA kernels only, so Dynamo cannot trace SDPA
    on CPU DTensors. With this the CPU smoke test of ``tp`` traces it; the rewrite then puts
    dash.attention there, and with --sdpa the CPU kernel runs per shard.
    """
    from torch.distributed.tensor.experimental import register_sharding

    from dash_inductor.distributed import backward_rule, forward_rule

    aten = torch.ops.aten
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)(
        lambda q, k, v, *_args, attn_mask=None, **_kw: forward_rule(q, k, v, attn_mask))
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(
        lambda g, q, k, v, out, lse, *_args, attn_mask=None, **_kw:
        backward_rule(g, q, k, v, out, lse, attn_mask))


def attention_calls(profile: torch.profiler.profile) -> Counter[str]:
    """Attention ops that ran in a profiled step: dash's ops and PyTorch's SDPA kernels."""
    counts: Counter[str] = Counter()
    for event in profile.key_averages():
        if event.key.startswith("dash::attention"):
            counts[event.key] += event.count
        elif "scaled_dot_product" in event.key or "flash_attention" in event.key \
                or "efficient_attention" in event.key:
            counts["sdpa"] += event.count
    return counts


@dataclasses.dataclass
class Run:
    losses: list[float]
    params: dict[str, Tensor]
    step_seconds: list[float]
    calls: Counter[str]


def _local(t: Tensor) -> Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def train(cfg: DemoConfig, mode: str, mesh: DeviceMesh, dp_rank: int) -> Run:
    """One run from ``cfg.seed``; step 1 is profiled to count the attention calls."""
    device = torch.device(cfg.device)
    torch._dynamo.reset()
    model = make_model(cfg)
    wrapped = parallelize(model, mode, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    generator = torch.Generator().manual_seed(cfg.seed + 1 + dp_rank)
    losses, seconds, calls = [], [], Counter()
    for step in range(cfg.steps):
        tokens = chain_batch(cfg, generator)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            if step == 1 else None
        _synchronize(device)
        start = time.perf_counter()
        with profiler or contextlib.nullcontext():
            loss = wrapped(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if profiler is not None:
            calls = attention_calls(profiler)
    params = {name: _local(p) for name, p in model.named_parameters()}
    return Run(losses, params, seconds, calls)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def differing(a: Run, b: Run) -> list[str]:
    """What is not bit-identical between two runs on this rank: losses and parameter names."""
    names = [] if a.losses == b.losses else ["losses"]
    return names + [n for n in a.params if not torch.equal(_bits(a.params[n]), _bits(b.params[n]))]


def make_mesh(mode: str, device: torch.device, world: int, tp: int) -> tuple[DeviceMesh, int]:
    """The mesh for ``mode`` and this rank's data-parallel index (which batch it draws)."""
    if mode != "tp":
        return init_device_mesh(device.type, (world,)), dist.get_rank()
    if world % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh, mesh["dp"].get_local_rank()


def run_mode(cfg: DemoConfig, mode: str, tp: int) -> tuple[bool, str]:
    """Train ``mode`` twice; (reproduced on every rank and ran the expected attention, a line)."""
    world = dist.get_world_size()
    mesh, dp_rank = make_mesh(mode, torch.device(cfg.device), world, tp)
    runs = [train(cfg, mode, mesh, dp_rank) for _ in range(2)]
    diff = differing(*runs)
    reports: list[object] = [None] * world
    dist.all_gather_object(reports, (dist.get_rank(), diff))
    bad = [(rank, names) for rank, names in reports if names]  # type: ignore[misc]
    calls = runs[0].calls
    dash_calls = calls["dash::attention"], calls["dash::attention_backward"]
    rewrite_on = dash_inductor.config.rewrite != "off"
    ran_expected = (min(dash_calls) >= cfg.layers and not calls["sdpa"]) if rewrite_on \
        else calls["sdpa"] > 0
    timed = [s for r in runs for s in r.step_seconds[2:]] or [runs[0].step_seconds[-1]]
    bits = "identical on every rank" if not bad else f"DIFFER {bad[:2]}"
    line = (f"{mode:<5} {bits:<26} dash fwd/bwd {dash_calls[0]}/{dash_calls[1]}, sdpa "
            f"{calls['sdpa']} (one step)  step {1e3 * sum(timed) / len(timed):8.2f} ms  "
            f"loss {runs[0].losses[0]:.4f} -> {runs[0].losses[-1]:.4f}")
    return not bad and ran_expected, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: ddp,fsdp,tp")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sdpa", action="store_true",
                        help="turn the rewrite off: PyTorch's deterministic SDPA, for comparison")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the tp mode")
    what = {"kv_heads": "KV heads of the GQA (odd) layers; ", "seq": "attention length; ",
            "batch": "per data-parallel rank; "}
    for name in SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"{what.get(name, '')}default {DEFAULTS['cpu'][name]} on CPU, "
                                 f"{DEFAULTS['cuda'][name]} on CUDA")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="default float32 on CPU, bfloat16 on CUDA")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    given = {name: getattr(args, name) for name in (*SIZES, "dtype")
             if getattr(args, name) is not None}
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" \
        else torch.device("cpu")
    try:
        cfg = make_config({**DEFAULTS[args.device], **given}, device)
    except ValueError as error:
        parser.error(str(error))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                            if device.type == "cuda" else None)
    torch.use_deterministic_algorithms(True)
    if device.type == "cpu" and "tp" in modes:
        allow_sdpa_on_cpu_dtensors()
    ok = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"torch {torch.__version__}, {world} x {name}, attention: "
                  f"{'PyTorch SDPA' if args.sdpa else 'dash'} over {cfg.seq - 1} tokens, {cfg}",
                  flush=True)
        with dash_inductor.config.patch(rewrite="off" if args.sdpa else "deterministic"):
            for mode in modes:
                passed, line = run_mode(cfg, mode, args.tp)
                ok &= passed
                if rank == 0:
                    print(("OK   " if passed else "FAIL ") + line, flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    status = main()
    # A gloo worker thread may still be dropping the last collective's tensors when main returns;
    # that needs the GIL, and once Python is finalizing, taking it ends the thread inside C++ and
    # aborts the process ("terminate called without an active exception", a core dump showed
    # it). Everything is printed and the group destroyed by now: leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
