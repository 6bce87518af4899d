"""What the provider's kernels share: PyTorch's own kernels to fall back to, arguments bound by
name, the backward's choices, and output strides.

A kernel registered in place of PyTorch's cannot fall back by calling the op again: the
dispatcher would send the call straight back to it. So, before overriding an op, the provider
takes PyTorch's kernel for that dispatch key (``torch.library.get_kernel``, the pattern PyTorch's
own custom ops use) and a fallback calls that kernel directly, below the override.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dash_inductor import config
from dash_inductor.library.op import check_schedule_allowed, op_options

#: (qualified op name, dispatch key) -> (PyTorch's kernel or None if it has none there, keyset),
#: for every op the provider has overridden at that key.
_ORIGINALS: dict[tuple[str, str], tuple[Any, torch._C.DispatchKeySet]] = {}


def find_op(name: str) -> torch._ops.OpOverload | None:
    """The default overload of ``"namespace::op"``, or None if this torch has no such op."""
    namespace, op = name.split("::")
    try:
        return getattr(getattr(torch.ops, namespace), op).default
    except (AttributeError, RuntimeError):
        return None


def take_original(name: str, dispatch_key: str) -> None:
    """Keep PyTorch's current kernel of ``name`` at ``dispatch_key``; call before overriding it."""
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, dispatch_key))
    try:
        kernel = torch.library.get_kernel(name, dispatch_key)
    except RuntimeError:  # no kernel there (a CPU-only build has no CUDA kernels)
        kernel = None
    _ORIGINALS[(name, dispatch_key)] = (kernel, keyset)


def forget(dispatch_key: str) -> None:
    """Drop the kernels taken for ``dispatch_key`` (the overrides are gone)."""
    for entry in [entry for entry in _ORIGINALS if entry[1] == dispatch_key]:
        del _ORIGINALS[entry]


def call_original(name: str, device: torch.device, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run PyTorch's kernel of ``name`` with the arguments the override received."""
    dispatch_key = torch._C._dispatch_key_for_device(device.type)
    entry = _ORIGINALS.get((name, dispatch_key))
    if entry is None:  # not overridden for this device: the op itself is PyTorch's
        op = find_op(name)
        assert op is not None, name
        return op(*args, **kwargs)
    kernel, keyset = entry
    if kernel is None:
        raise RuntimeError(f"dash_inductor: PyTorch has no {dispatch_key} kernel of {name} to "
                           f"fall back to")
    return kernel.call_boxed(keyset, *args, **kwargs)


def bind(name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The arguments of a call of ``name`` by name (defaults filled in from the installed schema),
    and the names whose values differ from their defaults. The dispatcher leaves trailing default
    arguments out of a Python kernel's call, and the schemas differ between torch versions."""
    op = find_op(name)
    assert op is not None, name
    values: dict[str, Any] = {}
    changed: set[str] = set()
    for index, argument in enumerate(op._schema.arguments):
        if index < len(args):
            value = args[index]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            raise TypeError(f"{name}: missing argument {argument.name!r}")
        values[argument.name] = value
        if not argument.has_default_value() or isinstance(value, Tensor) or \
                value != argument.default_value:
            changed.add(argument.name)
    return values, changed


def _allowed_choices() -> dict[str, object]:
    """The backward's choices (``config.CHOICES``) in force now. Under deterministic algorithms a
    non-deterministic schedule is refused (or warned about), as ``dash_inductor.attention`` does."""
    values = config.choices()
    check_schedule_allowed(values["schedule"])
    return values


def choices(query: Tensor) -> tuple:
    """The choices in force now, as the ``dash::varlen`` ops take them (positional)."""
    return tuple(_allowed_choices().values())


def options(query: Tensor) -> dict:
    """The choices in force now, as the ``dash::attention`` ops take them (keyword-only)."""
    return op_options(_allowed_choices())


def like(result: Tensor, like_: Tensor) -> Tensor:
    """``result`` with the strides of ``torch.empty_like(like_)``, which PyTorch's fake kernels
    promise (compiled code relies on them)."""
    if result.shape != like_.shape:
        return result
    target = torch.empty_like(like_)
    if target.stride() == result.stride():
        return result
    return target.copy_(result)
