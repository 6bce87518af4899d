"""Every bad input gets a clear error that names the argument and the expected form."""

from __future__ import annotations

import pytest
import torch

import dash_inductor


def _qkv(q=(2, 3, 5, 8), k=(2, 3, 7, 8), v=None, dtype=torch.float32):
    v = v or (*k[:-1], k[-1])
    return torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(v, dtype=dtype)


BAD_INPUTS = {
    "rank": (lambda: (torch.randn(5, 8), torch.randn(7, 8), torch.randn(7, 8)), {},
             r"query must be 3-D \(H, L, E\) or 4-D \(B, H, L, E\), got 2-D"),
    "mixed rank": (lambda: (torch.randn(3, 5, 8), *_qkv()[1:]), {}, r"same rank"),
    "batch": (lambda: _qkv(q=(2, 3, 5, 8), k=(3, 3, 7, 8)), {},
              r"the batch size of query \(2\) and key/value \(3\) must match"),
    "heads": (lambda: _qkv(q=(2, 4, 5, 8), k=(2, 3, 7, 8)), {}, r"query has 4 heads and key/value 3"),
    "gqa ratio": (lambda: _qkv(q=(2, 4, 5, 8), k=(2, 3, 7, 8)), dict(enable_gqa=True),
                  r"multiple of the number of key/value heads"),
    "head dim": (lambda: _qkv(q=(2, 3, 5, 8), k=(2, 3, 7, 6)), {}, r"same head dim E"),
    "key/value": (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8),
                           torch.randn(2, 3, 6, 8)), {}, r"key \(..., S, E\) and value"),
    "dtype": (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8).double(),
                       torch.randn(2, 3, 7, 8)), {}, r"same dtype"),
    "integer": (lambda: tuple(torch.ones(2, 3, 5, 8, dtype=torch.int32) for _ in range(3)), {},
                r"query has dtype torch.int32; expected a floating dtype"),
    "device": (lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8, device="meta"),
                        torch.randn(2, 3, 7, 8, device="meta")), {}, r"same device"),
    "mask shape": (lambda: _qkv(), dict(attn_mask=torch.ones(2, 3, 5, 6, dtype=torch.bool)),
                   r"attn_mask of shape \(2, 3, 5, 6\) does not broadcast to .*\(2, 3, 5, 7\)"),
    "mask dtype": (lambda: _qkv(), dict(attn_mask=torch.ones(5, 7, dtype=torch.int64)),
                   r"attn_mask must be bool \(True = attend\) or a float mask"),
    "mask and causal": (lambda: _qkv(), dict(attn_mask=torch.ones(5, 7, dtype=torch.bool),
                                             is_causal=True), r"attn_mask must be None when is_causal"),
    "scale": (lambda: _qkv(), dict(scale=float("nan")), r"scale must be a finite float"),
    "empty head dim": (lambda: _qkv(q=(2, 3, 5, 0), k=(2, 3, 7, 0)), {}, r"head dim E .* at least 1"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_error_names_argument_and_form(name):
    make, kwargs, pattern = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=pattern):
        dash_inductor.attention(*make(), **kwargs)


def test_error_also_at_trace_time():
    """The fake kernel validates too, so torch.compile reports the same message."""
    torch._dynamo.reset()
    q, k, v = _qkv(q=(2, 4, 5, 8), k=(2, 3, 7, 8))
    with pytest.raises(Exception, match=r"query has 4 heads and key/value 3"):
        torch.compile(dash_inductor.attention, fullgraph=True)(q, k, v)


def test_unsupported_reason_explains_instead_of_raising():
    q, k, v = _qkv()
    assert dash_inductor.unsupported_reason(q, k, v) is None
    assert "dropout" in dash_inductor.unsupported_reason(q, k, v, dropout_p=0.1)
    assert "batch size" in dash_inductor.unsupported_reason(*_qkv(k=(3, 3, 7, 8)))


def test_config_rejects_unknown_values():
    with pytest.raises(ValueError, match=r"schedule must be one of"):
        with dash_inductor.config.patch(schedule="fastest"):
            pass
    with pytest.raises(AttributeError, match=r"no option 'shedule'"):
        with dash_inductor.config.patch(shedule="shift"):
            pass
    assert dash_inductor.config.schedule == "auto"


def test_atomic_schedule_refused_under_deterministic_algorithms(restore_deterministic_algorithms):
    """The non-deterministic schedule raises in strict mode and warns in warn-only mode, like
    PyTorch's own non-deterministic ops, when the forward runs (exercised through the interpreted
    Triton kernels)."""
    q, k, v = (t.requires_grad_() for t in _qkv(q=(1, 1, 8, 16), k=(1, 1, 8, 16)))
    with dash_inductor.config.patch(cpu_backend="triton", schedule="atomic"):
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match=r"schedule='atomic' .* not deterministic"):
            dash_inductor.attention(q, k, v)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"schedule='atomic'"):
            out = dash_inductor.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    torch.use_deterministic_algorithms(True)
    with dash_inductor.config.patch(cpu_backend="triton"):
        dash_inductor.attention(q, k, v, schedule="recompute").sum().backward()


def test_bad_choices_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"schedule must be one of"):
        dash_inductor.attention(q, k, v, schedule="fastest")
    with pytest.raises(ValueError, match=r"kernel must be one of"):
        dash_inductor.attention(q, k, v, kernel="cuda")
    with pytest.raises(ValueError, match=r"kernel must be one of"):
        torch.ops.dash.attention(q, k, v, kernel_path="cuda")
