"""A pre-grad pass the user installed before ``import dash_inductor`` keeps running, and
``disable()`` puts it back. Needs a fresh interpreter, since the import is what installs the pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.fx_passes.pre_grad import pre_grad_passes

    class Counting(CustomGraphPass):
        def __init__(self):
            self.sdpa_calls_seen = []

        def __call__(self, graph):
            self.sdpa_calls_seen.append(
                sum(n.target is F.scaled_dot_product_attention for n in graph.nodes))

        def uuid(self):
            return "counting"

    first, second = Counting(), Counting()
    users = [first, second] if sys.argv[1] == "list" else first
    inductor_config.pre_grad_custom_pass = users

    import dash_inductor  # installs the rewrite, chaining the user's pass(es)

    graphs = []

    def pre_grad_only(gm, example_inputs):  # what Inductor runs first, without code generation
        graphs.append(pre_grad_passes(gm, example_inputs))
        return graphs[-1].forward

    def attention(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch.use_deterministic_algorithms(True)
    q = torch.randn(1, 2, 8, 16)
    out = torch.compile(attention, backend=pre_grad_only)(q)
    torch.testing.assert_close(out, attention(q), atol=1e-5, rtol=1e-5)
    targets = [n.target for n in graphs[0].graph.nodes]
    assert torch.ops.dash.attention.default in targets, targets
    assert F.scaled_dot_product_attention not in targets, targets
    for user_pass in (first, second)[:2 if sys.argv[1] == "list" else 1]:
        assert user_pass.sdpa_calls_seen[0] == 1, user_pass.sdpa_calls_seen
    assert inductor_config.pre_grad_custom_pass is not users
    dash_inductor.disable()
    assert inductor_config.pre_grad_custom_pass is users
    assert inductor_config.joint_custom_post_pass is None
    print("ok")
""")


def _hook_takes_lists() -> bool:
    """torch 2.13+ accepts a list of passes in the pre-grad hook; 2.11 takes one callable."""
    return hasattr(torch._inductor.custom_graph_pass, "get_custom_graph_passes")


@pytest.mark.parametrize("form", ["single", "list"])
def test_user_pass_installed_before_import(form: str) -> None:
    if form == "list" and not _hook_takes_lists():
        pytest.skip("this torch's pre-grad hook takes one callable, not a list")
    result = subprocess.run([sys.executable, "-c", SCRIPT, form], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
