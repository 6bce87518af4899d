"""The racecheck triage (``bench/racecheck.py --triage``, bench/racecheck_triage.py) on a stored
racecheck logs of H100 runs: every hazard there is one of the two known, ordered hand-offs
(docs/racecheck.md), and a hazard at another line is reported as unknown with a failing exit
status."""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "tests/data/racecheck-hopper-dense-shift-full-d64.log.gz"  # an H100 run's log
sys.path.insert(0, str(ROOT / "bench"))

import racecheck_triage  # noqa: E402

#: The Hopper kernels' lines that the log names, as they read in the tree that made it. Edits
#: since have moved them (the backward's SASS stayed byte-identical; the forward gained its packed
#: variant and a three-warpgroup one, whose two-warpgroup call is the first), and the triage finds
#: the known lines in today's sources: the test points the log at where the same lines are now.
LOG_LINES = {("backward.py", 274): "def backward_kernel(",
             ("backward.py", 362): "    gl.warp_specialize([",
             ("forward.py", 160): "def forward_kernel(",
             ("forward.py", 188): "        gl.warp_specialize(["}


#: The packed-capable forward's run (8ed1df8's tree): Triton 3.6 puts the exit state store at the
#: ``if`` that holds the two-warpgroup ``gl.warp_specialize`` call.
EXIT_LOG = ROOT / "tests/data/racecheck-hopper-forward-exit.log.gz"
EXIT_LOG_LINES = {("forward.py", 260): "def forward_kernel(",
                  ("forward.py", 311): "    if PARTS == 2:"}


def _log_of_today(log: Path = LOG, lines: dict = LOG_LINES) -> str:
    moved = {}
    for (name, old), start in lines.items():
        source = (ROOT / "ops/hopper" / name).read_text().splitlines()
        moved[(name, old)] = next(n for n, line in enumerate(source, 1) if line.startswith(start))
    text = gzip.decompress(log.read_bytes()).decode()
    return re.sub(r"(\w+\.py):(\d+)\b",
                  lambda m: f"{m[1]}:{moved.get((m[1], int(m[2])), m[2])}", text)


def _triage(tmp_path: Path, text: str) -> int:
    """The triage's exit status for a log of ``text``."""
    log = tmp_path / "rc.log"
    log.write_text(text)
    return racecheck_triage.triage(str(log))


def test_the_stored_reports_hazards_are_all_known(tmp_path, capsys):
    assert _triage(tmp_path, _log_of_today()) == 0
    out = capsys.readouterr().out
    assert "45 hazards in 4 groups" in out and "UNKNOWN" not in out
    assert "backward_kernel+0x2760 (backward.py:" in out  # the report


def test_a_hazard_elsewhere_is_unknown(tmp_path, capsys):
    assert _triage(tmp_path, _log_of_today().replace("backward.py:", "backward.py:9")) == 1
    assert "UNKNOWN" in capsys.readouterr().out


def test_the_exit_store_at_the_branch_of_the_warp_specialize_call_is_known(tmp_path, capsys):
    assert _triage(tmp_path, _log_of_today(EXIT_LOG, EXIT_LOG_LINES)) == 0
    out = capsys.readouterr().out
    assert "8 hazards in 2 groups" in out and "UNKNOWN" not in out


#: Every Hopper variant under ``--racecheck-report analysis`` (6277ae3's tree, H100): each pair of
#: racing instructions once, with its count, so nothing is past a print limit.
ANALYSIS_LOG = ROOT / "tests/data/racecheck-analysis-hopper.log.gz"
ANALYSIS_LOG_LINES = {("backward.py", 129): "        dq_bufs.index(d).store(",
                      ("backward.py", 272): "def backward_kernel(",
                      ("backward.py", 365): "    gl.warp_specialize([",
                      ("dq_writer.py", 127): "                                    vals = buf.slice(",
                      **EXIT_LOG_LINES}


def test_an_analysis_log_of_every_hopper_variant_is_all_known(tmp_path, capsys):
    assert _triage(tmp_path, _log_of_today(ANALYSIS_LOG, ANALYSIS_LOG_LINES)) == 0
    out = capsys.readouterr().out
    assert "7339800 hazards in 2831 groups" in out and "UNKNOWN" not in out
    assert "(forward.py:" in out and "(dq_writer.py:" in out


def test_an_analysis_race_elsewhere_is_unknown(tmp_path, capsys):
    text = _log_of_today(ANALYSIS_LOG, ANALYSIS_LOG_LINES).replace("dq_writer.py:", "dq_writer.py:9")
    assert _triage(tmp_path, text) == 1
    assert "UNKNOWN" in capsys.readouterr().out
