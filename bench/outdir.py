"""Where the benchmark scripts write their raw results: ``bench/results/<date>-<gpu>-<commit>/``.

The date is the UTC date of the run, the GPU a short lower-case name (``h200``, ``cpu``), the commit
the checkout's short hash, with ``-dirty`` when tracked files have uncommitted changes. Each folder
has a README.md that lists the commands that wrote into it.
"""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA GeForce RTX 4090"`` -> ``"geforce-rtx-4090"``."""
    name = name.split(",")[0].removeprefix("NVIDIA").strip().lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def commit() -> str:
    """The checkout's short commit hash (``-dirty`` with uncommitted changes), or ``nocommit``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "nocommit"
    return f"{head}-dirty" if dirty else head


def default_dir(gpu: str, date: str | None = None) -> Path:
    """``bench/results/<date>-<gpu>-<commit>`` for a GPU name (``torch.cuda.get_device_name()``);
    ``date`` starts with ``YYYY-MM-DD`` (default: today, UTC)."""
    date = (date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))[:10]
    return RESULTS / f"{date}-{gpu_slug(gpu)}-{commit()}"


def record_command(directory: Path, command: str, files: list[Path]) -> None:
    """Append the command and the files it wrote to ``directory/README.md``, once: a script that
    rewrites its files after every problem records the same line each time."""
    directory.mkdir(parents=True, exist_ok=True)
    readme = directory / "README.md"
    if not readme.exists():
        readme.write_text(f"# {directory.name}\n\nWritten by:\n\n")
    names = ", ".join(f"`{f.name}`" for f in files)
    line = f"- `{command}`: {names}\n"
    if line not in readme.read_text().splitlines(keepends=True):
        with readme.open("a") as handle:
            handle.write(line)
