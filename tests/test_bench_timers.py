"""The benchmarks' CUDA timers wait for dash's C++ replayer before they time anything.

The replayer loads (and on a fresh machine builds) in a thread of its own from the first calls on;
calls timed meanwhile share the GIL with that thread, and a grid's first problem read 2-5x slow
before the timers waited. Here ``do_bench`` and the replayer's ``load`` are stand-ins that record
their order: this shows the timers ask first, not that a GPU timing is clean.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import triton.testing

from dash_inductor.ops.shared import native

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import ab  # noqa: E402
import methods  # noqa: E402


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    order: list[str] = []

    def load(wait: bool = False) -> None:
        order.append(f"load(wait={wait})")

    def do_bench(fn, **kwargs) -> float:
        order.append("do_bench")
        fn()
        return 1.0

    monkeypatch.setattr(native, "load", load)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return order


def test_the_grid_timer_waits_for_the_replayer(calls: list[str]) -> None:
    assert methods.time_ms(lambda: None) == 1.0
    assert calls == ["load(wait=True)", "do_bench"]


def test_the_ab_timer_waits_for_the_replayer(calls: list[str]) -> None:
    timer = ab._timer("cuda", warmup=1, rep=1)
    assert calls == ["load(wait=True)"]
    assert timer(lambda: None) == 1.0
    assert calls == ["load(wait=True)", "do_bench"]


def test_the_cpu_timer_does_not_load_the_replayer(calls: list[str]) -> None:
    ab._timer("cpu", warmup=1, rep=1)(lambda: None)
    assert calls == []
