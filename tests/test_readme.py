"""The README's set-up block says what CI does: its test command is the last command of .ci/run,
its install keeps the user's torch (pyproject.toml's range), and the pin it names is CI's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[str]:
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def test_the_readme_set_up_block_matches_ci_and_pyproject() -> None:
    readme = (ROOT / "README.md").read_text()
    install, test = _commands(re.search(r"```bash\n(.*?)```", readme, re.DOTALL)[1])
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert test == ci[-1] == "python3 -m pytest -q"
    assert install == 'python3 -m pip install -e ".[test]"'  # no torch pin: keeps a CUDA torch
    torch_range, = re.findall(r'"(torch>=[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert f"`{torch_range}`" in readme
    pin, = re.findall(r"torch==[\d.]+", " ".join(ci))
    assert f"`{pin}` in `.ci/run`" in readme
