"""A process that repeats one ordered backward on the GPU (a case of ``test_contention_gpu.py``):
as ``bg`` it keeps the GPU time-sliced until it is stopped; as ``main`` it compares the bits of
CALLS calls with its first and prints how many differed."""

import sys

import torch

import dash_inductor
from dash_inductor import config
from dash_inductor.ops.shared.errors import check_spin_flags


def _dense():
    """Dense d64 causal, 30x the SM count in tiles (``test_many_tiles_no_hang``'s problem)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = -(-30 * sms // (4 * 32))
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(4, heads, 4096, 64, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(4))

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dash_inductor.attention(*leaves, is_causal=True).backward(do)
        return [t.grad for t in leaves]
    return run


def _packed():
    """Five documents, 16k tokens, d128, causal: the claimed deal and the in-kernel dQ conversion."""
    lengths = [8192, 512, 3000, 1537, 3143]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(sum(lengths), h, 128, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for h in (8, 2, 2, 8))

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dash_inductor.varlen_attention(*leaves, cu, cu, max(lengths), max(lengths),
                                             window_size=(-1, 0), enable_gqa=True)
        out.backward(do)
        return [t.grad for t in leaves]
    return run


def main(role: str, case: str, schedule: str, calls: int) -> None:
    with config.patch(kernel="hopper", schedule=schedule):
        run = {"dense": _dense, "packed": _packed}[case]()
        first = run()
        torch.cuda.synchronize()
        print("ready", flush=True)
        differed = 0
        while role == "bg" or calls > 0:
            again = run()
            if role == "main":
                calls -= 1
                differed += not all(torch.equal(a, b) for a, b in zip(first, again))
        check_spin_flags(wait=True)
    print("differed", differed, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
