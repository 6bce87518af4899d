"""One rank of the DTensor sharding-rule checks (tests/test_distributed.py starts two on gloo).

Every case runs dash.attention (or dash.varlen_attention) forward and backward on DTensors and
on the plain tensors, and records the placements of the outputs and gradients, the collectives
DTensor issued inside the op calls (CommDebugMode) and how the gathered results compare with the
unsharded op. Rank 0 writes the records as JSON to the path given as the only argument.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import dash_inductor  # noqa: F401  (registers the ops and their sharding rules)


def _run(mesh, op, tensors: dict[str, Any], places: dict[str, Any], extra: tuple,
         generator: torch.Generator, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``op(*tensors, *extra, **options)`` -> (out, lse) and its backward, plain and on
    DTensors."""
    options = options or {}
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    plain = {n: None if t is None else t.clone().requires_grad_(t.is_floating_point())
             for n, t in tensors.items()}
    out, lse = op(*plain.values(), *extra, **options)
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)

    sharded = {n: None if t is None else
               distribute_tensor(t, mesh, [places[n]]).requires_grad_(t.is_floating_point())
               for n, t in tensors.items()}
    with CommDebugMode() as forward_comm:
        d_out, d_lse = op(*sharded.values(), *extra, **options)
    d_grad = distribute_tensor(grad, mesh, list(d_out.placements))
    with CommDebugMode() as backward_comm:
        d_out.backward(d_grad)

    pairs = {"out": (out, d_out), "lse": (lse, d_lse)}
    pairs.update({f"d{n}": (t.grad, sharded[n].grad) for n, t in plain.items()
                  if t is not None and t.requires_grad})
    record: dict[str, Any] = {"placements": {}, "bitwise": {}, "max_diff": {},
                              "comms": {"forward": forward_comm.get_total_counts(),
                                        "backward": backward_comm.get_total_counts()}}
    for name, (r, g) in pairs.items():
        record["placements"][name] = [str(p) for p in g.placements]
        full = g.full_tensor()
        record["bitwise"][name] = torch.equal(full, r)
        finite = torch.isfinite(r)
        record["max_diff"][name] = (full[finite] - r[finite]).abs().max().item() if finite.any() \
            else 0.0
    return record


def _case(mesh, q_shape, kv_shape, q_place, kv_place, *, mask_shape=None, mask_place=None,
          mask_dtype=torch.bool, causal=False, gqa=False) -> dict[str, Any]:
    """dash.attention on dense (B, H, L, E) or (H, L, E) inputs."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator) for shape in (q_shape, kv_shape, kv_shape))
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(mask_shape, generator=generator) > 0.3 if mask_dtype == torch.bool
                else torch.randn(mask_shape, generator=generator))
    places = {"q": q_place, "k": kv_place, "v": kv_place, "mask": mask_place}
    return _run(mesh, torch.ops.dash.attention, {"q": q, "k": k, "v": v, "mask": mask}, places,
                (0.0, causal), generator, dict(enable_gqa=gqa))


def _varlen_case(mesh, heads, kv_heads, q_place, kv_place) -> dict[str, Any]:
    """dash.varlen_attention on two packed sequences (lengths 5 and 7), causal."""
    from torch.distributed.tensor import Replicate

    generator = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    tensors = {"q": torch.randn((12, heads, 16), generator=generator),
               "k": torch.randn((12, kv_heads, 16), generator=generator),
               "v": torch.randn((12, kv_heads, 16), generator=generator),
               "cu_q": cu, "cu_k": cu.clone()}
    places = {"q": q_place, "k": kv_place, "v": kv_place, "cu_q": Replicate(),
              "cu_k": Replicate()}
    return _run(mesh, torch.ops.dash.varlen_attention, tensors, places,
                (7, 7, None, [-1, 0], heads != kv_heads), generator)


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
    records["varlen_heads"] = _varlen_case(mesh, 4, 4, Shard(1), Shard(1))
    records["varlen_gqa"] = _varlen_case(mesh, 8, 4, Shard(1), Shard(1))
    records["varlen_tokens"] = _varlen_case(mesh, 4, 4, Shard(0), Shard(0))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # As examples/distributed_train.py: a gloo worker thread still dropping the last
    # collective's tensors during interpreter finalization aborts the process; skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
