"""The small GPT-style model that the demo, ``bench/step.py``, ``examples/distributed_train.py``
and the tests train.

Causal ``F.scaled_dot_product_attention`` from a fused q/k/v projection (or three separate ones,
which tensor parallelism can shard on heads), with grouped-query attention in every other layer, on
sequences that follow a hidden successor map: learnable in a few steps, so the loss visibly falls.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Model size and training length; the defaults finish in under two minutes on a 2-core CPU."""

    layers: int = 2
    d_model: int = 64
    heads: int = 4
    seq: int = 128
    batch: int = 4
    steps: int = 8
    vocab: int = 64
    kv_group: int = 2  #: query heads per KV head in the odd (GQA) layers; 1 turns GQA off
    #: q, k and v from three projections (``attn.q_proj``, ``k_proj``, ``v_proj``), each of which
    #: tensor parallelism can shard on heads, instead of one fused ``attn.qkv``
    separate_qkv: bool = False
    seed: int = 0
    lr: float = 1e-2
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "seq", "batch", "steps", "vocab", "kv_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if self.seq < 2:
            raise ValueError(f"seq must be at least 2 (next-token prediction), got {self.seq}")

    def kv_heads(self, layer: int) -> int:
        """Odd layers share each KV head between ``kv_group`` query heads (GQA) where the head
        count allows."""
        if layer % 2 == 1 and self.heads % self.kv_group == 0:
            return self.heads // self.kv_group
        return self.heads


#: Larger defaults for CUDA, where the step-time comparison needs attention to matter.
CUDA_DEFAULTS = {"layers": 4, "d_model": 512, "heads": 8, "seq": 2048, "batch": 8, "steps": 10,
                 "lr": 3e-3}


class Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, with optional GQA."""

    def __init__(self, d_model: int, heads: int, kv_heads: int,
                 separate_qkv: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        # A bool fixed here: with each block compiled on its own (examples/distributed_train.py),
        # Dynamo makes an int attribute that differs between blocks (kv_heads) dynamic, and an
        # SDPA call with a symbolic enable_gqa was not rewritten to dash.attention.
        self.gqa = kv_heads != heads
        self.widths = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.separate_qkv = separate_qkv
        if separate_qkv:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, width, bias=False)
                                                     for width in self.widths)
        else:
            self.qkv = nn.Linear(d_model, sum(self.widths), bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        if self.separate_qkv:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split(self.widths, dim=-1)
        # Heads as -1: under tensor parallelism with local outputs a rank holds a share of them.
        q = q.view(b, n, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, n, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, n, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP, each with a residual connection."""

    def __init__(self, d_model: int, heads: int, kv_heads: int,
                 separate_qkv: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, kv_heads, separate_qkv)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model whose forward returns the next-token cross-entropy loss."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, cfg.kv_heads(i),
                                          cfg.separate_qkv) for i in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tokens(inputs) + self.positions.weight[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def chain_batch(cfg: DemoConfig, generator: torch.Generator) -> Tensor:
    """Sequences that follow a fixed hidden successor map from a random start: learnable in a
    few steps, so the loss visibly falls."""
    successor = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(cfg.seed))
    tokens = torch.empty((cfg.batch, cfg.seq), dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (cfg.batch,), generator=generator)
    for t in range(1, cfg.seq):
        tokens[:, t] = successor[tokens[:, t - 1]]
    return tokens.to(cfg.device)


def make_model(cfg: DemoConfig) -> TinyGPT:
    """The model with weights drawn from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    return TinyGPT(cfg).to(device=cfg.device, dtype=cfg.dtype)
