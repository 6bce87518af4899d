"""Every bad input gets a clear error that names the argument and the expected form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dash_inductor
from dash_inductor.library import shapes


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


def _nested(layout: torch.layout) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=layout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
@pytest.mark.parametrize("argument", ["query", "key", "value"])
def test_nested_tensors_are_refused_by_name(layout, argument):
    """The public entries call ``check_not_nested`` before the op, where the dispatcher would
    reject a nested tensor without naming it; the op's own validation says the same."""
    dense = torch.randn(2, 2, 4, 8)
    args = {"query": dense, "key": dense, "value": dense, argument: _nested(layout)}
    message = (rf"^dash.attention: {argument} is a nested tensor \(layout {layout}\); nested "
               rf"tensors are not supported. .*dash_inductor.varlen_attention")
    with pytest.raises(ValueError, match=message):
        shapes.check_not_nested(*args.values())
    with pytest.raises(ValueError, match=message):
        shapes.canonicalize(*args.values())
    with pytest.raises(ValueError, match=rf"^dash.varlen_attention: {argument} is a nested"):
        shapes.check_not_nested(*args.values(), where="dash.varlen_attention")
    shapes.check_not_nested(dense, dense, dense)


def test_error_also_at_trace_time():
    """The fake kernel validates too, so torch.compile reports the same message."""
    torch._dynamo.reset()
    q, k, v = _qkv(q=(2, 4, 5, 8), k=(2, 3, 7, 8))
    with pytest.raises(Exception, match=r"query has 4 heads and key/value 3"):
        torch.compile(dash_inductor.attention, fullgraph=True)(q, k, v)


def test_unsupported_reason_explains_instead_of_raising():
    q, k, v = _qkv()
    assert dash_inductor.unsupported_reason(q, k, v) is None
    assert dash_inductor.unsupported_reason(q, k, v, dropout_p=0.1) is None
    assert "dropout_p must be in [0, 1)" in dash_inductor.unsupported_reason(q, k, v, dropout_p=1.0)
    assert "batch size" in dash_inductor.unsupported_reason(*_qkv(k=(3, 3, 7, 8)))


def test_config_rejects_unknown_values():
    with pytest.raises(ValueError, match=r"schedule must be one of"):
        with dash_inductor.config.patch(schedule="fastest"):
            pass
    with pytest.raises(AttributeError, match=r"no option 'shedule'"):
        with dash_inductor.config.patch(shedule="shift"):
            pass
    assert dash_inductor.config.schedule == "auto"


@pytest.mark.parametrize("name, value, error, message", [
    ("shedule", "shift", AttributeError,
     r"no option 'shedule'; options: \['cpu_backend', 'kernel', 'max_spin', 'rewrite', 'schedule'\]"),
    ("schedule", "fast", ValueError, r"config.schedule must be one of \('auto', "),
    ("max_spin", -3, ValueError, r"config.max_spin must be a positive int, got -3"),
    ("max_spin", 2.5, ValueError, r"config.max_spin must be a positive int, got 2.5"),
    ("rewrite", "sometimes", ValueError, r"config.rewrite must be one of"),
])
def test_config_assignment_raises_as_patch_does(name, value, error, message):
    """A typo or a bad value fails where it is assigned, not at some later call."""
    config = dash_inductor.config
    before = {option: config.get(option) for option in (*config.CHOICES, "rewrite")}
    with pytest.raises(error, match=message):
        setattr(config, name, value)
    with pytest.raises(error, match=message):
        with config.patch(**{name: value}):
            pass
    assert not hasattr(config, "shedule")
    assert {option: config.get(option) for option in before} == before


def test_config_assignment_of_a_good_value_holds_until_changed(monkeypatch):
    config = dash_inductor.config
    monkeypatch.setattr(config, "schedule", "shift")  # plain assignments, undone after the test
    monkeypatch.setattr(config, "max_spin", 7)
    assert config.choices()["schedule"] == "shift" and config.get("max_spin") == 7
    with config.patch(schedule="descending"):
        assert config.schedule == "descending"
    assert config.schedule == "shift"


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


@pytest.mark.parametrize("cpu_backend", ["reference", "triton"])
def test_atomic_is_refused_on_every_path(restore_deterministic_algorithms, cpu_backend):
    """The check does not depend on the device or the path: the CPU reference refuses ``atomic``
    under deterministic algorithms as the GPU does, so code that passes on a laptop passes on the
    cluster; through the op too."""
    q, k, v = _qkv(q=(1, 1, 8, 16), k=(1, 1, 8, 16))
    torch.use_deterministic_algorithms(True)
    with dash_inductor.config.patch(cpu_backend=cpu_backend):
        with pytest.raises(RuntimeError, match=r"schedule='atomic' .* not deterministic"):
            dash_inductor.attention(q.requires_grad_(), k, v, schedule="atomic")
        with pytest.raises(RuntimeError, match=r"schedule='atomic' .* not deterministic"):
            torch.ops.dash.attention(q, k, v, schedule="atomic", cpu_backend=cpu_backend)


def _sdpa_call_forms(q, k, v, mask):
    """SDPA's positional and keyword call forms, as its documentation writes them."""
    return [((q, k, v), {}), ((q, k, v, None, 0.0, True), {}), ((q, k, v, mask), {}),
            ((q, k, v, None, 0.0, False), dict(scale=0.3)),
            ((q, k, v, None, 0.0, True), dict(scale=None, enable_gqa=False)),
            ((q, k, v), dict(is_causal=True, scale=0.5)),
            ((q, k, v), dict(attn_mask=mask, dropout_p=0.0, scale=0.2)),
            ((q, k, v, mask, 0.0), dict(enable_gqa=False))]


def test_sdpa_positional_and_keyword_calls_give_sdpas_results():
    """Every SDPA call form, positional included, gives SDPA's result in float64 (no silent
    difference), through ``dash_inductor.attention`` and the op."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(9, 9, generator=gen) > 0.3
    mask[:, 0] = True
    for args, kwargs in _sdpa_call_forms(q, k, v, mask):
        expected = F.scaled_dot_product_attention(*args, **kwargs)
        torch.testing.assert_close(dash_inductor.attention(*args, **kwargs), expected,
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.ops.dash.attention(*args, **kwargs)[0], expected,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(is_causal=0.0), "is_causal must be a bool"), (dict(is_causal=1.5), "is_causal must be"),
    (dict(is_causal=None), "is_causal must be a bool"), (dict(enable_gqa=1), "enable_gqa must be"),
    (dict(scale="0.1"), "scale must be a float or None"), (dict(scale=True), "scale must be"),
    (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1), r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0"), "dropout_p must be a float")])
def test_bad_sdpa_flags_raise_naming_the_argument(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        dash_inductor.attention(q, k, v, **kwargs)


def test_the_op_takes_dropout_where_sdpa_has_it():
    """The op's schema keeps SDPA's order, dropout_p included, then dropout's RNG state, and
    takes the choices by keyword only: an SDPA-ordered positional call cannot shift into
    is_causal or scale. Called directly with dropout, the op wants the state drawn for it."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p=0.5 needs rng_state"):
        torch.ops.dash.attention(q, k, v, None, 0.5, True)
    with pytest.raises(ValueError, match=r"rng_state must be an int64 tensor of shape \(2,\)"):
        torch.ops.dash.attention(q, k, v, None, 0.5, True, torch.zeros(3, dtype=torch.int64))
    with pytest.raises((RuntimeError, TypeError)):  # scale is keyword-only, as in SDPA
        torch.ops.dash.attention(q, k, v, None, 0.0, True, 0.5)
    with pytest.raises(TypeError):
        dash_inductor.attention(q, k, v, None, 0.0, True, 0.5)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_nested_inputs_are_refused_by_name_at_the_entry_points(layout):
    """The dispatcher would reject a nested tensor with a bare NotImplementedError before the op's
    own checks: the public entries say what is wrong first."""
    nested = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=layout)
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"^dash.attention: query is a nested tensor"):
        dash_inductor.attention(nested, q, q)
    packed = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"key is a nested tensor"):
        dash_inductor.varlen_attention(packed, nested, packed, cu, cu, 6, 6)
