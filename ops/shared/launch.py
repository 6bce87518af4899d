"""Launch helpers: bound kernels, dot precision, mask kinds, co-resident grid size, and the
spin-error flag.

The ordered dQ reduction makes programs wait for each other, which is only safe when every program
that can be waited on is running. The persistent grid is therefore sized from the compiled kernel's
register and shared-memory use against the device's limits (and launched cooperatively where Triton
can, so an over-sized grid fails loudly instead of hanging).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable

import torch
from triton import knobs

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Under the CPU interpreter bf16 dots widen their operands (see ops/shared/tiles.py: mm).
WIDEN_BF16 = "widen_bf16"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 unless torch allows TF32 for matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return WIDEN_BF16
    return "tf32"


def mask_kind(mask: torch.Tensor | None) -> int:
    """The kernels' constexpr code for a mask: none, boolean (True = attend) or additive."""
    if mask is None:
        return MASK_NONE
    return MASK_BOOL if mask.dtype == torch.bool else MASK_ADD


@functools.lru_cache(maxsize=None)
def cooperative_launch_supported() -> bool:
    """Whether this Triton accepts ``launch_cooperative_grid`` as a launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in inspect.signature(CUDAOptions).parameters


def _blocks_per_sm(compiled, device: torch.device) -> int:
    """How many programs of ``compiled`` fit on one SM at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(device)
    num_warps = compiled.metadata.num_warps
    try:
        compiled._init_handles()
        n_regs = max(int(compiled.n_regs), 1)
    except (AttributeError, RuntimeError):
        return 1
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = (getattr(props, "regs_per_multiprocessor", 65536) // regs_per_warp) // num_warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    shared = int(compiled.metadata.shared)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem_per_sm // (shared + 1024) if shared > 0 else by_threads
    return max(1, min(by_regs, by_threads, by_smem, 32))


_CAPACITY: dict[tuple, int] = {}


def _specialization(value: object) -> object:
    """What Triton specialises an argument on (so equal keys mean the same compiled binary)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, int):
        return (value == 1, value % 16 == 0)
    return type(value)


def coresident_programs(kernel, args: tuple, kwargs: dict, device: torch.device) -> int:
    """The number of programs of ``kernel`` (with these arguments) that can run at once on ``device``.

    Compiles the kernel (Triton's warmup) once per specialisation to read its register and shared
    memory use; later calls are a dictionary lookup.
    """
    key = (device.index or 0, tuple(sorted(kwargs.items())), tuple(map(_specialization, args)))
    if key not in _CAPACITY:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _CAPACITY[key] = sms * _blocks_per_sm(compiled, device)
    return _CAPACITY[key]


class Launches:
    """A plan's kernels, each bound to its compiled binary on its first launch.

    Triton's ``kernel[grid](...)`` specialises every argument on every call (its type, whether an
    int is 1 or a multiple of 16, a pointer's alignment), which took more host time than the
    launch. A plan's signature (``dispatch.py``) fixes all of that, so each launch site of a plan
    (its ``slot``) binds once and later launches call the compiled kernel directly. Under the
    interpreter every launch goes through Triton, which has no compiled kernel to bind.
    """

    __slots__ = ("_bound",)

    def __init__(self) -> None:
        self._bound: dict[str, Callable[[tuple, tuple], None]] = {}

    def __call__(self, slot: str, kernel, grid: tuple[int, ...], args: tuple,
                 constexprs: dict) -> None:
        bound = self._bound.get(slot)
        if bound is None:
            if interpreting():
                kernel[grid](*args, **constexprs)
                return
            bound = self._bound[slot] = _bind(kernel, args, constexprs)
        bound(grid, args)


def _bind(kernel, args: tuple, constexprs: dict) -> Callable[[tuple, tuple], None]:
    """Compile ``kernel`` for these arguments and return a launcher of it that takes the grid and
    the positional arguments: the compiled kernel wants every parameter in order, constexprs too."""
    compiled = kernel.warmup(*args, grid=(1,), **constexprs)
    compiled._init_handles()
    parameters = inspect.signature(kernel.fn).parameters
    tail = tuple(constexprs[name] if name in constexprs else parameters[name].default
                 for name in kernel.arg_names[len(args):])
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    device, raw_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    hooks = knobs.runtime  # profilers set launch hooks: read at each launch, as Triton does

    def launch(grid: tuple[int, ...], args: tuple) -> None:
        stream = raw_stream(device())
        enter = hooks.launch_enter_hook
        info = None if enter is None else compiled.launch_metadata(grid, stream, *args, *tail)
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            function, metadata, info, enter, hooks.launch_exit_hook, *args, *tail)

    return launch


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Warn once per distinct message (fallbacks are per shape, not per call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


#: Watched launches: (the flag's pinned host copy as an array, event after the copy, the device,
#: what to raise).
_PENDING: list[tuple[object, "torch.cuda.Event", int, str | Callable[[int], Exception]]] = []
#: Pinned flags (tensor, array view) and events of launches already looked at, by device, for
#: reuse: allocating them anew was a visible part of a backward call's host time.
_FREE: dict[int, list[tuple[torch.Tensor, object, "torch.cuda.Event"]]] = {}
#: Stream objects by (device, raw stream): ``torch.cuda.current_stream()`` builds one in Python
#: at each call, which cost more than the copy it orders.
_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def _spin_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"dash attention backward: an ordered dQ wait exceeded max_spin for {what}; the "
        "programs of one head were probably not co-resident. The gradients are invalid. "
        "Use schedule='recompute', which never waits.")


def check_spin_flags(wait: bool = False) -> None:
    """Raise for an earlier backward whose bounded dQ wait gave up (its gradients are invalid), or
    for another watched flag that was set (e.g. packed offsets that break their contract).

    Looks only at launches the GPU has finished, so it never blocks the host, unless ``wait``:
    then it waits for every watched launch (tests, and callers that want the answer now).
    """
    if not _PENDING:
        return
    failed, pending = None, []
    for entry in _PENDING:
        host_flag, done, device, what = entry
        if wait:
            done.synchronize()
        if done.query():
            value = int(host_flag[1][0])
            if failed is None and value != 0:
                failed = what, value
            _FREE.setdefault(device, []).append((*host_flag, done))
        else:
            pending.append(entry)
    _PENDING[:] = pending
    if failed is not None:
        what, code = failed
        raise what(code) if callable(what) else _spin_error(what)


def _current_stream(device: int) -> "torch.cuda.Stream":
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(device)
    return stream


def watch_spin_flag(error_flag: torch.Tensor, what: str | Callable[[int], Exception]) -> None:
    """Check a launch's error flag without a host sync: copy it to pinned host memory on the
    stream and look at it once the GPU is past it (:func:`check_spin_flags`, run by every backward
    launch). ``what`` names the launch in the spin error, or makes the error from the flag's
    nonzero value. Under CUDA-graph capture the flag stays on the device, unwatched, and earlier
    flags are not looked at either (querying an event is not allowed while a stream captures)."""
    if torch.cuda.is_current_stream_capturing():
        return
    check_spin_flags()
    device = error_flag.device.index or 0
    free = _FREE.get(device)
    if free:
        host_flag, array, done = free.pop()
    else:
        host_flag = torch.empty((1,), dtype=torch.int32, pin_memory=True)
        array, done = host_flag.numpy(), torch.cuda.Event()
    host_flag.copy_(error_flag, non_blocking=True)
    done.record(_current_stream(device))
    _PENDING.append(((host_flag, array), done, device, what))
