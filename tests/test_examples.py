"""The examples that need hardware this machine may lack say so and exit 2, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_context_parallel_check_without_gpus_says_what_it_needs() -> None:
    done = subprocess.run([sys.executable, "examples/context_parallel_check.py"], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "context_parallel_check.py cannot run here: it needs CUDA GPUs and NCCL; this torch (" \
        in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
