"""Launch helpers: bound kernels, dot precision, mask kinds, the co-resident grid size and the
packed tensors' view.

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

from . import driver

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2
#: Who launches a bound kernel: "driver" (``driver.py``, where the kernel allows) or "triton"
#: (Triton's launcher always: for comparisons), read once from ``DASH_INDUCTOR_LAUNCHER``.
LAUNCHER = os.environ.get("DASH_INDUCTOR_LAUNCHER", "driver")
if LAUNCHER not in ("driver", "triton"):
    raise ValueError(f"DASH_INDUCTOR_LAUNCHER={LAUNCHER!r}: expected 'driver' or 'triton'")


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """Packed (T, H, D) as the (1, H, T, D) view the kernels read, heads before rows."""
    return t.transpose(0, 1).unsqueeze(0)


def virtual(t: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Packed (T, H, D) as the kernels' (num_seqs, H, T, D) with batch stride 0: every sequence of
    the virtual batch sees the whole packing and starts at its own offset."""
    return heads_first(t).expand(num_seqs, -1, -1, -1)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints: ``triton.cdiv`` is a constexpr function whose call costs
    microseconds on the host, in launchers that run at every call."""
    return -(-a // b)


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
    regs_per_warp = cdiv(n_regs * 32, 256) * 256
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
    (its ``slot``) binds once and later launches call the compiled kernel directly: through the
    CUDA driver (``driver.py``), or Triton's launcher where that cannot lay the kernel out or a
    profiler has set launch hooks. Under the interpreter every launch goes through Triton, which
    has no compiled kernel to bind.
    """

    __slots__ = ("_bound",)

    def __init__(self) -> None:
        self._bound: dict[str, Callable[[tuple, tuple], None]] = {}

    def via_driver(self) -> dict[str, bool]:
        """Which slots bound so far launch through ``driver.py`` rather than Triton's launcher."""
        return {slot: bound.direct for slot, bound in self._bound.items()}

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
    direct = driver.bind(compiled, len(args)) if LAUNCHER == "driver" else None

    def launch(grid: tuple[int, ...], args: tuple) -> None:
        enter, leave = driver.active(hooks.launch_enter_hook), driver.active(hooks.launch_exit_hook)
        if direct is not None and enter is None and leave is None:
            direct(grid, args)
            return
        if driver.TAPE[0] is not None:
            driver.TAPE[0].fail("a launch through Triton's launcher")
        stream = raw_stream(device())
        info = None
        if enter is not None or leave is not None:
            info = compiled.launch_metadata(grid, stream, *args, *tail)
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            function, metadata, info, enter, leave, *args, *tail)

    launch.direct = direct is not None
    return launch


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Warn once per distinct message (fallbacks are per shape, not per call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
