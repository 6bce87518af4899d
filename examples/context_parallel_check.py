"""Does PyTorch's context-parallel (ring) attention run on dash and repeat bit for bit?

    torchrun --nproc-per-node 2 examples/context_parallel_check.py

With the "DASH" flash-attention provider active, context parallel's ring calls dash's kernels for
every block (SDPA pinned to the flash backend). Each rank runs the same causal attention forward
and backward twice, sequence-sharded over all ranks, and checks that its output and gradients are
bit-identical between the runs, that dash ran, and that they match attention without context
parallelism within FlashAttention's accuracy rule. Exit status 0 when all of that holds.
"""

from __future__ import annotations

import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import dash_inductor  # noqa: E402
from dash_inductor import integrations  # noqa: E402


def _ring_attention(mesh, q, k, v, grad_out):
    """Output and gradients of causal attention under context parallelism, as local shards."""
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v, grad_out = (t.clone() for t in (q, k, v, grad_out))
    with context_parallel(mesh, buffers=[q, k, v, grad_out], buffer_seq_dims=[2, 2, 2, 2]):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves)]


def unmet_requirement() -> str | None:
    """Why the check cannot run here (None when it can), said before NCCL fails in its own words."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return (f"it needs CUDA GPUs and NCCL; this torch ({torch.__version__}) sees "
                f"{torch.cuda.device_count()} CUDA devices and has "
                f"{'' if dist.is_nccl_available() else 'no '}NCCL")
    if "RANK" not in os.environ:
        return "it runs one process per GPU: torchrun --nproc-per-node 2 " + sys.argv[0]
    return None


def main() -> int:
    reason = unmet_requirement()
    if reason is not None:
        print(f"context_parallel_check.py cannot run here: {reason}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cuda", (world,))
    message = integrations.activate_provider()
    if rank == 0:
        print(message)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 4096, 128)
    q, k, v, grad_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
    routes = ("provider.forward", "provider.backward")
    before = [integrations.dash_calls(r) for r in routes]
    first = _ring_attention(mesh, q, k, v, grad_out)
    calls = [integrations.dash_calls(r) - b for r, b in zip(routes, before)]
    fallbacks = {r: integrations.fallbacks(r) for r in routes}
    second = _ring_attention(mesh, q, k, v, grad_out)
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    # Reference: the same attention on the whole sequence, without context parallelism.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(grad_out.double())
    full = [ref.detach(), *(t.grad for t in leaves)]
    errors = {}
    for name, local, whole in zip(("out", "dq", "dk", "dv"), first, full):
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local.contiguous())
        # context_parallel's default load balancer splits the sequence into 2*world chunks and
        # gives rank r chunks r and 2*world-1-r; undo that order before comparing.
        chunks = [c for g in gathered for c in g.chunk(2, dim=2)]
        order = [None] * (2 * world)
        for r in range(world):
            order[r], order[2 * world - 1 - r] = chunks[2 * r], chunks[2 * r + 1]
        errors[name] = (torch.cat(order, dim=2).double() - whole).abs().max().item()
    ok = same and min(calls) > 0
    if rank == 0:
        print(f"fallbacks: {fallbacks}")
        print(f"ring attention on {world} GPUs: dash forward/backward calls {calls}; "
              f"two runs bit-identical on rank 0: {same}; max |err| against float64 attention "
              "on the whole sequence: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    flags = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if flags.item() == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
