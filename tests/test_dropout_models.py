"""Attention dropout in whole models under torch.compile: GPT-2, BERT and T5 (transformers,
``attn_implementation="sdpa"``) and ``nn.TransformerEncoderLayer``, tiny and random, in training
mode with their default dropout (0.1), under ``torch.use_deterministic_algorithms(True)``.

What it shows: every attention site of each model (T5's position bias and cross-attention
included) is rewritten to ``dash.attention`` with the model's dropout_p, and no SDPA is left in
the graphs; two 2-step training runs from the same ``torch.manual_seed`` give the same losses and
gradients bit for bit, and another seed other gradients; with only attention dropout on, a
sample's output is the same alone as at index 0 of a larger batch (docs/guarantees.md: the mask
depends on the sample's index, not on the batch size).

What it cannot show: the GPU's bits, or races. On the CPU the rewritten op runs its PyTorch
reference (not the Triton kernels, whose masks tests/test_dropout.py checks in the interpreter),
so these tests check the order of the RNG draws and of every sum, not the kernels'
synchronization (the GPU tests do that). The backend runs Inductor's graph passes (the rewrite
and AOTAutograd's partition) and then the partitioned graphs as they are: Inductor's code
generation took about a minute for GPT-2's forward and backward on two cores and decides nothing
about attention (tests/test_rewrite_unmatched.py trains a compiled encoder layer with it).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx

from dash_inductor.inductor import rewrite

P = 0.1  # every model's default attention dropout
LAYERS, WIDTH, HEADS, VOCAB, SEQ, DECODER_SEQ, BATCH = 2, 32, 4, 128, 16, 8, 3
# nn.Dropout modules that hold the attention's p (the models pass their .p to SDPA); every other
# nn.Dropout is the model's own, on hidden states.
ATTENTION_DROPOUTS = ("attn.attn_dropout", "attention.self.dropout")


pytestmark = pytest.mark.usefixtures("fresh_compiles")


# use_cache=False: training needs no KV cache, and tracing transformers' cache objects costs
# Dynamo seconds per compile.


def gpt2():
    t = pytest.importorskip("transformers")
    config = t.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                          n_positions=SEQ, use_cache=False, attn_implementation="sdpa")
    assert config.attn_pdrop == P
    return t.GPT2LMHeadModel(config), lambda m, ids: m(input_ids=ids).logits, LAYERS


def bert():
    t = pytest.importorskip("transformers")
    config = t.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                          max_position_embeddings=SEQ, attn_implementation="sdpa")
    assert config.attention_probs_dropout_prob == P
    return t.BertForMaskedLM(config), lambda m, ids: m(input_ids=ids).logits, LAYERS


def t5():
    t = pytest.importorskip("transformers")
    config = t.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH,
                        num_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                        relative_attention_max_distance=16, decoder_start_token_id=0,
                        pad_token_id=0, use_cache=False, attn_implementation="sdpa")
    assert config.dropout_rate == P

    def logits(m, ids):
        return m(input_ids=ids, decoder_input_ids=ids[:, :DECODER_SEQ]).logits

    # Per layer: encoder self-attention, decoder self-attention and cross-attention.
    return t.T5ForConditionalGeneration(config), logits, 3 * LAYERS


def encoder_layers():
    layers = [torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=P,
                                               batch_first=True) for _ in range(LAYERS)]
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), *layers,
                                torch.nn.Linear(WIDTH, VOCAB))
    return model, lambda m, ids: m(ids), LAYERS


MODELS = [gpt2, bert, t5, encoder_layers]


class InductorPasses:
    """A torch.compile backend: Inductor's ``compile_fx`` (its pre-grad, joint-graph and
    partitioning passes, the rewrite's among them), whose forward and backward graphs then run as
    FX graphs instead of generated code. Keeps those graphs for the tests to read."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        def run_as_is(graph, example_inputs, **kwargs):
            self.graphs.append(graph)
            return make_boxed_func(graph.forward)

        return compile_fx(gm, example_inputs, inner_compile=run_as_is)

    def calls(self, op) -> list[torch.fx.Node]:
        return [node for graph in self.graphs for node in graph.graph.nodes
                if node.op == "call_function" and node.target is op]


def assert_every_site_drops_on_dash(reports, backend, sites, backward=True):
    # A site left out of every graph (a graph break) would not be reported: count them too.
    assert len(reports) == sites and all(r.rewritten for r in reports), reports
    forwards = backend.calls(torch.ops.dash.attention.default)
    assert len(forwards) == sites
    # dash.attention(q, k, v, attn_mask, dropout_p, ...): SDPA's order.
    assert [n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p") for n in forwards] \
        == [P] * sites
    assert len(backend.calls(torch.ops.dash.dropout_rng.default)) == sites
    if backward:
        assert len(backend.calls(torch.ops.dash.attention_backward.default)) == sites
    targets = {str(n.target) for g in backend.graphs for n in g.graph.nodes}
    assert not any("scaled_dot_product" in target for target in targets)


def batch_of_ids(seed: int, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("build", MODELS, ids=lambda build: build.__name__)
def test_training_repeats_bitwise_with_every_site_dropping_on_dash(build):
    data_seed = random.randrange(2**31)  # fresh data each run; the seed is in every message
    torch.manual_seed(data_seed)
    model, logits, sites = build()
    model.train()
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    steps = [batch_of_ids(data_seed + i) for i in range(2)]
    backend = InductorPasses()

    def loss(model, ids):
        out = logits(model, ids)
        return F.cross_entropy(out.flatten(0, 1), ids.roll(-1, dims=1)[:, :out.shape[1]].flatten())

    compiled = torch.compile(loss, backend=backend, dynamic=False)

    def train(seed: int) -> list[torch.Tensor]:
        """Losses and every parameter's gradient of 2 SGD steps from the same weights."""
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(seed)
        results = []
        for ids in steps:
            optimizer.zero_grad(set_to_none=True)
            value = compiled(model, ids)
            value.backward()
            results += [value.detach(), *(p.grad.clone() for p in model.parameters())]
            optimizer.step()  # so the second step starts from weights the first one's bits set
        return results

    with rewrite.recording() as reports:
        first = train(data_seed)
    assert_every_site_drops_on_dash(reports, backend, sites)
    again, other = train(data_seed), train(data_seed + 1)
    assert len(backend.graphs) == 2, f"recompiled (data seed {data_seed})"
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), data_seed
    # The test can fail: another seed draws other masks, and the gradients change.
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True)), data_seed


@pytest.mark.parametrize("build", MODELS, ids=lambda build: build.__name__)
def test_a_sample_gives_the_same_bits_alone_or_first_in_a_batch(build):
    """docs/guarantees.md: a sample's mask depends on its index, not on the batch size, and the
    bits on neither. Model level: sample 0's logits (the forward, in training mode) are the same
    alone as at index 0 of a batch of 3, under the same seed. Gradients of the weights mix the
    samples, so only the forward is compared.

    The models' own nn.Dropout layers on hidden states are set to p = 0: they are PyTorch's
    (Inductor's RNG), not dash's, and not batch invariant (with generated code, an encoder
    layer's sample 0 changed with the batch under them; with these FX graphs, Inductor's random
    op draws from the generator by tensor size, which shifts the later draws). Attention keeps
    its default p, so dash's mask is the only random thing left: the other seed's output differs.
    The rest of the model (matmuls, norms) is batch invariant on the CPU at these sizes, which is
    PyTorch's doing, not dash's promise. T5 (its 8-token decoder) caught the reference giving a
    batch of one other bits, before it made its operands contiguous."""
    data_seed = random.randrange(2**31)
    torch.manual_seed(data_seed)
    model, logits, sites = build()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and not name.endswith(ATTENTION_DROPOUTS):
            module.p = 0.0
    model.train()
    ids = batch_of_ids(data_seed)
    backend = InductorPasses()
    compiled = torch.compile(logits, backend=backend, dynamic=False)
    outs = []
    with torch.no_grad(), rewrite.recording() as reports:
        for batch, seed in ((BATCH, data_seed), (1, data_seed), (1, data_seed + 1)):
            torch.manual_seed(seed)
            outs.append(compiled(model, ids[:batch]))
    # Two compiles (batch 3 and batch 1), each with every site on dash.
    assert_every_site_drops_on_dash(reports, backend, 2 * sites, backward=False)
    whole, alone, other_seed = outs
    assert torch.equal(whole[:1], alone), data_seed
    assert not torch.equal(alone, other_seed), data_seed
