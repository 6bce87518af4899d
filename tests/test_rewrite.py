"""The Inductor pass: which SDPA calls become dash.attention, numerics, caching, chaining, explain().

Every compile here defeats the FX graph and AOTAutograd caches (a hit would hide the pass) except in
the cache tests, which turn them on on purpose. One Inductor cache directory serves the whole
module, so the C++ kernels are built once and later compiles take about a second.
"""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_inductor_cache, run_and_get_code, run_fw_bw_and_get_code

import dash_inductor  # noqa: F401  (registers the op)
from dash_inductor import config
from dash_inductor.inductor import rewrite

OP = "torch.ops.dash.attention.default"
BACKWARD_OP = "torch.ops.dash.attention_backward.default"
MODES = {"strict": (True, False), "warn_only": (True, True), "off": (False, False)}


@pytest.fixture(scope="module", autouse=True)
def inductor_cache():
    with fresh_inductor_cache():
        yield


@pytest.fixture(autouse=True)
def restore_state():
    """Restore the determinism mode, config.rewrite and the passes' installation after each test."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    mode = config.rewrite
    installed = rewrite.PRE_GRAD_PASS.installed
    rewrite.install()
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        config.rewrite = mode
        if installed:
            rewrite.install()
        else:
            rewrite.uninstall()
        torch._dynamo.reset()


class Attention(torch.nn.Module):
    """A small attention block: projections, one SDPA call, output projection."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, dim: int = 16, **sdpa: object) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.sdpa = sdpa

    def forward(self, x, context=None, attn_mask=None):
        context = x if context is None else context
        (b, l, _), s = x.shape, context.shape[1]
        q = self.q(x).view(b, l, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(context).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask, **self.sdpa)
        return self.proj(y.transpose(1, 2).reshape(b, l, -1))


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[1, ..., 5:] = False
    return mask


# name -> (module kwargs, input factory); inputs are fresh random data on every call.
BLOCKS = {
    "gpt_causal": (dict(is_causal=True), lambda: (torch.randn(2, 8, 16),)),
    "gqa": (dict(kv_heads=2, enable_gqa=True, is_causal=True), lambda: (torch.randn(2, 8, 16),)),
    "bool_padding_mask": (dict(), lambda: (torch.randn(2, 8, 16), None, _padding_mask())),
    "float_mask": (dict(), lambda: (torch.randn(2, 8, 16), None, torch.randn(1, 4, 8, 8))),
    "cross_attention": (dict(), lambda: (torch.randn(2, 6, 16), torch.randn(2, 10, 16))),
    "dynamic_length": (dict(is_causal=True), lambda: (torch.randn(2, 8, 16),)),
}


def _grads(model: torch.nn.Module, run, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs if t is not None]
    args, it = [], iter(leaves)
    for t in inputs:
        args.append(None if t is None else next(it))
    model.zero_grad(set_to_none=True)
    out = run(*args)
    out.square().sum().backward()
    grads = [t.grad for t in leaves if t.requires_grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads


def _compile_and_check(name: str, deterministic: bool, warn_only: bool):
    torch.manual_seed(0)
    kwargs, make_inputs = BLOCKS[name]
    model = Attention(**kwargs)
    inputs = make_inputs()
    compiled = torch.compile(model)
    if name == "dynamic_length":
        torch._dynamo.mark_dynamic(inputs[0], 1)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    (out, grads), code = run_and_get_code(_grads, model, compiled, inputs)
    code = "\n".join(code)
    expected_out, expected_grads = _grads(model, model, inputs)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    return model, compiled, inputs, grads, code


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_rewritten_only_under_determinism(name: str, mode: str) -> None:
    """Rewritten in strict and warn-only mode (bitwise-repeatable grads), left alone otherwise;
    forward and grads match eager SDPA either way."""
    model, compiled, inputs, grads, code = _compile_and_check(name, *MODES[mode])
    if mode == "off":
        assert "dash.attention" not in code
        return
    assert OP in code and BACKWARD_OP in code
    assert "scaled_dot_product" not in code
    _, again = _grads(model, compiled, inputs)
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
    if name == "dynamic_length":  # another length runs through the same dynamic graph
        longer = torch.randn(2, 13, 16)
        torch.testing.assert_close(compiled(longer), model(longer), atol=2e-5, rtol=1e-5)


def test_learned_float_mask_keeps_its_gradient() -> None:
    """A float mask that requires grad still gets the same gradient after the rewrite."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = Attention()
    bias = torch.randn(1, 4, 8, 8, requires_grad=True)
    x = torch.randn(2, 8, 16)
    compiled = torch.compile(model)
    out, code = run_fw_bw_and_get_code(lambda: compiled(x, None, bias).square().sum())
    assert OP in "\n".join(code)
    got = bias.grad.clone()
    bias.grad = None
    model(x, None, bias).square().sum().backward()
    torch.testing.assert_close(got, bias.grad, atol=5e-5, rtol=1e-4)


def _call_forms(q, k, v, kv_gqa):
    aten_sdpa = torch.ops.aten.scaled_dot_product_attention
    return (F.scaled_dot_product_attention(q, k, v)
            + F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3)
            + F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0,
                                             is_causal=False, scale=None, enable_gqa=False)
            + F.scaled_dot_product_attention(q, kv_gqa, kv_gqa, is_causal=True, enable_gqa=True)
            + aten_sdpa(q, k, v, is_causal=True)
            + aten_sdpa.default(q, k, v, None, 0.0, False, scale=0.5))


def test_call_forms_all_rewritten() -> None:
    """Positional and keyword forms, default and explicit arguments, the functional and aten ops."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    kv_gqa = torch.randn(2, 2, 8, 8)
    out, code = run_and_get_code(torch.compile(_call_forms), q, k, v, kv_gqa)
    assert "\n".join(code).count(f"{OP}(") == 6
    torch.testing.assert_close(out, _call_forms(q, k, v, kv_gqa), atol=1e-5, rtol=1e-5)
    reports = rewrite.explain(_call_forms, q, k, v, kv_gqa)
    assert len(reports) == 6 and all(r.rewritten and r.reason is None for r in reports)


def _attention_with_a_5d_call(q, k, v):
    """Two SDPA calls, one the op cannot take (SDPA takes extra batch dims, dash does not)."""
    return (F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
            + F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_explain_reports_a_skipped_site_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.use_deterministic_algorithms(True)
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="dash_inductor"):
        first = rewrite.explain(_attention_with_a_5d_call, q, k, v)
        second = rewrite.explain(_attention_with_a_5d_call, q, k, v)
    assert first == second
    skipped = [r for r in first if not r.rewritten]
    assert [r.rewritten for r in first].count(True) == 1 and len(skipped) == 1
    assert "got 5-D" in skipped[0].reason and skipped[0].graph == "pre-grad"
    assert "test_rewrite.py" in skipped[0].site
    logged = [rec.getMessage() for rec in caplog.records if "got 5-D" in rec.getMessage()]
    assert len(logged) == 1


def test_explain_reports_unsupported_shape_and_disabled_state() -> None:
    """A call the op cannot take stays SDPA and says why; so does every call while determinism
    is off, or while the pass is uninstalled."""
    q = torch.randn(2, 2, 2, 8, 8)  # SDPA takes extra batch dims; dash.attention takes 3-D or 4-D

    def five_d(q):
        return F.scaled_dot_product_attention(q, q, q)

    torch.use_deterministic_algorithms(True)
    [report] = rewrite.explain(five_d, q)
    assert not report.rewritten and report.reason
    torch.use_deterministic_algorithms(False)
    [report] = rewrite.explain(five_d, q[0])
    assert not report.rewritten and "deterministic algorithms are off" in report.reason
    config.rewrite = "always"
    [report] = rewrite.explain(five_d, q[0])
    assert report.rewritten
    rewrite.uninstall()
    [report] = rewrite.explain(five_d, q[0])
    assert not report.rewritten and "disable" in report.reason
    assert not rewrite.PRE_GRAD_PASS.installed


def handwritten_attention(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(q.shape[-1]))
    return scores.add(mask).softmax(dim=-1).matmul(v)


def test_handwritten_attention_fused_by_inductor_is_rewritten() -> None:
    """fuse_attention turns this into SDPA in the joint graph; the joint pass then swaps it."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 16, 16)
    compiled = torch.compile(handwritten_attention)
    counters.clear()
    out, code = run_fw_bw_and_get_code(lambda: compiled(q, k, v, mask).square().sum())
    assert counters["inductor"]["fuse_attention"] >= 1
    code = "\n".join(code)
    assert OP in code and BACKWARD_OP in code and "scaled_dot_product" not in code
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    handwritten_attention(q, k, v, mask).square().sum().backward()
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=5e-5, rtol=1e-4)
    [report] = rewrite.explain(handwritten_attention, q, k, v, mask)
    assert report.rewritten and report.graph == "joint"


def test_multihead_attention_rewritten_in_joint_graph() -> None:
    """nn.MultiheadAttention reaches SDPA through a call Dynamo keeps opaque; the joint pass
    still swaps the fused op, and the gradients match eager."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 8, 16, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()

    def block(x):
        return mha(x, x, x, attn_mask=~mask, need_weights=False)[0]

    compiled = torch.compile(block)
    out, code = run_fw_bw_and_get_code(lambda: compiled(x))
    assert OP in "\n".join(code) and BACKWARD_OP in "\n".join(code)
    got = [t.grad.clone() for t in (x, *mha.parameters())]
    for t in (x, *mha.parameters()):
        t.grad = None
    torch.testing.assert_close(out, block(x), atol=2e-5, rtol=1e-5)
    block(x).sum().backward()
    for g, t in zip(got, (x, *mha.parameters()), strict=True):
        torch.testing.assert_close(g, t.grad, atol=5e-5, rtol=1e-4)


def _fw_bw_code(compiled, x) -> str:
    return "\n".join(run_fw_bw_and_get_code(lambda: compiled(x))[1])


def test_second_compile_hits_cache_and_toggling_recompiles() -> None:
    """With the FX graph and AOTAutograd caches on, a compile after dynamo.reset() is served from
    the cache and still holds the op; toggling determinism (or config.rewrite) never reuses the
    graph compiled under the other decision."""
    torch.manual_seed(0)
    model, x = Attention(is_causal=True), torch.randn(2, 8, 16)
    torch.use_deterministic_algorithms(True)
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for hit in (False, True):
            torch._dynamo.reset()
            counters.clear()
            assert OP in _fw_bw_code(torch.compile(model), x)
            assert counters["aot_autograd"]["autograd_cache_hit" if hit else "autograd_cache_miss"]
        compiled = torch.compile(model)
        for enabled, rewritten in ((True, True), (False, False), (True, True)):
            torch.use_deterministic_algorithms(enabled)
            assert (OP in _fw_bw_code(compiled, x)) is rewritten
        torch.use_deterministic_algorithms(False)
        config.rewrite = "always"  # read at compile time: a new compile picks it up
        torch._dynamo.reset()
        assert OP in _fw_bw_code(torch.compile(model), x)


class RecordingPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    """A user's pre-grad pass: counts SDPA calls it sees."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(sum(n.target is F.scaled_dot_product_attention for n in graph.nodes))

    def uuid(self) -> str:
        return "recording-pass"


def test_user_pre_grad_pass_chained_and_restored() -> None:
    torch.use_deterministic_algorithms(True)
    rewrite.uninstall()
    user_pass = RecordingPass()
    with torch._inductor.config.patch(pre_grad_custom_pass=user_pass):
        rewrite.install()
        assert torch._inductor.config.pre_grad_custom_pass is rewrite.PRE_GRAD_PASS
        _, code = run_and_get_code(torch.compile(_attention_with_a_5d_call),
                                   *torch.randn(3, 1, 2, 8, 8))
        assert user_pass.seen == [2]  # the user's pass runs first and sees both SDPA calls
        assert "\n".join(code).count(f"{OP}(") == 1
        rewrite.uninstall()
        assert torch._inductor.config.pre_grad_custom_pass is user_pass
    rewrite.install()


def test_uuid_and_pickle_follow_decision_and_chained_uuids() -> None:
    """Some torch versions pickle Inductor's config (with the hooks) into cache keys: the passes
    pickle by name plus uuid, so those keys also change with the decision."""
    torch.use_deterministic_algorithms(True)
    on = rewrite.PRE_GRAD_PASS.uuid(), pickle.dumps(rewrite.JOINT_PASS)
    torch.use_deterministic_algorithms(False)
    off = rewrite.PRE_GRAD_PASS.uuid(), pickle.dumps(rewrite.JOINT_PASS)
    config.rewrite = "always"
    assert on[0] != off[0] and on[1] != off[1]
    assert (rewrite.PRE_GRAD_PASS.uuid(), pickle.dumps(rewrite.JOINT_PASS)) == on
    assert pickle.loads(on[1]) is rewrite.JOINT_PASS
    rewrite.uninstall()
    with torch._inductor.config.patch(pre_grad_custom_pass=lambda graph: None):
        rewrite.install()
        assert rewrite.PRE_GRAD_PASS.uuid() is None  # a chained pass without uuid: no caching
        rewrite.uninstall()
    rewrite.install()


def test_a_site_without_a_stack_trace_is_labelled_by_what_it_is():
    """A pre-grad node without a stack trace names its module and node, and is not called fused;
    a joint-graph node is Inductor's fusion; with a trace, file:line in function."""
    from dash_inductor.inductor.sites import _site_of

    graph = torch.fx.Graph()
    node = graph.call_function(F.scaled_dot_product_attention, ())
    assert _site_of(node, "pre-grad") == f"node {node.name}, no source location in the graph"
    node.meta["nn_module_stack"] = {"a": ("layers.0.attn", torch.nn.MultiheadAttention)}
    assert _site_of(node, "pre-grad") == f"node {node.name}, in layers.0.attn (MultiheadAttention)"
    assert _site_of(node, "joint").startswith("attention fused by Inductor")
    node.meta["stack_trace"] = '  File "model.py", line 16, in forward\n    y = sdpa(q, k, v)\n'
    assert _site_of(node, "pre-grad") == "model.py:16 in forward"


def test_rewriting_on_the_cpu_says_once_what_it_costs(caplog):
    """On the CPU the rewrite runs dash's reference, slower than PyTorch's own CPU attention: an
    INFO line says so once per process, with the way back (rewrite='off')."""
    from dash_inductor.inductor import sites

    sites._cpu_noted.clear()
    torch.use_deterministic_algorithms(True)
    q = torch.randn(1, 2, 16, 8)
    with caplog.at_level("INFO", logger="dash_inductor"):
        for _ in range(2):
            dash_inductor.explain(lambda q: F.scaled_dot_product_attention(q, q, q), q)
    notes = [r for r in caplog.records if sites.CPU_NOTE in r.getMessage()]
    assert len(notes) == 1 and "rewrite = 'off'" in notes[0].getMessage()
