"""The ordered Hopper backward keeps its bits while other processes share the GPU.

Under time-slicing (no MPS) a context switch mid-kernel once left the dQ writer's ticket poll with
a value the ticket never held, and the writer took its turn early: about a quarter of the calls
of the dense case below had other bits, with whole dQ tiles wrong (docs/racecheck.md). Each
case runs four background processes on the same problem and compares 40 calls of a fifth with
its first. What it cannot show: a race that needs more processes, or other shapes, to appear.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm90 GPU")]

WORKER = Path(__file__).with_name("contend.py")
BACKGROUND = 4
CALLS = 40


def _start(role: str, case: str, schedule: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), role, case, schedule, str(CALLS)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("case, schedule", [("dense", "ascending"), ("dense", "descending"),
                                            ("packed", "ascending")])
def test_same_bits_under_time_slicing(case, schedule):
    background = [_start("bg", case, schedule) for _ in range(BACKGROUND)]
    try:
        for process in background:  # each has compiled and is repeating the call
            assert process.stdout.readline().strip() == "ready", process.stdout.read()
        main = _start("main", case, schedule)
        output, _ = main.communicate()
    finally:
        for process in background:
            process.kill()
            process.wait()
    assert main.returncode == 0, output
    assert "differed 0" in output.splitlines()[-1], output
