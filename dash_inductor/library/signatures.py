"""Plans kept per call signature, for the unmasked calls that a training step repeats.

The dispatcher caches its plans by a signature it reads from every tensor of a launch (seven in a
backward). A step calls each attention layer with the same shapes again and again; for the common
call (no mask, inputs already the kernels' 4-D views, a Triton path) this module keys the
dispatcher's plans by the caller's q, k, v, flags and choices instead, and knows how to allocate
the outputs, so a repeated call allocates and launches without validating or planning again.
Both public entries use it: the eager ``autograd.Function`` and the op's kernels. The dispatcher
(Triton and the kernels) is imported by a signature's first launch, not with the package.

On CUDA a signature's calls are also recorded, once their plans exist, as programs that the C++
replayer runs (``ops/shared/tape.py``, ``native.cpp``): the eager entry then calls it directly,
forward and backward, with no Python between the launches, and the ops' C++ kernels
(``native_ops.h``, installed over the Python ones at the first recording) run a bound call's
programs without entering Python at all, as a compiled graph calls them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dash_inductor.ops.plan import HOLDERS, Plan
from dash_inductor.ops.shared import errors, native
from dash_inductor.library import native_kernels
from dash_inductor.library.shapes import Canonical, empty_like_layout

_MAXSIZE = 1024  #: as the dispatcher's cache: a model has a handful of shapes per layer


def uses_triton(t: Tensor, cpu_backend: str) -> bool:
    """Whether the Triton kernels run on ``t``'s device (else the PyTorch reference)."""
    if t.dtype == torch.float64:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and cpu_backend == "triton"


class Signature:
    """What one signature decided: its canonical form, the forward plan, the backward plans by
    the layouts a backward adds (the incoming gradient; out and logsumexp as the caller kept them),
    and which inputs ``torch.empty_like`` reproduces (dense ones): their outputs and gradients are
    allocated that way, the cheapest allocation there is, at the first call as at every other."""

    __slots__ = ("form", "forward_plan", "backward_plans", "dense", "handle", "recorded",
                 "native_plans", "watch", "call")

    def __init__(self, c: Canonical, call: tuple) -> None:
        self.form, self.forward_plan, self.backward_plans = c.form(), None, {}
        self.dense = tuple(torch.empty_like(t).stride() == t.stride() for t in (c.q, c.k, c.v))
        #: The replayer's handle (None: not recorded yet; -1: cannot be), the backward layouts
        #: recorded, their plans by the replayer's index, the spin-flag watch of an ordered one,
        #: and the call's (flags, choices).
        self.handle, self.recorded, self.native_plans = None, set(), []
        self.watch, self.call = None, call

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kernel: str
                ) -> tuple[Tensor, Tensor, Plan]:
        """(out, float32 logsumexp, the plan that ran); ``out`` laid out as the query."""
        form, plan = self.form, self.forward_plan
        same = self.dense[0] and form.v_shape[3] == form.q_shape[3]
        out = (torch.empty_like(q) if same
               else empty_like_layout(q, (*form.q_shape[:3], form.v_shape[3])))
        lse = q.new_empty(form.q_shape[:3], dtype=torch.float32)
        if plan is None:
            from dash_inductor.ops import dispatch

            plan = self.forward_plan = dispatch.attention_forward(
                q, k, v, None, out, lse, is_causal=form.is_causal, scale=form.scale,
                kernel=kernel, window=form.window)
        else:
            plan.run(plan, q, k, v, None, out, lse, form.scale)
        return out, lse, plan

    def backward(self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 lse: Tensor, schedule: str, max_spin: int, kernel: str
                 ) -> tuple[tuple[Tensor, Tensor, Tensor], Plan]:
        """(dq, dk, dv laid out as q, k, v; the plan that ran)."""
        form = self.form
        layout = self.layout(grad_out, out, lse)
        plan = self.backward_plans.get(layout)
        dq, dk, dv = (torch.empty_like(t) if dense else empty_like_layout(t, tuple(t.shape))
                      for t, dense in zip((q, k, v), self.dense))
        if plan is None:
            from dash_inductor.ops import dispatch

            plan = self.backward_plans[layout] = dispatch.attention_backward(
                grad_out, q, k, v, out, lse, None, dq, dk, dv, is_causal=form.is_causal,
                scale=form.scale, schedule=schedule, max_spin=max_spin, kernel=kernel,
                window=form.window)
        else:
            plan.run(plan, grad_out, q, k, v, out, lse, None, dq, dk, dv, form.scale, max_spin)
        return (dq, dk, dv), plan

    @staticmethod
    def layout(grad_out: Tensor, out: Tensor, lse: Tensor) -> tuple:
        """What a backward's plan depends on beyond the signature."""
        return (grad_out.stride(), grad_out.data_ptr() % 16, grad_out.dtype, out.stride(),
                out.data_ptr() % 16, lse.stride(), torch.backends.cuda.matmul.allow_tf32)

    def replayable(self) -> bool:
        """Whether the replayer runs this signature's calls now."""
        return self.handle is not None and self.handle >= 0 and not native.launch_hooked()

    def replay_forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
        """(out, lse) from the replayer, or None where the signature was not recorded (or a
        profiler's launch hooks want to see the launches)."""
        if not self.replayable():
            return None
        out, lse = native.loaded().run_forward(self.handle, q, k, v)
        return out, lse

    def replay_backward(self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Plan] | None:
        """(dq, dk, dv; the plan recorded) from the replayer, or None where the gradient's
        layout has no program; its bounded waits are watched as the launcher would."""
        if not self.replayable():
            return None
        ran = native.loaded().run_backward(self.handle, grad_out, q, k, v, out, lse)
        if ran is None:
            return None
        if self.watch is not None:
            errors.watch_spin_flag(*self.watch)
        return tuple(ran[1:]), self.native_plans[ran[0]]

    def forward_recorded(self, q: Tensor, k: Tensor, v: Tensor, kernel: str
                         ) -> tuple[Tensor, Tensor, Plan]:
        """:meth:`forward`, recorded for the replayer when it is loaded and the plan exists."""
        module = None
        if self.handle is None and self.forward_plan is not None and q.is_cuda:
            module = native.load()
        if module is None:
            return self.forward(q, k, v, kernel)
        from dash_inductor.ops.shared import tape

        ran = []

        def run() -> list[Tensor]:
            ran[:] = self.forward(q, k, v, kernel)
            return ran[:2]

        (out, lse), program = tape.record(run, (q, k, v))
        if program is None:
            self.handle = -1
        else:
            module.set_fallback(_FALLBACK[0])
            self.handle = module.new_signature(module.Program(*program))
            _BY_HANDLE[self.handle] = self
            native_kernels.bind(module, self.handle, self.call, q, k, v, _watch)
        return out, lse, ran[2]

    def backward_recorded(self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, schedule: str, max_spin: int, kernel: str
                          ) -> tuple[tuple[Tensor, Tensor, Tensor], Plan]:
        """:meth:`backward`, recorded for the replayer under this signature's handle when the
        plan of the gradient's layout exists and was not recorded yet."""
        layout = self.layout(grad_out, out, lse)
        if (self.handle is None or self.handle < 0 or layout in self.recorded
                or layout not in self.backward_plans):
            return self.backward(grad_out, q, k, v, out, lse, schedule, max_spin, kernel)
        from dash_inductor.ops.shared import tape

        ran = []

        def run() -> tuple[Tensor, Tensor, Tensor]:
            ran[:] = self.backward(grad_out, q, k, v, out, lse, schedule, max_spin, kernel)
            return ran[0]

        module = native.load()
        grads, program = tape.record(run, (grad_out, q, k, v, out, lse))
        self.recorded.add(layout)
        plan = ran[1]
        if program is not None:
            module.add_backward(self.handle, module.layout_key(grad_out, out, lse),
                                module.Program(*program))
            self.native_plans.append(plan)
            if plan.schedule is not None and plan.schedule.ordered:
                self.watch = (errors.spin_flag(q.device), plan)
                module.set_watched(self.handle)
        return tuple(grads), plan


_SIGNATURES: dict[tuple, Signature] = {}
#: The replayer's autograd function's backward where it has no program for a gradient's layout
#: (``entry.py`` sets it): (handle, grad_out, q, k, v, out, lse) -> (dq, dk, dv).
_FALLBACK: list[Callable | None] = [None]
#: Recorded signatures by the replayer's handle (kept with the replayer's own table: a graph
#: built before a ``clear`` may still run a backward under an old handle).
_BY_HANDLE: dict[int, Signature] = {}


def _watch(handle: int) -> None:
    """The C++ backward kernel's call after an ordered backward: its bounded waits, watched."""
    signature = _BY_HANDLE.get(handle)
    if signature is not None and signature.watch is not None:
        errors.watch_spin_flag(*signature.watch)


def key(q: Tensor, k: Tensor, v: Tensor, flags: tuple, choices: tuple) -> tuple:
    """A call's signature: ``flags`` (is_causal, scale, enable_gqa, window) and ``choices``
    (``config.CHOICES``' values) as given, the tensors' layouts, and the modes that the checks
    made at a first call (determinism) and the plans (TF32) depend on."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16,
            v.data_ptr() % 16, flags, choices, torch.backends.cuda.matmul.allow_tf32,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


def lookup(signature_key: tuple) -> Signature | None:
    return _SIGNATURES.get(signature_key)


def set_fallback(backward: Callable) -> None:
    _FALLBACK[0] = backward


def remember(signature_key: tuple, c: Canonical, q: Tensor, k: Tensor, v: Tensor,
             call: tuple) -> Signature | None:
    """A new signature for a validated call ``c`` of ``q``, ``k``, ``v`` with ``call`` =
    (flags, choices) as :func:`key` took them, kept when repeats can reuse it: the inputs are
    the kernels' own 4-D views (no broadcast, no 3-D), not empty, and a Triton path runs them.
    None otherwise (the caller takes the general path each time)."""
    cpu_backend = call[1][2]
    if not (c.q is q and c.k is k and c.v is v and c.mask is None and q.numel() > 0
            and k.shape[2] > 0 and uses_triton(q, cpu_backend)):
        return None
    if len(_SIGNATURES) >= _MAXSIZE:
        clear()
    signature = _SIGNATURES[signature_key] = Signature(c, call)
    return signature


def by_handle(handle: int) -> Signature:
    return _BY_HANDLE[handle]


def native_plan(handle: int, index: int) -> Plan | None:
    """The plan of a signature's recorded forward (index -1) or backward, or None for a handle
    that no signature made (a program built directly, as tests do)."""
    signature = _BY_HANDLE.get(handle)
    if signature is None:
        return None
    return signature.forward_plan if index < 0 else signature.native_plans[index]


def wait_for_replayer() -> bool:
    """Block until the C++ replayer has loaded (built on first use, in a thread of its own);
    whether calls now run it. Timings taken while it loads share the GIL with that thread."""
    return native.load(wait=True) is not None


def clear() -> None:
    """Forget every signature and the plans it holds (``dash_inductor.ops.cache_clear`` too), and
    the calls the ops' C++ kernels replay; with the replayer switched off, those kernels too."""
    _SIGNATURES.clear()
    module = native.loaded()
    if module is not None:
        native_kernels.reset(module)


HOLDERS.append(clear)
