"""GPU determinism report: run the determinism properties on the Triton kernels and write them down.

    python3 bench/determinism_report.py [--out REPORT.md] [--json RECORDS.json]

By default both go to bench/results/<date>-<gpu>-<commit>/ (determinism-report.md and
determinism.json), with the command in that folder's README.md.

Checks, all with ``dash_inductor.testing``: (1) a handful of representative problems, each repeated
``--repeats`` times (1000, as FlashAttention-3's tests) per deterministic backward schedule;
(2) ``--draws`` hypothesis-drawn problems (derandomized) checked against SDPA's float64 math, over
repeats and for batch invariance; (3) a fresh process gives the same bits; (4) negative controls:
the ``atomic`` schedule and SDPA with determinism off must be caught differing between runs on some
problem, which shows that the checker can fail. tests/gpu/test_determinism_gpu.py runs the same
functions under pytest. Without CUDA (``--smoke``) it runs tiny problems in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke; must precede importing triton

import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dash_inductor  # noqa: E402
from dash_inductor import config  # noqa: E402
from dash_inductor.ops import catalog  # noqa: E402
from dash_inductor.pytest_plugin import deterministic_algorithms_mode  # noqa: E402
from dash_inductor.testing import (  # noqa: E402
                                   AttentionInputs,
                                   AttentionProblem,
                                   assert_batch_invariant,
                                   assert_bitwise_reproducible,
                                   assert_process_reproducible,
                                   attention_problems,
                                   flash_rule_errors,
                                   low_precision_math_sdpa,
                                   )

BF16, FP16 = torch.bfloat16, torch.float16
#: Representative problems for the 1000-repeat check: full and causal, head dims 64/96/128, GQA
#: (at d128 causal, the Hopper items that visit their tiles head by head), lengths off the tile
#: grid, a one-query decode step, masks with fully-masked rows, views.
REPRESENTATIVE: dict[str, AttentionProblem] = {
    "bf16 d128 full N=2048": AttentionProblem(2, 16, 16, 2048, 2048, 128, 128, BF16),
    "bf16 d128 causal N=2048": AttentionProblem(2, 16, 16, 2048, 2048, 128, 128, BF16,
                                                is_causal=True),
    "bf16 d64 GQA 16/4 causal N=1000": AttentionProblem(2, 16, 4, 1000, 1000, 64, 64, BF16,
                                                        is_causal=True),
    "bf16 d128 GQA 16/4 causal N=2048": AttentionProblem(2, 16, 4, 2048, 2048, 128, 128, BF16,
                                                         is_causal=True),
    "fp16 d96 bool mask L=777 S=1200, masked rows, (B,L,H,E) views": AttentionProblem(
        2, 8, 8, 777, 1200, 96, 96, FP16, mask="bool", mask_shape="batch",
        masked_rows=(0, 500), layout="transposed"),
    "bf16 d128 L=1 S=4097 (decode step), float mask": AttentionProblem(
        8, 16, 16, 1, 4097, 128, 128, BF16, mask="float", mask_shape="heads"),
}
#: Tiny stand-ins for --smoke (Triton interpreter on the CPU).
SMOKE: dict[str, AttentionProblem] = {
    "fp32 d16 causal L=33 S=20": AttentionProblem(1, 2, 1, 33, 20, 16, 16, is_causal=True),
    "bf16 d16 bool mask L=17 S=40, views": AttentionProblem(
        2, 2, 2, 17, 40, 16, 16, BF16, mask="bool", masked_rows=(3,), layout="transposed"),
}
DETERMINISTIC = catalog.DETERMINISTIC
#: Where the negative controls look for non-determinism: many KV tiles per Q tile.
CONTROL_PROBLEMS = [AttentionProblem(4, 16, 16, 4096, 4096, 128, 128, BF16),
                    AttentionProblem(2, 16, 16, 4096, 4096, 64, 64, BF16, is_causal=True),
                    AttentionProblem(8, 16, 16, 1024, 1024, 128, 128, FP16)]


def gpu_problems(max_len: int = 1100) -> st.SearchStrategy[AttentionProblem]:
    """Larger draws for the GPU: lengths across several tiles, head dims of real models."""
    return attention_problems(batch=(1, 3), q_heads=(1, 16), gqa_ratios=(1, 2, 4, 8),
                              q_len=(1, max_len), kv_len=(1, max_len), head_dims=(64, 96, 128),
                              v_head_dims=(64, 128), dtypes=(BF16, FP16), tile=128)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_repeats(problem: AttentionProblem, schedule: str, repeats: int, seed: int = 0) -> None:
    """Forward and backward of ``problem`` give the same bits ``repeats`` times in a row."""
    inputs = problem.make_inputs(_device(), seed)
    with config.patch(schedule=schedule):
        assert_bitwise_reproducible(dash_inductor.attention, *inputs.args, runs=repeats,
                                    **problem.sdpa_kwargs())


def check_batch_invariance(problem: AttentionProblem, schedule: str, seed: int = 0) -> None:
    """Each sequence gives the same bits alone as inside the batch."""
    inputs = problem.make_inputs(_device(), seed)
    with config.patch(schedule=schedule):
        assert_batch_invariant(dash_inductor.attention, inputs.args,
                               in_dims=problem.batch_in_dims(), kwargs=problem.sdpa_kwargs())


def _grads(fn: Callable[..., torch.Tensor], inputs: AttentionInputs, problem: AttentionProblem,
           upstream: torch.Tensor) -> list[torch.Tensor]:
    q, k, v, mask = inputs.args
    out = fn(q, k, v, attn_mask=mask, **problem.sdpa_kwargs())
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), upstream.to(out.dtype))]


def check_against_float64(problem: AttentionProblem, inputs: AttentionInputs) -> None:
    """The FlashAttention rule: our error is at most twice SDPA's in the same dtype, plus slack,
    both measured against SDPA's math backend in float64.

    The errors come from ``flash_rule_errors``; the slack here is relative, as in
    tests/test_properties.py: 1e-3 times the reference's largest magnitude (at least 1e-3).
    """
    shape = (problem.batch, problem.q_heads, problem.q_len, problem.v_head_dim)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(_device())
    ours = _grads(dash_inductor.attention, inputs, problem, upstream)
    with low_precision_math_sdpa():  # where SDPA falls back to math, it computes in the dtype
        same = _grads(F.scaled_dot_product_attention, inputs, problem, upstream)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        truth = _grads(F.scaled_dot_product_attention, inputs.cast(torch.float64), problem,
                       upstream)
    # SDPA's fused kernels may give NaN on fully-masked rows (the math backend gives 0): those
    # entries count as exact for SDPA, NaN in ours still fails
    same = [torch.where(theirs.isnan(), ref, theirs.double()) for theirs, ref in zip(same, truth)]
    for error, ref in zip(flash_rule_errors(ours, same, truth), truth):
        bound = 2 * error.same_error + 1e-3 * max(1.0, ref.abs().max().item())
        assert error.error <= bound, \
            f"{error.name}: error {error.error:.3g} > {bound:.3g} on {problem}"


def check_drawn_problem(problem: AttentionProblem, schedule: str, repeats: int = 20) -> None:
    """Accuracy, repeats and batch invariance of one drawn problem under one schedule."""
    inputs = problem.make_inputs(_device(), seed=problem.q_len * 7 + problem.kv_len)
    with config.patch(schedule=schedule):
        check_against_float64(problem, inputs)
        assert_bitwise_reproducible(dash_inductor.attention, *inputs.args, runs=repeats,
                                    **problem.sdpa_kwargs())
        assert_batch_invariant(dash_inductor.attention, inputs.args,
                               in_dims=problem.batch_in_dims(), kwargs=problem.sdpa_kwargs())


def check_process(problem: AttentionProblem, schedule: str) -> None:
    """A fresh Python process computes the same bits (digests of outputs and gradients)."""
    inputs = problem.make_inputs(_device(), seed=5)
    call = functools.partial(dash_inductor.attention, **problem.sdpa_kwargs())
    with config.patch(schedule=schedule):
        assert_process_reproducible(call, *inputs.args)


def find_nondeterminism(fn: Callable[..., torch.Tensor], problems: Sequence[AttentionProblem],
                        repeats: int) -> str:
    """The checker's report on the first problem where ``fn`` differs between runs.

    Raises AssertionError when no problem differs: then the negative control failed to show that
    the checker can catch non-determinism.
    """
    for problem in problems:
        inputs = problem.make_inputs(_device(), seed=11)
        try:
            assert_bitwise_reproducible(fn, *inputs.args, runs=repeats, **problem.sdpa_kwargs())
        except AssertionError as caught:
            return f"{problem}: {caught}"
    raise AssertionError(f"no run-to-run difference found in {repeats} repeats of "
                         f"{len(problems)} problems")


def control_atomic(problems: Sequence[AttentionProblem], repeats: int) -> str:
    """dash.attention with the non-deterministic ``atomic`` backward (fp32 atomics for dQ)."""
    with deterministic_algorithms_mode(False), config.patch(schedule="atomic"):
        return find_nondeterminism(dash_inductor.attention, problems, repeats)


def control_sdpa_deterministic(problems: Sequence[AttentionProblem], repeats: int) -> None:
    """Positive control: SDPA under ``torch.use_deterministic_algorithms(True)`` passes."""
    with deterministic_algorithms_mode(True):
        for problem in problems:
            inputs = problem.make_inputs(_device(), seed=11)
            assert_bitwise_reproducible(F.scaled_dot_product_attention, *inputs.args,
                                        runs=repeats, **problem.sdpa_kwargs())


def control_sdpa(problems: Sequence[AttentionProblem], repeats: int) -> str:
    """PyTorch's SDPA with its default (fastest) backends and determinism off."""
    with deterministic_algorithms_mode(False):
        return find_nondeterminism(F.scaled_dot_product_attention, problems, repeats)


@dataclasses.dataclass
class Record:
    check: str
    config: str
    schedule: str
    repeats: int
    passed: bool
    seconds: float
    detail: str = ""


def _timed(check: str, name: str, schedule: str, repeats: int,
           body: Callable[[], str | None]) -> Record:
    start = time.perf_counter()
    try:
        detail, passed = body() or "", True
    except AssertionError as failure:
        detail, passed = str(failure), False
    except Exception as error:  # a crash is a failed check too, not the end of the report
        detail, passed = f"{type(error).__name__}: {error}", False
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    record = Record(check, name, schedule, repeats, passed, time.perf_counter() - start, detail)
    print(f"[{'pass' if passed else 'FAIL'}] {check} | {name} | {schedule} | {repeats} repeats | "
          f"{record.seconds:.1f}s", flush=True)
    return record


def drawn(count: int, strategy: st.SearchStrategy[AttentionProblem]) -> list[tuple[AttentionProblem,
                                                                                   str]]:
    """``count`` derandomized draws, the same on every run, paired with the schedules in turn."""
    found: list[AttentionProblem] = []

    @settings(derandomize=True, max_examples=count, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(problem: AttentionProblem) -> None:
        found.append(problem)

    collect()
    return [(problem, DETERMINISTIC[i % len(DETERMINISTIC)]) for i, problem in enumerate(found)]


def run_all(args: argparse.Namespace) -> Iterator[Record]:
    table = SMOKE if args.smoke else REPRESENTATIVE
    for name, problem in table.items():
        for schedule in DETERMINISTIC:
            yield _timed("repeats", name, schedule, args.repeats,
                         lambda: check_repeats(problem, schedule, args.repeats))
            yield _timed("batch invariance", name, schedule, 1,
                         lambda: check_batch_invariance(problem, schedule))
    strategy = attention_problems(head_dims=(16,), tile=16) if args.smoke else gpu_problems()
    for problem, schedule in drawn(args.draws, strategy):
        yield _timed("drawn problem", str(problem), schedule, 20,
                     lambda: check_drawn_problem(problem, schedule))
    name, problem = next(iter(table.items()))
    yield _timed("fresh process", name, "shift", 1, lambda: check_process(problem, "shift"))
    controls = list(table.values()) if args.smoke else CONTROL_PROBLEMS
    yield _timed("control (expect pass)", "SDPA, determinism on", "-", args.control_repeats,
                 lambda: control_sdpa_deterministic(controls, args.control_repeats))
    yield _timed("negative control (expect caught)", "atomic schedule", "atomic",
                 args.control_repeats,
                 lambda: control_atomic(controls, args.control_repeats))
    yield _timed("negative control (expect caught)", "SDPA, determinism off", "-",
                 args.control_repeats,
                 lambda: control_sdpa(controls, args.control_repeats))


def environment() -> dict[str, str]:
    import triton

    cuda = torch.cuda.is_available()
    device = (f"{torch.cuda.get_device_name()}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs" if cuda
              else f"CPU ({platform.machine()}), Triton interpreter")
    return {"device": device,
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": str(torch.version.cuda), "python": platform.python_version(),
            "dash_inductor": dash_inductor.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown(env: dict[str, str], records: list[Record], args: argparse.Namespace) -> str:
    controls = [r for r in records if r.check.startswith("negative")]
    checks = [r for r in records if r not in controls]
    failed = [r for r in checks if not r.passed]
    lines = ["# Determinism report", "",
             "Written by `bench/determinism_report.py` (the checks of "
             "`tests/gpu/test_determinism_gpu.py`, with `dash_inductor.testing`).", "",
             *(f"- {key}: {value}" for key, value in env.items()), "",
             f"**Result: {len(checks) - len(failed)} of {len(checks)} checks passed; negative "
             f"controls caught {sum(r.passed for r in controls)} of {len(controls)}.**", "",
             "## Repeats and properties", "",
             "Each check compares every output and gradient (dQ, dK, dV) bit for bit with the "
             "first run; the upstream gradient is a fixed random tensor. Drawn problems also "
             "check accuracy against SDPA's float64 math (FlashAttention's rule) and batch "
             "invariance.", "",
             "| check | problem | schedule | repeats | result | seconds |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.config} | {r.schedule} | {r.repeats} | "
              f"{'pass' if r.passed else 'FAIL'} | {r.seconds:.1f} |" for r in checks]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- {r.check}, {r.config}, {r.schedule}:\n\n```\n{r.detail}\n```" for r in failed]
    lines += ["", "## Negative controls", "",
              "Known non-deterministic code must be caught by the same checker, or the passes "
              "above would prove nothing.", ""]
    for r in controls:
        verdict = "caught" if r.passed else "NOT caught"
        lines += [f"- {r.config}: **{verdict}** (up to {r.repeats} repeats per problem)", "",
                  "```", r.detail, "```", ""]
    lines += ["", f"Re-run: `python3 bench/determinism_report.py --repeats {args.repeats} "
                  f"--draws {args.draws}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the markdown report (default: "
                        "bench/results/<date>-<gpu>-<commit>/determinism-report.md)")
    parser.add_argument("--json", default=None, help="the raw records (default: determinism.json "
                        "in the default folder)")
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--draws", type=int, default=12)
    parser.add_argument("--control-repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny problems and few repeats (CPU, Triton interpreter)")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.draws, args.control_repeats = min(args.repeats, 3), min(args.draws, 3), 3
        config.cpu_backend = "triton"  # run the kernels (interpreted), not the PyTorch reference
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    env = environment()
    records = list(run_all(args))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import outdir

    directory = outdir.default_dir(env["device"], env["date"])
    report_path = args.out or os.path.join(directory, "determinism-report.md")
    json_path = args.json or os.path.join(directory, "determinism.json")
    for path in (report_path, json_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(report_path, "w") as handle:
        handle.write(markdown(env, records, args))
    with open(json_path, "w") as handle:
        json.dump({"environment": env, "records": [dataclasses.asdict(r) for r in records]},
                  handle, indent=1)
    if not (args.out and args.json):
        command = " ".join(["python3 bench/determinism_report.py", *sys.argv[1:]])
        outdir.record_command(directory, command, [Path(report_path), Path(json_path)])
    print(f"wrote {report_path} and {json_path}")


if __name__ == "__main__":
    main()
