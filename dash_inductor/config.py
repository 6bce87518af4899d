"""Runtime knobs of dash_inductor, read at call time (not at import time).

Change them by assignment (``dash_inductor.config.schedule = "shift"``) or, scoped, with
``dash_inductor.config.patch(schedule="shift")`` as a context manager. Both are validated, so a
misspelt option or a bad value raises where it is written, and reads need no check. The knobs that
decide the backward (``CHOICES``) are captured when the forward runs: ``dash_inductor.attention``
passes them to the op, and the Inductor pass bakes the values in force at compile time into the
graph.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

from dash_inductor.ops import catalog

#: Backward schedule. "auto" lets the launcher pick the fastest measured deterministic one:
#: on the Hopper kernels ``ops.hopper.config.auto_on_hopper`` ("shift" causal or packed;
#: unmasked "ascending" at head dim 64, "descending" otherwise), elsewhere
#: ``ops.portable.configs.auto_schedule`` ("recompute"); the others are listed in ``SCHEDULES``.
schedule: str = catalog.AUTO

#: Kernel path on CUDA: "auto" (the launcher picks), "portable" (the ``tl`` kernels) or "hopper".
kernel: str = "auto"

#: What runs the op on CPU: "reference" (the blocked PyTorch implementation) or "triton"
#: (the Triton kernels, which on CPU only run under ``TRITON_INTERPRET=1``; for tests).
cpu_backend: str = "reference"

#: When the Inductor pass rewrites SDPA: "deterministic" (only while
#: ``torch.are_deterministic_algorithms_enabled()``), "always", or "off".
rewrite: str = "deterministic"

#: Upper bound on the polls of one ordered dQ wait on the GPU. Past it the kernel sets an error
#: flag and the launcher raises, instead of hanging. Tests lower it to force that path.
max_spin: int = 1 << 26

SCHEDULES = (catalog.AUTO, *catalog.NAMES)
DETERMINISTIC_SCHEDULES = catalog.DETERMINISTIC
KERNELS = catalog.KERNELS
CPU_BACKENDS = ("reference", "triton")
REWRITE_MODES = ("deterministic", "always", "off")
#: The options that change the backward's bits or path: the ``dash::`` ops' last arguments, in
#: this order (the ops name the last one ``kernel_path``).
CHOICES = ("schedule", "max_spin", "cpu_backend", "kernel")

_CHOICES = {"schedule": SCHEDULES, "cpu_backend": CPU_BACKENDS, "rewrite": REWRITE_MODES,
            "kernel": KERNELS}
_OPTIONS = (*_CHOICES, "max_spin")


def _check_name(name: str) -> None:
    if name not in _OPTIONS:
        raise AttributeError(f"dash_inductor.config has no option {name!r}; options: "
                             f"{sorted(_OPTIONS)}")


def _check(name: str, value: object) -> None:
    _check_name(name)
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"dash_inductor.config.{name} must be one of {_CHOICES[name]}, got {value!r}")
    if name == "max_spin" and (not isinstance(value, int) or value < 1):
        raise ValueError(f"dash_inductor.config.max_spin must be a positive int, got {value!r}")


class _ConfigModule(types.ModuleType):
    """This module's type: an assignment to an option, or to a name the module lacks (a misspelt
    option), is validated first, so every option's stored value is valid."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _OPTIONS or name not in self.__dict__:
            _check(name, value)
        super().__setattr__(name, value)


def get(name: str) -> object:
    """The current value of option ``name`` (an AttributeError for a name that is no option)."""
    _check_name(name)
    return getattr(_module, name)


@contextlib.contextmanager
def patch(**options: object) -> Iterator[None]:
    """Set options for the duration of a ``with`` block, restoring them afterwards."""
    for name, value in options.items():  # all or nothing: check every option before setting one
        _check(name, value)
    saved = {name: getattr(_module, name) for name in options}
    try:
        for name, value in options.items():
            setattr(_module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(_module, name, value)


def check_choices(values: tuple) -> None:
    """Validate the op's choice arguments, given in ``CHOICES`` order (no config read: the ops
    check their arguments on every call)."""
    for name, value in zip(CHOICES, values):
        _check(name, value)


def choices(**overrides: object) -> dict[str, object]:
    """The op arguments named by ``CHOICES``: the config now, except ``overrides`` that are not None."""
    values = {name: getattr(_module, name) for name in CHOICES}
    for name, value in overrides.items():
        if name not in CHOICES:
            raise AttributeError(f"{name!r} is not one of the op's choices {CHOICES}")
        if value is not None:
            _check(name, value)
            values[name] = value
    return values


_module = sys.modules[__name__]
_module.__class__ = _ConfigModule
