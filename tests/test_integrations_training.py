"""What users run around attention besides a plain step: activation checkpointing, torch.export,
and double backward (which dash does not have: it must fail loudly, not return wrong numbers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dash_inductor


def _qkv(requires_grad: bool = True):
    torch.manual_seed(0)
    return [torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=requires_grad)
            for _ in range(3)]


def _grads(fn, leaves):
    for leaf in leaves:
        leaf.grad = None
    fn(*leaves).square().sum().backward()
    return [leaf.grad.clone() for leaf in leaves]


def test_checkpointing_recomputes_the_same_bits():
    leaves = _qkv()

    def attend(q, k, v):
        return dash_inductor.attention(q, k, v, is_causal=True)

    plain = _grads(attend, leaves)
    for reentrant in (False, True):
        recomputed = _grads(lambda *t: checkpoint(attend, *t, use_reentrant=reentrant), leaves)
        assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


def test_hf_gradient_checkpointing_with_dash(deterministic_algorithms):
    transformers = pytest.importorskip("transformers")

    def grads(checkpointing: bool):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="dash")
        model = transformers.LlamaForCausalLM(config).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids).logits.square().mean().backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


def test_double_backward_raises():
    q, k, v = _qkv()
    out = dash_inductor.attention(q, k, v, is_causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="dash.attention has no double backward.*math backend"):
        dq.sum().backward()


class _Dash(torch.nn.Module):
    def forward(self, q, k, v):
        return dash_inductor.attention(q, k, v, is_causal=True)


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _targets(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_export_keeps_dash_as_one_op_and_plain_sdpa_as_aten():
    inputs = tuple(t.detach().float() for t in _qkv(requires_grad=False))
    program = torch.export.export(_Dash(), inputs)
    assert "dash.attention.default" in _targets(program)
    assert torch.equal(program.module()(*inputs), _Dash()(*inputs))
    assert "dash.attention.default" in _targets(program.run_decompositions())

    sdpa = torch.export.export(_Sdpa(), inputs)
    assert "aten.scaled_dot_product_attention.default" in _targets(sdpa)
    # Decomposed for inference (the default table), plain SDPA becomes its math: no fused kernel.
    assert not any("attention" in t for t in _targets(sdpa.run_decompositions()))
