"""Attention the passes reach only with help: nn.TransformerEncoderLayer with mixed mask types
(rewritten), and attention with no SDPA call for them to take (reported by explain(), with why).

The FX graph and AOTAutograd caches are off, so every compile runs the passes; explain() skips
Inductor's code generation, and only the numerics test builds kernels.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from dash_inductor.inductor import rewrite

pytestmark = pytest.mark.usefixtures("fresh_compiles")


def encoder_layer(dropout: float) -> torch.nn.TransformerEncoderLayer:
    return torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                            dropout=dropout, batch_first=True)


def tutorial_masks(length: int = 8):
    """PyTorch's tutorial pattern: a float causal mask and a bool padding mask."""
    causal = torch.nn.Transformer.generate_square_subsequent_mask(length)
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, length - 3:] = True
    return causal, padding


def test_encoder_layer_with_mixed_masks_is_rewritten_and_matches_eager():
    layer = encoder_layer(dropout=0.0)
    causal, padding = tutorial_masks()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def block(x):
        return layer(x, src_mask=causal, src_key_padding_mask=padding, is_causal=True)

    counters.clear()
    with rewrite.recording() as reports, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(block)(x)
        out.square().sum().backward()
    # One graph, no break at the mask warning, which is still given, once, while tracing.
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert [str(w.message) for w in caught].count(
        "Support for mismatched src_key_padding_mask and src_mask is deprecated. "
        "Use same type for both instead.") == 1
    [report] = reports
    assert report.rewritten and report.graph == "joint"
    params = (x, *layer.parameters())
    got = [t.grad.clone() for t in params]
    for t in params:
        t.grad = None
    expected = block(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for g, t in zip(got, params, strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_encoder_layer_dropout_is_taken_in_training(training):
    """With dropout in training the pre-grad pass takes nn.MultiheadAttention's call (its SDPA
    call then runs dash's dropout); in eval it drops nothing and the joint pass takes it."""
    layer = encoder_layer(dropout=0.1).train(training)
    causal, padding = tutorial_masks()
    [report] = rewrite.explain(
        lambda x: layer(x, src_mask=causal, src_key_padding_mask=padding), torch.randn(2, 8, 32))
    assert report.rewritten
    assert report.graph == ("pre-grad" if training else "joint")
    if training:
        assert report.call == "torch.nn.functional.multi_head_attention_forward"


def test_compiled_encoder_layer_with_dropout_runs_dash_and_repeats_bitwise():
    """The compiled layer's attention runs dash's forward and backward (the plans they recorded)
    with its dropout: the same seed gives the same bits (outputs and every gradient), another
    seed other bits."""
    from dash_inductor.library import op

    layer = encoder_layer(dropout=0.1).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    compiled = torch.compile(layer)

    def run(seed):
        torch.manual_seed(seed)
        op._PLANS.clear()
        out = compiled(x)
        out.square().sum().backward()
        ran = [plan.op for plan in op.last_plans()]
        result = [out.detach(), *(t.grad.clone() for t in (x, *layer.parameters()))]
        for t in (x, *layer.parameters()):
            t.grad = None
        return result, ran

    (first, ran), (again, _), (other, _) = run(0), run(0), run(1)
    assert ran == ["forward", "backward"]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


def test_multihead_attention_returning_weights_is_reported():
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 8, 32)
    [report] = rewrite.explain(lambda x: mha(x, x, x)[0], x)  # need_weights defaults to True
    assert not report.rewritten and report.graph == "pre-grad"
    assert report.reason.startswith("need_weights=True") and "calls no SDPA" in report.reason
    [report] = rewrite.explain(lambda x: mha(x, x, x, need_weights=False)[0], x)
    assert report.rewritten


def test_hf_eager_attention_is_reported_as_no_sdpa_call():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention

    def attention_layer(attn: str):
        config = transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            attn_implementation=attn)
        return LlamaAttention(config, layer_idx=0)

    x = torch.randn(2, 12, 32)
    rotary = (torch.ones(2, 12, 8), torch.zeros(2, 12, 8))
    eager = attention_layer("eager")
    [report] = rewrite.explain(lambda x: eager(x, rotary, None)[0], x)
    assert not report.rewritten and report.graph == "joint"
    assert report.call == "torch.nn.functional.softmax"
    assert "LlamaAttention" in report.reason and "attn_implementation='sdpa'" in report.reason
    assert "eager_attention_forward" in report.site
    sdpa = attention_layer("sdpa")  # the same module calling SDPA: rewritten, nothing else
    [report] = rewrite.explain(lambda x: sdpa(x, rotary, None)[0], x)
    assert report.rewritten
