"""The device check of the packed offsets' contract (``offsets.py``): one program reads
``cu_seq_q`` and ``cu_seq_k`` on the device and reports their breaches through a flag of its own
(``errors.watch_value_flag``), so the host never reads them. Every packed launcher runs it first;
the kernels treat a sequence that breaks the contract as empty (``tiles.sequence_bounds``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import offsets
from .errors import watch_value_flag
from .launch import Launches

_START, _ORDER = tl.constexpr(offsets.START), tl.constexpr(offsets.ORDER)
_END, _LONGEST = tl.constexpr(offsets.END), tl.constexpr(offsets.LONGEST)
_KEYS = tl.constexpr(offsets.KEYS)


@triton.jit
def _breaches(CU, n, total, max_len, BLOCK: tl.constexpr):
    """Bits of the offsets' breaches (``ops/shared/offsets.py``) for ``n`` sequences."""
    bad_order = tl.zeros([BLOCK], tl.int32)
    too_long = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        a = tl.load(CU + i, mask=inside, other=0)
        b = tl.load(CU + i + 1, mask=inside, other=0)
        bad_order = tl.maximum(bad_order, tl.where(inside & (b < a), 1, 0))
        too_long = tl.maximum(too_long, tl.where(inside & (b - a > max_len), 1, 0))
    return (tl.where(tl.load(CU) != 0, _START, 0) | (tl.max(bad_order, 0) * _ORDER)
            | tl.where(tl.load(CU + n) != total, _END, 0) | (tl.max(too_long, 0) * _LONGEST))


@triton.jit
def _check_offsets_kernel(CU_Q, CU_K, FLAG, n, total_q, total_k, max_q, max_k,
                          BLOCK: tl.constexpr):
    code = (_breaches(CU_Q, n, total_q, max_q, BLOCK)
            | (_breaches(CU_K, n, total_k, max_k, BLOCK) << _KEYS))
    tl.store(FLAG, code.to(tl.int32))


def offsets_flag(launches: Launches, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
                 totals: tuple[int, int], max_lens: tuple[int, int]) -> torch.Tensor:
    """The device check of the offsets: a one-element int32 tensor, 0 or the breaches' bits."""
    flag = torch.zeros((1,), device=cu_seq_q.device, dtype=torch.int32)
    launches("offsets", _check_offsets_kernel, (1,),
             (cu_seq_q, cu_seq_k, flag, cu_seq_q.numel() - 1, *totals, *max_lens),
             dict(BLOCK=1024))
    return flag


def check_offsets(launches: Launches, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
                  totals: tuple[int, int], max_lens: tuple[int, int]) -> None:
    """On CUDA, check the offsets' contract on the device, without a host sync: a breach raises
    ``ValueError`` later (CPU offsets are checked on the host by the caller before it launches)."""
    if cu_seq_q.device.type != "cuda":
        return
    flag = offsets_flag(launches, cu_seq_q, cu_seq_k, totals, max_lens)
    watch_value_flag(flag, lambda code: ValueError(offsets.device_breach(code, totals, max_lens)))
