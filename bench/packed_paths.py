"""The packed backward on its two CUDA paths, side by side: the Hopper kernel with each schedule
and the portable ``recompute``; by this measurement ``schedule="auto"`` runs Hopper ``shift`` for
packed sequences (``ops/hopper/config.auto_on_hopper``).

    python bench/packed_paths.py [--head-dim 64] [--full]

bf16, head dim 128 with 16 heads (or 64 with 32), 16,384 packed tokens, causal (or, ``--full``,
unmasked) within each sequence, on four packings:
three documents of unequal length, four of 4096, one sequence, three of equal length.
``triton.testing.do_bench`` medians of the backward alone (the forward is the portable one, run
once); TFLOP/s count the attended pairs only (2.5 x 4 x H x D x pairs). Prints one line per
packing.
"""

from __future__ import annotations

import argparse

import torch
import triton

from dash_inductor.ops import varlen_backward, varlen_forward

TOKENS, WIDTH = 16384, 2048  # WIDTH = heads x head dim
PACKINGS = ([7429, 3667, 5288], [4096] * 4, [TOKENS], [5461, 5461, 5462])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--full", action="store_true", help="no causal mask within a sequence")
    args = parser.parse_args()
    head_dim, causal = args.head_dim, not args.full
    heads = WIDTH // head_dim
    print(f"head dim {head_dim}, {heads} heads, {'causal' if causal else 'full'}", flush=True)
    for lens in PACKINGS:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(TOKENS, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        longest, scale = max(lens), head_dim ** -0.5
        out, lse = torch.empty_like(q), torch.empty(heads, TOKENS, device="cuda")
        varlen_forward(q, k, v, cu, cu, longest, longest, out, lse, is_causal=causal, scale=scale,
                       kernel="portable")
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
        flops = 2.5 * 4 * heads * head_dim * pairs
        grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
        row = []
        for schedule in ("shift", "descending", "ascending", "atomic", "recompute"):
            ms = triton.testing.do_bench(lambda: varlen_backward(
                do, q, k, v, out, lse, cu, cu, longest, longest, *grads, is_causal=causal,
                scale=scale, schedule=schedule, kernel="hopper"), warmup=20, rep=100)
            row.append(f"{schedule} {ms:.3f}ms {flops / ms / 1e9:.0f}TF")
        ms = triton.testing.do_bench(lambda: varlen_backward(
            do, q, k, v, out, lse, cu, cu, longest, longest, *grads, is_causal=causal, scale=scale,
            schedule="recompute", kernel="portable"), warmup=20, rep=100)
        row.append(f"portable-recompute {ms:.3f}ms {flops / ms / 1e9:.0f}TF")
        print(lens, " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
