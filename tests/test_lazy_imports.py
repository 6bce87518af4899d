"""``import dash_inductor`` imports neither Dynamo nor Inductor (seconds each) nor Triton, yet the
ops are registered and the rewrite and the Dynamo hints are in place by the time anything
compiles. Each script runs in a fresh interpreter, since what an import loads is decided once per
process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "torch._inductor.pattern_matcher",
         "torch.nn.attention.varlen", "torch.distributed.tensor", "triton")

SCRIPTS = {
    "import": f"""
        import sys
        import torch
        import dash_inductor

        assert not [m for m in {HEAVY!r} if m in sys.modules], sorted(sys.modules)
        for op in ("attention", "attention_backward", "attention_mask_grad", "dropout_rng",
                   "varlen_attention", "varlen_attention_backward"):
            assert hasattr(torch.ops.dash, op), op
        from dash_inductor.inductor import rewrite
        assert rewrite.installed()
        from dash_inductor.library import varlen
        from torch.nn.attention.varlen import AuxRequest
        assert varlen.AuxRequest is AuxRequest
    """,
    "compile": """
        import sys
        import torch
        import torch.nn.functional as F
        import dash_inductor
        from dash_inductor.library.op import last_plans

        def attention(q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

        torch.use_deterministic_algorithms(True)
        q = torch.randn(1, 2, 8, 16)
        out = torch.compile(attention)(q)  # the first import of Dynamo and Inductor
        torch.testing.assert_close(out, attention(q), atol=1e-5, rtol=1e-5)
        assert [plan.kernel for plan in last_plans()] == ["reference"], last_plans()
        from torch._inductor import config
        from dash_inductor.inductor import rewrite
        assert config.pre_grad_custom_pass is rewrite.PRE_GRAD_PASS
        assert config.joint_custom_post_pass is rewrite.JOINT_PASS
    """,
    "disable_first": """
        import dash_inductor
        from dash_inductor.inductor import rewrite

        dash_inductor.disable()  # before Inductor is imported: it must not install on import
        assert not rewrite.installed()
        from torch._inductor import config
        assert config.pre_grad_custom_pass is None and config.joint_custom_post_pass is None
        dash_inductor.enable()
        assert config.pre_grad_custom_pass is rewrite.PRE_GRAD_PASS and rewrite.installed()
    """,
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_in_a_fresh_interpreter(name: str) -> None:
    script = textwrap.dedent(SCRIPTS[name]) + "print('ok')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
