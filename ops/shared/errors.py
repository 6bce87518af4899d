"""Errors the kernels raise on the device, reported on the host later, without a sync.

The ordered dQ waits are bounded: a wait that gives up sets its device's spin flag, one sticky
int32 that every backward launch on the device shares, so a launch allocates, clears and copies
nothing for it. Every :data:`LOOK_EVERY` watched launches the host copies the flag to pinned memory
on the launching stream, and it raises at the first watched launch after the copy has landed; the
flag is then cleared on the stream. A failed wait is thus reported within about two rounds of
``LOOK_EVERY`` backward calls, or at once by ``check_spin_flags(wait=True)``; the gradients of the
calls in between are invalid too (a wait that sees the flag set gives up at once).

Checks that carry a value (the packed offsets' breaches) keep a flag per launch, copied at once.
Under CUDA-graph capture nothing is copied or queried (not allowed while a stream captures); the
captured kernels still raise the sticky flag when replayed, which the next look outside reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..plan import Plan
from . import tape

#: Watched launches between two looks at a device's spin flag: a copy and an event cost about as
#: much host time as a launch, and a failed wait is a bug report, not control flow.
LOOK_EVERY = 8
#: Plans named in a spin error's message (the latest distinct ones watched).
_PLANS_KEPT = 4


class _SpinFlag:
    """A device's sticky spin flag, its pinned host copy and the state of the current look."""

    __slots__ = ("flag", "host", "array", "done", "in_flight", "since", "plans")

    def __init__(self, device: torch.device) -> None:
        self.flag = _outside_graph_pools(device)
        self.host = torch.empty((1,), dtype=torch.int32, pin_memory=True)
        self.array, self.done = self.host.numpy(), torch.cuda.Event()
        self.in_flight, self.since, self.plans = False, 0, []

    def look(self, device: int) -> None:
        """Copy the flag to the host behind the launches so far (stream-ordered)."""
        self.host.copy_(self.flag, non_blocking=True)
        self.done.record(_current_stream(device))
        self.in_flight, self.since = True, 0

    def landed(self, wait: bool) -> bool:
        if wait:
            self.done.synchronize()
        return self.done.query()


def _outside_graph_pools(device: torch.device) -> torch.Tensor:
    """A zeroed int32 flag made by a thread of its own: a CUDA-graph tree's warm-up routes this
    thread's allocations into the tree's pool, which must hold no tensor that outlives its graphs.
    The current stream waits for the zeroing (an event, no host sync)."""
    made: list = []

    def make() -> None:
        try:
            with torch.cuda.device(device):
                flag, zeroed = (torch.zeros((1,), device=device, dtype=torch.int32),
                                torch.cuda.Event())
                zeroed.record()
                made.append((flag, zeroed))
        except BaseException as error:  # raised again in the calling thread
            made.append(error)

    thread = threading.Thread(target=make, name="dash-spin-flag")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    flag, zeroed = made[0]
    torch.cuda.current_stream(device).wait_event(zeroed)
    return flag


#: Sticky flags by device index.
_SPIN: dict[int, _SpinFlag] = {}
#: Per-launch flags: (pinned copy, its array, event after the copy, what to raise from the value).
_PENDING: list[tuple[torch.Tensor, object, "torch.cuda.Event", Callable[[int], Exception]]] = []
#: Stream objects by (device, raw stream): ``torch.cuda.current_stream()`` builds one in Python
#: at each call, which cost more than the copy it orders.
_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def _current_stream(device: int) -> "torch.cuda.Stream":
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(device)
    return stream


def spin_flag(device: torch.device) -> torch.Tensor:
    """The int32 flag that ``device``'s bounded waits raise (the kernels' ``ERR``): the device's
    sticky one, or on the CPU (the interpreter, where waits never give up) a fresh zero."""
    if device.type != "cuda":
        return torch.zeros((1,), device=device, dtype=torch.int32)
    index = device.index if device.index is not None else torch.cuda.current_device()
    state = _SPIN.get(index)
    if state is None:
        if torch.cuda.is_current_stream_capturing():  # would live in the graph's memory pool
            return torch.zeros((1,), device=device, dtype=torch.int32)
        state = _SPIN[index] = _SpinFlag(device)
        tape.persistent(state.flag)
    return state.flag


def _spin_error(plans: list[Plan]) -> RuntimeError:
    names = "; ".join(f"{plan.spec['shape']}, schedule {plan.schedule.name!r}" for plan in plans)
    return RuntimeError(
        "dash attention backward: an ordered dQ wait exceeded max_spin in a launch of "
        f"{names}; the programs of one head were probably not co-resident. The "
        "gradients of the backward calls since the previous check are invalid. Use "
        "schedule='recompute', which never waits.")


def watch_spin_flag(flag: torch.Tensor, plan: Plan) -> None:
    """Note a launch of ``plan`` that may raise ``flag`` (from :func:`spin_flag`), and look at
    earlier launches' flags as they land."""
    if torch.cuda.is_current_stream_capturing():
        return
    with tape.outside():
        _watch(flag, plan)


def _watch(flag: torch.Tensor, plan: Plan) -> None:
    check_spin_flags()
    state = _SPIN.get(flag.device.index)
    if state is None or state.flag is not flag:  # a capture-time flag: nothing to watch
        return
    if plan not in state.plans:
        state.plans = [*state.plans[1 - _PLANS_KEPT:], plan]
    state.since += 1
    if not state.in_flight and state.since >= LOOK_EVERY:
        state.look(flag.device.index)


def watch_value_flag(flag: torch.Tensor, error: Callable[[int], Exception]) -> None:
    """Raise ``error(value)`` for a launch's own int32 ``flag`` once the GPU has set it nonzero:
    copied to pinned memory now, looked at by a later :func:`check_spin_flags`."""
    if torch.cuda.is_current_stream_capturing():
        return
    check_spin_flags()
    host = torch.empty((1,), dtype=torch.int32, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    done = torch.cuda.Event()
    done.record(_current_stream(flag.device.index or 0))
    _PENDING.append((host, host.numpy(), done, error))


def check_spin_flags(wait: bool = False) -> None:
    """Raise for an earlier launch whose bounded wait gave up (its gradients are invalid), or whose
    flag carries another error (packed offsets that break their contract).

    Looks only at copies the GPU has finished, so it never blocks the host, unless ``wait``: then
    it copies every device's spin flag now and waits for every copy (tests, careful callers).
    """
    for device, state in _SPIN.items():
        if wait and not state.in_flight:
            state.look(device)
        if state.in_flight and state.landed(wait):
            state.in_flight = False
            if state.array[0] != 0:
                plans = state.plans
                state.plans, state.array[0] = [], 0
                state.flag.zero_()
                raise _spin_error(plans)
    if not _PENDING:
        return
    failed, pending = None, []
    for entry in _PENDING:
        _, array, done, error = entry
        if wait:
            done.synchronize()
        if done.query():
            if failed is None and array[0] != 0:
                failed = error(int(array[0]))
        else:
            pending.append(entry)
    _PENDING[:] = pending
    if failed is not None:
        raise failed
