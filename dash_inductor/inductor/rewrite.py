"""The Inductor pass that puts ``torch.ops.dash.attention`` in place of SDPA.

Why a pre-grad pass: it sees ``scaled_dot_product_attention`` as the user wrote it, before
AOTAutograd picks a backend, so one pattern covers every device, and AOTAutograd then traces the
op's own autograd (``rewrite_sdpa.py``). Why also a joint-graph pass: Inductor's fuse_attention
turns hand-written attention (matmul, scale, softmax, matmul) into SDPA only later, on the joint
graph, where the pre-grad pass can no longer see it; ``rewrite_fused.py`` swaps those fused calls
for ours.

The decision is taken at compile time: the pass fires while
``torch.are_deterministic_algorithms_enabled()`` (strict or warn-only), or always, or never, as
``dash_inductor.config.rewrite`` says, and the op calls it writes carry the backward choices
(``config.CHOICES``: schedule, kernel, ...) in force then. The passes' ``uuid()`` carries the
decision and those choices, so the FX graph and AOTAutograd caches never serve a graph compiled
under others.

This module imports neither Inductor nor Dynamo, which take seconds to import: ``install()``
puts the passes (``passes.py``) into Inductor's hooks as soon as Inductor is imported, which
any compilation does first.
"""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from dash_inductor.inductor import unmatched
from dash_inductor.inductor.sites import SiteReport, explain_disabled, recording
from dash_inductor.integrations.import_hook import after_import, cancel, waiting

_INDUCTOR = "torch._inductor"


def __getattr__(name: str) -> Any:
    """``PRE_GRAD_PASS`` and ``JOINT_PASS`` (``passes.py``); reading them imports Inductor."""
    if name in ("PRE_GRAD_PASS", "JOINT_PASS"):
        from dash_inductor.inductor import passes

        return getattr(passes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_passes(_inductor: ModuleType) -> None:
    from dash_inductor.inductor import passes

    for chained_pass in passes.PASSES:
        chained_pass.install()


def install() -> None:
    """Put the passes into Inductor's hooks, chaining whatever the hooks held (idempotent): now if
    Inductor is imported, else when it is; and have Dynamo trace nn.Transformer's mask
    canonicalisation without a graph break (for good), likewise once Dynamo is imported."""
    after_import(_INDUCTOR, _install_passes)
    after_import("torch._dynamo", unmatched.canonical_mask_without_graph_break)


def uninstall() -> None:
    """Take the passes out, restoring exactly what the hooks held before ``install()``."""
    cancel(_INDUCTOR, _install_passes)
    if _INDUCTOR in sys.modules:
        from dash_inductor.inductor import passes

        for chained_pass in passes.PASSES:
            chained_pass.uninstall()


def installed() -> bool:
    """Whether both passes are in Inductor's hooks, or will be put there when it is imported."""
    if _INDUCTOR not in sys.modules:
        return waiting(_INDUCTOR, _install_passes)
    from dash_inductor.inductor import passes

    return all(chained_pass.installed for chained_pass in passes.PASSES)



def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[SiteReport]:
    """Compile ``fn`` afresh with Inductor, call it once on the arguments, and say per site
    whether its attention was rewritten to dash.attention, and if not, why.

    The compile runs under a fresh Inductor cache and with a backend of its own, so neither the
    FX graph cache nor an earlier ``torch.compile`` of ``fn`` hides the passes; it runs Inductor's
    graph passes but not its code generation (the call runs the graph Dynamo captured). The
    decision is the one a real compile would take now (it follows the determinism mode and
    ``config.rewrite``).
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_inductor_cache

    def unused(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        return make_boxed_func(gm.forward)

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Inductor's graph passes, ours among them, run while compile_fx traces; its code
        # generation, the costliest part and one that decides nothing reported here, is skipped,
        # and the call runs the graph Dynamo captured.
        compile_fx(gm, example_inputs, inner_compile=unused)
        return gm.forward

    with recording() as records, fresh_inductor_cache(), _installed_for_reports():
        torch.compile(fn, backend=inductor)(*args, **kwargs)
    return records


@contextlib.contextmanager
def _installed_for_reports() -> Iterator[None]:
    """While explain() runs, let a disabled pass see (never rewrite) the sites it would have."""
    from dash_inductor.inductor import passes

    missing = [p for p in passes.PASSES if not p.installed]
    for chained_pass in missing:
        chained_pass.install()
    explain_disabled.append(bool(missing))
    try:
        yield
    finally:
        explain_disabled.pop()
        for chained_pass in missing:
            chained_pass.uninstall()
