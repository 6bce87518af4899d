"""The demo behind ``python -m dash_inductor demo``, run tiny on the CPU, and its command line."""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest
import torch

from dash_inductor import __main__ as cli
from dash_inductor.demo import cli as demo_module
from dash_inductor.demo.cli import Run, Variant, demo, differing_tensors, render_table, train, verdict
from dash_inductor.demo.tiny_gpt import DemoConfig

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


def test_demo_on_cpu_says_sdpa_is_already_reproducible(tiny_result) -> None:
    result, lines = tiny_result
    text = "\n".join(lines)
    assert "SDPA is already reproducible" in text
    assert f"rewritten to dash.attention: {TINY.layers} of the model's {TINY.layers}" in text
    assert [v.name for v in result.variants] == ["dash, determinism on"]  # no GPU comparison
    assert result.step_ms == {}


def test_demo_fails_when_the_rewrite_does_not_fire(tiny_result) -> None:
    """CPU SDPA alone gives bit-identical runs too: without dash.attention the demo must fail."""
    result, _ = tiny_result
    without = dataclasses.replace(result, rewritten=0, sites=[])
    assert not without.differing and without.exit_code == 1
    lines = verdict(without)
    assert lines[1].startswith(f"FAIL: the rewrite replaced 0 of {TINY.layers} attention calls")
    assert not any(line.startswith("OK") for line in lines)
    assert verdict(result)[-1].startswith("OK: dash ran every attention call")


def _variant(name: str, deterministic: bool, step_s: float, differing: list[str]) -> Variant:
    run = Run(losses=[1.0], state={"w": torch.zeros(1), "b": torch.zeros(1)},
              step_seconds=[9.0, 9.0, step_s, step_s])
    return Variant(name, deterministic, "off", [run, run], differing)


def test_gpu_table_shows_bits_and_step_time_against_determinism_off() -> None:
    lines = render_table([_variant("determinism off", False, 0.050, ["w"]),
                          _variant("SDPA, determinism on", True, 0.065, []),
                          _variant("dash, determinism on", True, 0.055, [])])
    assert len(lines) == 4
    off, sdpa, dash = lines[1:]
    assert "differ (1 of 2 tensors)" in off and "50.00 ms" in off and "1.00x" in off
    assert "identical" in sdpa and "65.00 ms" in sdpa and "1.30x" in sdpa
    assert "identical" in dash and "55.00 ms" in dash and "1.10x" in dash


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
    assert "dash_inductor.ops provides" in text
    assert "attention_forward" in text and "attention_backward" in text


def test_bench_without_a_checkout_says_how(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "bench_script", lambda: None)
    assert cli.main(["bench", "--quick"]) == 2
    assert "bench/run.py" in capsys.readouterr().out


@pytest.mark.parametrize("device, visible", [("cuda", 0), ("cuda:1", 1)])
def test_demo_on_a_missing_cuda_device_says_so(monkeypatch, capsys, device, visible) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(demo_module, "run_demo", lambda cfg: pytest.fail("the demo ran"))
    assert cli.main(["demo", "--device", device]) == 2
    assert (f"error: --device {device}, but this torch ({torch.__version__}) sees {visible} CUDA "
            f"devices; --device cpu runs the demo on the CPU") in capsys.readouterr().err


def test_bench_on_a_cpu_says_the_grid_needs_a_gpu_and_what_runs_here(monkeypatch, capsys) -> None:
    """The command it points at is the one tests/test_bench_packed.py runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # bench/run.py puts bench/ on the path
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "bench/run.py times the grid on a CUDA GPU; none is visible" in err
    assert "`python -m dash_inductor bench --packed --smoke --device cpu`" in err
