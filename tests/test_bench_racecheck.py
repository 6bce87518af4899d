"""The racecheck triage (``bench/racecheck.py --triage``, bench/racecheck_triage.py) on a stored
racecheck log of the H100 run: every hazard there is one of the two known, ordered hand-offs
(docs/racecheck.md), and a hazard at another line is reported as unknown with a failing exit
status."""

from __future__ import annotations

import gzip
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


def _log_of_today() -> str:
    text = gzip.decompress(LOG.read_bytes()).decode()
    for (name, old), start in LOG_LINES.items():
        source = (ROOT / "ops/hopper" / name).read_text().splitlines()
        now = next(n for n, line in enumerate(source, 1) if line.startswith(start))
        text = text.replace(f"{name}:{old})", f"{name}:{now})").replace(
            f"in {name}:{old}\n", f"in {name}:{now}\n")
    return text


def test_the_stored_reports_hazards_are_all_known(tmp_path, capsys):
    log = tmp_path / "rc.log"
    log.write_text(_log_of_today())
    assert racecheck_triage.triage(str(log)) == 0
    out = capsys.readouterr().out
    assert "45 hazards in 4 groups" in out and "UNKNOWN" not in out
    assert "backward_kernel+0x2760 (backward.py:" in out  # the report


def test_a_hazard_elsewhere_is_unknown(tmp_path, capsys):
    text = _log_of_today().replace("backward.py:", "backward.py:9")
    log = tmp_path / "rc.log"
    log.write_text(text)
    assert racecheck_triage.triage(str(log)) == 1
    assert "UNKNOWN" in capsys.readouterr().out
