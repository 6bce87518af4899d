"""The dQ accumulator's conversion (``ops/shared/dq_convert.py``) against PyTorch's copy, on the CPU
(Triton interpreter), for the gradient layouts the launchers hand it: (B, H, L, E) contiguous,
a model's (B, L, H, E) seen as (B, H, L, E), and packed (T, H, E) seen as (1, H, T, E). The
interpreter rounds float32 to bfloat16 by truncation, not to nearest even as the GPU does, so
here the conversion is checked exactly in float16 and float32; tests/gpu checks bfloat16."""

import pytest
import torch

from dash_inductor.ops.shared.dq_convert import convert_dq
from dash_inductor.ops.shared.launch import Launches

LAYOUTS = {
    "bhle": lambda b, h, l, e, dt: torch.empty(b, h, l, e, dtype=dt),
    "blhe": lambda b, h, l, e, dt: torch.empty(b, l, h, e, dtype=dt).transpose(1, 2),
    "packed": lambda b, h, l, e, dt: torch.empty(l, h, e, dtype=dt).transpose(0, 1).unsqueeze(0),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 3, 70, 64, 64, 128), (1, 4, 200, 96, 128, 256),
                                   (1, 5, 33, 128, 128, 64)], ids=str)
def test_conversion_equals_pytorchs_copy(shape, layout, dtype):
    batch, heads, seq, e, head_acc, rows = shape
    batch = 1 if layout == "packed" else batch  # packed gradients are one batch entry
    acc = torch.randn(batch * heads, rows, head_acc, generator=torch.Generator().manual_seed(0))
    dq = LAYOUTS[layout](batch, heads, seq, e, dtype).fill_(float("nan"))
    convert_dq(Launches(), acc, dq)
    expected = acc.view(batch, heads, rows, head_acc)[:, :, :seq, :e].to(dtype)
    assert torch.equal(dq, expected)
