"""pytest-benchmark suites: forward, backward, and forward+backward of dash.attention per schedule
and of the baselines (SDPA with determinism off and on, FlexAttention compiled).

Each benchmark records its problem, the backend or schedule that actually ran and its TFLOP/s in
``extra_info``, so ``--benchmark-json`` holds everything needed to make the tables.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

import methods as m

ROUNDS, WARMUP_ROUNDS = 10, 3


@pytest.fixture(scope="module")
def inputs(problem: m.Problem):
    torch._dynamo.reset()  # FlexAttention compiles per shape; stay under the recompile limit
    tensors = m.make_inputs(problem)
    yield tensors
    del tensors
    torch.cuda.empty_cache()


def _prepared(method: m.Method, problem: m.Problem, inputs) -> m.Prepared:
    try:
        return m.prepare(method, problem, inputs)
    except Exception as error:  # a baseline that cannot run this problem is skipped, with why
        pytest.skip(f"{method.title} cannot run {problem.label}: {error}")


def _bench(benchmark, prepared: m.Prepared, fn: Callable[[], object], flops: float,
           leaves: list[torch.Tensor], what: str) -> None:
    def call() -> None:
        for t in leaves:
            t.grad = None
        fn()
        torch.cuda.synchronize()

    with prepared.mode():
        benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    median_s = benchmark.stats.stats.median
    benchmark.extra_info.update(
        problem=prepared.problem.as_dict(), method=prepared.method.name, what=what,
        backend=prepared.backend, tflops=flops / median_s / 1e12)


FORWARD_METHODS = m.BASELINES + m.DASH[:1]


@pytest.mark.parametrize("method", FORWARD_METHODS, ids=lambda x: x.name)
def test_forward(benchmark, method: m.Method, problem: m.Problem, inputs) -> None:
    prepared = _prepared(method, problem, inputs)
    q, k, v, _ = inputs
    _bench(benchmark, prepared, lambda: prepared.forward(q, k, v), problem.flops_forward, [],
           "forward")


@pytest.mark.parametrize("method", m.METHODS, ids=lambda x: x.name)
def test_backward(benchmark, method: m.Method, problem: m.Problem, inputs) -> None:
    prepared = _prepared(method, problem, inputs)
    q, k, v, grad_out = inputs
    with prepared.mode():
        out = prepared.forward(q, k, v)
    _bench(benchmark, prepared, lambda: out.backward(grad_out, retain_graph=True),
           problem.flops_backward, [q, k, v], "backward")


@pytest.mark.parametrize("method", m.METHODS, ids=lambda x: x.name)
def test_forward_backward(benchmark, method: m.Method, problem: m.Problem, inputs) -> None:
    prepared = _prepared(method, problem, inputs)
    q, k, v, grad_out = inputs
    _bench(benchmark, prepared, lambda: prepared.forward(q, k, v).backward(grad_out),
           problem.flops_forward + problem.flops_backward, [q, k, v], "forward+backward")
