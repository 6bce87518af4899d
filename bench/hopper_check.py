"""Check the Hopper (sm90) backward and time its schedules (launcher only), in one process.

    python3 bench/hopper_check.py [--quick | --grid d64] [--out DIR]

Accuracy: FlashAttention's rule (|ours - fp32 ref| <= 2 |torch same-dtype - ref| + 1e-3, the
same-dtype reference computed in that dtype; ``dash_inductor.testing``) for every schedule on
uneven and GQA shapes; determinism: bitwise equal gradients over repeats for every
deterministic schedule; timing: backward TFLOP/s (2.5x the forward's 4*B*H*N^2*D, halved when
causal) of each schedule on the Hopper and the portable kernels.

The timing is launcher only, not comparable: dash's columns call ``attention_backward`` (the
launcher) directly, without the op, its checks, its allocations or autograd, while the columns
printed beside them for orientation (SDPA with cuDNN, PyTorch's deterministic SDPA,
FlexAttention compiled with a causal block mask where causal) run through
``torch.autograd.grad``. Compare dash's columns with each other; for dash against the others,
time them all through the public op with bench/run.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from dash_inductor.ops import attention_backward, attention_forward, catalog
from dash_inductor.testing import flash_rule_errors, sdpa_math_reference


def inputs(batch, hq, hkv, seq, dim, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(batch, h, seq, dim, device="cuda", dtype=dtype, generator=gen)
    return make(hq), make(hkv), make(hkv), make(hq)


def _forward(q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=q.shape[-1] ** -0.5)
    return out, lse


def _hopper(q, k, v, do, out, lse, causal, schedule, cfg=None):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                       scale=q.shape[-1] ** -0.5, schedule=schedule, kernel="hopper", config=cfg)
    return dq, dk, dv


def _portable(q, k, v, do, out, lse, causal, schedule):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                       scale=q.shape[-1] ** -0.5, schedule=schedule, kernel="portable")
    return dq, dk, dv


def _sdpa_grads(q, k, v, do, causal, dtype):
    """(dq, dk, dv) of SDPA's math backend in ``dtype`` (bf16/fp16 computed in that dtype)."""
    return sdpa_math_reference(q, k, v, do, dtype, is_causal=causal,
                               enable_gqa=q.shape[1] != k.shape[1])[1:]


def check_accuracy(shapes, log):
    ok = True
    for shape in shapes:
        for causal in (False, True):
            q, k, v, do = inputs(*shape)
            ref = _sdpa_grads(q, k, v, do, causal, torch.float32)
            same = _sdpa_grads(q, k, v, do, causal, q.dtype)
            out, lse = _forward(q, k, v, causal)
            for schedule in catalog.NAMES:
                grads = _hopper(q, k, v, do, out, lse, causal, schedule)
                errors = flash_rule_errors(grads, same, ref, names=("dq", "dk", "dv"))
                ok &= all(e.ok for e in errors)
                log(f"accuracy {shape} causal={causal} {schedule:10s} " + "  ".join(
                    f"{e.name} {e.error:.2e}/{e.bound:.2e}" for e in errors))
            portable = _portable(q, k, v, do, out, lse, causal, "recompute")
            log(f"accuracy {shape} causal={causal} portable recompute (reference point) " + "  ".join(
                f"{e.name} {e.error:.2e}"
                for e in flash_rule_errors(portable, same, ref, names=("dq", "dk", "dv"))))
    return ok


def repeats_bitwise(fn, repeats):
    """Whether ``repeats`` more calls of ``fn`` give the bits of its first call."""
    first = fn()
    return all(all(torch.equal(a, b) for a, b in zip(first, fn())) for _ in range(repeats))


def check_bitwise(shapes, repeats, log):
    ok = True
    for shape in shapes:
        for causal in (False, True):
            q, k, v, do = inputs(*shape, seed=1)
            out, lse = _forward(q, k, v, causal)
            for schedule in catalog.DETERMINISTIC:
                same = repeats_bitwise(
                    lambda: _hopper(q, k, v, do, out, lse, causal, schedule), repeats)
                ok &= same
                log(f"bitwise {shape} causal={causal} {schedule:10s} {repeats} repeats: {same}")
    return ok


def bench_tflops(fn, shape, causal, passes=2.5):
    """TFLOP/s of ``fn`` (median time) as FlashAttention counts: ``passes`` x the forward's
    4*B*H*N^2*D (2.5 for the backward), halved when causal."""
    batch, hq, _, seq, dim = shape
    flops = passes * 4 * batch * hq * seq * seq * dim / (2 if causal else 1)
    return flops / (triton.testing.do_bench(fn, return_mode="median") * 1e-3) / 1e12


def _flex(q, k, v, causal):
    """FlexAttention's output, compiled once per shape (its backward is what is timed)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                 q.shape[2], k.shape[2], device=q.device)
    torch._dynamo.reset()  # it compiles per shape; stay under the recompile limit
    flex = torch.compile(flex_attention, dynamic=False)
    return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


LAUNCHER_ONLY = ("launcher only, not comparable: dash's columns call the launcher directly; "
                 "sdpa and flex run through torch.autograd.grad")


def time_backward(shapes, log):
    """Backward TFLOP/s of every column on every shape, in this one process and GPU: dash's
    through its launcher, the others through autograd (``LAUNCHER_ONLY``)."""
    log(f"timing: {LAUNCHER_ONLY}")
    rows = []
    for shape in shapes:
        for causal in (False, True):
            q, k, v, do = inputs(*shape)
            out, lse = _forward(q, k, v, causal)
            row = {"shape": shape, "causal": causal}
            for schedule in catalog.NAMES:
                row[f"hopper {schedule}"] = bench_tflops(
                    lambda: _hopper(q, k, v, do, out, lse, causal, schedule), shape, causal)
            for schedule in ("recompute", "shift", "descending", "atomic"):
                row[f"portable {schedule}"] = bench_tflops(
                    lambda: _portable(q, k, v, do, out, lse, causal, schedule), shape, causal)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            for name, backend, deterministic in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION, False),
                                                 ("sdpa deterministic", SDPBackend.FLASH_ATTENTION,
                                                  True)):
                torch.use_deterministic_algorithms(deterministic)
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                       enable_gqa=q.shape[1] != k.shape[1])
                row[name] = bench_tflops(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True),
                                   shape, causal)
                torch.use_deterministic_algorithms(False)
            o = _flex(qg, kg, vg, causal)
            row["flex"] = bench_tflops(
                lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), shape, causal)
            rows.append(row)
            cells = lambda keep: "  ".join(f"{key}={val:.0f}" for key, val in row.items()
                                           if isinstance(val, float) and keep(key))
            dash = lambda key: key.startswith(("hopper ", "portable "))
            log(f"tflops {shape} causal={causal} launcher only: {cells(dash)}  |  through "
                f"autograd (not comparable): {cells(lambda key: not dash(key))}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="accuracy and a short timing only")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--grid", choices=("default", "d64"), default="default",
                        help="d64: the quick accuracy check, then head dim 64 at N = 4k, 8k and "
                             "16k and GQA 4:1 (what an auto rule for head dim 64 needs)")
    parser.add_argument("--out", default=None, help="folder for hopper_check.json")
    args = parser.parse_args()
    started = time.time()
    log = lambda line: print(f"[{time.time() - started:6.1f}s] {line}", flush=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    accuracy = [(2, 4, 2, 1000, 128), (2, 8, 8, 1024, 64)]
    timing = [(4, 16, 16, 4096, 128)]
    full = not args.quick and args.grid == "default"
    if full:
        accuracy += [(1, 2, 2, 300, 128), (1, 4, 1, 777, 64)]
        timing += [(4, 16, 4, 4096, 128), (1, 16, 16, 16384, 128), (4, 32, 32, 4096, 64)]
    if args.grid == "d64":
        timing = [(4, 32, 32, 4096, 64), (2, 32, 32, 8192, 64), (1, 32, 32, 16384, 64),
                  (4, 32, 8, 4096, 64)]
    ok = check_accuracy(accuracy, log)
    if full:
        ok &= check_bitwise([(2, 8, 8, 1024, 128), (1, 16, 4, 2048, 64)], args.repeats, log)
    rows = time_backward(timing, log)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(f"{args.out}/hopper_check.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "ok": ok, "timing_note": LAUNCHER_ONLY,
                       "timing": rows}, f, indent=1)
    log(f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
