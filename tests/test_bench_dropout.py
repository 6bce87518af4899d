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
