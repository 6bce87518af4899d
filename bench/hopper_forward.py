"""Check and time the Hopper (sm90) forward against the portable forward and SDPA, in one process.

    python3 bench/hopper_forward.py [--out DIR] [--repeats 20]

Accuracy: FlashAttention's rule on ``out`` (``dash_inductor.testing``), the logsumexp against
float32, and the whole step (Hopper forward, then the Hopper ``shift`` backward) on the gradients;
determinism: bitwise equal outputs over repeats; timing: forward TFLOP/s (4*B*H*N^2*D, halved when
causal) of the Hopper forward (its tile and others; at head dim 64 also the two-warpgroup tile,
"hopper 2wg", checked and timed), the portable forward, and SDPA's cuDNN and FlashAttention-2
backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from dash_inductor.ops import attention_backward, attention_forward
from dash_inductor.ops.hopper.config import HopperForwardConfig, forward_config
from dash_inductor.testing import flash_rule_errors, sdpa_math_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_check import bench_tflops, inputs, repeats_bitwise  # noqa: E402


def _run(path, q, k, v, causal, cfg=None):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    scale = q.shape[-1] ** -0.5
    attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale, kernel=path,
                      config=cfg)
    return out, lse


def _lse_reference(q, k, causal):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").tril()
        s = s.masked_fill(~keep, -math.inf)
    return torch.logsumexp(s, -1)


def check(shapes, repeats, log):
    ok = True
    for shape in shapes:
        for causal in (False, True):
            q, k, v, do = inputs(*shape)
            kwargs = dict(is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
            ref = sdpa_math_reference(q, k, v, do, torch.float32, **kwargs)
            same = sdpa_math_reference(q, k, v, do, q.dtype, **kwargs)
            lse_ref = _lse_reference(q, k, causal)
            paths = [("hopper", None), ("portable", None)]
            if shape[-1] == 64:
                paths.append(("hopper", HopperForwardConfig()))
            for path, cfg in paths:
                out, lse = _run(path, q, k, v, causal, cfg)
                (err,) = flash_rule_errors([out], [same[0]], [ref[0]], names=("out",))
                lse_err = (lse - lse_ref).abs().max().item()
                ok &= err.ok and lse_err <= 1e-3
                name = path + (" 2wg" if cfg else "")
                log(f"accuracy {shape} causal={causal} {name:12s} {err}  lse {lse_err:.2e}")
                if cfg is not None:
                    same_bits = repeats_bitwise(lambda: _run(path, q, k, v, causal, cfg), repeats)
                    ok &= same_bits
                    log(f"bitwise {shape} causal={causal} {name} {repeats} repeats: {same_bits}")
            out, lse = _run("hopper", q, k, v, causal)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            attention_backward(do, q, k, v, out, lse, None, *grads, is_causal=causal,
                               scale=q.shape[-1] ** -0.5, schedule="shift", kernel="hopper")
            errors = flash_rule_errors(grads, same[1:], ref[1:], names=("dq", "dk", "dv"))
            ok &= all(e.ok for e in errors)
            log(f"step {shape} causal={causal} hopper forward + shift: "
                + "  ".join(str(e) for e in errors))
            same_bits = repeats_bitwise(lambda: _run("hopper", q, k, v, causal), repeats)
            ok &= same_bits
            log(f"bitwise {shape} causal={causal} {repeats} repeats: {same_bits}")
    return ok


#: Tile configs timed beside the table's (block_n, stages); the first key of a row is the table's.
_TUNING = ((128, 2), (128, 4), (64, 3), (64, 4))


def time_forward(shapes, log):
    rows = []
    for shape in shapes:
        for causal in (False, True):
            q, k, v, _ = inputs(*shape)
            row = {"shape": shape, "causal": causal}
            base = forward_config(shape[-1])
            bench = lambda fn: bench_tflops(fn, shape, causal, passes=1.0)
            for block_n, stages in ((base.block_n, base.stages), *_TUNING):
                cfg = dataclasses.replace(base, block_n=block_n, stages=stages)
                shared = 2 * shape[-1] * (cfg.block_m + 2 * stages * block_n)
                if shared <= 227 * 1024 and f"hopper n{block_n} s{stages}" not in row:
                    row[f"hopper n{block_n} s{stages}"] = bench(
                        lambda: _run("hopper", q, k, v, causal, cfg))
            if shape[-1] == 64:
                row["hopper 2wg"] = bench(lambda: _run("hopper", q, k, v, causal,
                                                       HopperForwardConfig()))
            row["portable"] = bench(lambda: _run("portable", q, k, v, causal))
            for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    row[name] = bench(lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]))
            rows.append(row)
            log(f"tflops {shape} causal={causal} " + "  ".join(
                f"{key}={val:.0f}" for key, val in row.items() if isinstance(val, float)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for hopper_forward.json")
    args = parser.parse_args()
    started = time.time()
    log = lambda line: print(f"[{time.time() - started:6.1f}s] {line}", flush=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    ok = check([(2, 4, 2, 1000, 128), (2, 8, 8, 1024, 64), (1, 2, 2, 300, 128),
                (1, 4, 1, 777, 64), (1, 8, 8, 4096, 128)], args.repeats, log)
    rows = time_forward([(4, 16, 16, 4096, 128), (4, 16, 4, 4096, 128), (1, 16, 16, 16384, 128),
                         (4, 32, 32, 4096, 64), (8, 16, 16, 1024, 128)], log)
    if args.out:
        with open(f"{args.out}/hopper_forward.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "ok": ok, "timing": rows}, f, indent=1)
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
