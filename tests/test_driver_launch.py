"""CPU tests of the driver launches' argument packing (ops/shared/driver.py) against Triton's
kernel ABI, with a stand-in for libcuda that records what it is given.

What this shows: the parameter list (a descriptor as its 128-byte map, its shape as i32 and its
strides as i64; constexprs dropped; two NULL scratch pointers last), each value at the address the
launch passes, and the TMA encoding's arguments in Triton's order (innermost dim first, byte
strides, the kernel's block and swizzle). What it cannot: that a GPU reads them so; the GPU test
(tests/gpu/test_driver_launch_gpu.py) compares bits with Triton's launcher.
"""

import ctypes
import random
import struct
from types import SimpleNamespace

import pytest

from dash_inductor.ops.shared import driver


class _FakeCuda:
    """Records launches and encodings; answers cuFuncGetParamInfo from ``sizes``."""

    def __init__(self, sizes):
        self.sizes, self.launches, self.encodes = sizes, [], []

    def cuFuncGetParamInfo(self, function, index, offset, size):
        index = index.value
        if index >= len(self.sizes):
            return driver._INVALID_VALUE
        ctypes.cast(size, ctypes.POINTER(ctypes.c_size_t))[0] = self.sizes[index]
        return 0

    def cuTensorMapEncodeTiled(self, out, elem_type, rank, address, dims, strides, box, unit,
                               interleave, swizzle, promotion, fill):
        self.encodes.append((elem_type, rank, address, list(dims), list(strides)[:rank - 1],
                             list(box), list(unit), interleave, swizzle, promotion, fill))
        ctypes.memset(out, len(self.encodes), driver._MAP_BYTES)
        return 0

    def cuLaunchKernelEx(self, config, function, params, extra):
        fields = struct.unpack(driver._CONFIG, ctypes.string_at(config.value, 56))
        grid, threads, shared, stream, attrs, count = fields[:3], fields[3], fields[6], *fields[7:]
        attribute = struct.unpack("<" + driver._ATTRIBUTE, ctypes.string_at(attrs, 72))
        self.launches.append((grid, threads, shared, stream, count, attribute, params))
        return 0


class _Tensor:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


def _compiled(signature, metas, cooperative=False):
    metadata = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                               launch_pdl=False, shared=1024, num_warps=8,
                               launch_cooperative_grid=cooperative, tensordesc_meta=metas)
    return SimpleNamespace(metadata=metadata, function=1234, src=SimpleNamespace(
        signature=signature))


def _read(params, index, code):
    address = params[index]
    return struct.unpack(code, ctypes.string_at(address, struct.calcsize(code)))[0]


@pytest.fixture
def fake(monkeypatch):
    def install(sizes):
        cuda = _FakeCuda(sizes)
        monkeypatch.setattr(driver, "_driver", lambda: cuda)
        monkeypatch.setattr(driver.torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        monkeypatch.setattr(driver.torch._C, "_cuda_getCurrentRawStream", lambda d: 77,
                            raising=False)
        return cuda
    return install


def test_values_land_where_the_kernel_reads_them(fake):
    signature = {"Q": "tensordesc<bf16[1, 1, 64, 128]>", "O": "*bf16", "L": "i32",
                 "ONE": "constexpr", "S": "i64", "scale": "fp32", "B": "i1", "X": "constexpr"}
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 64, 128],
            "fp4_padded": False}
    sizes = [128, 4, 4, 4, 4, 8, 8, 8, 8, 8, 4, 8, 4, 1, 8, 8]
    cuda = fake(sizes)
    launch = driver.bind(_compiled(signature, [meta]), nargs=7)
    assert launch is not None
    rng = random.Random(0)
    for call in range(3):
        shape = [rng.randrange(1, 9), rng.randrange(1, 17), rng.randrange(65, 4097), 128]
        strides = [shape[1] * shape[2] * 128, shape[2] * 128, 128, 1]
        desc = SimpleNamespace(base=_Tensor(0x7000_0000 + 1024 * call), shape=shape,
                               strides=strides, padding="zero")
        out, length, stride, scale = _Tensor(rng.randrange(1 << 40) * 16), rng.randrange(1 << 30), \
            rng.randrange(1 << 50), rng.random()
        grid = (rng.randrange(1, 300), 2)
        launch(grid, (desc, out, length, 1, stride, scale, True))
        ran, threads, shared, stream, count, attribute, params = cuda.launches[-1]
        assert (ran, threads, shared, stream) == ((*grid, 1), 256, 1024, 77)
        assert count == 0  # not cooperative: the attribute is there, not counted
        assert ctypes.string_at(params[0], 128) == bytes([len(cuda.encodes)]) * 128
        assert [_read(params, 1 + i, "<i") for i in range(4)] == shape
        assert [_read(params, 5 + i, "<q") for i in range(4)] == strides
        assert _read(params, 9, "<Q") == out.ptr
        assert _read(params, 10, "<i") == length
        assert _read(params, 11, "<q") == stride
        assert _read(params, 12, "<f") == pytest.approx(scale, rel=1e-7)
        assert _read(params, 13, "<b") == 1
        assert params[14] is None or _read(params, 14, "<Q") == 0
        assert params[15] is None or _read(params, 15, "<Q") == 0
        assert params[0] % 64 == 0
        elem_type, rank, address, dims, byte_strides, box, unit, *rest = cuda.encodes[-1]
        assert (elem_type, rank, address) == (8, 4, desc.base.ptr)  # device code 9 is host 8
        assert dims == shape[::-1] and byte_strides == [2 * s for s in strides[-2::-1]]
        assert box == [128, 64, 1, 1] and unit == [1] * 4 and rest == [0, 3, 2, 0]


def test_a_cooperative_kernel_asks_for_it(fake):
    cuda = fake([8, 4, 8, 8])
    launch = driver.bind(_compiled({"P": "*fp32", "N": "i32"}, [], cooperative=True), nargs=2)
    launch((132,), (_Tensor(4096), 5))
    grid, *_, count, attribute, params = cuda.launches[-1]
    assert grid == (132, 1, 1) and count == 1 and attribute == (driver._COOPERATIVE, 1)
    assert _read(params, 0, "<Q") == 4096 and _read(params, 1, "<i") == 5
    launch((0,), (_Tensor(4096), 5))  # an empty grid launches nothing
    assert len(cuda.launches) == 1


def test_a_descriptor_is_encoded_once_per_object(fake):
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [64, 64],
            "fp4_padded": False}
    cuda = fake([128, 4, 4, 8, 8, 8, 8])
    launch = driver.bind(_compiled({"D": "tensordesc<bf16[64, 64]>"}, [meta]), nargs=1)
    desc = SimpleNamespace(base=_Tensor(0x1000), shape=[128, 64], strides=[64, 1], padding="nan")
    for _ in range(3):
        launch((1,), (desc,))
    assert len(cuda.encodes) == 1 and cuda.encodes[0][-1] == driver._OOB_NAN


@pytest.mark.parametrize("change", ["scratch", "clusters", "tuple", "bf16", "no_meta", "sizes"])
def test_what_it_cannot_pack_goes_to_triton(fake, change):
    signature = {"P": "*fp32", "N": "i32"}
    sizes = [8, 4, 8, 8]
    compiled = _compiled(signature, [])
    if change == "scratch":
        compiled.metadata.global_scratch_size = 64
    elif change == "clusters":
        compiled.metadata.num_ctas = 2
    elif change == "tuple":
        signature["N"] = ("i32", "i32")
    elif change == "bf16":
        signature["N"] = "bf16"
    elif change == "no_meta":
        signature["N"] = "tensordesc<bf16[64, 64]>"
    else:
        sizes = [8, 8, 8, 8]  # the driver reads a 64-bit N: not the ABI assumed here
    fake(sizes)
    assert driver.bind(compiled, nargs=2) is None


def test_a_tape_records_the_block_and_its_patches(fake):
    """Under a tape (ops/shared/tape.py) a launch reports its packed block, and each address in
    it as a patch over the call's tensors: pointers at their parameter's offset, descriptors as
    the encoding's arguments over their base."""
    import torch

    from dash_inductor.ops.shared import tape

    signature = {"D": "tensordesc<fp32[16, 8]>", "P": "*fp32", "N": "i32"}
    meta = {"swizzle": 1, "elem_size": 4, "elem_type": 7, "block_size": [16, 8],
            "fp4_padded": False}
    fake([128, 4, 4, 8, 8, 8, 4, 8, 8])
    launch = driver.bind(_compiled(signature, [meta]), nargs=3)
    x = torch.randn(64, 8)

    def call():
        out = torch.empty(100)
        view = out[36:]  # a pointer into the middle of a tensor the call made
        desc = SimpleNamespace(base=x, shape=[64, 8], strides=[8, 1], padding="zero")
        launch((3, 2), (desc, view, 77))
        return [out]

    _, program = tape.record(call, (x,))
    assert program is not None
    inputs, steps, outputs, kept = program
    (kind, function, grid, threads, shared, cooperative, block, offsets, pointers, maps) = steps[-1]
    assert (kind, function, grid, threads, shared) == ("launch", 1234, (3, 2, 1), 256, 1024)
    sizes = [128, 4, 4, 8, 8, 8, 4]
    assert len(offsets) == len(sizes) + 2 and offsets[0] == 0 and offsets[-1] == offsets[-2]
    assert struct.unpack_from("<i", block, offsets[6])[0] == 77
    assert struct.unpack_from("<Q", block, offsets[-1])[0] == 0  # the scratch pointers: NULL
    made = [step[1] for step in steps if step[0] == "aten"]  # one result each, slots from 1
    assert made[0] == "aten::empty" and made[-1] == "aten::slice"
    assert pointers == [(offsets[5], inputs + len(made) - 1, 0)]
    ((at, slot, offset, elem_type, swizzle, fill, dims, strides, box),) = maps
    assert (at, slot, offset, elem_type, swizzle, fill) == (0, 0, 0, 7, 1, driver._OOB_NONE)
    assert (dims, strides, box) == ((8, 64), (32,), (8, 16))
    assert made[outputs[0] - inputs] in ("aten::empty", "aten::detach") and kept == []
    from dash_inductor.ops.shared import native

    module = native.load(wait=True)
    if module is not None:  # the C++ replayer parses the program (running it needs a GPU)
        module.Program(*program)
