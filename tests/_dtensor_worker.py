"""One rank of the DTensor sharding-rule checks (tests/test_distributed.py starts two on gloo).

Every case runs dash.attention forward and backward on DTensors and on the plain tensors, and
records the placements of the outputs and gradients, the collectives DTensor issued inside the op
calls (CommDebugMode) and how the gathered results compare with the unsharded op. Rank 0 writes
the records as JSON to the path given as the only argument.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import dash_inductor  # noqa: F401  (registers the ops and their sharding rules)


def _case(mesh, q_shape, kv_shape, q_place, kv_place, *, mask_shape=None, mask_place=None,
          mask_dtype=torch.bool, causal=False, gqa=False) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator) for shape in (q_shape, kv_shape, kv_shape))
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(mask_shape, generator=generator) > 0.3 if mask_dtype == torch.bool
                else torch.randn(mask_shape, generator=generator))
    plain = [t.clone().requires_grad_(t.is_floating_point()) if t is not None else None
             for t in (q, k, v, mask)]
    out, lse = torch.ops.dash.attention(*plain, causal, None, gqa)
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)

    places = (q_place, kv_place, kv_place, mask_place)
    sharded = [distribute_tensor(t, mesh, [p]).requires_grad_(t.is_floating_point())
               if t is not None else None for t, p in zip((q, k, v, mask), places)]
    with CommDebugMode() as forward_comm:
        d_out, d_lse = torch.ops.dash.attention(*sharded, causal, None, gqa)
    d_grad = distribute_tensor(grad, mesh, list(d_out.placements))
    with CommDebugMode() as backward_comm:
        d_out.backward(d_grad)

    names = ["out", "lse", "dq", "dk", "dv"] + (["dmask"] if mask_dtype != torch.bool
                                                  and mask is not None else [])
    ref = [out, lse] + [t.grad for t in plain[:3]] + ([plain[3].grad] if len(names) == 6 else [])
    got = [d_out, d_lse] + [t.grad for t in sharded[:3]] + ([sharded[3].grad]
                                                            if len(names) == 6 else [])
    record: dict[str, Any] = {"placements": {}, "bitwise": {}, "max_diff": {},
                              "comms": {"forward": forward_comm.get_total_counts(),
                                        "backward": backward_comm.get_total_counts()}}
    for name, r, g in zip(names, ref, got):
        record["placements"][name] = [str(p) for p in g.placements]
        full = g.full_tensor()
        record["bitwise"][name] = torch.equal(full, r)
        finite = torch.isfinite(r)
        record["max_diff"][name] = (full[finite] - r[finite]).abs().max().item() if finite.any() \
            else 0.0
    return record


def main(path: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    b, l, e = 2, 8, 16
    cases = {
        "heads": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e), q_place=Shard(1),
                      kv_place=Shard(1), causal=True),
        "batch": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e), q_place=Shard(0),
                      kv_place=Shard(0), causal=True),
        "replicated": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e), q_place=Replicate(),
                           kv_place=Replicate()),
        "gqa": dict(q_shape=(b, 8, l, e), kv_shape=(b, 4, l, e), q_place=Shard(1),
                    kv_place=Shard(1), causal=True, gqa=True),
        "gqa_one_local_kv_head": dict(q_shape=(b, 4, l, e), kv_shape=(b, 2, l, e),
                                      q_place=Shard(1), kv_place=Shard(1), gqa=True),
        "shared_kv_head": dict(q_shape=(b, 4, l, e), kv_shape=(b, 1, l, e), q_place=Shard(1),
                               kv_place=Replicate(), gqa=True),
        "three_d_heads": dict(q_shape=(4, l, e), kv_shape=(4, l, e), q_place=Shard(0),
                              kv_place=Shard(0)),
        "bool_mask_heads": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e), q_place=Shard(1),
                                kv_place=Shard(1), mask_shape=(b, 4, l, l), mask_place=Shard(1)),
        "float_mask_broadcast": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e),
                                     q_place=Shard(1), kv_place=Shard(1), mask_shape=(l, l),
                                     mask_place=Replicate(), mask_dtype=torch.float32),
        "sequence": dict(q_shape=(b, 4, l, e), kv_shape=(b, 4, l, e), q_place=Shard(2),
                         kv_place=Shard(2), causal=True),
        "gqa_uneven": dict(q_shape=(b, 6, l, e), kv_shape=(b, 3, l, e), q_place=Shard(1),
                           kv_place=Shard(1), gqa=True),
    }
    records = {name: _case(mesh, **kwargs) for name, kwargs in cases.items()}
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
