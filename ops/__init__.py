"""Triton kernels of dash_inductor, their dispatcher and launchers (imported as ``dash_inductor.ops``).

This layer knows Triton and tensors only: no torch.library, no autograd. The caller
(``dash_inductor/library/op.py``) validates and canonicalises the inputs and allocates the outputs:

- ``q`` (B, Hq, L, E), ``k`` (B, Hkv, S, E), ``v`` (B, Hkv, S, Ev), any strides, one float dtype;
  ``Hq % Hkv == 0`` and query head ``h`` reads KV head ``h // (Hq // Hkv)``.
- ``mask``: None, or a bool (True = attend) or additive float tensor of shape (B, Hq, L, S), usually
  an ``expand``-ed view with zero strides on broadcast dims.
- ``is_causal``: SDPA's top-left alignment, query i sees keys j <= i.
- ``window`` (keyword, default (-1, -1)): query i sees keys i - left..i + right, -1 = that side
  open, top-left aligned (the op passes a right side of 0 as ``is_causal``); tiles outside it are
  never loaded.
- ``lse``: natural-log logsumexp, fp32 (B, Hq, L); -inf on rows that see no key.

Every entry goes through the dispatcher (``dispatch.py``), which plans once per call signature;
``cache_info()`` and ``cache_clear()`` inspect and reset its cache. Imported on first use, so that
``dash_inductor.ops.catalog`` (the schedules' definition, plain Python) loads without Triton.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan

_DISPATCHED = ("attention_forward", "attention_backward", "varlen_forward", "varlen_backward",
               "cache_info", "cache_clear")
__all__ = ["Plan", "check_spin_flags", *_DISPATCHED]


def __getattr__(name: str) -> Any:
    if name in _DISPATCHED:
        from . import dispatch

        return getattr(dispatch, name)
    if name == "check_spin_flags":  # raise a deferred kernel error now (tests, careful callers)
        from .shared.errors import check_spin_flags

        return check_spin_flags
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
