"""Launch a compiled Triton kernel through the CUDA driver, without Triton's per-call Python.

Triton's launcher reads every argument again at every call: a Python call of each tensor's
``data_ptr`` and a driver query of each pointer, each TMA descriptor encoded anew, a Python
frame for its scratch buffers. A plan fixes the types of its launches' arguments
(``launch.Launches``), so a bound launch here packs the values into one block with a single
``struct`` call, keeps each descriptor's encoding (the plans' descriptors are themselves cached
by address) and calls ``cuLaunchKernelEx`` through ctypes. The block follows Triton's kernel ABI
(its ``expand_signature``: a descriptor is the 128-byte map, then its shape as i32 and strides
as i64; two scratch pointers close the list), checked against the driver's
``cuFuncGetParamInfo`` when binding; a kernel this cannot launch the same way keeps Triton's
launcher (``bind`` returns None).
"""

from __future__ import annotations

import ctypes
import re
import struct
import threading
from collections.abc import Callable

import torch

#: struct codes of the scalar kernel parameters (Triton passes fp16 as IEEE half bits too).
_CODES = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B",
          "u16": "H", "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
_MAP_BYTES, _MAP_ALIGN = 128, 64  #: CUtensorMap: 128 opaque bytes, 64-byte aligned
_SMEM_LIMIT = 228 * 1024  #: above it Triton adds an oversized-shared-memory launch attribute
#: Triton's device-side TMA element types differ from the driver's in three codes; 11 is TF32.
_HOST_TYPE = {8: 10, 9: 8, 10: 9}
_TF32 = 11
_L2_PROMOTION_128B = 2
_OOB_NONE, _OOB_NAN = 0, 1
_INVALID_VALUE = 1  #: CUDA_ERROR_INVALID_VALUE: cuFuncGetParamInfo past the last parameter
_DESCRIPTORS_KEPT = 4096  #: encodings kept per descriptor parameter of a bound launch
POINTER, VALUE = "pointer", "value"  #: how a bound launch reads an argument (else: encodings)
#: The tape recording launches now (``tape.py``), or None: every bound launch reports to it.
TAPE: list = [None]

_cuda: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    """libcuda with the calls used here (each releases the GIL, as Triton's launcher does: a
    launch behind a full queue waits in the driver)."""
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u32, ptr = ctypes.c_uint, ctypes.c_void_p
        lib.cuLaunchKernelEx.argtypes = [ptr, ptr, ptr, ptr]
        lib.cuTensorMapEncodeTiled.argtypes = [ptr, ctypes.c_int, u32, ptr, ptr, ptr, ptr, ptr,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _cuda = lib
    return _cuda


def active(hook):
    """``hook`` (a Triton launch hook), or None where it would call nothing: Triton 3.6+ keeps
    its launch hooks in a ``HookChain`` that is never None, and a chain without calls would still
    cost a metadata record and two Python calls a launch."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def _loadable() -> bool:
    """Whether libcuda loads here (not on a machine with no CUDA driver, e.g. ROCm's)."""
    try:
        _driver()
    except OSError:
        return False
    return True


def _map_aligned(n: int) -> int:
    """``n`` rounded up to a TMA map's alignment (addresses and offsets alike)."""
    return -(-n // _MAP_ALIGN) * _MAP_ALIGN


def _check(status: int, what: str) -> None:
    if status:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        name = text.value.decode() if text.value else f"error {status}"
        raise RuntimeError(f"dash attention: {what} failed: CUDA {name}")


def _param_sizes(function: int) -> list[int] | None:
    """The kernel's parameter sizes as the driver reads them, or None where it cannot say."""
    lib = _driver()
    if not hasattr(lib, "cuFuncGetParamInfo"):
        return None
    offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
    while True:
        status = lib.cuFuncGetParamInfo(ctypes.c_void_p(function), ctypes.c_size_t(len(sizes)),
                                        ctypes.byref(offset), ctypes.byref(size))
        if status == _INVALID_VALUE:
            return sizes
        if status:
            return None
        sizes.append(size.value)


class Encodings:
    """The TMA maps of one descriptor parameter, by descriptor object (a plan's descriptors are
    cached by address: ``ops/hopper/launch.py``), each as the parameter values it expands to."""

    __slots__ = ("meta", "kept", "scratch", "aligned")

    def __init__(self, meta: dict) -> None:
        self.meta, self.kept = meta, {}
        self.scratch = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
        self.aligned = _map_aligned(ctypes.addressof(self.scratch))

    def values(self, desc) -> tuple:
        entry = self.kept.get(id(desc))
        if entry is None or entry[0] is not desc:
            if len(self.kept) >= _DESCRIPTORS_KEPT:
                self.kept.clear()
            entry = self.kept[id(desc)] = (desc, (self._encode(desc), *desc.shape, *desc.strides))
        return entry[1]

    def tiled(self, desc) -> tuple:
        """Triton's encoding of a tiled descriptor, as ``cuTensorMapEncodeTiled``'s arguments
        (element type, base address, dims innermost first, byte strides, box, swizzle, fill):
        unit element strides and 128-byte L2 promotion go without saying."""
        meta, elem_size = self.meta, self.meta["elem_size"]
        elem_type = _HOST_TYPE.get(meta["elem_type"], meta["elem_type"])
        if getattr(desc, "round_f32_to_tf32", False):
            elem_type = _TF32
        return (elem_type, desc.base.data_ptr(), tuple(reversed(desc.shape)),
                tuple(elem_size * s for s in reversed(desc.strides[:-1])),
                tuple(reversed(meta["block_size"])), meta["swizzle"],
                _OOB_NAN if desc.padding == "nan" else _OOB_NONE)

    def _encode(self, desc) -> bytes:
        elem_type, base, dims, strides, box, swizzle, fill = self.tiled(desc)
        rank = len(dims)
        _check(_driver().cuTensorMapEncodeTiled(
            self.aligned, elem_type, rank, base, (ctypes.c_uint64 * rank)(*dims),
            (ctypes.c_uint64 * rank)(*strides), (ctypes.c_uint32 * rank)(*box),
            (ctypes.c_uint32 * rank)(*([1] * rank)), 0, swizzle, _L2_PROMOTION_128B, fill),
            "cuTensorMapEncodeTiled")
        return ctypes.string_at(self.aligned, _MAP_BYTES)


def _rank(kind: str) -> int:
    """The rank of a ``tensordesc<dtype[block], ..., input_rank=r>`` parameter type."""
    found = re.search(r",input_rank=(\d+)", kind)
    if found:
        return int(found.group(1))
    return re.match(r"[^[]*\[([^\]]*)\]", kind).group(1).count(",") + 1


def bind(compiled, nargs: int) -> Callable[[tuple, tuple], None] | None:
    """A launcher of ``compiled`` (``_init_handles`` done) that takes the grid and the first
    ``nargs`` arguments (the rest are constexprs), or None where the kernel needs what only
    Triton's launcher does: scratch buffers, clusters, launch attributes, tuple or bf16 scalar
    parameters, descriptors without TMA metadata, or a parameter list the driver disagrees with."""
    if torch.version.hip is not None or not _loadable():
        return None
    metadata = compiled.metadata
    if (getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0)
            or getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_pdl", False)
            or metadata.shared > _SMEM_LIMIT
            or tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) != (1, 1, 1)):
        return None
    kinds = list(compiled.src.signature.values())
    if len(kinds) < nargs or any(k != "constexpr" for k in kinds[nargs:]):
        return None
    metas = list(getattr(metadata, "tensordesc_meta", None) or [])
    fmt, sizes, offset, offsets, steps, arg_offsets = [], [], 0, [], [], []
    for kind in kinds[:nargs]:
        if not isinstance(kind, str):
            return None
        if kind == "constexpr":
            steps.append(None)
            arg_offsets.append(None)
            continue
        if kind.startswith("tensordesc"):
            if not metas or metas[0].get("fp4_padded") or metas[0].get("is_im2col"):
                return None
            rank = _rank(kind)
            steps.append(Encodings(metas.pop(0)))
            params = [("128s", _MAP_BYTES, _MAP_ALIGN), *[("i", 4, 4)] * rank,
                      *[("q", 8, 8)] * rank]
        elif kind.startswith("*"):
            steps.append(POINTER)
            params = [("Q", 8, 8)]
        elif kind in _CODES:
            steps.append(VALUE)
            code = _CODES[kind]
            params = [(code, struct.calcsize(code), struct.calcsize(code))]
        else:
            return None
        arg_offsets.append(offset + -offset % params[0][2])
        for code, size, align in params:
            pad = -offset % align
            fmt.append("x" * pad + code)
            offsets.append(offset + pad)
            sizes.append(size)
            offset += pad + size
    if metas or not steps:
        return None
    driver_sizes = _param_sizes(compiled.function)
    if driver_sizes is None or driver_sizes != sizes + [8, 8]:
        return None
    return _launcher(compiled, tuple(steps), fmt, offsets, len(sizes), tuple(arg_offsets))


#: The head of a launch's block: CUlaunchConfig (grid, block, shared bytes, stream, attributes,
#: their count), then one CUlaunchAttribute (id, value) that asks for a cooperative launch.
_CONFIG = "<7I4xQQI4x"
_ATTRIBUTE = "i4xi60x"
_COOPERATIVE = 2  #: CU_LAUNCH_ATTRIBUTE_COOPERATIVE


class Bound:
    """What a tape (``tape.py``) records of a bound launch besides its arguments: the kernel, its
    launch config, how each argument is read and where its parameters start in the block."""

    __slots__ = ("function", "threads", "shared", "cooperative", "steps", "arg_offsets",
                 "param_offsets", "span")

    def __init__(self, compiled, steps: tuple, arg_offsets: tuple, offsets: list[int],
                 span: tuple[int, int]) -> None:
        metadata = compiled.metadata
        self.function, self.steps, self.arg_offsets = compiled.function, steps, arg_offsets
        self.threads, self.shared = 32 * metadata.num_warps, metadata.shared
        self.cooperative = bool(metadata.launch_cooperative_grid)
        self.span = span  # the parameters' bytes in the launch's block
        length = span[1] - span[0]
        null = length + -length % 8
        self.param_offsets = (*offsets, null, null)  # the scratch pointers: one zeroed word

    def report(self, grid: tuple, args: tuple, view) -> None:
        start, end = self.span
        TAPE[0].launch(self, grid, args, bytes(view[start:end]).ljust(self.param_offsets[-1] + 8,
                                                                       b"\0"))


def _launcher(compiled, steps: tuple, fmt: list[str], offsets: list[int], count: int,
              arg_offsets: tuple) -> Callable[[tuple, tuple], None]:
    """One block holds the config, its attribute and the parameters, so that a launch is one
    ``pack_into`` of this call's values and one ``cuLaunchKernelEx``, under a lock: the driver
    reads the block with the GIL released, and another thread must not refill it meanwhile. The
    call is generated with one expression per argument: a loop over the kinds cost more."""
    head = struct.calcsize(_CONFIG + _ATTRIBUTE)
    params_at = _map_aligned(head)
    layout = struct.Struct(_CONFIG + _ATTRIBUTE + "x" * (params_at - head) + "".join(fmt))
    block = ctypes.create_string_buffer(layout.size + 2 * _MAP_ALIGN)
    base = _map_aligned(ctypes.addressof(block))
    view = (ctypes.c_char * (layout.size + 16)).from_buffer(block, base - ctypes.addressof(block))
    null = base + layout.size + (-layout.size % 8)  # the two scratch pointers: NULL, zeroed
    params = (ctypes.c_void_p * (count + 2))(*(base + params_at + o for o in offsets), null, null)
    attribute = base + struct.calcsize(_CONFIG)
    bound = Bound(compiled, steps, arg_offsets, offsets, (params_at, layout.size))
    cooperative, fixed = int(bound.cooperative), (bound.threads, 1, 1, bound.shared)
    terms = []
    for i, step in enumerate(steps):
        if step is VALUE:
            terms.append(f"a{i}")
        elif step is POINTER:
            terms.append(f"a{i}.data_ptr()")
        elif step is not None:
            terms.append(f"*s{i}.values(a{i})")
    names = ", ".join(f"a{i}" for i in range(len(steps)))
    source = (f"def run(grid, args):\n"
              f"    {names}{',' if len(steps) == 1 else ''} = args\n"
              f"    x, y, z = (*grid, 1, 1)[:3]\n"
              f"    if not x * y * z:\n"
              f"        return\n"
              f"    with lock:\n"
              f"        pack(view, 0, x, y, z, *fixed, stream(device()), attribute, cooperative,\n"
              f"             _COOPERATIVE, 1, {', '.join(terms)})\n"
              f"        if TAPE[0] is not None:\n"
              f"            bound.report((x, y, z), args, view)\n"
              f"        status = launch(config, function, params, None)\n"
              f"    if status:\n"
              f"        _check(status, 'a kernel launch')\n")
    scope = {f"s{i}": step for i, step in enumerate(steps) if isinstance(step, Encodings)}
    scope.update(pack=layout.pack_into, view=view, fixed=fixed, attribute=attribute,
                 cooperative=cooperative, _COOPERATIVE=_COOPERATIVE, _check=_check,
                 stream=torch._C._cuda_getCurrentRawStream, device=torch._C._cuda_getDevice,
                 launch=_driver().cuLaunchKernelEx, config=ctypes.c_void_p(base),
                 function=ctypes.c_void_p(compiled.function), params=params, block=block,
                 lock=threading.Lock(), TAPE=TAPE, bound=bound)
    name = getattr(compiled, "name", "a kernel")
    exec(compile(source, f"<dash launch of {name}>", "exec"), scope)
    return scope["run"]
