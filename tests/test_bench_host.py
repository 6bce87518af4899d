"""bench/host.py on the CPU, on tiny shapes (a check that the script runs and writes its table,
not a measurement): every method times, the JSON has its rounds and the breakdown's rows, the
determinism mode the methods switch is restored, and each compiled variant runs its own graph."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import host  # noqa: E402


def test_host_bench_times_every_method_on_the_cpu(tmp_path):
    import torch

    assert not torch.are_deterministic_algorithms_enabled()
    assert host.main(["--device", "cpu", "--calls", "2", "--rounds", "2", "--no-compile",
                      "--breakdown", "--layers", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "host.json").read_text())
    methods = {row["method"]: row for row in result["rows"]}
    assert set(methods) == {"sdpa_off", "sdpa_on", "floor", "dash", "varlen_dash"}
    for row in methods.values():
        assert len(row["host_us_rounds"]) == 2 and 0 < row["host_us"] <= row["done_us"]
    steps = {(row["step"], row["input_sets"]) for row in result["breakdown"]}
    assert steps == {(step, sets) for step in ("op forward", "op backward") for sets in (1, 2)}
    assert all(row["host_us"] > 0 for row in result["breakdown"])
    assert not torch.are_deterministic_algorithms_enabled()


def test_each_compiled_method_runs_its_own_graph():
    """Dynamo keeps graphs per code object: without ``methods.compile_own`` the rewritten
    determinism-on method would run the SDPA one's graph (both compiled under determinism).
    Here dash's compiled methods call dash.attention at every layer and the SDPA ones never."""
    import torch

    from dash_inductor.library import op

    saved = torch.are_deterministic_algorithms_enabled()
    try:
        methods = host._compiled_methods((1, 2, 32, 16), torch.float32, "cpu", 2, None)
        for name, (det, call, _) in methods.items():
            torch.use_deterministic_algorithms(det)
            op._PLANS.clear()
            call()
            calls = 2 if name.startswith("layers") else 1
            expected = ["backward"] * calls + ["forward"] * calls if name.endswith("dash") else []
            assert sorted(plan.op for plan in op.last_plans()) == expected, name
    finally:
        torch.use_deterministic_algorithms(saved)
