"""docs/benchmarks.md and the README against the raw results: every table of the page is what
bench/doc_tables.py makes of the files its marker names, those files are the curated ones kept in
bench/results (each folder with a README.md, no scripts), the README's measured numbers all appear
in the page, and no code names a results folder."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import doc_tables  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()


def test_the_committed_tables_match_their_raw_files():
    assert doc_tables.render(PAGE) == PAGE, "run python bench/doc_tables.py"
    assert doc_tables.main(["--check"]) == 0


def test_every_table_names_a_curated_raw_file_with_its_command():
    sources = doc_tables.sources(PAGE)
    assert len(sources) >= 8
    for source in sources:
        path = ROOT / source
        assert path.is_file() and RESULTS in path.parents, source
        readme = (path.parent / "README.md").read_text()
        assert path.name in readme, f"{path.parent.name}: {path.name} not described"
        assert re.search(r"(`|^)(python3?|torchrun) ", readme, re.MULTILINE), f"{path.parent.name}: no command"


def test_results_hold_curated_files_only():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 60
    assert not [p for p in files if p.suffix == ".py"]
    for folder in (p for p in RESULTS.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), folder.name
        assert folder.name in (RESULTS / "README.md").read_text(), f"{folder.name} not indexed"


def test_the_page_stays_documentation():
    assert len(PAGE.splitlines()) <= 250
    assert not re.search(r"^#+ .*\b[0-9a-f]{7}\b", PAGE, re.MULTILINE)  # no per-commit sections


def test_every_measured_number_of_the_readme_and_the_home_page_is_in_the_page():
    readme = (ROOT / "README.md").read_text()
    for name, text in (("README.md", readme[:readme.index("## Try it")]),
                       ("docs/index.md", (ROOT / "docs" / "index.md").read_text())):
        numbers = re.findall(r"(\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?)(?:×| TFLOP/s)", text)
        assert len(numbers) >= 5, name
        missing = [n for n in numbers if n not in PAGE]
        assert not missing, f"{name}: numbers not in docs/benchmarks.md: {missing}"


def test_no_code_names_a_results_folder():
    folder = re.compile(r"bench/results/\d{4}-")
    tracked = [p for p in ROOT.rglob("*.py") if RESULTS not in p.parents
               and not any(part.startswith(".") or part in ("build", "scratch")
                           for part in p.relative_to(ROOT).parts)]
    cited = [str(p.relative_to(ROOT)) for p in tracked if folder.search(p.read_text())]
    assert not cited


def test_an_excluded_fa4_row_is_shown_as_such_and_left_out_of_the_ranges(tmp_path):
    methods = ("sdpa_off", "fa4", "fa4_det", "dash_auto")

    def row(problem: str, method: str, speed: float) -> dict:
        return {"problem": problem, "method": method, "backend": "shift",
                "forward_tflops": 500.0 * speed, "backward_tflops": 400.0 * speed}

    rows = [row("a", m, 1.0) for m in methods] + [row("b", m, 1.0) for m in methods[:3]]
    rows.append({**row("b", "dash_auto", 0.25), "excluded": "a reason"})
    env = {"gpu": "GPU", "torch": "2.11", "triton": "3.6"}
    path = tmp_path / "2026-01-01-h100-abcdef0" / "fa4.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"environment": env, "rows": rows}))
    text = doc_tables.fa4(str(path))
    assert "| b | 400 | 400 | 400 | excluded | — | 500 | excluded | — |" in text
    assert "deterministic 1.00×; forward: dash / FA4 1.00× (the other points)" in text
    assert "- dash at b: excluded, a reason" in text
