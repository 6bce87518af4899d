"""bench/dropout.py on the CPU, on tiny shapes (a check that the script runs every method and
writes its rows, not a measurement), and the determinism mode it switches is restored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import dropout  # noqa: E402


def test_dropout_bench_times_every_method_on_the_cpu(tmp_path):
    import torch

    assert not torch.are_deterministic_algorithms_enabled()
    assert dropout.main(["--device", "cpu", "--rounds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "dropout.json").read_text())
    assert [row["label"] for row in result["rows"]] == ["d16 full N=64", "d16 causal N=64"]
    for row in result["rows"]:
        assert "dash p portable" in dropout.methods_for("cpu")
        assert "SDPA flash p" not in dropout.methods_for("cpu")
        assert "SDPA flash p" in dropout.methods_for("cuda")
        for name in dropout.methods_for("cpu"):
            assert row[name]["forward_ms"] > 0 and row[name]["backward_ms"] > 0
        assert row["dash backward p / p=0"] > 0
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_pinned_peer_that_refuses_a_problem_is_recorded_not_fatal(tmp_path, monkeypatch):
    """A pinned SDPA kernel without a kernel for a problem (cuDNN with dropout, say) raises; the
    row names the refusal and leaves that peer's ratio out, and the run goes on. A refusal of
    dash's own methods still ends the run."""
    import pytest

    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.\nmore")

    methods = dict(dropout.METHODS)
    methods["SDPA cuDNN p"] = (False, refuse, True)
    monkeypatch.setattr(dropout, "METHODS", methods)
    monkeypatch.setattr(dropout, "methods_for",
                        lambda device: ["dash p=0", "dash p", "SDPA det. on p", "SDPA cuDNN p"])
    assert dropout.main(["--device", "cpu", "--rounds", "2", "--out", str(tmp_path)]) == 0
    for row in json.loads((tmp_path / "dropout.json").read_text())["rows"]:
        assert row["refused"] == {"SDPA cuDNN p": "No available kernel. Aborting execution."}
        assert "SDPA cuDNN p" not in row and "SDPA cuDNN backward p / p=0" not in row
        assert row["dash p"]["backward_ms"] > 0
    methods["dash p"] = (True, refuse, True)
    with pytest.raises(RuntimeError, match="No available kernel"):
        dropout.main(["--device", "cpu", "--rounds", "1", "--out", str(tmp_path)])
