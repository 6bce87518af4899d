"""dash_inductor's pytest plugin (hypothesis profiles ``dash-ci`` and ``dash-gpu``, determinism
fixtures): the top-level module ``_dash_inductor_pytest_plugin``, re-exported.

pytest loads the plugin by itself where dash_inductor is installed (the ``pytest11`` entry point
``dash_inductor.pytest_plugin``); ``pytest_plugins = ["dash_inductor.pytest_plugin"]`` in a
``conftest.py`` is then a no-op, and loads it where the package is not installed.
"""

from _dash_inductor_pytest_plugin import (CI_PROFILE, GPU_PROFILE, deterministic_algorithms,
                                          deterministic_algorithms_mode,
                                          restore_deterministic_algorithms)

__all__ = ["CI_PROFILE", "GPU_PROFILE", "deterministic_algorithms", "deterministic_algorithms_mode",
           "restore_deterministic_algorithms"]
