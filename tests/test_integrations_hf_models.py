"""attn_implementation="dash" where models go beyond plain SDPA: compiled (one graph for a fixed
shape). Tiny random models on the CPU, under deterministic algorithms."""

from __future__ import annotations

import pytest
import torch

from dash_inductor.integrations import routes

transformers = pytest.importorskip("transformers")
LAYERS = 2


@pytest.fixture(autouse=True)
def _fresh_counts(deterministic_algorithms):
    routes.reset()
    yield


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
