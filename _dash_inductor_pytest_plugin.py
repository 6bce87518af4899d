"""pytest plugin of dash_inductor: hypothesis profiles and determinism fixtures.

Installed with the package as the ``pytest11`` entry point ``dash_inductor.pytest_plugin``, so
pytest loads it in every run, before any ``conftest.py``. That is why it lives outside the
``dash_inductor`` package and imports neither torch nor dash_inductor (the fixtures import torch
when used): Triton must not be imported before a ``conftest.py`` has set ``TRITON_INTERPRET``.
``dash_inductor.pytest_plugin`` re-exports it. It only *registers* hypothesis profiles: selecting
one is the user's choice (``pytest --hypothesis-profile=dash-ci``), so nobody's settings change
silently.

Profiles:

- ``dash-ci``: derandomized (the same examples on every run, so a CI failure reproduces), no
  deadline (first calls compile kernels), few examples, and the failure blob printed.
- ``dash-gpu``: more examples for larger GPU draws, still derandomized and without deadline.

Fixtures:

- ``deterministic_algorithms``: turns ``torch.use_deterministic_algorithms(True)`` on for the test
  and restores the previous mode (including ``warn_only``) afterwards.
- ``restore_deterministic_algorithms``: lets the test set the mode itself, restores it afterwards.
- ``deterministic_algorithms_mode(enabled, warn_only)``: the same as a context manager.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

CI_PROFILE = "dash-ci"
GPU_PROFILE = "dash-gpu"


def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is an optional test dependency
        return
    slow_checks = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile(
        CI_PROFILE, derandomize=True, deadline=None, max_examples=10, print_blob=True,
        suppress_health_check=slow_checks, database=None)
    settings.register_profile(
        GPU_PROFILE, derandomize=True, deadline=None, max_examples=50, print_blob=True,
        suppress_health_check=slow_checks, database=None)


_register_hypothesis_profiles()


@contextlib.contextmanager
def deterministic_algorithms_mode(enabled: bool = True, warn_only: bool = False) -> Iterator[None]:
    """Set ``torch.use_deterministic_algorithms`` inside the block, restore the old mode after."""
    import torch

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@pytest.fixture
def restore_deterministic_algorithms() -> Iterator[None]:
    """Let the test change ``torch.use_deterministic_algorithms``; restore it afterwards."""
    import torch

    with deterministic_algorithms_mode(torch.are_deterministic_algorithms_enabled(),
                                       torch.is_deterministic_algorithms_warn_only_enabled()):
        yield


@pytest.fixture
def deterministic_algorithms() -> Iterator[None]:
    """Run the test with ``torch.use_deterministic_algorithms(True)`` (strict), then restore."""
    with deterministic_algorithms_mode(True):
        yield
