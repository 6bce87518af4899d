"""bench/racecheck.py's triage, on a stored racecheck log of the H100 run: every hazard there is
one of the two known, ordered hand-offs (docs/racecheck.md), and a hazard at another line is
reported as unknown with a failing exit status."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "tests/data/racecheck-hopper-dense-shift-full-d64.log.gz"  # an H100 run's log
sys.path.insert(0, str(ROOT / "bench"))

import racecheck  # noqa: E402


def test_the_stored_reports_hazards_are_all_known(tmp_path, capsys):
    log = tmp_path / "rc.log"
    log.write_text(gzip.decompress(LOG.read_bytes()).decode())
    assert racecheck.triage(str(log)) == 0
    out = capsys.readouterr().out
    assert "45 hazards in 4 groups" in out and "UNKNOWN" not in out
    assert "backward_kernel+0x2760 (backward.py:274)" in out  # the report


def test_a_hazard_elsewhere_is_unknown(tmp_path, capsys):
    text = gzip.decompress(LOG.read_bytes()).decode().replace("backward.py:274", "backward.py:99")
    log = tmp_path / "rc.log"
    log.write_text(text)
    assert racecheck.triage(str(log)) == 1
    assert "UNKNOWN" in capsys.readouterr().out
