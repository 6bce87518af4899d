"""Determinism of the Triton kernels on a GPU: the properties of tests/test_properties.py with
larger draws, 1000 repeats of representative problems under every deterministic schedule, and
negative controls proving that the checker catches real non-determinism.

The checks live in bench/determinism_report.py, which runs them to write a report under
bench/results/; here pytest runs the same functions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.determinism_report import (
                                      CONTROL_PROBLEMS,
                                      DETERMINISTIC,
                                      REPRESENTATIVE,
                                      check_batch_invariance,
                                      check_drawn_problem,
                                      check_process,
                                      check_repeats,
                                      control_atomic,
                                      control_sdpa,
                                      control_sdpa_deterministic,
                                      gpu_problems,
                                      )
from dash_inductor import pytest_plugin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = settings.get_profile(pytest_plugin.GPU_PROFILE)
REPEATS = 1000  # as FlashAttention-3's determinism tests


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("name", list(REPRESENTATIVE))
def test_representative_problem_repeats_bitwise(name: str, schedule: str):
    check_repeats(REPRESENTATIVE[name], schedule, REPEATS)


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("name", list(REPRESENTATIVE))
def test_representative_problem_is_batch_invariant(name: str, schedule: str):
    check_batch_invariance(REPRESENTATIVE[name], schedule)


@settings(GPU, max_examples=24)
@given(problem=gpu_problems(), schedule=st.sampled_from(DETERMINISTIC))
def test_drawn_problem_is_accurate_reproducible_and_batch_invariant(problem, schedule: str):
    check_drawn_problem(problem, schedule)


@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_fresh_process_gives_the_same_bits(schedule: str):
    check_process(next(iter(REPRESENTATIVE.values())), schedule)


def test_negative_control_atomic_schedule_is_caught():
    report = control_atomic(CONTROL_PROBLEMS, repeats=50)
    # fp32 atomics reorder the dQ sum; dK and dV are owned by one program and stay exact
    assert "grad of args[0] differs at index" in report, report


def test_negative_control_sdpa_without_determinism_is_caught():
    report = control_sdpa(CONTROL_PROBLEMS, repeats=50)
    assert "differs at index" in report, report


def test_positive_control_sdpa_with_determinism_passes():
    control_sdpa_deterministic(CONTROL_PROBLEMS[:1], repeats=100)
