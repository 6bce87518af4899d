"""The varlen reference: per sequence, the blocked reference of ``reference.py`` with the window
as the dense kernels take it (``packing.kernel_window``: itself where Lq = Lk, so that the
reference skips the keys it masks, else a dense keep-mask). A sequence's bits depend on that
sequence only, because nothing is computed across sequences.
"""

from __future__ import annotations

import math

from torch import Tensor

from dash_inductor.library import packing, reference
from dash_inductor.library.window import Window


def forward(query: Tensor, key: Tensor, value: Tensor, segments: list[packing.Segment],
            scale: float, window: Window, out: Tensor, lse: Tensor) -> None:
    """Write each sequence's output into ``out`` (Tq, Hq, Ev), logsumexp into ``lse`` (Hq, Tq)."""
    for seg in segments:
        if seg.q1 == seg.q0:
            continue
        if seg.k1 == seg.k0:  # no key: zero output, -inf logsumexp, as dash.attention
            out[seg.q0:seg.q1] = 0
            lse[:, seg.q0:seg.q1] = -math.inf
            continue
        mask, dense_window, causal = packing.kernel_window(seg, window, query.shape[1],
                                                           query.device)
        o, s = reference.attention_forward(
            packing.view(query, seg.q0, seg.q1), packing.view(key, seg.k0, seg.k1),
            packing.view(value, seg.k0, seg.k1), mask, causal, scale, dense_window)
        packing.view(out, seg.q0, seg.q1).copy_(o)
        lse[:, seg.q0:seg.q1] = s[0]


def backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
             lse: Tensor, segments: list[packing.Segment], scale: float, window: Window,
             dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Write each sequence's gradients into the zero-initialised packed ``dq``, ``dk``, ``dv``."""
    for seg in segments:
        if seg.q1 == seg.q0 or seg.k1 == seg.k0:
            continue
        mask, dense_window, causal = packing.kernel_window(seg, window, query.shape[1],
                                                           query.device)
        grads = reference.attention_backward(
            packing.view(grad_out, seg.q0, seg.q1), packing.view(query, seg.q0, seg.q1),
            packing.view(key, seg.k0, seg.k1), packing.view(value, seg.k0, seg.k1),
            packing.view(out, seg.q0, seg.q1), lse[None, :, seg.q0:seg.q1], mask, causal, scale,
            dense_window)
        for packed, (start, stop), g in zip((dq, dk, dv), ((seg.q0, seg.q1), (seg.k0, seg.k1),
                                                           (seg.k0, seg.k1)), grads):
            packing.view(packed, start, stop).copy_(g)
