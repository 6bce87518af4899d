"""dash_inductor's pytest plugin comes with the package: pytest loads it without a conftest.py,
so docs/testing.md's first snippet runs as copied, and loading it imports neither torch nor
dash_inductor, so a conftest.py can still set TRITON_INTERPRET before Triton's first import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_first_snippet_of_the_testing_docs_runs_as_copied(tmp_path: Path) -> None:
    snippet = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "testing.md").read_text(),
                        re.DOTALL)[1]
    assert 'settings.get_profile("dash-ci")' in snippet
    (tmp_path / "test_attention.py").write_text(snippet)
    env = {name: value for name, value in os.environ.items()
           if name != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_attention.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, (f"{done.stdout[-3000:]}\n(installed before pyproject.toml "
                                  f"declared the plugin? pip install -e . registers it)")
    assert "1 passed" in done.stdout


def test_loading_the_plugin_imports_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, _dash_inductor_pytest_plugin; "
                           "print(sorted({'torch', 'triton', 'dash_inductor'} & set(sys.modules)))"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
