"""``dash_inductor.attention``: SDPA's signature, validated, then the op or the eager fast path.

A call on plain 4-D CUDA tensors without a mask, outside tracing, dispatch modes and functorch
transforms, runs the op's launches through a ``torch.autograd.Function`` instead of the custom-op
layers, whose Python took most of a small call's host time; a repeated signature reuses its plans
(``signatures.py``), and once recorded runs forward and backward in the C++ replayer. Everything
else goes through ``dash::attention``. All run the same plans, so the bits are the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dash_inductor import config
from dash_inductor.library import signatures
from dash_inductor.library.dropout import check_p, dropout_rng
from dash_inductor.library.op import (_backward, _forward, _grads_to_inputs, attention_backward_op, attention_op,
                                      check_schedule_allowed, op_options, record)
from dash_inductor.library.shapes import canonicalize, check_not_nested, check_sdpa_flags, unfilled
from dash_inductor.library.window import NO_WINDOW, check_window
from dash_inductor.ops.shared import errors, native


def _first_call(q: Tensor, k: Tensor, v: Tensor, flags: tuple, choices: tuple,
                key: tuple) -> tuple[Tensor, Tensor, signatures.Signature | None]:
    """Validate and run a signature's first call; remember it where repeats can reuse it."""
    is_causal, scale, enable_gqa, window = flags
    check_schedule_allowed(choices[0])
    c = canonicalize(q, k, v, None, is_causal, scale, enable_gqa, window)
    signature = signatures.remember(key, c, q, k, v, (flags, choices))
    if signature is None:
        out, lse = _forward(c, choices[2], choices[3])
        return out, lse, None
    out, lse, plan = signature.forward(q, k, v, choices[3])
    record(plan)
    return out, lse, signature


def _grads(signature: signatures.Signature | None, flags: tuple, choices: tuple,
           grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
           lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The eager backward (``_EagerAttention``'s, and the replayer's for a layout it has no
    program of yet)."""
    schedule, max_spin, cpu_backend, kernel_path = choices
    is_causal, scale, enable_gqa, window = flags
    if torch.is_grad_enabled():  # create_graph: the op's backward refuses a second derivative
        return attention_backward_op(
            grad_out, q, k, v, out, lse, None, is_causal, scale, enable_gqa,
            window_size=list(window), schedule=schedule, max_spin=max_spin,
            cpu_backend=cpu_backend, kernel_path=kernel_path)
    with unfilled():
        if signature is None:
            c = canonicalize(q, k, v, None, is_causal, scale, enable_gqa, window)
            return _grads_to_inputs(c, _backward(c, grad_out, out, lse, schedule, max_spin,
                                                 cpu_backend, kernel_path), q, k, v)
        grads, plan = signature.backward_recorded(grad_out, q, k, v, out, lse, schedule,
                                                  max_spin, kernel_path)
    record(plan)
    return grads


def _replayed_grads(handle: int, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    signature = signatures.by_handle(handle)
    return _grads(signature, *signature.call, grad_out, q, k, v, out, lse)


signatures.set_fallback(_replayed_grads)


class _EagerAttention(torch.autograd.Function):
    """The eager fast path: the ops' forward and backward kernels, called directly."""

    @staticmethod
    def forward(ctx, q, k, v, flags: tuple, choices: tuple, key: tuple):
        signature = signatures.lookup(key)
        with unfilled():
            if signature is None:
                out, lse, signature = _first_call(q, k, v, flags, choices, key)
            else:
                out, lse, plan = signature.forward_recorded(q, k, v, choices[3])
                record(plan)
        # The logsumexp is saved, not returned: a second output costs autograd more host time
        # than the rest of the call's bookkeeping. No tensor in the context either, so that
        # saved-tensor hooks (offloading, checkpointing) see them all.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.signature, ctx.flags, ctx.choices = signature, flags, choices
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_grads(ctx.signature, ctx.flags, ctx.choices, grad_out, *ctx.saved_tensors),
                None, None, None)


def _replay(signature: signatures.Signature, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A recorded signature's call: forward and backward in the C++ replayer."""
    record(signature.forward_plan)
    if signature.watch is not None:  # the backward's bounded waits, watched at the forward
        errors.watch_spin_flag(*signature.watch)
    return native.loaded().attention(q, k, v, signature.handle)


def _eager_cuda(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> bool:
    """Whether a call may skip the dispatcher: plain 4-D CUDA tensors without a mask, no tracing,
    no mode or functorch transform that would want to see the op."""
    return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and attn_mask is None
            and q.is_cuda and q.dim() == 4 and q.dtype != torch.float64
            and not torch.compiler.is_compiling()
            and torch._C._len_torch_function_stack() == 0
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
              enable_gqa: bool = False, window_size: tuple[int, int] = NO_WINDOW,
              schedule: str | None = None, kernel: str | None = None) -> Tensor:
    """Deterministic ``torch.nn.functional.scaled_dot_product_attention``: SDPA's signature, its
    positional order and its keyword-only ``scale`` and ``enable_gqa``. ``dropout_p`` in [0, 1)
    drops attention probabilities as SDPA does, whenever it is > 0, with a mask drawn from
    PyTorch's default generator of the query's device (``dropout.py``): ``torch.manual_seed``
    reproduces it.

    ``window_size=(left, right)``: a sliding window with FlashAttention's meaning, top-left
    aligned like ``is_causal`` (``window.py``); (-1, -1) is none. ``schedule`` and ``kernel``
    (None: ``dash_inductor.config``'s) and the rest of ``config.CHOICES`` are read now, so the
    backward runs what was in force at this call.
    """
    check_not_nested(query, key, value)
    check_sdpa_flags(is_causal, scale, enable_gqa, "dash.attention")
    dropout_p = check_p(dropout_p)
    choices = config.choices(schedule=schedule, kernel=kernel)
    # Checked here too: the schema's own cast errors would not name the argument.
    window = check_window(window_size, "dash.attention")
    if dropout_p:
        return attention_op(query, key, value, attn_mask, dropout_p, is_causal,
                            dropout_rng(query), scale=scale, enable_gqa=enable_gqa,
                            **op_options(choices, window))[0]
    if _eager_cuda(query, key, value, attn_mask):
        flags, chosen = (is_causal, scale, enable_gqa, window), tuple(choices.values())
        signature_key = signatures.key(query, key, value, flags, chosen)
        signature = signatures.lookup(signature_key)
        if signature is not None and signature.replayable():
            return _replay(signature, query, key, value)
        return _EagerAttention.apply(query, key, value, flags, chosen, signature_key)
    return attention_op(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                        enable_gqa=enable_gqa, **op_options(choices, window))[0]
