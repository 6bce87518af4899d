"""attn_implementation="dash" on tiny random transformers models (CPU, eager, deterministic)."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch

import dash_inductor
from dash_inductor.integrations import routes
from dash_inductor.integrations.import_hook import after_import

from _dispatch_count import OpCounter, sdpa_free

transformers = pytest.importorskip("transformers")
LAYERS = 2


@pytest.fixture(autouse=True)
def _fresh_counts(deterministic_algorithms):
    routes.reset()
    yield


def llama(attn: str, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn)
    return transformers.LlamaForCausalLM(config)


def gpt2(attn: str, seed: int = 0, attn_pdrop: float = 0.0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, attn_pdrop=attn_pdrop,
        bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config)


def batch(padded: bool):
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (3, 12))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding
        mask[2, 9:] = 0  # right padding
    return ids, mask


def train_step(model, ids, mask):
    """Logits and the gradient of every parameter after one backward."""
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_dash_runs_matches_sdpa_and_repeats_bitwise(make, padded):
    ids, mask = batch(padded)
    with OpCounter() as counter:
        logits, grads = train_step(make("dash"), ids, mask)
    ops = counter.attention_ops()
    assert ops == {"dash.attention.default": LAYERS, "dash.attention_backward.default": LAYERS}
    assert sdpa_free(counter)
    assert routes.dash_calls("hf") == LAYERS and routes.fallbacks("hf") == {}

    sdpa_logits, sdpa_grads = train_step(make("sdpa"), ids, mask)
    torch.testing.assert_close(logits, sdpa_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, sdpa_grads[name], rtol=1e-4, atol=1e-5)

    again_logits, again_grads = train_step(make("dash"), ids, mask)
    assert torch.equal(logits, again_logits)
    assert all(torch.equal(grad, again_grads[name]) for name, grad in grads.items())


def test_training_dropout_runs_dash_and_repeats_under_manual_seed():
    ids, mask = batch(padded=False)
    runs = []
    for _ in range(2):
        model = gpt2("dash", attn_pdrop=0.1)  # seeds the generator: both runs draw alike
        with OpCounter() as counter:
            runs.append(train_step(model, ids, mask))
        assert counter.counts["dash.attention.default"] == LAYERS
    assert routes.fallbacks("hf") == {} and routes.dash_calls("hf") == 2 * LAYERS
    (logits, grads), (again_logits, again_grads) = runs
    assert torch.equal(logits, again_logits)
    assert all(torch.equal(grad, again_grads[name]) for name, grad in grads.items())


def test_eval_mode_drops_dropout_and_runs_dash():
    ids, mask = batch(padded=True)
    model = gpt2("dash", attn_pdrop=0.1).eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert routes.dash_calls("hf") == LAYERS and routes.fallbacks("hf") == {}


def test_registered_with_both_interfaces():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    dash_inductor.integrations.register_hf()  # idempotent
    assert ALL_ATTENTION_FUNCTIONS["dash"] is dash_inductor.integrations.hf.dash_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["dash"] is sdpa_mask
    assert dash_inductor.integrations.hf.registered()


def test_after_import_runs_once_when_the_module_is_imported(tmp_path, monkeypatch):
    name = "dash_after_import_probe"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        VALUE = 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import(name, lambda module: seen.append(module.VALUE))
    assert seen == [] and name not in sys.modules
    module = __import__(name)
    try:
        assert seen == [42]
        assert type(module.__loader__).__name__ == "SourceFileLoader"
        assert not any(getattr(f, "name", None) == name for f in sys.meta_path)
        after_import(name, lambda module: seen.append(-1))  # already imported: now
        assert seen == [42, -1]
    finally:
        sys.modules.pop(name, None)


def test_example_reproduces_on_the_paths_cpu_runs(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "train_tiny_qwen2.py"
    spec = importlib.util.spec_from_file_location("train_tiny_qwen2", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--device", "cpu", "--steps", "2", "--paths", "hf", "provider"]) == 0
    printed = capsys.readouterr().out
    assert "hf: two runs bit-identical: True; {'hf dash': 8}" in printed
    assert "provider: skipped" in printed
