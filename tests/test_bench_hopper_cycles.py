"""bench/hopper_cycles.py on the CPU (profiling needs an H100/H200 and Nsight Compute): the
command it profiles, how it reads ncu's CSV and the outputs' digest, and how a round compares
configs; and bench/hopper_profile.py's digest, which tells a changed bit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import hopper_cycles  # noqa: E402
import hopper_profile  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def ncu_output(cycles: list[int], digest: str) -> str:
    """What ncu prints for one run: its notes, the program's lines, then one CSV row a launch."""
    rows = [f'"{i}","7","python3","127.0.0.1","forward_kernel","1","7","(384, 1, 1)",'
            f'"(32, 64, 1)","0","9.0","Command line profiler metrics",'
            f'"{hopper_cycles.METRIC}","cycle","{c:,}"' for i, c in enumerate(cycles)]
    return "\n".join(["==PROF== Connected to process 7", f"digest {digest}",
                      "==PROF== Disconnected from process 7", HEADER, *rows])


def test_the_command_profiles_the_ops_kernel_with_the_config() -> None:
    command = hopper_cycles.ncu_command("forward", (4, 16, 4, 4096, 128), True, "forward",
                                        "stages=2", 5)
    assert command[0] == "ncu" and "regex:^forward_kernel" in command
    assert command[command.index("--target-processes") + 1] == "application-only"
    assert command[command.index("-c") + 1] == "5" == command[command.index("--launches") + 1]
    assert command[command.index("--config") + 1] == "stages=2"
    assert command[command.index("--shape") + 1] == "4,16,4,4096,128"
    assert command[command.index("--causal") + 1] == "yes"


def test_ncu_output_parses_to_each_launchs_cycles_and_the_digest() -> None:
    cycles = [random.randrange(10**5, 10**8) for _ in range(random.randrange(1, 8))]
    assert hopper_cycles.parse_ncu(ncu_output(cycles, "ab12")) == (cycles, "ab12")


def test_output_without_a_metric_row_has_no_cycles() -> None:
    assert hopper_cycles.parse_ncu("==PROF== Error: no kernels were profiled\n") == ([], None)


def test_a_round_compares_medians_and_digests_with_the_defaults() -> None:
    row = hopper_cycles.compare({"default": ([100, 300, 200], "a"),
                                 "stages=2": ([190, 180, 170], "a"),
                                 "pingpong=1": ([210, 230, 220], "b")})
    assert row["default"] == {"cycles": 200, "ratio": 1.0, "bits_equal_default": True}
    assert row["stages=2"]["ratio"] == pytest.approx(0.9)
    assert row["stages=2"]["bits_equal_default"] is True
    assert row["pingpong=1"]["bits_equal_default"] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_digest_changes_with_any_bit(dtype: torch.dtype) -> None:
    a = torch.randn(3, 5, dtype=dtype)
    b = a.clone()
    assert hopper_profile.digest((a, b)) == hopper_profile.digest((a.clone(), b.clone()))
    bits = b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    bits.view(-1)[random.randrange(b.numel())] ^= 1
    assert hopper_profile.digest((a, b)) != hopper_profile.digest((a, a.clone()))
    assert hopper_profile.digest((torch.zeros(2),)) != hopper_profile.digest((-torch.zeros(2),))


def test_a_run_alternates_configs_and_writes_each_rounds_row(monkeypatch, tmp_path) -> None:
    """main() with ncu replaced by canned output: each config compiled once without ncu, then the
    default and each config in every round, in that order, and one JSON row a round with the
    configs' ratios and bit flags."""
    calls, compiled = [], []
    cycles = {"": 1000, "stages=2": 900, "row_sums_at_end=1": 1100}

    def fake_run(command, capture_output, text, timeout):
        config = command[command.index("--config") + 1]
        if command[0] != "ncu":  # the compile pass
            compiled.append(config)
            return subprocess.CompletedProcess(command, 0, "digest a", "")
        calls.append(config)
        digest = "b" if config.startswith("row_sums") else "a"
        return subprocess.CompletedProcess(command, 0, ncu_output([cycles[config]] * 3, digest), "")

    monkeypatch.setattr(hopper_cycles.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["hopper_cycles.py", "--op", "forward", "--shape",
                                      "1,2,2,256,64", "--causal", "no", "--config", "stages=2",
                                      "--config", "row_sums_at_end=1", "--rounds", "2",
                                      "--launches", "3", "--out", str(tmp_path)])
    assert hopper_cycles.main() == 0
    assert compiled == ["", "stages=2", "row_sums_at_end=1"]
    assert calls == ["", "stages=2", "row_sums_at_end=1"] * 2
    rows = json.loads((tmp_path / "hopper_cycles.json").read_text())["rows"]
    assert [row["round"] for row in rows] == [0, 1]
    configs = rows[0]["configs"]
    assert configs["stages=2"]["ratio"] == pytest.approx(0.9)
    assert configs["stages=2"]["bits_equal_default"] is True
    assert configs["row_sums_at_end=1"]["bits_equal_default"] is False


def test_a_run_without_cycles_fails_with_what_ncu_printed(monkeypatch) -> None:
    def fake_run(command, capture_output, text, timeout):
        return subprocess.CompletedProcess(command, 1, "", "==ERROR== ERR_NVGPUCTRPERM")

    monkeypatch.setattr(hopper_cycles.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="ERR_NVGPUCTRPERM"):
        hopper_cycles.profile(["ncu"])


def test_a_process_past_its_limit_ends_the_run_with_the_configs_name(monkeypatch) -> None:
    """A config that deadlocks (or compiles too slowly) ends the run with an error naming it."""
    def fake_run(command, capture_output, text, timeout):
        assert timeout == 42
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(hopper_cycles.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"compiling stages=2: no result in 42 s"):
        hopper_cycles.compile_first(["python3", "bench/hopper_tune.py"], "stages=2", 42)
