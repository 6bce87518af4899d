"""GPU tests of attention dropout in the Hopper kernels: the mask each draws is
``shared/dropout.py``'s bit for bit, the outputs and gradients meet FlashAttention's accuracy rule
against a reference that applies that mask, and their bits repeat.

Only a GPU runs the Gluon kernels; the CPU tests (tests/test_dropout.py) check the mask's formula
on the portable kernels in the interpreter.
"""

import pytest
import torch

from dash_inductor.library.dropout import keep_mask
from dash_inductor.ops import attention_backward, attention_forward, cache_clear
from dash_inductor.ops.catalog import DETERMINISTIC
from dash_inductor.ops.hopper import config as hopper_config
from dash_inductor.ops.shared.dropout import Dropout
from dash_inductor.testing import assert_flash_rule

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the Hopper kernels need an sm90 GPU")]

P = 0.2
# Both 32-bit words of the seed and of the counter in use.
STATE = (0x1234_5678_9ABC_DEF0 >> 1, (1 << 62) - 7)


def _dropout(p=P):
    return Dropout(p, torch.tensor(STATE, dtype=torch.int64, device="cuda"))


def _inputs(batch, hq, hkv, seq, dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, hq, seq, dim), (batch, hkv, seq, dim), (batch, hkv, seq, dim),
              (batch, hq, seq, dim))
    return tuple(torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for s in shapes)


def _run(q, k, v, do, causal, schedule, forward_kernel, backward_kernel, p=P):
    """(out, dq, dk, dv) and the two plans of a forward and backward with dropout."""
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(do)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    plans = [attention_forward(q, k, v, None, out, lse, is_causal=causal, scale=scale,
                               kernel=forward_kernel, dropout=_dropout(p))]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    plans.append(attention_backward(do, q, k, v, out, lse, None, dq, dk, dv, is_causal=causal,
                                    scale=scale, schedule=schedule, kernel=backward_kernel,
                                    dropout=_dropout(p)))
    return (out, dq, dk, dv), [plan.kernel for plan in plans]


def _ours(q, k, v, do, causal, schedule, kernel="hopper", p=P):
    """Forward and backward with dropout on ``kernel``."""
    grads, kernels = _run(q, k, v, do, causal, schedule, kernel, kernel, p)
    assert kernels == [kernel, kernel]
    return grads


def _reference(q, k, v, do, causal, dtype):
    """(out, dq, dk, dv) of softmax(q k^T * scale) with the keep mask applied, scaled by
    1 / (1 - p), times v, computed in ``dtype`` by autograd."""
    keep = keep_mask(_dropout().rng, P, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    scores = leaves[0] @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device="cuda").triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs * keep / (1 - P)) @ vv
    out.backward(do.to(dtype))
    return (out.detach(), *(t.grad for t in leaves))


SHAPES = [(2, 8, 8, 1024, 64), (1, 16, 16, 2048, 128), (2, 8, 2, 1000, 128)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_hopper_kernels_with_dropout_follow_the_flash_rule(shape, causal):
    q, k, v, do = _inputs(*shape)
    ref = _reference(q, k, v, do, causal, torch.float32)
    same = _reference(q, k, v, do, causal, torch.bfloat16)
    for schedule in DETERMINISTIC:
        assert_flash_rule(_ours(q, k, v, do, causal, schedule), same, ref, what=schedule)


def _identity_problem(n, seed):
    """q = 0 makes P uniform (1 / S). With S = D keys and v the identity, out = keep / (S (1 -
    p)); with an identity grad_out (L = D queries), dV = (keep / (S (1 - p)))^T: an element is
    zero exactly where the mask dropped it, in the forward and in the backward. (q, k, the
    identity, P's keep mask) of n queries and keys, head dim n."""
    batch, heads = 2, 4
    q = torch.zeros(batch, heads, n, n, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, heads, n, n, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(seed))
    eye = torch.eye(n, device="cuda", dtype=torch.bfloat16).expand_as(q).contiguous()
    return q, k, eye, keep_mask(_dropout().rng, P, (batch, heads, n, n))


def _assert_drops(q, k, eye, keep, kernel):
    out, _, _, dv = _ours(q, k, eye, eye, False, "descending", kernel)
    assert torch.equal(out != 0, keep), kernel
    assert torch.equal(dv != 0, keep.transpose(-1, -2)), kernel


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_hopper_kernels_drop_the_portable_mask(head_dim):
    """Both kernel families drop exactly the reference mask (``_identity_problem``)."""
    q, k, eye, keep = _identity_problem(head_dim, seed=1)
    for kernel in ("portable", "hopper"):
        _assert_drops(q, k, eye, keep, kernel)


def test_a_first_threshold_of_one_leaves_later_calls_their_own():
    """A plan binds its kernels at its first call: a first p of at most 2**-16 (threshold 1, which
    Triton would make a constant of the binary) leaves a later p on the same plans its own mask."""
    q, k, eye, keep = _identity_problem(64, seed=2)
    for kernel in ("portable", "hopper"):
        cache_clear()
        _ours(q, k, eye, eye, False, "descending", kernel, p=2.0 ** -17)
        _assert_drops(q, k, eye, keep, kernel)


@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_the_hopper_kernels_with_dropout_repeat_their_bits(schedule):
    q, k, v, do = _inputs(2, 8, 2, 1536, 128, seed=3)
    first = _ours(q, k, v, do, True, schedule)
    for _ in range(20):
        again = _ours(q, k, v, do, True, schedule)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), schedule


@pytest.mark.parametrize("head_dim, causal", [(128, False), (128, True), (64, False), (64, True)])
def test_auto_with_dropout_runs_the_measured_paths(head_dim, causal):
    """``auto`` with dropout: the Hopper forward unmasked where it takes that length, else the
    portable one; the Hopper backward (the portable one at head dim 64 causal); with the bits of
    those kernels named."""
    seq = 2048
    q, k, v, do = _inputs(1, 8, 8, seq, head_dim, seed=5)
    hopper_forward = not causal and seq >= hopper_config.FORWARD_MIN_SEQ[head_dim]
    forward = "hopper" if hopper_forward else "portable"
    backward = "portable" if head_dim == 64 and causal else "hopper"
    auto, kernels = _run(q, k, v, do, causal, "auto", "auto", "auto")
    assert kernels == [forward, backward]
    named, _ = _run(q, k, v, do, causal, "auto", forward, backward)
    assert all(torch.equal(a, b) for a, b in zip(auto, named))
