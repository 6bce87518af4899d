"""The Python side of the ops' C++ kernels (``ops/shared/native_ops.h``).

Once the replayer has loaded and a signature is recorded, C++ kernels registered above the ops'
Python ones run a bound call's programs without entering Python: a compiled graph's call then
costs the host about what an ATen op does. What they do not replay goes to the Python kernels
given here, called with every argument positionally; a call that wants gradients goes to a copy
of torch.library's Python autograd kernel, one that wants none below autograd from C++.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from dash_inductor.ops.shared import native

#: forward, backward, and their autograd kernels (None where this torch cannot make those).
_KERNELS: list[Callable | None] = []


def _positional(op, kernel: Callable, leading: int = 0) -> Callable:
    """``kernel`` called with every argument of ``op`` positionally (after ``leading`` others),
    as the C++ kernels pass them."""
    arguments = op._opoverload._schema.arguments
    first = leading + next(i for i, a in enumerate(arguments) if a.kwarg_only)
    names = [a.name for a in arguments[first - leading:]]

    def call(*args):
        return kernel(*args[:first], **dict(zip(names, args[first:])))
    return call


def _autograd(op) -> Callable | None:
    """torch.library's autograd kernel of ``op``, made as torch.library makes the one it
    registers, taking (keyset, *arguments); None where this torch has no such maker."""
    try:
        from torch._library.autograd import make_autograd_impl
    except ImportError:
        return None
    return _positional(op, make_autograd_impl(op._opoverload, op), leading=1)


def register(forward_op, forward: Callable, backward_op, backward: Callable) -> None:
    """The custom ops and their Python kernels (``op.py``, once)."""
    _KERNELS[:] = [_positional(forward_op, forward), _positional(backward_op, backward),
                   _autograd(forward_op), _autograd(backward_op)]


def install(module, key: str, watch: Callable[[int], None]) -> None:
    """The C++ kernels at dispatch key ``key`` and its autograd key, over the Python ones;
    ``watch(handle)`` runs after an ordered backward that a bound signature replays."""
    forward, backward, forward_autograd, backward_autograd = _KERNELS
    module.install_ops(key, forward, backward, native.launch_hooked, watch, forward_autograd,
                       backward_autograd)


def bind(module, handle: int, call: tuple, q: Tensor, k: Tensor, v: Tensor,
         watch: Callable[[int], None]) -> None:
    """Let the C++ kernels replay calls like this one (``call`` = (flags, choices) as
    ``signatures.key`` takes them) under ``handle``, installing them on CUDA at the first (a
    later install keeps the kernels in place)."""
    if not _KERNELS:
        return
    install(module, "CUDA", watch)
    (is_causal, scale, enable_gqa, window), (schedule, max_spin, cpu_backend, kernel) = call
    module.bind(handle, q=q, k=k, v=v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                window_size=list(window), schedule=schedule, max_spin=max_spin,
                cpu_backend=cpu_backend, kernel_path=kernel)


def reset(module) -> None:
    """Forget every bound call; with the replayer switched off, remove the C++ kernels too."""
    module.unbind_all()
    if not native.ENABLED:
        module.uninstall_ops()
