"""bench/packed.py --smoke on the CPU, in a subprocess, so that the packed-document benchmark
(which only really runs on a GPU) cannot rot: it must run end to end through
``python -m dash_inductor bench --packed`` and write a JSON whose every row is timed or says why not.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("packed")
    done = subprocess.run([sys.executable, "-m", "dash_inductor", "bench", "--packed", "--smoke",
                           "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "packed.json").read_text()), out


def test_every_row_is_timed_or_says_why(smoke) -> None:
    rows = smoke[0]["rows"]
    assert {(r["head_dim"], r["kind"]) for r in rows} == {
        (d, kind) for d in (64, 128) for kind in ("docs", "window", "causal", "full")}
    for row in rows:
        if row["status"] == "ok":
            for key in ("forward_ms", "backward_ms", "forward_tflops", "backward_tflops"):
                assert math.isfinite(row[key]) and row[key] > 0, (row["method"], key)
        else:
            assert row["status"] in ("skipped", "failed") and row["reason"].strip(), row


def test_on_the_cpu_dash_and_sdpa_run_and_the_cuda_methods_are_skipped(smoke) -> None:
    for row in smoke[0]["rows"]:
        method = row["method"]
        if method.startswith(("dash_", "sdpa_")):
            assert row["status"] == "ok", row
        else:
            assert row["status"] == "skipped" and "CUDA" in row["reason"], row
    dash = {r["method"] for r in smoke[0]["rows"] if r["method"].startswith("dash_")}
    assert {"dash_auto", "dash_recompute", "dash_shift"} <= dash


def test_problems_and_attended_pairs(smoke) -> None:
    result = smoke[0]
    sizes = result["sizes"]
    by_kind = {r["kind"]: r for r in result["rows"] if r["head_dim"] == 128}
    lengths = by_kind["docs"]["lengths"]
    assert sum(lengths) == sizes["tokens"] and len(lengths) > 1
    assert all(sizes["doc_min"] <= n <= sizes["doc_max"] for n in lengths)
    assert by_kind["docs"]["pairs"] == sum(n * (n + 1) // 2 for n in lengths)
    tokens, window = sizes["tokens"], sizes["window"]
    assert by_kind["window"]["pairs"] == sum(min(i, window) + 1 for i in range(tokens))
    assert by_kind["causal"]["pairs"] == tokens * (tokens + 1) // 2
    assert by_kind["full"]["pairs"] == tokens * tokens
    for entry in result["summary"]:
        assert 0 < entry["window_over_full_pairs"] < entry["window_over_causal_pairs"] < 1
        assert math.isfinite(entry["window_over_full_backward"])
        assert entry["docs_flex_over_dash_auto_bwd"] is None  # no FlexAttention on the CPU


def test_writes_the_markdown_and_the_command(smoke) -> None:
    out = smoke[1]
    assert "| problem | method |" in (out / "packed.md").read_text()
    commands = [line for line in (out / "README.md").read_text().splitlines()
                if "bench/packed.py --smoke" in line]
    assert len(commands) == 1, commands  # once, though the files are rewritten after each problem


def test_varlen_methods_take_packed_leaves_over_the_same_memory() -> None:
    """dash's varlen_attention (and varlen_attn) get (T, H, D) leaves, as their users hold them,
    so autograd adds no layout copy to their backward; the dense methods get (1, H, T, D) views of
    the same storage."""
    sys.path.insert(0, str(ROOT / "bench"))
    import packed_methods as pm

    docs, window = (c for c in pm.cases(pm.SMOKE, (64,)) if c.kind in ("docs", "window"))
    inputs = pm.make_inputs(docs, "cpu", seed=0)
    packed_way, = pm.dash_candidates(pm.Setup.of(docs, "cpu"))
    dense_way, = pm.dash_candidates(pm.Setup.of(window, "cpu"))
    assert packed_way.packed and not dense_way.packed
    assert pm.inputs_for(dense_way, inputs) is inputs
    for mine, theirs in zip(pm.inputs_for(packed_way, inputs), inputs):
        assert mine.shape == (docs.tokens, docs.heads, docs.head_dim) and mine.is_contiguous()
        assert mine.data_ptr() == theirs.data_ptr()
    q, k, v, grad_out = pm.inputs_for(packed_way, inputs)
    assert q.is_leaf and q.requires_grad and not grad_out.requires_grad


def test_rounds_time_every_way_that_many_times_and_report_the_median(tmp_path) -> None:
    """``--rounds 3``: each timed row keeps three timings of each pass and reports their median."""
    done = subprocess.run([sys.executable, "bench/packed.py", "--smoke", "--device", "cpu",
                           "--head-dims", "64", "--problems", "docs", "--rounds", "3",
                           "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    timed = [r for r in json.loads((tmp_path / "packed.json").read_text())["rows"]
             if r["status"] == "ok"]
    assert timed
    for row in timed:
        for key in ("forward", "backward"):
            times = row[f"{key}_rounds"]
            assert len(times) == 3 and all(t > 0 for t in times)
            assert row[f"{key}_ms"] == sorted(times)[1]
