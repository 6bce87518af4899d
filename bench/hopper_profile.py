"""One Hopper launch to profile, after two warm-up launches (compile, caches):

    ncu --clock-control none --set full -k regex:^backward_kernel -s 2 -c 1 -o REPORT \\
        python3 bench/hopper_profile.py --shape 4,16,4,4096,128 --causal yes --schedule shift

``--op forward`` runs the forward instead (kernel ``forward_kernel``), and ``--method fa4``
FlashAttention-4's forward on the same values in its layout, to set the two side by side. Nsight
Compute then reports the third launch; docs/kernels-notes.md cites what it showed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_check import _forward, _hopper, inputs  # noqa: E402
from hopper_tune import parse_shape  # noqa: E402
from methods import fa4_layout  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(4, 16, 16, 4096, 128),
                        help="B,Hq,Hkv,N,D")
    parser.add_argument("--causal", choices=("yes", "no"), default="no")
    parser.add_argument("--schedule", default="shift")
    parser.add_argument("--op", choices=("backward", "forward"), default="backward")
    parser.add_argument("--method", choices=("dash", "fa4"), default="dash",
                        help="fa4: FlashAttention-4's forward (--op forward only)")
    args = parser.parse_args()
    causal = args.causal == "yes"
    q, k, v, do = inputs(*args.shape)
    if args.method == "fa4":
        from flash_attn.cute import flash_attn_func

        q4, k4, v4 = fa4_layout((q, k, v))
        for _ in range(3):
            flash_attn_func(q4, k4, v4, causal=causal)
    elif args.op == "forward":
        for _ in range(3):
            _forward(q, k, v, causal)
    else:
        out, lse = _forward(q, k, v, causal)
        for _ in range(3):
            _hopper(q, k, v, do, out, lse, causal, args.schedule)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
