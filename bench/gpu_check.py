"""Correctness and speed of the kernels on one GPU, in one process (run on an H100/H200).

    python bench/gpu_check.py [--out DIR] [--check] [--time] [--sweep] [--tune]
                              [--dims 64,128] [--seqs 1024,4096]

--check: FlashAttention-rule accuracy of forward and every backward schedule (from
``dash_inductor.testing``: the same-dtype reference computed in bf16), and 5-repeat bitwise
equality of the deterministic ones. --time: TFLOP/s of forward and of each backward schedule on the
docs/benchmarks.md grid (bf16, H*D = 2048, B*N = 16384), SDPA (determinism off) as anchor. --sweep:
backward and forward tile configs on d64/d128, N = 4096. --tune: `recompute` under dQ-kernel and
main-kernel config candidates, and the ordered schedules, on --dims x --seqs. FLOPs as
FlashAttention counts them: forward 4*B*H*N^2*D (halved when causal), backward 2.5x forward.
Timings: triton's do_bench median.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from dash_inductor.ops import attention_backward, attention_forward
from dash_inductor.ops.catalog import NAMES as SCHEDULES
from dash_inductor.ops.catalog import ORDERED
from dash_inductor.ops.portable.configs import BackwardConfig, ForwardConfig
from dash_inductor.testing import flash_rule_errors, sdpa_math_reference


def inputs(batch, heads, seq, dim, kv_heads=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads = kv_heads or heads
    shape_q, shape_kv = (batch, heads, seq, dim), (batch, kv_heads, seq, dim)
    return [torch.randn(s, device="cuda", dtype=dtype, generator=gen)
            for s in (shape_q, shape_kv, shape_kv, shape_q)]


def forward(q, k, v, causal, config=None):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=q.shape[-1] ** -0.5,
                      config=config)
    return out, lse


def backward(q, k, v, do, out, lse, causal, schedule, config=None):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    plan = attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                              scale=q.shape[-1] ** -0.5, schedule=schedule, config=config)
    return plan.schedule.name, (dq, dk, dv)


def check(report):
    for (b, h, hkv, n, d) in [(2, 8, 8, 1024, 64), (1, 16, 16, 2048, 128), (2, 8, 2, 1000, 128), (1, 4, 4, 700, 256)]:
        for causal in (False, True):
            q, k, v, do = inputs(b, h, n, d, kv_heads=hkv)
            gqa = h != hkv
            ref = sdpa_math_reference(q, k, v, do, torch.float32, is_causal=causal, enable_gqa=gqa)
            same = sdpa_math_reference(q, k, v, do, torch.bfloat16, is_causal=causal,
                                       enable_gqa=gqa)
            out, lse = forward(q, k, v, causal)
            for schedule in SCHEDULES:
                used, grads = backward(q, k, v, do, out, lse, causal, schedule)
                errors = flash_rule_errors((out, *grads), same, ref)
                worst = max(e.error / e.bound for e in errors)
                reps = [backward(q, k, v, do, out, lse, causal, schedule)[1] for _ in range(5)]
                bitwise = all(torch.equal(x, y) for g in reps for x, y in zip(g, grads))
                row = dict(kind="check", shape=(b, h, hkv, n, d), causal=causal, schedule=used,
                           error_over_bound=round(worst, 3), ok=all(e.ok for e in errors),
                           bitwise5=bitwise)
                report.append(row)
                print(row, flush=True)


def tflops(ms, b, h, n, d, causal, backward_pass):
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * (2.5 if backward_pass else 1.0)
    return flops / ms * 1e-9


def time_grid(report, dims, seqs, gqa=False):
    for d in dims:
        for n in seqs:
            b, h = 16384 // n, 2048 // d
            for causal in (False, True):
                q, k, v, do = inputs(b, h, n, d, kv_heads=h // 4 if gqa else None)
                out, lse = forward(q, k, v, causal)
                row = dict(kind="time", b=b, h=h, n=n, d=d, causal=causal, gqa=gqa)
                row["fwd"] = tflops(do_bench(lambda: forward(q, k, v, causal), return_mode="median"),
                                    b, h, n, d, causal, False)
                for schedule in SCHEDULES:
                    used = backward(q, k, v, do, out, lse, causal, schedule)[0]
                    ms = do_bench(lambda: backward(q, k, v, do, out, lse, causal, schedule),
                                  return_mode="median")
                    row[schedule if used == schedule else f"{schedule}->{used}"] = tflops(
                        ms, b, h, n, d, causal, True)
                qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
                row["sdpa_fwd"] = tflops(do_bench(lambda: F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=causal, enable_gqa=gqa), return_mode="median"), b, h, n, d, causal, False)
                row["sdpa_bwd"] = tflops(do_bench(lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True),
                                                  return_mode="median"), b, h, n, d, causal, True)
                report.append({k2: (round(x, 1) if isinstance(x, float) else x) for k2, x in row.items()})
                print(report[-1], flush=True)


BACKWARD_CANDIDATES = {  # (block_m, block_n, num_warps, num_stages) of the main kernel
    128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)],
    64: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2)],
}
FORWARD_CANDIDATES = [ForwardConfig(*c) for c in (
    (128, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3))]


def sweep(report, dims, schedules):
    for d in dims:
        n = 4096
        b, h = 16384 // n, 2048 // d
        for causal in (False, True):
            q, k, v, do = inputs(b, h, n, d)
            out, lse = forward(q, k, v, causal)
            for cfg in FORWARD_CANDIDATES:
                try:
                    ms = do_bench(lambda: forward(q, k, v, causal, cfg), return_mode="median")
                    row = dict(kind="sweep_fwd", d=d, causal=causal, cfg=cfg.__dict__,
                               tflops=round(tflops(ms, b, h, n, d, causal, False), 1))
                except Exception as exc:  # out of resources: record and go on
                    row = dict(kind="sweep_fwd", d=d, causal=causal, cfg=cfg.__dict__, error=str(exc)[:80])
                report.append(row)
                print(row, flush=True)
            for main in BACKWARD_CANDIDATES.get(d, BACKWARD_CANDIDATES[128]) if not causal else ():
                cfg = BackwardConfig(*main, 128, 64, 8, 2)
                for schedule in schedules:
                    try:
                        ms = do_bench(lambda: backward(q, k, v, do, out, lse, causal, schedule, cfg),
                                      return_mode="median")
                        row = dict(kind="sweep_bwd", d=d, causal=causal, schedule=schedule, cfg=cfg.__dict__,
                                   tflops=round(tflops(ms, b, h, n, d, causal, True), 1))
                    except Exception as exc:
                        row = dict(kind="sweep_bwd", d=d, causal=causal, schedule=schedule,
                                   cfg=cfg.__dict__, error=str(exc)[:80])
                    report.append(row)
                    print(row, flush=True)


DQ_CANDIDATES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
                 (64, 32, 4, 4)]
MAIN_CANDIDATES = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)]


def tune(report, dims, seqs):
    """`recompute` under dQ-kernel and main-kernel configs, and the ordered schedules, by problem."""
    from dash_inductor.ops.portable.configs import backward_config
    for d in dims:
        for n in seqs:
            b, h = 16384 // n, 2048 // d
            for causal in (False, True):
                q, k, v, do = inputs(b, h, n, d)
                out, lse = forward(q, k, v, causal)
                base = backward_config(d, q.dtype, causal, 9)
                row = dict(kind="tune", d=d, n=n, causal=causal, table=base.__dict__)
                configs = [(f"dq={'x'.join(map(str, c))}",
                            BackwardConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, *c))
                           for c in DQ_CANDIDATES]
                configs += [(f"main={'x'.join(map(str, c))}",
                             BackwardConfig(*c, base.dq_block_m, base.dq_block_n, base.dq_num_warps,
                                            base.dq_num_stages)) for c in MAIN_CANDIDATES]
                for name, cfg in configs:
                    try:
                        ms = do_bench(lambda: backward(q, k, v, do, out, lse, causal, "recompute", cfg),
                                      return_mode="median")
                        row[f"recompute {name}"] = round(tflops(ms, b, h, n, d, causal, True), 1)
                    except Exception as exc:  # out of resources: record and go on
                        row[f"recompute {name}"] = str(exc)[:60]
                for schedule in ("atomic", *ORDERED):
                    used = backward(q, k, v, do, out, lse, causal, schedule)[0]
                    ms = do_bench(lambda: backward(q, k, v, do, out, lse, causal, schedule),
                                  return_mode="median")
                    row[used] = round(tflops(ms, b, h, n, d, causal, True), 1)
                report.append(row)
                print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check.json (default "
                        "bench/results/<date>-<gpu>-<commit>)")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--gqa", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--sweep-schedules", default="atomic,ascending")
    args = parser.parse_args()
    if args.out is None:
        import outdir  # bench/outdir.py, beside this script

        directory = outdir.default_dir(torch.cuda.get_device_name())
        command = " ".join(["python bench/gpu_check.py", *sys.argv[1:]])
        outdir.record_command(directory, command, [directory / "gpu_check.json"])
        args.out = str(directory)
    os.makedirs(args.out, exist_ok=True)
    dims = [int(x) for x in args.dims.split(",")]
    report = [dict(kind="env", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, sms=torch.cuda.get_device_properties(0).multi_processor_count)]
    print(report[0], flush=True)
    start = time.time()
    try:
        if args.check:
            check(report)
        if args.time:
            time_grid(report, dims, [int(x) for x in args.seqs.split(",")], gqa=args.gqa)
        if args.tune:
            tune(report, dims, [int(x) for x in args.seqs.split(",")])
        if args.sweep:
            sweep(report, dims, args.sweep_schedules.split(","))
    finally:
        report.append(dict(kind="wall", seconds=round(time.time() - start, 1)))
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
