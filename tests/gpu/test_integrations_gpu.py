"""GPU tests of the integrations: the "DASH" provider for eager SDPA and ``varlen_attn``,
``attn_implementation="dash"``, and CUDA-graph capture of a training step through each path.

That dash ran is read from the profiler's kernel names (dash's Triton kernels are named after
their ``@triton.jit`` functions), and that PyTorch's attention did not run from the absence of its
flash, memory-efficient and cuDNN kernels; a positive control shows those patterns do catch
PyTorch's kernels. Accuracy follows FlashAttention's rule (``dash_inductor.testing``);
determinism is ``torch.equal``.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import dash_inductor
from dash_inductor.integrations import provider, provider_varlen, routes
from dash_inductor.testing import assert_flash_rule, low_precision_math_sdpa

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_provider = pytest.mark.skipif(provider.registry() is None,
                                    reason="this torch has no flash-attention provider registry")

#: dash's kernels: the portable forward, preprocess, backward and dQ pass, and the Hopper backward.
DASH_KERNELS = ("_attention_forward_kernel", "_preprocess_kernel", "_backward_main_kernel",
                "_backward_dq_kernel", "backward_kernel")
#: PyTorch's attention kernels: FlashAttention-2, memory-efficient (cutlass fmha), cuDNN.
FOREIGN = ("flash", "fmha", "cudnn", "sdpa")
WARMUP, REPLAYS = 3, 2


@pytest.fixture(autouse=True)
def _fresh_counts(deterministic_algorithms):
    routes.reset()
    yield


@contextlib.contextmanager
def provider_active():
    dash_inductor.integrations.activate_provider()
    try:
        yield
    finally:
        dash_inductor.integrations.deactivate_provider()


def kernel_names(fn) -> set[str]:
    """Names of the CUDA kernels ``fn`` launched."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == DeviceType.CUDA}


def assert_dash_only(names: set[str]) -> None:
    ran = [name for name in names if any(kernel in name for kernel in DASH_KERNELS)]
    foreign = [name for name in names if any(pattern in name.lower() for pattern in FOREIGN)]
    assert ran, f"no dash kernel ran: {sorted(names)}"
    assert not foreign, f"PyTorch attention kernels ran: {foreign}"


def _bhle(batch, hq, hkv, seq, dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, hq, seq, dim), (batch, hkv, seq, dim), (batch, hkv, seq, dim),
              (batch, hq, seq, dim))
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]


def _sdpa_grads(q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad_out)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def test_positive_control_the_patterns_catch_pytorchs_sdpa():
    q, k, v, grad_out = _bhle(2, 8, 8, 1024, 128)
    names = kernel_names(lambda: _sdpa_grads(q, k, v, grad_out))
    assert any(pattern in name.lower() for name in names for pattern in FOREIGN), sorted(names)
    assert not any(kernel in name for name in names for kernel in DASH_KERNELS), sorted(names)


@needs_provider
@pytest.mark.parametrize("hkv", [8, 2], ids=["mha", "gqa"])
def test_provider_runs_dash_for_eager_sdpa_and_repeats_bitwise(hkv):
    q, k, v, grad_out = _bhle(2, 8, hkv, 1024, 128, seed=1)
    results = []
    with provider_active():
        names = kernel_names(lambda: results.append(_sdpa_grads(q, k, v, grad_out)))
        results.append(_sdpa_grads(q, k, v, grad_out))
    assert_dash_only(names)
    assert routes.dash_calls("provider.forward") == 2
    assert routes.dash_calls("provider.backward") == 2
    assert routes.fallbacks("provider.forward") == {}
    assert all(torch.equal(a, b) for a, b in zip(*results))
    direct = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = dash_inductor.attention(*direct, is_causal=True, enable_gqa=hkv != 8)
    out.backward(grad_out)
    # The same op with the same arguments: the same bits (for GQA only the output is compared,
    # in case this torch hands the flash op repeated K/V and sums their gradients itself).
    expected = [out.detach(), *(t.grad for t in direct)][:4 if hkv == 8 else 1]
    assert all(torch.equal(a, b) for a, b in zip(results[0], expected))


# -- varlen_attn ----------------------------------------------------------------------------------

LENGTHS = [300, 1000, 17, 700]


def _varlen_call(q, k, v, cu, window):
    from torch.nn.attention.varlen import varlen_attn

    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters \
        and q.shape[1] != k.shape[1] else {}
    return varlen_attn(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), window_size=window, **gqa)


def _varlen_grads(q, k, v, grad_out, cu, window):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = _varlen_call(*leaves, cu, window)
    out.backward(grad_out)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _per_sequence_math(q, k, v, grad_out, cu, causal, dtype):
    """SDPA's math backend one sequence at a time, in ``dtype`` (bf16 computed in bf16, as
    FlashAttention's reference is)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    bounds = cu.tolist()
    outs = []
    with low_precision_math_sdpa(), sdpa_kernel(SDPBackend.MATH):
        for a, b in zip(bounds, bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in leaves)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                       enable_gqa=True).transpose(0, 1))
        out = torch.cat(outs)
        out.backward(grad_out.to(dtype))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@needs_provider
@pytest.mark.skipif(provider_varlen.unavailable_reason() is not None,
                    reason=str(provider_varlen.unavailable_reason()))
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)], ids=["full", "causal"])
@pytest.mark.parametrize("hkv", [8, 2], ids=["mha", "gqa"])
def test_varlen_attn_through_the_provider(window, hkv):
    total = sum(LENGTHS)
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, grad_out = (torch.randn(total, h, 128, device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for h in (8, hkv, hkv, 8))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    results = []
    with provider_active():
        names = kernel_names(lambda: results.append(_varlen_grads(q, k, v, grad_out, cu,
                                                                  window)))
        results.append(_varlen_grads(q, k, v, grad_out, cu, window))
    assert_dash_only(names)
    assert routes.dash_calls("provider.varlen_forward") == 2
    assert routes.dash_calls("provider.varlen_backward") == 2
    assert all(torch.equal(a, b) for a, b in zip(*results))
    causal = window == (-1, 0)
    assert_flash_rule(results[0],
                      _per_sequence_math(q, k, v, grad_out, cu, causal, torch.bfloat16),
                      _per_sequence_math(q, k, v, grad_out, cu, causal, torch.float32),
                      what=f"varlen_attn window={window} hkv={hkv}")


# -- attn_implementation="dash" -------------------------------------------------------------------

LAYERS = 2


def tiny_llama(attn: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def _hf_grads():
    model = tiny_llama("dash").train()
    ids = torch.randint(0, 512, (2, 256), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(3))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_hf_dash_runs_counted_and_repeats_bitwise():
    grads = []
    names = kernel_names(lambda: grads.append(_hf_grads()))
    assert_dash_only(names)
    assert routes.dash_calls("hf") == LAYERS and routes.fallbacks("hf") == {}
    grads.append(_hf_grads())
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# -- CUDA graphs ----------------------------------------------------------------------------------


class TinyAttention(torch.nn.Module):
    """Two attention blocks whose attention is ``attend(q, k, v)`` on (B, H, L, E) views."""

    def __init__(self, attend, dim: int = 256, heads: int = 4):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({name: torch.nn.Linear(dim, dim) for name in "qkvo"})
            for _ in range(2))

    def forward(self, x):
        b, length, dim = x.shape
        for block in self.blocks:
            q, k, v = (block[n](x).view(b, length, self.heads, -1).transpose(1, 2) for n in "qkv")
            x = x + block["o"](self.attend(q, k, v).transpose(1, 2).reshape(b, length, dim))
        return x


def _training(make, loss_of, batches, graphed: bool):
    """Losses and final weights of a training step per batch: all eager, or WARMUP eager steps
    on a side stream and then the captured step replayed for the remaining batches."""
    model, optimizer = make()
    static = [t.clone() for t in batches[0]]
    losses: list[torch.Tensor] = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, *static)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())

    def load(batch):
        for s, t in zip(static, batch):
            s.copy_(t)

    if not graphed:
        for batch in batches:
            load(batch)
            step()
    else:
        side = torch.cuda.Stream()  # warm up off the default stream, as capture needs
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for batch in batches[:WARMUP]:
                load(batch)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = loss_of(model, *static)
            static_loss.backward()
            optimizer.step()
        for batch in batches[WARMUP:]:
            load(batch)
            graph.replay()
            losses.append(static_loss.detach().clone())
    torch.cuda.synchronize()
    return losses, [p.detach().clone() for p in model.parameters()]


def _assert_graph_equals_eager(make, loss_of, batches):
    eager = _training(make, loss_of, batches, graphed=False)
    graphed = _training(make, loss_of, batches, graphed=True)
    assert len(graphed[0]) == WARMUP + REPLAYS
    for step, (a, b) in enumerate(zip(*(run[0] for run in (eager, graphed)))):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} eager, {b.item()} graphed"
    differ = [i for i, (a, b) in enumerate(zip(eager[1], graphed[1])) if not torch.equal(a, b)]
    assert not differ, f"parameters {differ} differ between eager and graph replay"


def _attention_model(attend):
    def make():
        torch.manual_seed(0)
        model = TinyAttention(attend).to(device="cuda", dtype=torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    gen = torch.Generator(device="cuda").manual_seed(4)
    batches = [(torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, generator=gen),)
               for _ in range(WARMUP + REPLAYS)]
    return make, batches


def _square_loss(model, x):
    return model(x).float().square().mean()


def test_cuda_graph_of_a_step_through_the_direct_op():
    make, batches = _attention_model(
        lambda q, k, v: dash_inductor.attention(q, k, v, is_causal=True))
    assert_dash_only(kernel_names(lambda: _square_loss(make()[0], *batches[0]).backward()))
    _assert_graph_equals_eager(make, _square_loss, batches)


@needs_provider
def test_cuda_graph_of_a_step_through_the_provider():
    make, batches = _attention_model(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with provider_active():
        assert_dash_only(kernel_names(lambda: _square_loss(make()[0], *batches[0]).backward()))
        calls = routes.dash_calls("provider.forward")
        _assert_graph_equals_eager(make, _square_loss, batches)
    # Replays run no Python, so only the capture is counted: 2 blocks x (WARMUP + REPLAYS eager
    # steps, WARMUP warm-up steps, 1 captured step).
    assert routes.dash_calls("provider.forward") - calls == 2 * (2 * WARMUP + REPLAYS + 1)
    assert routes.fallbacks("provider.forward") == {}


def test_cuda_graph_of_a_step_through_hf_dash():
    # Under stream capture transformers cannot read position_ids to rule out packed sequences,
    # so it builds a 4-D mask where eager code gets is_causal; both runs get the same 4-D causal
    # mask here, so that eager and captured code run the same dash path.
    seq = 256
    mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril().expand(2, 1, seq, seq)

    def make():
        model = tiny_llama("dash").train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def loss_of(model, embeds):
        logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
        return logits.float().square().mean()

    gen = torch.Generator(device="cuda").manual_seed(5)
    batches = [(torch.randn(2, seq, 256, device="cuda", dtype=torch.bfloat16, generator=gen),)
               for _ in range(WARMUP + REPLAYS)]
    assert_dash_only(kernel_names(lambda: loss_of(make()[0], *batches[0]).backward()))
    _assert_graph_equals_eager(make, loss_of, batches)
    assert routes.fallbacks("hf") == {}
