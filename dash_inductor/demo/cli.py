"""The demo behind ``python -m dash_inductor demo``: reproducible training with torch.compile.

It trains a small GPT-style model (``tiny_gpt.py``: causal SDPA, grouped-query attention in every
other layer) with ``torch.compile``, each way twice from the same seed. On a GPU it trains three ways and prints one
table: determinism off (the bits may differ between the runs), SDPA under
``torch.use_deterministic_algorithms(True)`` with the rewrite off (same bits, PyTorch's
deterministic attention's step time), and dash (same bits, its step time). On a CPU, where SDPA is
already reproducible, it trains with dash only and shows what dash adds there: which attention calls
the Inductor pass rewrote to ``dash.attention`` (and why any were left alone), and that both runs
end with bit-identical weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterator, TextIO

import torch
from torch import Tensor

import dash_inductor
from dash_inductor.demo.tiny_gpt import DemoConfig, chain_batch, make_model
from dash_inductor.library.signatures import wait_for_replayer

# cuBLAS refuses deterministic mode without a fixed workspace; it must be set before cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class ProgressBar:
    """A plain-text progress bar (no dependency): redrawn in place on a terminal, lines otherwise."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream or sys.stdout
        self.done = 0
        self.interactive = self.stream.isatty()

    def update(self, note: str = "") -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} {note}")
        if self.interactive:
            self.stream.write("\r" + line.ljust(100))
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclasses.dataclass
class Run:
    """What one training run produced."""

    losses: list[float]
    state: dict[str, Tensor]
    step_seconds: list[float]


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(cfg: DemoConfig, *, deterministic: bool = True, compiled: bool = True,
          label: str = "train", stream: TextIO | None = None) -> Run:
    """Train a fresh model from ``cfg.seed`` for ``cfg.steps`` steps; the caller sets the modes."""
    torch._dynamo.reset()
    model = make_model(cfg)
    step_fn: Callable[[Tensor], Tensor] = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    losses, seconds = [], []
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(deterministic)
    try:
        bar = ProgressBar(cfg.steps, label, stream)
        for _ in range(cfg.steps):
            tokens = chain_batch(cfg, generator)
            _synchronize(cfg.device)
            start = time.perf_counter()
            loss = step_fn(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _synchronize(cfg.device)
            seconds.append(time.perf_counter() - start)
            losses.append(loss.item())
            bar.update(f"loss {losses[-1]:.4f}")
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return Run(losses, state, seconds)


def differing_tensors(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Names of the tensors that are not bit-identical between two state dicts."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [name for name in a if not torch.equal(_bits(a[name]), _bits(b[name]))]


def _bits(t: Tensor) -> Tensor:
    """The tensor's raw bits as integers, so that NaNs and signed zeros compare exactly."""
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view_dtype)


@contextlib.contextmanager
def quiet_cache_key_warnings() -> Iterator[None]:
    """Silence Inductor's "Failed to pickle cache key" warnings for the block.

    Some torch versions print a traceback per compiled graph when a cache key holds an object that
    cannot be pickled; the compile goes on without the cache. The demo's output stays readable.
    """
    logger = logging.getLogger("torch._inductor.codecache")
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


@contextlib.contextmanager
def recorded_sites() -> Iterator[list[Any]]:
    """Collect the rewrite's report of every attention site compiled inside the block.

    The compiles run under a fresh Inductor cache, so the pass really runs (a cache hit would
    skip it and report nothing); compiles repeated inside the block reuse that cache.
    """
    from torch._inductor.utils import fresh_inductor_cache

    from dash_inductor.inductor import rewrite

    with rewrite.recording() as records, fresh_inductor_cache():
        yield records


def describe_sites(reports: list[Any]) -> tuple[int, list[str]]:
    """(number of rewritten calls, printable lines) for a list of the rewrite's site reports."""
    counts = Counter((r.site, r.rewritten, r.reason) for r in reports if r.graph == "pre-grad"
                     or r.rewritten)
    rewritten = sum(n for (_, done, _), n in counts.items() if done)
    lines = []
    for (site, done, reason), n in sorted(counts.items(), key=lambda kv: (not kv[0][1], kv[0][0])):
        what = "rewritten to dash.attention" if done else f"left as SDPA: {reason}"
        lines.append(f"  {n} x {_short_site(site)}: {what}")
    return rewritten, lines


def _short_site(site: str) -> str:
    path, _, rest = site.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else site


def _mean_step_ms(run: Run) -> float:
    """Mean step time in ms, leaving out the first steps (compilation and warm-up)."""
    timed = run.step_seconds[2:] or run.step_seconds[-1:]
    return 1e3 * sum(timed) / len(timed)


#: The three ways the demo trains on a GPU: (name, deterministic algorithms, config.rewrite).
DETERMINISM_OFF = ("determinism off", False, "off")
SDPA_DETERMINISTIC = ("SDPA, determinism on", True, "off")
DASH = ("dash, determinism on", True, "deterministic")


@dataclasses.dataclass
class Variant:
    """Two training runs of one way of training, and whether their final weights agree."""

    name: str
    deterministic: bool
    rewrite: str
    runs: list[Run]
    differing: list[str]

    @property
    def step_ms(self) -> float:
        """Mean step time over both runs, leaving out each run's warm-up steps."""
        return sum(_mean_step_ms(run) for run in self.runs) / len(self.runs)


def train_twice(cfg: DemoConfig, name: str, deterministic: bool, rewrite: str,
                stream: TextIO | None = None,
                after_first: Callable[[], None] | None = None) -> Variant:
    """Train twice from the same seed under one (determinism mode, ``config.rewrite``) pair."""
    runs: list[Run] = []
    with dash_inductor.config.patch(rewrite=rewrite):
        for index in (1, 2):
            runs.append(train(cfg, deterministic=deterministic, label=f"  run {index}",
                              stream=stream))
            if index == 1 and after_first is not None:
                after_first()
    return Variant(name, deterministic, rewrite, runs,
                   differing_tensors(runs[0].state, runs[1].state))


def bits_cell(variant: Variant) -> str:
    """"identical", or how many tensors differ between the two runs."""
    if not variant.differing:
        return "identical"
    return f"differ ({len(variant.differing)} of {len(variant.runs[0].state)} tensors)"


def render_table(variants: list[Variant]) -> list[str]:
    """The GPU comparison: one line per way of training, with its bits and its step time."""
    baseline = next((v.step_ms for v in variants if not v.deterministic), None)
    width = max(len(v.name) for v in variants)
    lines = [f"  {'':<{width}}  {'final weights, run 1 vs 2':<28}{'step time':>10}"
             f"{'vs determinism off':>20}"]
    for v in variants:
        ratio = f"{v.step_ms / baseline:.2f}x" if baseline else "-"
        lines.append(f"  {v.name:<{width}}  {bits_cell(v):<28}{v.step_ms:>7.2f} ms{ratio:>20}")
    return lines


@dataclasses.dataclass
class DemoResult:
    """Everything the demo measured. ``exit_code`` is 0 when dash's two runs are bit-identical with
    finite losses and the rewrite put dash.attention in place of every attention call."""

    runs: list[Run]  #: dash's two runs
    sites: list[Any]
    rewritten: int
    expected_rewrites: int
    differing: list[str]
    variants: list[Variant] = dataclasses.field(default_factory=list)

    @property
    def step_ms(self) -> dict[str, float]:
        """Step time (ms) of each way of training (on a GPU; empty on a CPU)."""
        return {v.name: v.step_ms for v in self.variants} if len(self.variants) > 1 else {}

    @property
    def rewrite_fired(self) -> bool:
        return self.rewritten >= self.expected_rewrites

    @property
    def exit_code(self) -> int:
        finite = all(math.isfinite(x) for run in self.runs for x in run.losses)
        return 0 if not self.differing and finite and self.rewrite_fired else 1


def demo(cfg: DemoConfig, out: Callable[[str], None] = print,
         stream: TextIO | None = None) -> DemoResult:
    """Run the whole demo, printing through ``out`` (lines) and ``stream`` (progress bars).

    On a GPU: the same compiled training run three ways, each twice (determinism off, SDPA with
    determinism on, dash), and one table of their bits and step times. On a CPU: dash only, since
    CPU SDPA is already reproducible; it shows the rewrite and the bit-identical runs.
    """
    dash_inductor.enable()  # installed at import; again in case disable() was called
    device = torch.device(cfg.device)
    on_gpu = device.type == "cuda"
    out(f"dash_inductor {dash_inductor.__version__}, torch {torch.__version__}, device "
        f"{torch.cuda.get_device_name(device) if on_gpu else 'cpu'}")
    gqa_layers = [i for i in range(cfg.layers) if cfg.kv_heads(i) != cfg.heads]
    out(f"Model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads (GQA in layers "
        f"{gqa_layers or 'none'}), seq {cfg.seq}, batch {cfg.batch}, {cfg.steps} steps, "
        f"{str(cfg.dtype).removeprefix('torch.')}; torch.compile, two runs from seed {cfg.seed}")
    if not on_gpu:
        out("On CPU, PyTorch's SDPA is already reproducible: two runs give the same bits with or "
            "without dash,\nand there is no speed to compare. What this run shows is the rewrite: "
            "every SDPA call of the compiled\nmodel runs dash.attention (here its deterministic "
            "PyTorch reference), and the two runs end bit-identical.\nOn a GPU the demo also "
            "trains with determinism off and with PyTorch's deterministic SDPA, and times all "
            "three.")

    if on_gpu:  # every variant's steps are timed with no load running beside them
        out("Loading dash's C++ replayer (built once per torch version, about a minute)")
        wait_for_replayer()
    variants: list[Variant] = []
    with quiet_cache_key_warnings():
        if on_gpu:
            for name, deterministic, rewrite in (DETERMINISM_OFF, SDPA_DETERMINISTIC):
                out(f"{name}:")
                variants.append(train_twice(cfg, name, deterministic, rewrite, stream))
        name, deterministic, rewrite = DASH
        out(f"{name} (torch.use_deterministic_algorithms(True), the Inductor rewrite on):")
        counted: list[tuple[int, list[str]]] = []
        with recorded_sites() as sites:
            dash_variant = train_twice(cfg, name, deterministic, rewrite, stream,
                                       after_first=lambda: counted.append(describe_sites(sites)))
        variants.append(dash_variant)
    rewritten, lines = counted[0]
    result = DemoResult(dash_variant.runs, list(sites), rewritten, cfg.layers,
                        dash_variant.differing, variants)

    out(f"Attention calls rewritten to dash.attention: {rewritten} of the model's {cfg.layers}")
    for line in lines:
        out(line)
    if on_gpu:
        out("")
        for line in render_table(variants):
            out(line)
        out("")
    for line in verdict(result):
        out(line)
    return result


def verdict(result: DemoResult) -> list[str]:
    """dash's final losses, then OK or what failed: the rewrite, the bits or the losses."""
    runs = result.runs
    lines = [f"dash, final loss: run 1 {runs[0].losses[-1]:.6f}, run 2 {runs[1].losses[-1]:.6f}"]
    if not result.rewrite_fired:
        lines.append(f"FAIL: the rewrite replaced {result.rewritten} of "
                     f"{result.expected_rewrites} attention calls, so these runs show SDPA's "
                     f"bits, not dash's (is dash_inductor.config.rewrite 'off'?)")
    if result.differing:
        lines.append(f"FAIL: dash's final weights differ between the runs in "
                     f"{len(result.differing)} tensors, e.g. {result.differing[:3]}")
    if not all(math.isfinite(x) for run in runs for x in run.losses):
        lines.append(f"FAIL: non-finite loss in {[run.losses for run in runs]}")
    if not result.exit_code:
        lines.append(f"OK: dash ran every attention call, and the final weights of both runs are "
                     f"bit-identical ({len(runs[0].state)} tensors).")
    return lines


def run_demo(cfg: DemoConfig, out: Callable[[str], None] = print,
             stream: TextIO | None = None) -> int:
    """The demo as a command: returns the process exit status (0 = dash ran and reproduced)."""
    return demo(cfg, out, stream).exit_code
