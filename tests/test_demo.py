"""The demo behind ``python -m dash_inductor demo``, run tiny on the CPU, and its command line."""

from __future__ import annotations

import io

import pytest
import torch

from dash_inductor import __main__ as cli
from dash_inductor import demo as demo_module
from dash_inductor.demo import DemoConfig, demo, differing_tensors, train

TINY = DemoConfig(layers=2, d_model=32, heads=4, seq=24, batch=2, steps=3, seed=3)


@pytest.fixture(scope="module")
def tiny_result() -> tuple[demo_module.DemoResult, list[str]]:
    lines: list[str] = []
    result = demo(TINY, out=lines.append, stream=io.StringIO())
    return result, lines


def test_demo_rewrites_every_attention_and_reproduces_the_bits(tiny_result) -> None:
    result, lines = tiny_result
    assert result.exit_code == 0, "\n".join(lines)
    assert result.rewritten == TINY.layers  # both layers, the GQA one included
    assert not [r for r in result.sites if not r.rewritten]
    assert not result.differing
    assert any("bit-identical" in line for line in lines)
    for name, tensor in result.runs[0].state.items():
        assert torch.equal(tensor, result.runs[1].state[name]), name


def test_demo_training_matches_eager_sdpa(tiny_result) -> None:
    """The rewritten, compiled model computes what the eager SDPA model computes."""
    result, _ = tiny_result
    eager = train(TINY, deterministic=False, compiled=False, stream=io.StringIO())
    torch.testing.assert_close(torch.tensor(result.runs[0].losses), torch.tensor(eager.losses),
                               rtol=1e-4, atol=1e-5)
    assert eager.losses[-1] < eager.losses[0]  # the task is learnable: the loss falls
    for name, tensor in eager.state.items():
        torch.testing.assert_close(result.runs[0].state[name], tensor, rtol=1e-3, atol=1e-4)


def test_differing_tensors_sees_one_flipped_bit() -> None:
    a = {"w": torch.randn(5, 7), "b": torch.randn(3)}
    b = {name: t.clone() for name, t in a.items()}
    assert differing_tensors(a, b) == []
    b["w"].view(torch.int32)[2, 3] ^= 1
    assert differing_tensors(a, b) == ["w"]
    assert differing_tensors(a, {"w": a["w"]}) == ["b"]


def test_cli_maps_flags_to_the_config(monkeypatch) -> None:
    seen: list[DemoConfig] = []
    monkeypatch.setattr(demo_module, "run_demo", lambda cfg: seen.append(cfg) or 0)
    assert cli.main(["demo", "--layers", "3", "--d-model", "48", "--heads", "6", "--seq", "40",
                     "--batch", "5", "--steps", "7", "--device", "cpu", "--seed", "9"]) == 0
    (cfg,) = seen
    assert (cfg.layers, cfg.d_model, cfg.heads, cfg.seq, cfg.batch, cfg.steps, cfg.seed) == (
        3, 48, 6, 40, 5, 7, 9)
    assert cfg.device == "cpu" and cfg.dtype == torch.float32
    assert [cfg.kv_heads(i) for i in range(3)] == [6, 3, 6]


@pytest.mark.parametrize("argv, message", [
    (["demo", "--heads", "5"], "multiple of heads"),
    (["demo", "--steps", "0"], "steps must be a positive int"),
    (["demo", "--device", "tpu"], "--device must be cpu or cuda"),
])
def test_cli_rejects_bad_flags(argv, message, capsys) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_info_reports_versions_config_and_schedules(capsys) -> None:
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"torch {torch.__version__}" in text
    assert "schedule='auto'" in text and "shift" in text and "recompute" in text
    assert "dash_inductor.ops provides attention_forward, attention_backward" in text


def test_bench_without_a_checkout_says_how(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "bench_script", lambda: None)
    assert cli.main(["bench", "--quick"]) == 2
    assert "bench/run.py" in capsys.readouterr().out
