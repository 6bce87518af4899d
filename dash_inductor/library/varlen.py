"""``varlen_attention``: packed variable-length attention with ``varlen_attn``'s signature, backed
by the custom ops ``dash::varlen_attention`` and ``dash::varlen_attention_backward``.

Like ``dash::attention`` the ops take the backward's choices (``config.CHOICES``) as their last
arguments, captured when the forward runs, and have fake kernels and a registered autograd. Each
sequence is computed alone: on the reference by ``reference_varlen.py``; on the Triton path
(CUDA, ``cpu_backend="triton"``) by one launch per pass over all sequences, whose programs read
the offsets on the device and work on one sequence each (``ops/portable/packed.py``, and the
Hopper kernels, ``ops/hopper/``, where the dispatcher picks them). So a sequence's outputs and
gradients are the same bits whatever is packed beside it, under every schedule. The dispatcher
(Triton and the kernels) is imported at the first launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from dash_inductor import config
from dash_inductor.library import packing, reference, reference_varlen
from dash_inductor.library.op import (_MAX_SPIN, check_schedule_allowed, forbid_double_backward, record,
                                      uses_triton)
from dash_inductor.library.shapes import check_not_nested, unfilled
from dash_inductor.library.window import NO_WINDOW, check_window, with_causal

if TYPE_CHECKING:
    from torch.nn.attention.varlen import AuxRequest


class _AuxRequest(NamedTuple):
    """Which auxiliary outputs ``varlen_attention`` returns (as PyTorch's, for a PyTorch without
    ``varlen_attn``)."""

    lse: bool = False


def __getattr__(name: str) -> Any:
    """``AuxRequest``: PyTorch's, imported on first use, as its module imports Dynamo (seconds)."""
    if name != "AuxRequest":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from torch.nn.attention.varlen import AuxRequest
    except ImportError:  # a PyTorch without varlen_attn
        return _AuxRequest
    return AuxRequest


_CHOICES = ('str schedule="auto", SymInt max_spin=67108864, str cpu_backend="reference", '
            'str kernel_path="auto"')
_PACKED = ("Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, float? scale, "
           "int[2] window_size, bool enable_gqa")


def _scale(query: Tensor, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[2])


def _forward_outputs(query: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    out = torch.empty((query.shape[0], query.shape[1], value.shape[2]), dtype=query.dtype,
                      device=query.device)
    lse = torch.empty((query.shape[1], query.shape[0]), device=query.device,
                      dtype=reference.accumulation_dtype(query.dtype))
    return out, lse


@torch.library.custom_op(
    "dash::varlen_attention", mutates_args=(),
    schema=(f"(Tensor query, Tensor key, Tensor value, {_PACKED}, {_CHOICES}) "
            "-> (Tensor, Tensor)"))
def varlen_attention_op(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                        cu_seq_k: Tensor, max_q: int, max_k: int, scale: float | None,
                        window_size: Sequence[int], enable_gqa: bool, schedule: str = "auto",
                        max_spin: int = _MAX_SPIN, cpu_backend: str = "reference",
                        kernel_path: str = "auto") -> tuple[Tensor, Tensor]:
    raise NotImplementedError(f"dash.varlen_attention has no kernel for device "
                              f"{query.device.type!r}; supported: cpu, cuda")


@varlen_attention_op.register_fake
def _varlen_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                 enable_gqa, schedule="auto", max_spin=_MAX_SPIN, cpu_backend="reference",
                 kernel_path="auto"):
    config.check_choices((schedule, max_spin, cpu_backend, kernel_path))
    packing.check_packed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                         enable_gqa)
    return _forward_outputs(query, value)


def _segments(query: Tensor, key: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int,
              max_k: int, cpu_backend: str) -> list[packing.Segment] | None:
    """The sequences, read on the host, for the reference, and for CPU offsets, where reading
    them is free and makes a breach of their contract an error now; None on CUDA, whose kernels
    check the offsets on the device."""
    if query.device.type == "cpu" or not uses_triton(query, cpu_backend):
        return packing.sequences(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
    return None


@varlen_attention_op.register_kernel(("cpu", "cuda"))
def _varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                   enable_gqa, schedule="auto", max_spin=_MAX_SPIN, cpu_backend="reference",
                   kernel_path="auto"):
    config.check_choices((schedule, max_spin, cpu_backend, kernel_path))
    window = packing.check_packed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                  window_size, enable_gqa)
    segments = _segments(query, key, cu_seq_q, cu_seq_k, max_q, max_k, cpu_backend)
    out, lse = _forward_outputs(query, value)
    if not uses_triton(query, cpu_backend):
        reference_varlen.forward(query, key, value, segments, _scale(query, scale), window, out,
                                 lse)
    else:
        from dash_inductor.ops import dispatch

        kernel_window, causal = with_causal(window, False)
        record(dispatch.varlen_forward(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, out, lse, is_causal=causal,
            scale=_scale(query, scale), window=kernel_window, kernel=kernel_path))
    return out, lse


@torch.library.custom_op(
    "dash::varlen_attention_backward", mutates_args=(),
    schema=("(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
            f"Tensor logsumexp, {_PACKED}, {_CHOICES}) -> (Tensor, Tensor, Tensor)"))
def varlen_attention_backward_op(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                 out: Tensor, logsumexp: Tensor, cu_seq_q: Tensor,
                                 cu_seq_k: Tensor, max_q: int, max_k: int, scale: float | None,
                                 window_size: Sequence[int], enable_gqa: bool,
                                 schedule: str = "auto", max_spin: int = _MAX_SPIN,
                                 cpu_backend: str = "reference", kernel_path: str = "auto"
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    raise NotImplementedError(f"dash.varlen_attention_backward has no kernel for device "
                              f"{query.device.type!r}; supported: cpu, cuda")


@varlen_attention_backward_op.register_fake
def _varlen_backward_fake(grad_out, query, key, value, out, logsumexp, cu_seq_q, cu_seq_k, max_q,
                          max_k, scale, window_size, enable_gqa, schedule="auto",
                          max_spin=_MAX_SPIN, cpu_backend="reference", kernel_path="auto"):
    config.check_choices((schedule, max_spin, cpu_backend, kernel_path))
    packing.check_packed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                         enable_gqa)
    return tuple(torch.empty_like(t) for t in (query, key, value))


@varlen_attention_backward_op.register_kernel(("cpu", "cuda"))
@unfilled()
def _varlen_backward_kernel(grad_out, query, key, value, out, logsumexp, cu_seq_q, cu_seq_k, max_q,
                            max_k, scale, window_size, enable_gqa, schedule="auto",
                            max_spin=_MAX_SPIN, cpu_backend="reference", kernel_path="auto"):
    config.check_choices((schedule, max_spin, cpu_backend, kernel_path))
    window = packing.check_packed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                  window_size, enable_gqa)
    segments = _segments(query, key, cu_seq_q, cu_seq_k, max_q, max_k, cpu_backend)
    # Laid out as the inputs (as SDPA's gradients are), so that autograd does not copy them to
    # the leaves' strides: a (T, H, D) view of (H, T, D) memory gets (H, T, D) gradients. The
    # packed kernels write every element (keys without queries included); the reference leaves
    # such keys alone.
    kernels = uses_triton(query, cpu_backend)
    grads = tuple((torch.empty_like if kernels else torch.zeros_like)(t)
                  for t in (query, key, value))
    if not kernels:
        reference_varlen.backward(grad_out, query, key, value, out, logsumexp, segments,
                                  _scale(query, scale), window, *grads)
    else:
        from dash_inductor.ops import dispatch

        kernel_window, causal = with_causal(window, False)
        record(dispatch.varlen_backward(
            grad_out, query, key, value, out, logsumexp, cu_seq_q, cu_seq_k, max_q, max_k,
            *grads, is_causal=causal, scale=_scale(query, scale), schedule=schedule,
            max_spin=max_spin, kernel=kernel_path, window=kernel_window))
    return grads


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, \
        *choices = inputs
    check_schedule_allowed(choices[0])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, out, lse, cu_seq_q, cu_seq_k)
    ctx.args = (max_q, max_k, scale, tuple(window_size), enable_gqa, *choices)


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    query, key, value, out, lse, cu_seq_q, cu_seq_k = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward_op(grad_out, query, key, value, out, lse, cu_seq_q,
                                              cu_seq_k, *ctx.args)
    return (dq, dk, dv, *(None,) * 11)


varlen_attention_op.register_autograd(_backward, setup_context=_setup_context)
forbid_double_backward(varlen_attention_backward_op, "dash.varlen_attention")


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                     cu_seq_k: Tensor, max_q: int, max_k: int, *,
                     return_aux: AuxRequest | None = None, scale: float | None = None,
                     window_size: tuple[int, int] = NO_WINDOW,
                     enable_gqa: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Deterministic ``torch.nn.attention.varlen.varlen_attn`` (same signature and meaning).

    ``query`` (Tq, Hq, E), ``key`` (Tk, Hkv, E), ``value`` (Tk, Hkv, Ev) pack N sequences at the
    int32/int64 offsets ``cu_seq_q`` / ``cu_seq_k`` (N + 1 each); ``max_q`` / ``max_k`` bound the
    lengths. ``window_size=(left, right)`` is FlashAttention's window, aligned bottom-right per
    sequence: (-1, -1) full, (-1, 0) causal, (W, 0) causal with W keys back. Returns the output
    (Tq, Hq, Ev), and with ``return_aux.lse`` also the logsumexp (Hq, Tq), as ``varlen_attn``.

    Checked when traced (also on fake tensors): ranks, dtypes, devices, head counts and dims,
    offsets' dtype and shape, ``max_q``/``max_k`` non-negative, window values >= -1. The offsets'
    values (start at 0, non-decreasing, last = T, no length above ``max_q``/``max_k``) are checked
    without a host synchronisation: CPU offsets on the host at the call; CUDA offsets on the
    device, raising the same ``ValueError`` asynchronously, from a later launch or from
    ``dash_inductor.ops.check_spin_flags(wait=True)`` (docs/op.md). The backward's
    choices are read from ``dash_inductor.config`` now.
    """
    choices = config.choices()
    # Checked here too: the schema's own cast errors would not name the argument.
    check_not_nested(query, key, value, where=packing.WHERE)
    window = check_window(window_size, packing.WHERE)
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, Tensor):
            raise ValueError(f"{packing.WHERE}: {name} must be a Tensor of cumulative sequence "
                             f"offsets, got {type(cu).__name__}")
    out, lse = varlen_attention_op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                   window, enable_gqa, *choices.values())
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out
