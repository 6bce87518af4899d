"""Small forward + backward runs of every kernel variant, to run under compute-sanitizer.

Each variant is one (path, layout, schedule, mask, head dim) of the kernels, run once through the
public API on a small problem (seconds on the GPU; sanitizer tools run kernels 10-100x slower)
and checked against SDPA's math backend (FlashAttention's rule, ``dash_inductor.testing``):

- ``hopper-forward-{full,causal}-d{64,128}``: the Hopper (Gluon) forward alone.
- ``hopper-dense-{schedule}-{full,causal}-d{64,128}``: ``dash_inductor.attention(...,
  kernel="hopper")``: the Hopper forward and the dense Hopper backward, each of the ordered
  schedules (``ascending``, ``descending``, ``shift``).
- ``hopper-packed-{schedule}-{full,causal}-d{64,128}``: ``dash_inductor.varlen_attention`` with
  ``kernel="hopper"``: the packed Hopper forward and backward (checked from the recorded plans).
  Causal ``shift`` is the claimed deal (``ops/hopper/deal.py``), given more work items than an
  H100 has SMs so that programs claim; at head dim 128 it also converts dQ in the kernel's tail
  (``ops/hopper/dq_tail.py``).
- ``portable-dense-{schedule}-{full,causal}-d{64,128}`` and ``portable-packed-...``: the
  ``tl`` kernels (``kernel="portable"``), every schedule of ``catalog.NAMES``.

On an sm90 GPU (warm Triton's cache first: a compile under the sanitizer is slow too)::

    python3 bench/racecheck.py --list
    python3 bench/racecheck.py                      # every variant, no sanitizer: warms the cache
    compute-sanitizer --tool racecheck --racecheck-report analysis --print-limit 1000000 \
        --launch-timeout 0 --target-processes application-only --show-backtrace no \
        python3 bench/racecheck.py --variants 'hopper-*' --no-check > racecheck.log 2>&1
    python3 bench/racecheck.py --triage racecheck.log
    compute-sanitizer --tool synccheck --launch-timeout 0 --target-processes application-only \
        python3 bench/racecheck.py --variants hopper-dense-shift-full-d64

``--launch-timeout 0``: the sanitizer's default wait for a CUDA process is shorter than Python's
imports. ``--variants`` takes names or shell patterns (comma or space separated). Without a GPU,
``--device cpu`` runs the portable variants on tiny shapes in the Triton interpreter (it sets
``TRITON_INTERPRET=1`` itself) to check the script. The exit status is 1 if a variant failed (an
exception, a path other than the one named, or the accuracy check), else 0: a clean run of the
script under a sanitizer still needs the sanitizer's own summary (``ERROR SUMMARY`` /
``RACECHECK SUMMARY``) read. ``--triage LOG`` groups a racecheck log's hazards (an ``analysis``
report lists each racing pair once, so nothing is past the print limit; a ``hazard`` one adds
addresses) and marks the two known false positives, Triton's warp-specialization state bytes and
the dQ partial's hand-off (racecheck loses a named barrier's ordering once one side also took a
partial barrier of its own); docs/racecheck.md has the evidence.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from racecheck_triage import triage  # noqa: E402 -- bench/ is on the path when run


@dataclass(frozen=True)
class Variant:
    """One kernel variant and the problem that runs it."""

    path: str  #: "hopper" or "portable"
    layout: str  #: "forward" (Hopper forward only), "dense" or "packed"
    schedule: str | None  #: the backward schedule; None for "forward"
    causal: bool
    head_dim: int

    @property
    def name(self) -> str:
        parts = [self.path, self.layout, self.schedule, "causal" if self.causal else "full",
                 f"d{self.head_dim}"]
        return "-".join(p for p in parts if p)

    @property
    def note(self) -> str:
        if self.path == "hopper" and self.layout == "packed" and self.causal and \
                self.schedule == "shift":
            return "claimed deal" + (", dQ tail conversion" if self.head_dim == 128 else "")
        return ""


HEAD_DIMS = (64, 128)
HOPPER_SCHEDULES = ("ascending", "descending", "shift")  # the ordered ones, the Hopper path's


def variants(portable_schedules: tuple[str, ...]) -> list[Variant]:
    """Every variant, in the order they run."""
    found = [Variant("hopper", "forward", None, causal, d)
             for d in HEAD_DIMS for causal in (False, True)]
    for path, schedules in (("hopper", HOPPER_SCHEDULES), ("portable", portable_schedules)):
        for layout in ("dense", "packed"):
            found += [Variant(path, layout, s, causal, d) for d in HEAD_DIMS for s in schedules
                      for causal in (False, True)]
    return found


def select(all_variants: list[Variant], patterns: list[str]) -> list[Variant]:
    """The variants whose names match one of ``patterns`` (names or shell patterns)."""
    wanted = [p for item in patterns for p in item.replace(",", " ").split()]
    chosen = [v for v in all_variants if any(fnmatch.fnmatchcase(v.name, p) for p in wanted)]
    unknown = [p for p in wanted if not any(fnmatch.fnmatchcase(v.name, p) for v in all_variants)]
    if unknown:
        raise SystemExit(f"no variant matches {unknown}; see --list")
    return chosen


# ---------------------------------------------------------------------------------------------
# Problems


@dataclass(frozen=True)
class Sizes:
    """The problem sizes: a dense (1, hq, seq, D) problem, and packed self-attention lengths."""

    hq: int
    hkv: int
    seq: int
    packed: tuple[int, ...]
    claimed: tuple[int, ...]  #: the packed lengths of the claimed-deal variants


def sizes(device: str, gqa: bool, seq: int | None) -> Sizes:
    hq, hkv = (4, 2) if gqa else (2, 2)
    if device == "cpu":  # the Triton interpreter: tiny
        return Sizes(hq, hkv, seq or 40, (40, 0, 17), (40, 0, 17))
    # (1, 2, 300, D) is the problem of the racecheck report (docs/racecheck.md); the packed
    # lengths put tile edges inside sequences and leave one empty. The claimed deal's programs
    # claim only where the items outnumber the programs (at most one per SM, 132 on an H100):
    # 80 short sequences on 2 KV heads make 160 and more.
    return Sizes(hq, hkv, seq or 300, (300, 77, 0, 200, 129), (300, 77, 0, 200) + (96,) * 80)


def _randn(shape, device, gen, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def run_dense(v: Variant, sz: Sizes, device: str, dtype, seed: int):
    """(outputs by name, the inputs) of one dense call through ``dash_inductor.attention``: the
    forward, then the backward unless the variant is the forward alone."""
    gen = torch.Generator().manual_seed(seed)
    q = _randn((1, sz.hq, sz.seq, v.head_dim), device, gen, dtype)
    k = _randn((1, sz.hkv, sz.seq, v.head_dim), device, gen, dtype)
    val = _randn((1, sz.hkv, sz.seq, v.head_dim), device, gen, dtype)
    do = _randn((1, sz.hq, sz.seq, v.head_dim), device, gen, dtype)
    if v.layout == "forward":  # no gradient: the forward alone
        with torch.no_grad():
            out = dash_inductor.attention(q, k, val, is_causal=v.causal,
                                          enable_gqa=sz.hq != sz.hkv, kernel=v.path)
        return {"out": out}, (q, k, val, do)
    leaves = [t.detach().requires_grad_() for t in (q, k, val)]
    # Everything after ``value`` by keyword: the signature is SDPA's order.
    out = dash_inductor.attention(*leaves, is_causal=v.causal, enable_gqa=sz.hq != sz.hkv,
                                  schedule=v.schedule, kernel=v.path)
    out.backward(do)
    grads = [t.grad for t in leaves]
    return dict(zip(("out", "dq", "dk", "dv"), [out.detach(), *grads])), (q, k, val, do)


def run_packed(v: Variant, sz: Sizes, device: str, dtype, seed: int):
    """(outputs by name, the inputs, lengths) of one ``varlen_attention`` call and its backward."""
    lengths = sz.claimed if v.note.startswith("claimed") else sz.packed
    total = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = _randn((total, sz.hq, v.head_dim), device, gen, dtype)
    k = _randn((total, sz.hkv, v.head_dim), device, gen, dtype)
    val = _randn((total, sz.hkv, v.head_dim), device, gen, dtype)
    do = _randn((total, sz.hq, v.head_dim), device, gen, dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                           device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k, val)]
    with dash_inductor.config.patch(schedule=v.schedule, kernel=v.path):
        out = dash_inductor.varlen_attention(*leaves, offsets, offsets, max(lengths),
                                             max(lengths),
                                             window_size=(-1, 0) if v.causal else (-1, -1),
                                             enable_gqa=sz.hq != sz.hkv)
    out.backward(do)
    grads = [t.grad for t in leaves]
    return (dict(zip(("out", "dq", "dk", "dv"), [out.detach(), *grads])), (q, k, val, do),
            lengths)


def reference(v: Variant, inputs, lengths, dtype, sz: Sizes):
    """(same-dtype, float32) references on the CPU (no kernel of theirs runs under the sanitizer),
    each a list in the order of the outputs."""
    from dash_inductor.testing import sdpa_math_reference

    q, k, val, do = (t.detach().cpu() for t in inputs)
    kwargs = dict(is_causal=v.causal, enable_gqa=sz.hq != sz.hkv)
    if v.layout != "packed":
        refs = [sdpa_math_reference(q, k, val, do, d, **kwargs) for d in (dtype, torch.float32)]
        return [list(r[:1] if v.layout == "forward" else r) for r in refs]
    results = []
    for d in (dtype, torch.float32):
        parts = [[], [], [], []]
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            start += n
            if n == 0:
                continue
            seq = [t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, val, do)]
            for part, r in zip(parts, sdpa_math_reference(*seq, d, **kwargs)):
                part.append(r[0].transpose(0, 1))
        results.append([torch.cat(p) for p in parts])
    return results


def check_plans(v: Variant, plans) -> str | None:
    """Why the launches recorded did not run the variant named (None when they did)."""
    backward = [p for p in plans if p.op == "backward"]
    forward = [p for p in plans if p.op == "forward"]
    if v.layout == "forward":
        return None if forward and forward[-1].kernel == "hopper" else f"forward ran {forward}"
    if not backward:
        return "no backward plan recorded"
    plan = backward[-1]
    schedule = getattr(plan.schedule, "name", plan.schedule)  # a name, or a catalog.Schedule
    if plan.kernel != v.path or schedule != v.schedule:
        return (f"backward ran {plan.kernel}/{schedule} ({plan.kernel_reason or ''}"
                f"{plan.fallback or ''})")
    ran_forward = forward[-1].kernel if forward else None
    if v.path == "hopper" and ran_forward != "hopper":
        return f"forward ran {ran_forward}"
    return None


def run_variant(v: Variant, sz: Sizes, device: str, repeat: int, check: bool) -> tuple[bool, str]:
    from dash_inductor.library.op import last_plans
    from dash_inductor.testing import flash_rule_errors

    dtype = torch.bfloat16
    runs = []
    for _ in range(repeat):
        recorded = getattr(dash_inductor.library.op, "_PLANS", None)
        if recorded is not None:  # this run's plans only
            recorded.clear()
        if v.layout == "packed":
            outputs, inputs, lengths = run_packed(v, sz, device, dtype, seed=0)
            plans = last_plans()
        else:
            outputs, inputs = run_dense(v, sz, device, dtype, seed=0)
            plans = last_plans()
            lengths = None
        if device == "cuda":
            torch.cuda.synchronize()
            if check_spin_flags is not None:
                check_spin_flags(wait=True)
        runs.append(outputs)
    notes = []
    failed = False
    wrong_path = check_plans(v, plans)
    if wrong_path:
        failed = True
        notes.append(f"PATH: {wrong_path}")
    if repeat > 1:
        same = all(torch.equal(r[name], runs[0][name]) for r in runs[1:] for name in runs[0])
        failed |= not same and v.schedule != "atomic"
        notes.append("bits equal" if same else "bits DIFFER")
    if check:
        same_ref, ref = reference(v, inputs, lengths, dtype, sz)
        names = tuple(runs[0])
        errors = flash_rule_errors([runs[0][n].cpu() for n in names], same_ref, ref, names=names)
        # A sanity check, not the accuracy tests (tests/gpu/): a race corrupts whole values or
        # leaves NaNs, so an error within 1/64 of the output's largest value (a few bf16 ulps,
        # which tiny problems can exceed the rule by) passes too.
        slack = {e.name: r.abs().max().item() / 64 for e, r in zip(errors, ref)}
        bad = [e for e in errors if not (e.ok or e.error <= slack[e.name])]
        failed |= bool(bad)
        worst = max(errors, key=lambda e: e.error / e.bound)
        notes.append(("ACCURACY " + "; ".join(str(e) for e in bad)) if bad else
                     f"accuracy ok (worst {worst.name}: {worst.error:.2g}, rule's bound "
                     f"{worst.bound:.2g}, slack {slack[worst.name]:.2g})")
    return not failed, ", ".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the variants' names and exit")
    parser.add_argument("--variants", nargs="*", default=["*"],
                        help="names or shell patterns, e.g. 'hopper-dense-*' (default: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the portable variants in the Triton interpreter (a smoke check)")
    parser.add_argument("--gqa", action="store_true", help="4 query heads on 2 KV heads (else 2:2)")
    parser.add_argument("--seq", type=int, default=None, help="dense sequence length "
                        "(default 300, the report's; 40 on the CPU)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per variant; above 1 the bits must repeat (not for atomic)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the accuracy check (SDPA's math backend, on the CPU)")
    parser.add_argument("--triage", metavar="LOG",
                        help="group the hazards of a racecheck log (--racecheck-report hazard) "
                             "and mark the known false positives; run nothing else")
    args = parser.parse_args(argv)
    if args.triage:
        return triage(args.triage)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 set before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    _imports()
    from dash_inductor.ops import catalog

    all_variants = variants(catalog.NAMES)
    if args.list:
        for v in all_variants:
            print(v.name + (f"  ({v.note})" if v.note else ""))
        return 0
    chosen = select(all_variants, args.variants)
    if args.device == "cpu":
        skipped = [v for v in chosen if v.path != "portable"]
        chosen = [v for v in chosen if v.path == "portable"]
        if skipped:
            print(f"skipped on the CPU: {len(skipped)} Hopper variants (they need an sm90 GPU)")
        dash_inductor.config.cpu_backend = "triton"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for the portable kernels")
    elif torch.cuda.get_device_capability()[0] != 9 and any(v.path == "hopper" for v in chosen):
        raise SystemExit("the Hopper variants need an sm90 GPU; select 'portable-*'")
    sz = sizes(args.device, args.gqa, args.seq)
    print(f"# device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, triton {triton.__version__}; dense (1, {sz.hq}/{sz.hkv}, "
          f"{sz.seq}, D), packed lengths {list(sz.packed)}, claimed-deal packing "
          f"{len(sz.claimed)} sequences; {len(chosen)} variants", flush=True)
    failures = 0
    for v in chosen:
        start = time.perf_counter()
        try:
            ok, notes = run_variant(v, sz, args.device, args.repeat, not args.no_check)
        except Exception as error:  # noqa: BLE001 -- report it and go on to the next variant
            ok, notes = False, f"EXCEPTION {type(error).__name__}: {error}"
            traceback.print_exc(limit=4)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {v.name:36s} {time.perf_counter() - start:6.1f}s  "
              f"{notes}" + (f"  [{v.note}]" if v.note else ""), flush=True)
    print(f"# {len(chosen) - failures} passed, {failures} failed")
    return 1 if failures else 0


def _imports() -> None:
    """Import torch, Triton and the package (after TRITON_INTERPRET is settled)."""
    global torch, triton, dash_inductor, check_spin_flags
    import torch
    import triton

    import dash_inductor

    try:
        from dash_inductor.ops.shared.errors import check_spin_flags
    except ImportError:
        check_spin_flags = None


torch = triton = dash_inductor = check_spin_flags = None

if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # quiet when piped into head
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
