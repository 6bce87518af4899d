"""The oracle shared by the op tests: SDPA's math backend in float64 on CPU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_math(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """SDPA forced onto its math backend, on float64 copies of the inputs."""
    q, k, v = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask.detach().double().requires_grad_(mask.requires_grad)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v, kwargs.get("attn_mask"))


def reference_scores(problem, inputs) -> tuple[Tensor, Tensor | None]:
    """float64 ``q k^T * scale`` of an ``AttentionProblem``'s inputs, KV heads repeated for GQA,
    and its mask (float64 when it is a float mask); the callers apply masks as they need."""
    q, k, _, mask = (t.detach().double() if t is not None and t.is_floating_point() else t
                     for t in inputs.args)
    k = k.repeat_interleave(problem.q_heads // problem.kv_heads, dim=1)
    scale = problem.scale if problem.scale is not None else 1 / math.sqrt(problem.head_dim)
    return q @ k.transpose(-1, -2) * scale, mask


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-5),
            torch.float16: dict(atol=4e-3, rtol=4e-3), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]
