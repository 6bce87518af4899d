"""Record one call of a plan as a program of steps, for ``native.cpp`` to replay at later calls.

A plan fixes every host decision of its signature; what a repeated call still does is allocate
its buffers, point TMA descriptors at them and launch. Recorded once, that work is a list of
steps over tensor slots (the inputs first, then each step's results): an ATen call, seen by a
``TorchDispatchMode`` with its arguments in schema order, or a kernel launch, reported by
``driver.py`` with its parameter block, in which each tensor address and each descriptor is a
patch over a slot. Replaying it with new inputs makes the same calls and launches, so the bits
are the Python path's. A call whose work cannot be expressed so (a launch through Triton's own
launcher, a tensor that is neither an input nor made by the call) records nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import driver


class Unrecordable(Exception):
    """The call did something a program cannot replay."""


#: Tensors that live as long as the process (the spin flags): a program may hold their address.
_PERSISTENT: list[torch.Tensor] = []


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as kept for the process's life, so that recorded launches may address it."""
    _PERSISTENT.append(t)
    return t


def outside():
    """A context whose ATen calls no tape records: host bookkeeping beside a plan's launches
    (the spin flag's looks), which the caller of a replay does itself."""
    return _disable_current_modes() if driver.TAPE[0] is not None else contextlib.nullcontext()


def _returns_tensors(func) -> bool:
    return all(str(ret.type) == "Tensor" for ret in func._schema.returns)


class _Tape(TorchDispatchMode):
    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.slots: list[torch.Tensor] = list(inputs)
        self.steps: list[tuple] = []
        self.kept: list[torch.Tensor] = []
        self.failure: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.failure is None:
            try:
                self._aten(func, args, kwargs, result)
            except Unrecordable as error:
                self.failure = str(error)
        return result

    def _slot(self, t: torch.Tensor) -> int:
        for i, slot in enumerate(self.slots):
            if slot is t:
                return i
        raise Unrecordable(f"a tensor of shape {tuple(t.shape)} that the call did not make")

    def _aten(self, func, args: tuple, kwargs: dict, result: Any) -> None:
        if not _returns_tensors(func):
            raise Unrecordable(f"{func} returns more than tensors")
        arguments = []
        for i, arg in enumerate(func._schema.arguments):
            if i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                value = arg.default_value
            if isinstance(value, torch.Tensor):
                arguments.append((self._slot(value), None))
            elif isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in value):
                raise Unrecordable(f"{func} takes a list of tensors")
            else:
                arguments.append((-1, value))
        namespace, name = func._schema.name.split("::")
        self.steps.append(("aten", f"{namespace}::{name}", func._schema.overload_name, arguments))
        self.slots.extend(result if isinstance(result, (list, tuple)) else (result,))

    def _address(self, ptr: int) -> tuple[int, int]:
        """(slot, byte offset from its data pointer) of a device address, or (-1, 0) for the
        address of a persistent tensor, which the program keeps."""
        best = None
        for i, t in enumerate(self.slots):
            storage = t.untyped_storage()
            start = storage.data_ptr()
            if start <= ptr < start + max(storage.nbytes(), 1):
                if t.data_ptr() == ptr:
                    return i, 0
                if best is None:
                    best = (i, ptr - t.data_ptr())
        if best is not None:
            return best
        for t in _PERSISTENT:
            if t.data_ptr() <= ptr < t.data_ptr() + max(t.untyped_storage().nbytes(), 1):
                self.kept.append(t)
                return -1, 0
        raise Unrecordable(f"a kernel reads address {ptr:#x}, outside every tensor of the call")

    def launch(self, bound: "driver.Bound", grid: tuple[int, int, int], args: tuple,
               block: bytes) -> None:
        """``driver.py``'s report of a launch: ``block`` its packed parameters."""
        if self.failure is not None:
            return
        try:
            pointers, maps = [], []
            for i, (step, at) in enumerate(zip(bound.steps, bound.arg_offsets)):
                if step is driver.POINTER:
                    slot, offset = self._address(args[i].data_ptr())
                    if slot >= 0:
                        pointers.append((at, slot, offset))
                elif isinstance(step, driver.Encodings):
                    elem_type, base, dims, strides, box, swizzle, fill = step.tiled(args[i])
                    slot, offset = self._address(base)
                    if slot < 0:
                        raise Unrecordable("a TMA descriptor over a persistent tensor")
                    maps.append((at, slot, offset, elem_type, swizzle, fill, dims, strides, box))
            self.steps.append(("launch", bound.function, grid, bound.threads, bound.shared,
                               bound.cooperative, block, bound.param_offsets, pointers, maps))
        except Unrecordable as error:
            self.failure = str(error)

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason


def record(call: Callable[[], Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]
           ) -> tuple[Sequence[torch.Tensor], tuple | None]:
    """Run ``call`` (whose tensors are ``inputs`` and what it makes) and record it: its results,
    and the program's (inputs, steps, output slots, kept tensors), or None where it cannot."""
    tape = _Tape(inputs)
    driver.TAPE[0] = tape
    try:
        with tape:
            results = call()
    finally:
        driver.TAPE[0] = None
    if tape.failure is not None:
        return results, None
    try:
        outputs = [tape._slot(t) for t in results]
    except Unrecordable:
        return results, None
    return results, (len(inputs), tape.steps, outputs, tape.kept)
