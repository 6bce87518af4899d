"""attn_implementation="dash" where models go beyond plain SDPA: compiled (one graph for a fixed
shape), soft-capping (Gemma2, transformers' eager attention) and a relative position bias (T5,
dash's float-mask path). Tiny random models on the CPU, under deterministic algorithms."""

from __future__ import annotations

import pytest
import torch

from dash_inductor.integrations import routes

from _dispatch_count import OpCounter, sdpa_free

transformers = pytest.importorskip("transformers")
LAYERS = 2
SOFTCAP = "logit soft-capping (softcap) is not supported by dash.attention; " \
          "transformers' eager attention runs it"


@pytest.fixture(autouse=True)
def _fresh_counts(deterministic_algorithms):
    routes.reset()
    yield


def grads_of(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(grads, expected, rtol=1e-4, atol=1e-5):
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=rtol, atol=atol, msg=name)


def test_compiled_llama_compiles_once_over_20_steps():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="dash")
    model = transformers.LlamaForCausalLM(config).train()
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(model, backend=counting_backend)
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(20):
        logits = compiled(input_ids=ids).logits
        logits.square().mean().backward()
    # One frame compiled and no graph break: a guard on Python state read by the integration
    # (its call counts, the op's validation cache) would recompile every step.
    assert len(frames) == 1
    targets = [str(node.target) for node in frames[0].graph.nodes if node.op == "call_function"]
    assert targets.count("dash.attention.default") == LAYERS
    assert not any("scaled_dot_product" in target for target in targets)
    # Compiled code counts the routing decisions once, when the graph is traced.
    assert routes.dash_calls("hf") == LAYERS and routes.fallbacks("hf") == {}
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def gemma2(attn: str, **overrides):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_implementation=attn, **overrides)
    return transformers.Gemma2ForCausalLM(config)


def padded_batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


def causal_lm_step(model, ids, mask):
    """Logits of the real tokens and every gradient, from a loss on the real tokens only (padded
    query rows attend to nothing: eager and SDPA-style attention give them different values)."""
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = logits[mask.bool()]
    real.square().mean().backward()
    return real.detach(), grads_of(model)


@pytest.mark.parametrize("overrides, dash_runs", [
    ({}, False),  # the default config: soft-capping, so transformers' eager attention runs
    ({"attn_logit_softcapping": None, "sliding_window": 4}, True),  # dash, windows in the mask
], ids=["softcap", "no-softcap-window"])
def test_gemma2_trains_and_matches_eager(overrides, dash_runs):
    ids, mask = padded_batch(seed=torch.randint(0, 2**16, ()).item())
    with OpCounter() as counter:
        logits, grads = causal_lm_step(gemma2("dash", **overrides), ids, mask)
    eager_logits, eager_grads = causal_lm_step(gemma2("eager", **overrides), ids, mask)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, eager_grads)
    if dash_runs:
        assert routes.dash_calls("hf") == LAYERS and routes.fallbacks("hf") == {}
        assert counter.counts["dash.attention_backward.default"] == LAYERS
    else:
        assert routes.dash_calls("hf") == 0 and routes.fallbacks("hf") == {SOFTCAP: LAYERS}
        assert "dash.attention.default" not in counter.counts


def t5(attn: str):
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation=attn)
    return transformers.T5ForConditionalGeneration(config)


def seq2seq_step(model, ids, mask, labels):
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), grads_of(model)


def test_t5_position_bias_runs_dash_and_matches_eager():
    generator = torch.Generator().manual_seed(torch.randint(0, 2**16, ()).item())
    ids = torch.randint(1, 64, (2, 10), generator=generator)
    labels = torch.randint(1, 64, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # encoder padding: a bool mask folded into the bias
    with OpCounter() as counter:
        logits, grads = seq2seq_step(t5("dash"), ids, mask, labels)
    # Encoder and decoder self-attention and cross-attention, per layer, all on dash; the
    # relative_attention_bias weights get their gradient through dash's mask gradient.
    assert routes.dash_calls("hf") == 3 * LAYERS and routes.fallbacks("hf") == {}
    assert counter.counts["dash.attention_backward.default"] == 3 * LAYERS
    assert all(name.startswith("dash.") for name in counter.attention_ops())  # no PyTorch SDPA
    eager_logits, eager_grads = seq2seq_step(t5("eager"), ids, mask, labels)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, eager_grads)
    assert any("relative_attention_bias" in name for name in grads)
