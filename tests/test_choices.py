"""The backward's choices (schedule, kernel path, ...) are captured when the forward runs, travel
with the op, reach the launcher, and come back as plans; the compiled path bakes them in, keeps
them until its graph is dropped, and a new compile under other choices gets a graph of its own."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_inductor_cache, run_fw_bw_and_get_code

import dash_inductor
from dash_inductor import config
from dash_inductor.library import op as library
from dash_inductor.inductor import rewrite
from dash_inductor.__main__ import info_lines
from dash_inductor.ops import catalog


def _qkv(seed: int = 0, causal_len: int = 40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, causal_len, 16, generator=gen, requires_grad=True) for _ in range(3)]


def _grads(schedule: str | None, seed: int = 0) -> list[torch.Tensor]:
    q, k, v = _qkv(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dash_inductor.attention(q, k, v, is_causal=True, schedule=schedule).backward(
        torch.randn(1, 2, 40, 16, generator=gen))
    return [t.grad for t in (q, k, v)]


def test_schedule_chosen_in_a_block_applies_to_a_backward_outside_it() -> None:
    """The README's example: forward inside ``config.patch``, backward after the block."""
    q, k, v = _qkv()
    with config.patch(cpu_backend="triton", schedule="shift"):
        out = dash_inductor.attention(q, k, v, is_causal=True)
    with config.patch(schedule="ascending"):  # what is in force at backward time is ignored
        out.backward(torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(1)))
    backward = library.last_plans()[-1]
    assert (backward.op, backward.schedule_requested, backward.schedule.name) == \
        ("backward", "shift", "shift")
    assert backward.kernel == "portable"
    with config.patch(cpu_backend="triton"):
        shift = _grads("shift")
        assert library.last_plans()[-1].schedule.name == "shift"
        ascending = _grads("ascending")
    for got, expected, other in zip((q.grad, k.grad, v.grad), shift, ascending):
        assert torch.equal(got, expected)
    assert not all(torch.equal(a, b) for a, b in zip(shift, ascending))  # the choice shows in bits


def test_explicit_arguments_override_the_config_and_plans_say_what_ran() -> None:
    q, k, v = _qkv(seed=2)
    with config.patch(cpu_backend="triton", schedule="shift"):
        dash_inductor.attention(q, k, v, schedule="auto", kernel="portable").sum().backward()
    forward, backward = library.last_plans()[-2:]
    assert (forward.op, forward.kernel, forward.kernel_reason, forward.schedule) == \
        ("forward", "portable", None, None)
    assert backward.schedule_requested == "auto"
    assert backward.schedule.name in catalog.DETERMINISTIC and backward.fallback is None
    assert backward.grid[0] >= 1 and backward.config is not None
    dash_inductor.attention(q, k, v).sum().backward()  # the CPU reference also leaves plans
    assert [p.kernel for p in library.last_plans()[-2:]] == ["reference", "reference"]
    assert any(line.startswith("last launch: Plan(op='backward'") for line in info_lines())


def test_auto_kernel_says_why_and_hopper_is_refused_at_forward_time() -> None:
    q, k, v = _qkv(seed=3)
    with config.patch(cpu_backend="triton"):
        dash_inductor.attention(q, k, v)
        assert "device 'cpu'" in library.last_plans()[-1].kernel_reason
        with pytest.raises(ValueError, match="kernel='hopper'"):
            dash_inductor.attention(q, k, v, kernel="hopper")


def test_schema_ends_with_the_choices_in_config_order_keyword_only() -> None:
    for op in (torch.ops.dash.attention.default, torch.ops.dash.attention_backward.default):
        arguments = op._schema.arguments[-len(config.CHOICES):]
        assert [a.name for a in arguments] == [*config.CHOICES[:-1], "kernel_path"]
        assert all(a.kwarg_only for a in arguments)


@pytest.fixture
def deterministic_compile():
    """Determinism on and the passes installed; both restored afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    installed = rewrite.PRE_GRAD_PASS.installed
    torch.use_deterministic_algorithms(True)
    rewrite.install()
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled)
        if not installed:
            rewrite.uninstall()
        torch._dynamo.reset()


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_compiled_graph_bakes_the_schedule_and_a_change_recompiles(deterministic_compile) -> None:
    """With the FX graph and AOTAutograd caches on, a compile after a schedule change is not
    served the graph compiled under the old schedule."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(seed=4))
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for schedule in ("descending", "shift", "descending"):
            torch._dynamo.reset()
            with config.patch(schedule=schedule):
                uuid = rewrite.PRE_GRAD_PASS.uuid()
                compiled = torch.compile(_attend)
                _, code = run_fw_bw_and_get_code(lambda: compiled(q, k, v).sum())
            code = "\n".join(code)
            assert f"'{schedule}'" in code and "torch.ops.dash.attention" in code
            assert ("'shift'" in code) == (schedule == "shift")
        with config.patch(schedule="shift"):
            assert rewrite.PRE_GRAD_PASS.uuid() != uuid


def test_a_compiled_function_keeps_its_schedule_until_a_reset(deterministic_compile) -> None:
    """Dynamo does not guard on dash's configuration: a function already compiled keeps the
    schedule it was compiled with after a change (as the docs say), and takes the new one once
    ``torch.compiler.reset()`` drops its graph."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(seed=5))
    compiled = torch.compile(_attend)
    with config.patch(schedule="descending"):
        compiled(q, k, v).sum().backward()
    assert library.last_plans()[-1].schedule_requested == "descending"
    with config.patch(schedule="shift"):
        compiled(q, k, v).sum().backward()
        assert library.last_plans()[-1].schedule_requested == "descending"
        torch.compiler.reset()
        compiled(q, k, v).sum().backward()
        assert library.last_plans()[-1].schedule_requested == "shift"


def test_explain_and_log_name_the_schedule_and_kernel_of_each_site(deterministic_compile,
                                                                   caplog) -> None:
    q, k, v = (t.detach() for t in _qkv(seed=5))
    with config.patch(schedule="descending", kernel="portable"), \
            caplog.at_level("DEBUG", logger="dash_inductor"):
        [report] = dash_inductor.explain(_attend, q, k, v)
    assert report.rewritten and (report.schedule, report.kernel) == ("descending", "portable")
    assert any("schedule 'descending', kernel 'portable'" in r.getMessage() for r in caplog.records)


def test_rewrite_off_is_not_blamed_on_determinism(deterministic_compile) -> None:
    q, k, v = (t.detach() for t in _qkv(seed=6))
    with config.patch(rewrite="off"):
        [report] = dash_inductor.explain(_attend, q, k, v)
    assert not report.rewritten and report.schedule is None
    assert "rewrite='off'" in report.reason and "deterministic" not in report.reason
