"""The price of attention dropout: dash with and without it, and PyTorch's SDPA with it.

    python bench/dropout.py [--p 0.1] [--head-dims 128,64] [--seq 4096] [--rounds 3] [--out DIR]
    python bench/dropout.py --device cpu ...   # tiny shapes: a check of the script, not a timing

At B·N = 16k, H·D = 2048, bf16, causal and full, each method through its public entry and
``torch.autograd``, the methods taking turns for ``--rounds`` rounds (medians reported):

- ``dash p=0``: ``dash_inductor.attention`` without dropout (``auto``), determinism on;
- ``dash p``: the same with ``dropout_p=p`` (its Philox mask, drawn again in the backward);
- ``dash p portable`` and ``dash p hopper``: each kernel family named (``kernel=``), the
  measurement behind what ``auto`` takes with dropout (CUDA only);
- ``SDPA det. on p``: ``F.scaled_dot_product_attention(dropout_p=p)`` under deterministic
  algorithms (what PyTorch runs for a deterministic model with dropout);
- ``SDPA det. off p``: the same with determinism off;
- ``SDPA flash p=0``, ``SDPA flash p``, ``SDPA cuDNN p=0``, ``SDPA cuDNN p``: PyTorch's
  FlashAttention-2 and cuDNN kernels pinned (``sdpa_kernel``), determinism off, without and with
  dropout: what PyTorch's own dropout pays for its mask (CUDA only).

Forward and backward ms (``triton.testing.do_bench`` medians, the backward of a retained graph),
the kernel path and schedule dash's backward ran, and the ratios the dropout issue names: dash's
backward with dropout over without, and SDPA determinism on over dash, both with dropout; and
the same ratio for FlashAttention-2's and cuDNN's backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dash_inductor  # noqa: E402
import methods as m  # noqa: E402
import outdir  # noqa: E402
from dash_inductor.library.op import last_plans  # noqa: E402

Attention = Callable[..., torch.Tensor]
#: name -> (determinism on, attention, dropout taken from --p)
METHODS: dict[str, tuple[bool, Attention, bool]] = {
    "dash p=0": (True, dash_inductor.attention, False),
    "dash p": (True, dash_inductor.attention, True),
    "dash p portable": (True, partial(dash_inductor.attention, kernel="portable"), True),
    "dash p hopper": (True, partial(dash_inductor.attention, kernel="hopper"), True),
    "SDPA det. on p": (True, F.scaled_dot_product_attention, True),
    "SDPA det. off p": (False, F.scaled_dot_product_attention, True),
    "SDPA flash p=0": (False, m.sdpa_pinned("FLASH_ATTENTION"), False),
    "SDPA flash p": (False, m.sdpa_pinned("FLASH_ATTENTION"), True),
    "SDPA cuDNN p=0": (False, m.sdpa_pinned("CUDNN_ATTENTION"), False),
    "SDPA cuDNN p": (False, m.sdpa_pinned("CUDNN_ATTENTION"), True),
}
#: Methods that run on CUDA only: dash's Hopper kernels, PyTorch's FlashAttention-2 and cuDNN.
CUDA_ONLY = ("dash p hopper", "SDPA flash p=0", "SDPA flash p", "SDPA cuDNN p=0", "SDPA cuDNN p")
#: Peers whose backward with dropout over without is reported beside dash's.
PEERS = ("SDPA flash", "SDPA cuDNN")


def methods_for(device: str) -> list[str]:
    """The methods timed on ``device``: those of ``CUDA_ONLY`` on CUDA alone."""
    return [name for name in METHODS if device == "cuda" or name not in CUDA_ONLY]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def _ms(fn: Callable[[], object], leaves: list[torch.Tensor], device: str) -> float:
    if device == "cuda":
        return m.time_ms(fn, leaves)
    start = time.perf_counter()  # the CPU check: one call, no statistics
    fn()
    return 1e3 * (time.perf_counter() - start)


def _time(problem: m.Problem, fn: Attention, p: float, det: bool, device: str,
          inputs: tuple) -> tuple[float, float]:
    q, k, v, grad = inputs
    kwargs = dict(dropout_p=p, is_causal=problem.causal, enable_gqa=problem.group > 1)
    with m.determinism(det):
        forward = _ms(lambda: fn(q, k, v, **kwargs), [], device)
        out = fn(q, k, v, **kwargs)
        backward = _ms(lambda: out.backward(grad, retain_graph=True), [q, k, v], device)
    for t in (q, k, v):
        t.grad = None
    return forward, backward


def _problems(args: argparse.Namespace, device: str) -> list[m.Problem]:
    dims = [int(d) for d in args.head_dims.split(",")]
    if device == "cpu":
        return [m.Problem(1, 2, 2, 64, 16, causal, torch.float32) for causal in (False, True)]
    return [m.Problem(m.TOKENS // args.seq, m.WIDTH // d, m.WIDTH // d, args.seq, d, causal)
            for d in dims for causal in (False, True)]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for problem in _problems(args, device):
        inputs = m.make_inputs(problem, device)
        names = methods_for(device)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        refused: dict[str, str] = {}  # a peer without a kernel for the problem (cuDNN, say)
        ran = None
        for _ in range(args.rounds):
            for name in names:
                if name in refused:
                    continue
                det, fn, dropout = METHODS[name]
                try:
                    samples[name].append(_time(problem, fn, args.p if dropout else 0.0, det,
                                               device, inputs))
                except RuntimeError as error:
                    if not name.startswith(PEERS):  # only a pinned kernel may refuse
                        raise
                    refused[name] = str(error).splitlines()[0]
                    print(f"{problem.label}: {name} refused: {refused[name]}", flush=True)
                if name == "dash p":
                    plan = last_plans()[-1]
                    ran = f"{plan.kernel} {plan.schedule.name if plan.schedule else ''}".strip()
        row = {"problem": problem.as_dict(), "label": problem.label, "dash_p_ran": ran,
               "refused": refused}
        for name, runs in samples.items():
            if name in refused:
                continue
            row[name] = {"forward_ms": statistics.median(r[0] for r in runs),
                         "backward_ms": statistics.median(r[1] for r in runs)}
        row["dash backward p / p=0"] = row["dash p"]["backward_ms"] / row["dash p=0"]["backward_ms"]
        row["SDPA det. on / dash backward, p"] = (row["SDPA det. on p"]["backward_ms"]
                                                  / row["dash p"]["backward_ms"])
        for peer in PEERS:
            if f"{peer} p" in row and f"{peer} p=0" in row:
                row[f"{peer} backward p / p=0"] = (row[f"{peer} p"]["backward_ms"]
                                                   / row[f"{peer} p=0"]["backward_ms"])
        rows.append(row)
        print(f"{problem.label:22s} dash bwd p=0 {row['dash p=0']['backward_ms']:.3f} ms, "
              f"p={args.p} {row['dash p']['backward_ms']:.3f} ({ran}): "
              f"x{row['dash backward p / p=0']:.2f}; SDPA det. on p "
              f"{row['SDPA det. on p']['backward_ms']:.3f}: "
              f"x{row['SDPA det. on / dash backward, p']:.2f}; fwd/bwd p by kernel: "
              + ", ".join(f"{n[7:]} {row[n]['forward_ms']:.3f}/{row[n]['backward_ms']:.3f}"
                          for n in names if n.startswith("dash p "))
              + "".join(f"; {peer} bwd p / p=0 x{row[f'{peer} backward p / p=0']:.2f}"
                        for peer in PEERS if f"{peer} backward p / p=0" in row), flush=True)
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "p": args.p, "rounds": args.rounds}
    out = args.out or outdir.default_dir(env["device"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dropout.json"
    path.write_text(json.dumps({"environment": env, "command": " ".join(sys.argv),
                                "rows": rows}, indent=1))
    outdir.record_command(out, "python bench/dropout.py " + " ".join(argv or sys.argv[1:]), [path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
