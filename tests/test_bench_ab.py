"""bench/ab.py on the CPU, on tiny float32 shapes (a check that the script runs, not a
measurement): HEAD checked out beside the working tree, each imported by its own worker from its
own files, the rounds alternating, and the bits of the two compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import ab  # noqa: E402


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--help"],
                            capture_output=True, text=True, check=True)
    assert "--ref" in result.stdout and "--problem" in result.stdout


def test_problems_parse_and_bad_ones_are_refused():
    assert ab.parse_problem("2,8,2,128,64,causal") == (2, 8, 2, 128, 64, True)
    assert ab.parse_problem("1,2,2,16,16") == (1, 2, 2, 16, 16, False)
    for bad in ("1,2,2,16", "1,3,2,16,16", "1,2,2,16,16,sideways", "0,2,2,16,16"):
        with pytest.raises(Exception):
            ab.parse_problem(bad)


def test_the_finder_maps_package_dirs_onto_one_tree(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"dash_inductor.ops" = "ops"\n\n[other]\nx = "y"\n')
    dirs = ab._package_dirs(tmp_path)
    assert dirs == {"dash_inductor": tmp_path / "dash_inductor",
                    "dash_inductor.ops": tmp_path / "ops"}


def test_ab_against_head_on_the_cpu(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--ref", "HEAD",
                    "--device", "cpu", "--dtype", "float32", "--problem", "1,2,2,16,16,causal",
                    "--problem", "1,4,2,24,8", "--rounds", "2", "--warmup", "1", "--rep", "2",
                    "--json", str(out)], cwd=ROOT, check=True)
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 4
    first, second = (r for r in result["rounds"] if r["problem"].endswith("causal"))
    assert list(first)[-2:] == ["ref", "tree"] and list(second)[-2:] == ["tree", "ref"]
    for entry in result["summary"].values():
        assert entry["same_bits"] in (True, False)
        assert entry["ref"]["backward_ms"]["median"] > 0 < entry["tree"]["backward_ms"]["median"]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                               text=True).stdout
    assert "dash-ab-" not in worktrees


def test_a_folder_holding_a_checkout_is_taken_as_it_is(tmp_path):
    tree = tmp_path / "copy"
    (tree / "dash_inductor").mkdir(parents=True)
    with ab.checked_out(str(tree)) as (path, commit):
        assert path == tree.resolve() and commit == "copy"
    assert (tree / "dash_inductor").is_dir()  # not removed afterwards


def test_the_checked_dropout_call_does_not_depend_on_how_often_the_timer_called():
    """do_bench's call count follows the clock; the bits compared must not."""
    import dash_inductor

    job = {"problem": (1, 2, 2, 32, 16, False), "dtype": "float32", "device": "cpu",
           "schedule": "auto", "kernel": "auto", "dropout_p": 0.3}

    def timer_calling(times):
        def timer(fn):
            for _ in range(times):
                fn()
            return 1.0

        return timer

    bits = {ab._measure(dash_inductor, job, timer_calling(n))["bits"] for n in (1, 4)}
    assert len(bits) == 1
