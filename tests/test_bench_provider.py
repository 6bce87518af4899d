"""bench/provider_step.py --smoke on the CPU, in a subprocess, so that the provider benchmark (which
only really runs on a GPU) cannot rot: every variant is timed or says why not, and the row of
attn_implementation="dash" shows dash's calls."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("provider_step")
    done = subprocess.run([sys.executable, "bench/provider_step.py", "--smoke", "--device", "cpu",
                           "--profile", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_every_variant_is_timed_or_says_why(smoke: Path) -> None:
    rows = {r["variant"]: r for r in json.loads((smoke / "provider_step.json").read_text())["rows"]}
    assert list(rows) == ["SDPA, determinism off", "SDPA, determinism on",
                          "DASH provider, determinism on", 'HF "dash", determinism on']
    provider = rows.pop("DASH provider, determinism on")
    assert provider["status"] == "skipped" and "CUDA only" in provider["reason"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0 and row["fallbacks"] == {}
    assert rows["SDPA, determinism on"]["dash_calls_per_step"] == {}
    assert rows['HF "dash", determinism on']["dash_calls_per_step"] == {"hf": 2}  # 2 layers
    for row in rows.values():  # --profile: the costliest ops of one step, costliest first
        costs = [k["ms"] for k in row["top_kernels"]]
        assert costs and costs == sorted(costs, reverse=True) and costs[0] > 0


def test_markdown_table_and_the_command_are_written(smoke: Path) -> None:
    table = (smoke / "provider_step.md").read_text()
    assert "| variant | step ms | vs SDPA, determinism off |" in table
    assert '| HF "dash", determinism on |' in table and "| hf 2 |" in table
    assert "1.00x" in table  # the baseline row against itself
    readme = (smoke / "README.md").read_text()
    assert "`python bench/provider_step.py --smoke --device cpu --profile --out " in readme
