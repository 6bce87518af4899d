"""Train a tiny random Qwen2 (grouped-query attention) a few steps three ways, each twice, and
check that the two runs of each way end with bit-identical weights.

    python examples/train_tiny_qwen2.py                 # CPU: the paths that run there
    python examples/train_tiny_qwen2.py --device cuda   # all three

The ways:
  compiled  attn_implementation="sdpa" under torch.compile: dash_inductor's Inductor pass rewrites
            SDPA into dash.attention because deterministic algorithms are on.
  provider  eager SDPA with "DASH" activated as PyTorch's flash-attention implementation
            (CUDA only: the flash backend does not run on CPU).
  hf        eager attn_implementation="dash".
No download: the model comes from a config with random weights, the data is random tokens.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys

import torch

import dash_inductor
from dash_inductor import integrations

PATHS = ("compiled", "provider", "hf")


def make_model(attn: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, attn_implementation=attn)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


def train(path: str, steps: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Weights after ``steps`` AdamW steps on random tokens (same seed every call)."""
    model = make_model("dash" if path == "hf" else "sdpa", device, dtype)
    step_model = torch.compile(model) if path == "compiled" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, 128, (4, 64), generator=data).to(device)
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"  {path} step {step}: loss {loss.item():.6f}")
    return [p.detach().clone() for p in model.parameters()]


def run(path: str, steps: int, device: str, dtype: torch.dtype) -> bool:
    if path == "provider":
        if device != "cuda":
            print("provider: skipped, SDPA's flash backend (and so the provider) runs on CUDA only")
            return True
        print(integrations.activate_provider())
    integrations.reset_counts()
    sites: list = []
    with contextlib.ExitStack() as stack:
        if path == "compiled":  # compile afresh so that the rewrite reports every site
            from torch._inductor.utils import fresh_inductor_cache

            stack.enter_context(fresh_inductor_cache())
            sites = stack.enter_context(dash_inductor.inductor.rewrite.recording())
        if path == "provider":
            stack.callback(integrations.deactivate_provider)
        first, second = (train(path, steps, device, dtype) for _ in range(2))
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    calls: collections.Counter[str] = collections.Counter()
    for (name, reason), n in integrations.routes.counts.items():
        calls[f"{name} {'dash' if reason is None else 'fallback'}"] += n
    if sites:
        calls["sites rewritten by the pass"] = sum(site.rewritten for site in sites)
    print(f"{path}: two runs bit-identical: {same}; {dict(calls) or 'no integration calls'}")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.use_deterministic_algorithms(True)
    print(f"dash_inductor {dash_inductor.__version__}, torch {torch.__version__}, {args.device}")
    results = [run(path, args.steps, args.device, dtype) for path in args.paths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
