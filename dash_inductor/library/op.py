"""The ``dash::attention`` custom ops: schemas, fake kernels, autograd and per-device kernels.

``dash::attention`` takes SDPA's arguments in SDPA's order, ``dropout_p`` included (with the
``rng_state`` that ``dash::dropout_rng`` draws: ``dropout.py``), and returns
(out, logsumexp) with SDPA's semantics (logsumexp in float32, float64 for float64 inputs so that
float64 gradients stay exact); its backward is the separate op ``dash::attention_backward`` (and
``dash::attention_mask_grad`` for a float mask that requires grad), so that AOTAutograd and
Inductor see three opaque, deterministic ops. Kernels by device:

- CUDA: the Triton kernels of ``dash_inductor.ops`` for float16/bfloat16/float32; float64 and the
  mask gradient run the blocked PyTorch reference on the GPU (same semantics, deterministic, slower).
- CPU: ``reference.py``, or with ``cpu_backend="triton"`` the Triton kernels through the
  Triton interpreter (for tests; float64 stays on the reference).

Every choice that changes the backward's bits or path (``config.CHOICES``: schedule, max_spin,
cpu_backend, kernel; the op calls the last one ``kernel_path``, as Inductor's fallback kernels
reserve ``kernel``) is a keyword-only argument of both ops, so it is captured when the forward
runs and saved for the backward. What each launch ran is kept in ``last_plans()``.

``dash_inductor.attention`` (``entry.py``) calls these ops, or, for an eager call on plain CUDA
tensors, the same library functions through a lean ``torch.autograd.Function``. The dispatcher
(``dash_inductor.ops.dispatch``, which imports Triton and the kernels) is imported at the first
launch, not with the package.
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dash_inductor import config
from dash_inductor.library import reference
from dash_inductor.library.dropout import check_p, check_state
from dash_inductor.ops import catalog
from dash_inductor.ops.plan import Plan
from dash_inductor.ops.shared import native
from dash_inductor.library import native_kernels, signatures
from dash_inductor.library.shapes import Canonical, canonicalize, empty_like_layout, unfilled
from dash_inductor.library.signatures import uses_triton
from dash_inductor.library.window import NO_WINDOW

if TYPE_CHECKING:
    from dash_inductor.ops.shared.dropout import Dropout

#: The latest launches' plans, newest last, numbered in the sequence they share with the C++
#: replayer's backward launches (host-side values only: recording never syncs).
_PLANS: collections.deque[tuple[int, Plan]] = collections.deque(maxlen=16)
_REFERENCE_FORWARD = Plan("forward", "reference", None, None, None, None, ())


def record(plan: Plan) -> None:
    """Keep ``plan`` as the latest launch (host-side values only: never syncs)."""
    _PLANS.append((native.next_number(), plan))


def last_plans() -> list[Plan]:
    """What the latest forward and backward launches ran (schedule, kernel path, fallback, grid)."""
    entries = list(_PLANS)
    module = native.loaded()
    if module is not None:  # the backwards that the replayer ran, by its journal
        entries += [(number, plan) for number, handle, index in module.journal()
                    if (plan := signatures.native_plan(handle, index)) is not None]
        entries = sorted(entries, key=lambda entry: entry[0])[-_PLANS.maxlen:]
    return [plan for _, plan in entries]


def check_schedule_allowed(schedule: str) -> None:
    """Refuse (or, warn-only, warn about) a non-deterministic backward under deterministic
    algorithms, when the forward runs, as PyTorch does for its own non-deterministic ops; on
    every device and path alike, so code that passes on a laptop passes on the cluster."""
    if schedule == catalog.AUTO or catalog.get(schedule).deterministic:
        return
    if torch.are_deterministic_algorithms_enabled():
        message = (f"dash.attention with schedule={schedule!r} adds dQ with unordered atomics in "
                   f"the backward and is not deterministic; use 'auto' or another schedule")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _dropout(dropout_p: float, rng_state: Tensor | None) -> Dropout | None:
    if not dropout_p:
        return None
    from dash_inductor.ops.shared.dropout import Dropout

    return Dropout(dropout_p, rng_state)


def _allocate_forward(c: Canonical) -> tuple[Tensor, Tensor]:
    """``out`` laid out as the query, and the logsumexp (float32, float64 for float64)."""
    b, h, l, _ = c.q.shape
    out = empty_like_layout(c.q, (b, h, l, c.v.shape[-1]))
    lse = torch.empty((b, h, l), dtype=reference.accumulation_dtype(c.q.dtype), device=c.q.device)
    return out, lse


def _allocate_grads(c: Canonical) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv laid out as q, k, v."""
    return (empty_like_layout(c.q, tuple(c.q.shape)), empty_like_layout(c.k, tuple(c.k.shape)),
            empty_like_layout(c.v, tuple(c.v.shape)))


def _forward(c: Canonical, cpu_backend: str, kernel_path: str,
             dropout: Dropout | None = None) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) of canonical inputs, in their 4-D form."""
    out, lse = _allocate_forward(c)
    if out.numel() == 0 or c.k.shape[2] == 0:
        out.zero_()
        lse.fill_(-math.inf)
    elif uses_triton(c.q, cpu_backend):
        from dash_inductor.ops import dispatch

        record(dispatch.attention_forward(c.q, c.k, c.v, c.mask, out, lse,
                                          is_causal=c.is_causal, scale=c.scale,
                                          kernel=kernel_path, window=c.window, dropout=dropout))
    else:
        ref_out, ref_lse = reference.attention_forward(c.q, c.k, c.v, c.mask, c.is_causal, c.scale,
                                                       c.window, dropout)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        record(_REFERENCE_FORWARD)
    return out, lse


def _backward(c: Canonical, do4: Tensor, out4: Tensor, lse4: Tensor, schedule: str,
              max_spin: int, cpu_backend: str, kernel_path: str,
              dropout: Dropout | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of canonical inputs, in their 4-D form."""
    grads = _allocate_grads(c)
    if any(g.numel() == 0 for g in grads) or c.q.shape[2] == 0 or c.k.shape[2] == 0:
        for g in grads:
            g.zero_()
    elif uses_triton(c.q, cpu_backend):
        from dash_inductor.ops import dispatch

        record(dispatch.attention_backward(
            do4, c.q, c.k, c.v, out4, lse4, c.mask, *grads, is_causal=c.is_causal, scale=c.scale,
            schedule=schedule, max_spin=max_spin, kernel=kernel_path, window=c.window,
            dropout=dropout))
    else:
        for g, r in zip(grads, reference.attention_backward(do4, c.q, c.k, c.v, out4, lse4, c.mask,
                                                            c.is_causal, c.scale, c.window,
                                                            dropout)):
            g.copy_(r)
        record(Plan("backward", "reference", None, schedule, None, None, ()))
    return grads


def _as_canonical_out(c: Canonical, t: Tensor) -> Tensor:
    """``out`` / ``grad_out`` / ``logsumexp`` as given by the caller, in the 4-D (or 3-D) form."""
    return t.unsqueeze(0) if c.three_d else t


def _grads_to_inputs(c: Canonical, grads, q: Tensor, k: Tensor, v: Tensor):
    dq, dk, dv = grads
    return c.reduce_grad(dq, q), c.reduce_grad(dk, k), c.reduce_grad(dv, v)


_MAX_SPIN = 1 << 26  # the op's default; config.max_spin's default
#: The op's keyword-only arguments after SDPA's: the window, then ``config.CHOICES``.
OPTIONS_SCHEMA = ('int[2] window_size=[-1, -1], str schedule="auto", SymInt max_spin=67108864, '
                  'str cpu_backend="reference", str kernel_path="auto"')
#: SDPA's schema (``aten::scaled_dot_product_attention``): ``scale`` and ``enable_gqa`` are
#: keyword-only there too.
#: Dropout's (seed, offset), drawn by ``dash::dropout_rng`` where dropout_p > 0: positional
#: (a custom op takes no keyword-only tensor), after SDPA's positional arguments.
_RNG_SCHEMA = "Tensor? rng_state=None"
_SDPA_SCHEMA = ("Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, "
                f"bool is_causal=False, {_RNG_SCHEMA}, *, float? scale=None, "
                "bool enable_gqa=False")


def op_options(choices: dict[str, object], window: Sequence[int] = NO_WINDOW) -> dict[str, object]:
    """``config.choices()`` (and a window) as the ops' keyword arguments."""
    return dict(window_size=list(window), schedule=choices["schedule"],
                max_spin=choices["max_spin"], cpu_backend=choices["cpu_backend"],
                kernel_path=choices["kernel"])


@torch.library.custom_op("dash::attention", mutates_args=(),
                         schema=f"({_SDPA_SCHEMA}, {OPTIONS_SCHEMA}) -> (Tensor, Tensor)")
def attention_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, rng_state: Tensor | None = None,
                 *, scale: float | None = None, enable_gqa: bool = False,
                 window_size: Sequence[int] = NO_WINDOW, schedule: str = "auto",
                 max_spin: int = _MAX_SPIN, cpu_backend: str = "reference",
                 kernel_path: str = "auto") -> tuple[Tensor, Tensor]:
    raise NotImplementedError(f"dash.attention has no kernel for device {q.device.type!r}; "
                              f"supported: cpu, cuda")


def _checked(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
             choices, rng_state=None) -> Canonical:
    config.check_choices(choices)
    check_state(check_p(dropout_p), rng_state, q.device)
    return canonicalize(q, k, v, attn_mask, is_causal, scale, enable_gqa, window_size)


@attention_op.register_fake
def _attention_fake(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, rng_state=None, *,
                    scale=None, enable_gqa=False, window_size=NO_WINDOW, schedule="auto",
                    max_spin=_MAX_SPIN, cpu_backend="reference", kernel_path="auto"):
    c = _checked(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                 (schedule, max_spin, cpu_backend, kernel_path), rng_state)
    out, lse = _allocate_forward(c)
    return c.squeeze(out), c.squeeze(lse)


def _attention_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, rng_state=None, *,
                      scale=None, enable_gqa=False, window_size=NO_WINDOW, schedule="auto",
                      max_spin=_MAX_SPIN, cpu_backend="reference", kernel_path="auto"):
    choices = (schedule, max_spin, cpu_backend, kernel_path)
    c = None
    with unfilled():
        if attn_mask is None and dropout_p == 0.0:  # validated at its signature's first call
            flags = (is_causal, scale, enable_gqa, tuple(window_size))
            key = signatures.key(q, k, v, flags, choices)
            signature = signatures.lookup(key)
            if signature is None:
                c = _checked(q, k, v, None, dropout_p, is_causal, scale, enable_gqa,
                             window_size, choices, rng_state)
                signature = signatures.remember(key, c, q, k, v, (flags, choices))
            if signature is not None:
                replayed = signature.replay_forward(q, k, v)
                if replayed is not None:
                    record(signature.forward_plan)
                    return replayed
                out, lse, plan = signature.forward_recorded(q, k, v, kernel_path)
                record(plan)
                return out, lse
        if c is None:  # not validated above (a mask, dropout)
            c = _checked(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         window_size, choices, rng_state)
        out, lse = _forward(c, cpu_backend, kernel_path, _dropout(dropout_p, rng_state))
    return c.squeeze(out), c.squeeze(lse)


@torch.library.custom_op(
    "dash::attention_backward", mutates_args=(),
    schema=("(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor logsumexp, "
            f"Tensor? attn_mask, bool is_causal, float? scale, bool enable_gqa, {_RNG_SCHEMA}, *, "
            f"float dropout_p=0.0, {OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)"))
def attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          logsumexp: Tensor, attn_mask: Tensor | None, is_causal: bool,
                          scale: float | None, enable_gqa: bool,
                          rng_state: Tensor | None = None, *, dropout_p: float = 0.0,
                          window_size: Sequence[int] = NO_WINDOW, schedule: str = "auto",
                          max_spin: int = _MAX_SPIN, cpu_backend: str = "reference",
                          kernel_path: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    raise NotImplementedError(f"dash.attention_backward has no kernel for device "
                              f"{q.device.type!r}; supported: cpu, cuda")


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale,
                             enable_gqa, rng_state=None, *, dropout_p=0.0,
                             window_size=NO_WINDOW, schedule="auto", max_spin=_MAX_SPIN,
                             cpu_backend="reference", kernel_path="auto"):
    c = _checked(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                 (schedule, max_spin, cpu_backend, kernel_path), rng_state)
    grads = _allocate_grads(c)
    return _grads_to_inputs(c, grads, q, k, v)


def _attention_backward_kernel(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale,
                               enable_gqa, rng_state=None, *, dropout_p=0.0,
                               window_size=NO_WINDOW, schedule="auto", max_spin=_MAX_SPIN,
                               cpu_backend="reference", kernel_path="auto"):
    choices = (schedule, max_spin, cpu_backend, kernel_path)
    with unfilled():
        if attn_mask is None and dropout_p == 0.0:  # the forward's signature, validated then
            signature = signatures.lookup(signatures.key(
                q, k, v, (is_causal, scale, enable_gqa, tuple(window_size)), choices))
            if signature is not None:
                grads, plan = (signature.replay_backward(grad_out, q, k, v, out, logsumexp)
                               or signature.backward_recorded(grad_out, q, k, v, out, logsumexp,
                                                              schedule, max_spin, kernel_path))
                record(plan)
                return grads
        c = _checked(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                     choices, rng_state)
        do4, out4, lse4 = (_as_canonical_out(c, t) for t in (grad_out, out, logsumexp))
        grads = _backward(c, do4, out4, lse4, schedule, max_spin, cpu_backend, kernel_path,
                          _dropout(dropout_p, rng_state))
    return _grads_to_inputs(c, grads, q, k, v)


# The kernels are registered below the custom ops' own wrappers, as plain dispatcher kernels: the
# wrappers' per-call checks (output aliasing, a dynamo-disabled frame) cost more host time than a
# repeated call's launches. opcheck still checks the aliasing.
_LIB = torch.library.Library("dash", "FRAGMENT")
for _device in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention_kernel, _device)
    _LIB.impl("attention_backward", _attention_backward_kernel, _device)


@torch.library.custom_op(
    "dash::attention_mask_grad", mutates_args=(),
    schema=("(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor logsumexp, "
            "Tensor attn_mask, float? scale, bool enable_gqa, int[2] window_size=[-1, -1], "
            f"float dropout_p=0.0, {_RNG_SCHEMA}) -> Tensor"))
def attention_mask_grad_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           logsumexp: Tensor, attn_mask: Tensor, scale: float | None,
                           enable_gqa: bool, window_size: Sequence[int] = NO_WINDOW,
                           dropout_p: float = 0.0, rng_state: Tensor | None = None) -> Tensor:
    """Gradient of an additive float mask (a learned bias), summed over its broadcast dims.

    Runs the blocked reference on every device (deterministic; it materialises (B, H, L, S), which
    the mask itself already is).
    """
    check_state(check_p(dropout_p), rng_state, q.device)
    c = canonicalize(q, k, v, attn_mask, False, scale, enable_gqa, window_size)
    do4, out4, lse4 = (_as_canonical_out(c, t) for t in (grad_out, out, logsumexp))
    grad = reference.attention_mask_grad(do4, c.q, c.k, c.v, out4, lse4, c.mask, c.is_causal,
                                         c.scale, c.window, _dropout(dropout_p, rng_state))
    return c.reduce_grad(grad, attn_mask).to(attn_mask.dtype)


@attention_mask_grad_op.register_fake
def _attention_mask_grad_fake(grad_out, q, k, v, out, logsumexp, attn_mask, scale, enable_gqa,
                              window_size=NO_WINDOW, dropout_p=0.0, rng_state=None):
    canonicalize(q, k, v, attn_mask, False, scale, enable_gqa, window_size)
    return torch.empty(attn_mask.shape, dtype=attn_mask.dtype, device=attn_mask.device)


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    q, k, v, attn_mask, dropout_p, is_causal, rng_state = inputs
    options = dict(keyword_only_inputs)
    check_schedule_allowed(options["schedule"])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    # The dropout mask is recomputed from the saved (seed, offset), never stored.
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng_state)
    ctx.is_causal, ctx.scale, ctx.enable_gqa = is_causal, options.pop("scale"), options.pop(
        "enable_gqa")
    ctx.options, ctx.dropout_p = options, dropout_p


def _op_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, attn_mask, rng_state = ctx.saved_tensors
    dropout = dict(dropout_p=ctx.dropout_p, rng_state=rng_state)
    dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, attn_mask, ctx.is_causal,
                                       ctx.scale, ctx.enable_gqa, **ctx.options, **dropout)
    dmask = None
    if attn_mask is not None and ctx.needs_input_grad[3]:
        dmask = attention_mask_grad_op(grad_out, q, k, v, out, lse, attn_mask, ctx.scale,
                                       ctx.enable_gqa, ctx.options["window_size"], **dropout)
    return dq, dk, dv, dmask, None, None, None


attention_op.register_autograd(_op_backward, setup_context=_setup_context)


def forbid_double_backward(op, name: str) -> None:
    """Give a backward op an autograd formula that raises a clear error: its kernels have no
    derivative of their own, and PyTorch's generic "no autograd formula" message names none of
    what a user can do instead."""

    def refuse(ctx, *grads):
        raise RuntimeError(
            f"{name} has no double backward (a gradient of its gradients, e.g. after "
            f"torch.autograd.grad(..., create_graph=True)): its backward is a deterministic kernel "
            f"without a derivative. For higher-order gradients use "
            f"torch.nn.functional.scaled_dot_product_attention's math backend.")

    op.register_autograd(refuse, setup_context=lambda ctx, inputs, output, **_: None)


forbid_double_backward(attention_backward_op, "dash.attention")
forbid_double_backward(attention_mask_grad_op, "dash.attention (its mask gradient)")


def unsupported_reason(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> str | None:
    """Why ``dash::attention`` cannot take this SDPA call (None when it can). Works on fake tensors."""
    try:
        check_p(dropout_p)
    except ValueError as error:
        return str(error)
    if not all(isinstance(t, Tensor) for t in (query, key, value)):
        return "query, key and value must be tensors"
    if query.device.type not in ("cpu", "cuda"):
        return f"device {query.device.type!r} is not supported (cpu, cuda)"
    try:
        canonicalize(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    except ValueError as error:
        return str(error)
    return None


native_kernels.register(attention_op, _attention_kernel, attention_backward_op,
                        _attention_backward_kernel)
