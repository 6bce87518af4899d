"""pytest-benchmark set-up for bench/: the problem grid option, and skipping without CUDA.

    pytest bench/ --benchmark-json=bench.json [--dash-grid quick|full]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--dash-grid", choices=("quick", "full"), default="quick",
                     help="problems of the attention benchmarks: a few (quick, default) or "
                          "the whole grid of docs/benchmarks.md (full)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "problem" in metafunc.fixturenames:
        import methods

        problems = methods.grid(quick=metafunc.config.getoption("--dash-grid") == "quick")
        metafunc.parametrize("problem", problems, ids=[p.label.replace(" ", "-") for p in problems],
                             scope="module")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="the attention benchmarks need a CUDA GPU")
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
