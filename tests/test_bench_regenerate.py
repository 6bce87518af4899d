"""bench/regenerate.py: its runs name only options their scripts take, and ``--retarget`` points exactly
the tables they feed at the new folder (the distributed one keeps its source)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import regenerate  # noqa: E402
import doc_tables  # noqa: E402


def test_every_run_passes_only_options_its_script_defines():
    for name, run in regenerate.RUNS.items():
        source = (ROOT / "bench" / run.script).read_text()
        for option in (a for a in run.args if a.startswith("--")):
            assert re.search(rf"add_argument\(\s*\"{option}\"", source), (name, option)


def test_retarget_points_the_fed_tables_at_the_folder():
    page = doc_tables.PAGE.read_text()
    tables = [t for run in regenerate.RUNS.values() for t in run.tables]
    folder = "results/2030-01-01-h100-0123abc"
    new = regenerate.retarget(page, folder, tables)
    markers = [(m[2], m[3].split()) for m in doc_tables.MARKER.finditer(new)]
    steps = [paths for kind, paths in markers if kind.startswith("step")]
    assert steps == [[f"{folder}/step-b2.json", f"{folder}/step-b1.json"],
                     [f"{folder}/step-graphs.json"], [f"{folder}/step.json"]]
    fed = {kind for kind, _, _ in tables}
    for kind, paths in markers:
        moved = all(p.startswith(folder + "/") for p in paths)
        assert moved == (kind in fed), kind
    assert [m[4] for m in doc_tables.MARKER.finditer(new)] == \
        [m[4] for m in doc_tables.MARKER.finditer(page)]  # the tables are left to render()
