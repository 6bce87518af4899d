"""bench/host_time.py on the CPU, in a subprocess (it turns deterministic algorithms on), so that the
host-time benchmark cannot rot: it must time a forward and backward, profile them, and write its
JSON and the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_host_time_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "bench/host_time.py", "--device", "cpu", "--calls", "3",
                           "--profile", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    assert row["kernel"] == "auto" and row["calls"] == 3
    assert 0 < row["host_ms"] <= row["done_ms"]
    costs = [entry["ms_per_call"] for entry in row["profile"]]
    assert costs == sorted(costs, reverse=True) and costs[0] > 0
    assert any("attention" in entry["function"] for entry in row["profile"])
    assert "`python bench/host_time.py --device cpu --calls 3 --profile --out " in (
        tmp_path / "README.md").read_text()
