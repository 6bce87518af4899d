"""Hopper launches to profile, after two warm-up launches (compile, caches):

    ncu --clock-control none --set full -k regex:^backward_kernel -s 2 -c 1 -o REPORT \\
        python3 bench/hopper_profile.py --shape 4,16,4,4096,128 --causal yes --schedule shift

``--op forward`` runs the forward instead (kernel ``forward_kernel``), and ``--method fa4``
FlashAttention-4's forward on the same values in its layout, to set the two side by side.
``--config`` overrides fields of the op's Hopper config (``bench/hopper_tune.py``'s form),
``--launches`` how many launches follow the warm-ups. For dash it prints a line ``digest HASH``
of the last launch's outputs (forward: out and lse; backward: dQ, dK, dV), by which
``bench/hopper_cycles.py`` checks that a config changed no bit. docs/kernels-notes.md cites what
the profiles showed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_check import inputs  # noqa: E402
from hopper_tune import parse_config, parse_shape, runner  # noqa: E402
from methods import fa4_layout  # noqa: E402

WARMUPS = 2


def digest(tensors: tuple[torch.Tensor, ...]) -> str:
    """A hash of the tensors' bytes, equal exactly when every bit is."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(4, 16, 16, 4096, 128),
                        help="B,Hq,Hkv,N,D")
    parser.add_argument("--causal", choices=("yes", "no"), default="no")
    parser.add_argument("--schedule", default="shift")
    parser.add_argument("--op", choices=("backward", "forward"), default="backward")
    parser.add_argument("--method", choices=("dash", "fa4"), default="dash",
                        help="fa4: FlashAttention-4's forward (--op forward only)")
    parser.add_argument("--config", default="", help="config fields, e.g. stages=2,pingpong=1")
    parser.add_argument("--launches", type=int, default=1, help="launches after the warm-ups")
    args = parser.parse_args()
    if args.method == "fa4" and (args.op != "forward" or args.config):
        parser.error("--method fa4 runs FlashAttention-4's forward: --op forward, no --config")
    causal = args.causal == "yes"
    q, k, v, do = inputs(*args.shape)
    cfg = parse_config(args.config, args.op, args.shape[-1], causal) if args.config else None
    if args.method == "fa4":
        from flash_attn.cute import flash_attn_func

        q4, k4, v4 = fa4_layout((q, k, v))
        run = lambda: flash_attn_func(q4, k4, v4, causal=causal)
    else:
        run_config = runner(args.op, q, k, v, do, causal, args.schedule)
        run = lambda: run_config(cfg)
    for _ in range(WARMUPS + args.launches):
        result = run()
    torch.cuda.synchronize()
    if args.method == "dash":
        print("digest", digest(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
