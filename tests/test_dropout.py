"""Attention dropout: the keep mask, its statistics, its gradients and its reproducibility.

On a machine without CUDA the ``tl`` kernels run in the Triton interpreter, one program after
another: these tests check the mask's formula, that every kernel and schedule draws the same
bits, and the order of every sum, not races (the GPU tests do that). The mask is observed
exactly through an identity ``v`` (the forward's output is P * keep / (1 - p)) and an identity
``grad_out`` (dV is (P * keep)^T / (1 - p)): an element is zero exactly where it was dropped.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import dash_inductor  # noqa: E402
from dash_inductor import config  # noqa: E402
from dash_inductor.library import reference  # noqa: E402
from dash_inductor.library.dropout import keep_mask, philox  # noqa: E402
from dash_inductor.ops import attention_backward, attention_forward, rules  # noqa: E402
from dash_inductor.ops.catalog import NAMES  # noqa: E402
from dash_inductor.ops.portable.configs import ForwardConfig  # noqa: E402
from dash_inductor.ops.shared.dropout import Dropout, kernel_args, keep, load_state  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
# A state with both 32-bit words of the seed and of the counter in use.
STATE = torch.tensor([0x1234_5678_9ABC_DEF0 >> 1, (1 << 62) - 7], dtype=torch.int64)


def _state(device=DEVICE):
    return STATE.to(device)


@triton.jit
def _keep_kernel(RNG, OUT, threshold, L, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seed, offset = load_state(RNG, True)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kept = keep(seed, offset, threshold, bh, pid_m * BLOCK_M, pid_n * BLOCK_N, L, S, BLOCK_M,
                BLOCK_N)
    tl.store(OUT + bh * L * S + rows[:, None] * S + cols[None, :], kept.to(tl.int8),
             mask=(rows[:, None] < L) & (cols[None, :] < S))


def test_philox_matches_the_papers_known_answer():
    """Random123's known-answer vector of Philox4x32-10 for key 0 and counter 0."""
    words = philox(torch.tensor(0), torch.tensor(0))
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
@pytest.mark.parametrize("tile", [(16, 16), (32, 64)])
def test_reference_mask_is_the_kernels_mask_bit_for_bit(p, tile):
    """The PyTorch Philox gives the same bits as Triton's ``tl.randint4x``, for any tiling."""
    shape = (2, 3, 37, 45)
    rng = _state()
    out = torch.zeros(shape[0] * shape[1], *shape[2:], dtype=torch.int8, device=DEVICE)
    args = kernel_args(Dropout(p, rng), rng)
    grid = (triton.cdiv(shape[2], tile[0]), triton.cdiv(shape[3], tile[1]), shape[0] * shape[1])
    _keep_kernel[grid](rng, out, args[1], shape[2], shape[3], BLOCK_M=tile[0], BLOCK_N=tile[1])
    assert torch.equal(out.view(shape).bool(), keep_mask(rng, p, shape))


def test_each_element_takes_the_half_its_coordinates_name():
    """``ops/shared/dropout.py``'s definition element by element, from the formula alone: the
    call's counter, the output 2 q3 + k3 and the half q % 2, at random coordinates."""
    shape, p = (2, 3, 37, 45), 0.5
    batch, heads, n_rows, keys = shape
    mask = keep_mask(_state("cpu"), p, shape)
    seed, offset = (int(x) for x in STATE)
    coords = torch.stack([torch.randint(0, n, (64,)) for n in shape], dim=1).tolist()
    for b, h, q, k in coords:
        call = ((b * heads + h) * 4 * math.ceil(n_rows / 16) + 4 * (q // 16) + (q % 8) // 2) \
            * 8 * math.ceil(keys / 16) + 8 * (k // 16) + k % 8
        word = int(philox(torch.tensor(seed), torch.tensor(offset + call))[
            2 * (q // 8 % 2) + k // 8 % 2])
        half = word >> 16 if q % 2 else word & 0xFFFF
        assert bool(mask[b, h, q, k]) == (half >= math.ceil(p * 65536)), (b, h, q, k)


def test_a_tile_that_splits_a_block_of_16_is_refused():
    """A call covers a 16 x 16 block: a kernel tile must hold whole blocks."""
    rng = _state()
    out = torch.zeros(1, 16, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(Exception, match="spans 16s"):
        _keep_kernel[(2, 1, 1)](rng, out, 0, 16, 16, BLOCK_M=8, BLOCK_N=16)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_within_four_standard_errors(p):
    mask = keep_mask(_state("cpu"), p, (4, 4, 64, 64))
    n = mask.numel()
    assert abs(mask.double().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("rows", [slice(0, 8), slice(5, 30), slice(33, 37), slice(36, 37)])
def test_keep_mask_of_some_rows_is_those_rows_of_the_whole_mask(rows):
    """The reference draws a query block's rows alone, from any row (not only a Philox call's
    first), and gets the whole mask's bits."""
    shape, cols = (2, 3, 37, 45), slice(7, 40)
    whole = keep_mask(_state("cpu"), 0.3, shape)
    assert torch.equal(keep_mask(_state("cpu"), 0.3, shape, cols, rows), whole[:, :, rows, cols])


def test_keep_mask_depends_on_every_coordinate_and_state():
    """Neighbouring rows (one Philox call), columns, heads and batches, and a new seed or offset,
    each get masks that agree only about as often as independent ones would (half, at p = 0.5)."""
    shape = (2, 2, 16, 64)
    mask = keep_mask(_state("cpu"), 0.5, shape)
    pairs = [(mask[:, :, 0::2], mask[:, :, 1::2]), (mask[..., 0::2], mask[..., 1::2]),
             (mask[:, 0], mask[:, 1]), (mask[0], mask[1])]
    for delta in ([1, 0], [0, 1]):
        other = keep_mask(_state("cpu") + torch.tensor(delta), 0.5, shape)
        pairs.append((mask, other))
    for a, b in pairs:
        assert 0.35 < (a == b).double().mean().item() < 0.65


def _identity_problem(batch=2, heads=2, seq_q=37, seq_k=45, e=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq_q, e, generator=gen).to(DEVICE)
    k = torch.randn(batch, heads, seq_k, e, generator=gen).to(DEVICE)
    v = torch.eye(seq_k).expand(batch, heads, seq_k, seq_k).contiguous().to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("block", [(16, 16), (32, 32), (64, 16)])
def test_forward_drops_the_reference_mask_under_any_tiling(block):
    q, k, v = _identity_problem()
    rng = _state()
    out = torch.empty(*q.shape[:3], v.shape[3], device=DEVICE)
    lse = torch.empty(q.shape[:3], device=DEVICE)
    attention_forward(q, k, v, None, out, lse, is_causal=False, scale=0.25,
                      dropout=Dropout(0.4, rng), config=ForwardConfig(*block, 4, 1))
    assert torch.equal(out != 0, keep_mask(rng, 0.4, (*q.shape[:3], k.shape[2])))


@pytest.mark.parametrize("schedule", NAMES)
def test_every_backward_schedule_drops_the_reference_mask(schedule):
    """dV = scale * (P * keep)^T dO with dO = I shows the main kernel's mask; dQ (the recompute
    schedule's own kernel included) must match the float64 reference that applies that mask."""
    q, k, _ = _identity_problem(seq_q=40, seq_k=40)
    v = torch.randn(2, 2, 40, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grad_out = torch.eye(40).expand(2, 2, 40, 40).contiguous().to(DEVICE)
    dropout = Dropout(0.3, _state())
    out, lse = torch.empty_like(grad_out), torch.empty(q.shape[:3], device=DEVICE)
    attention_forward(q, k, v, None, out, lse, is_causal=True, scale=0.25, dropout=dropout)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    attention_backward(grad_out, q, k, v, out, lse, None, dq, dk, dv, is_causal=True,
                       scale=0.25, schedule=schedule, dropout=dropout)
    causal = torch.ones(40, 40, dtype=torch.bool, device=DEVICE).tril()
    kept = keep_mask(dropout.rng, 0.3, grad_out.shape) & causal
    assert torch.equal((dv != 0).transpose(-1, -2), kept)
    ref = _explicit_grads(q, k, v, grad_out, dropout, is_causal=True, scale=0.25)
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


def _explicit_grads(q, k, v, grad_out, dropout, *, is_causal=False, scale=None, mask=None):
    """Gradients in float64 of softmax(q k^T * scale + mask) * keep / (1 - p) @ v, by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    s = q64 @ kk.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                          -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    kept = keep_mask(dropout.rng, dropout.p, s.shape)
    out = (torch.softmax(s, dim=-1) * kept / (1 - dropout.p)) @ vv
    return torch.autograd.grad(out, (q64, k64, v64), grad_out.double())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", ["plain", "causal_gqa", "bool_mask"])
def test_op_gradients_match_a_float64_reference_with_the_same_mask(backend, case):
    gen = torch.Generator().manual_seed(2)
    hkv = 1 if case == "causal_gqa" else 2
    q = torch.randn(2, 2, 21, 16, generator=gen)
    k, v = (torch.randn(2, hkv, 33, 16, generator=gen) for _ in range(2))
    grad_out = torch.randn(2, 2, 21, 16, generator=gen)
    mask = torch.rand(2, 1, 21, 33, generator=gen) > 0.3 if case == "bool_mask" else None
    kwargs = dict(is_causal=case == "causal_gqa", enable_gqa=hkv == 1)
    rng = _state("cpu")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.ops.dash.attention(*inputs, mask, 0.2, kwargs["is_causal"], rng,
                                   enable_gqa=kwargs["enable_gqa"], cpu_backend=backend)[0]
    grads = torch.autograd.grad(out, inputs, grad_out)
    want = _explicit_grads(q, k, v, grad_out, Dropout(0.2, rng), is_causal=kwargs["is_causal"],
                           mask=None if mask is None else mask.expand(2, 2, 21, 33))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_reference_blocks_draw_their_part_of_the_mask():
    """Causal GQA over several query blocks: each block draws its own rows and keys of the mask."""
    gen = torch.Generator().manual_seed(8)
    rows = 2 * reference.BLOCK_M + 7
    q = torch.randn(1, 4, rows, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, rows, 16, generator=gen, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, 4, rows, 16, generator=gen)
    rng = _state("cpu")
    out = torch.ops.dash.attention(q, k, v, None, 0.2, True, rng, enable_gqa=True)[0]
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want = _explicit_grads(q, k, v, grad_out, Dropout(0.2, rng), is_causal=True)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_a_float_mask_gets_its_gradient_through_the_same_mask():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 2, 12, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    rng = _state("cpu")
    out = torch.ops.dash.attention(q, k, v, bias, 0.3, False, rng)[0]
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + bias
    want = (torch.softmax(s, -1) * keep_mask(rng, 0.3, s.shape) / 0.7) @ v
    torch.testing.assert_close(out, want)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (got,), (ref,) = (torch.autograd.grad(o, bias, grad_out) for o in (out, want))
    torch.testing.assert_close(got, ref)


def test_output_is_unbiased():
    """E[out] = out at p = 0: a batch of copies of one problem draws independent masks."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 8, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    draws = 2000
    copies = [t.expand(draws, 1, 8, 8) for t in (q, k, v)]
    out = torch.ops.dash.attention(*copies, None, 0.5, False, _state("cpu"))[0]
    exact = torch.ops.dash.attention(q, k, v)[0]
    standard_error = out.std(dim=0) / math.sqrt(draws)
    z = (out.mean(dim=0) - exact[0]) / standard_error
    assert z.abs().max().item() < 5


# The interpreter is slow: it runs one layout, a model's.
@pytest.mark.parametrize("backend, layout", [("reference", "bhld"), ("reference", "blhd"),
                                             ("triton", "blhd")])
def test_a_sample_gets_the_same_bits_alone_or_in_a_larger_batch(backend, layout):
    """The mask depends on the sample's index, not on the batch size, and the bits on neither:
    the first samples of a batch give the bits they give on their own. "blhd" is a model's
    (B, L, H, D) projections seen as (B, H, L, D): a batch of one of them is a different
    strided tensor, which the reference once multiplied without a copy, and at some sizes (L = 8
    here, not 30) PyTorch's CPU product then rounded differently."""
    gen = torch.Generator().manual_seed(5)
    for seq in (8, 30):
        q, k, v, grad_out = (torch.randn(3, seq, 2, 16, generator=gen).transpose(1, 2)
                             for _ in range(4))
        if layout == "bhld":
            q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
        results = []
        for batch in (3, 2, 1):
            inputs = [t[:batch].detach().requires_grad_() for t in (q, k, v)]
            out = torch.ops.dash.attention(*inputs, None, 0.3, True, _state("cpu"),
                                           cpu_backend=backend)[0]
            results.append((out, *torch.autograd.grad(out, inputs, grad_out[:batch])))
        for whole, *parts in zip(*results):
            assert all(torch.equal(whole[:len(part)], part) for part in parts), seq


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_manual_seed_reproduces_a_run_and_each_call_draws_anew(backend):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen, requires_grad=True) for _ in range(3))
    runs = []
    with config.patch(cpu_backend=backend):
        for _ in range(2):
            torch.manual_seed(7)
            first = dash_inductor.attention(q, k, v, dropout_p=0.3)
            second = dash_inductor.attention(q, k, v, dropout_p=0.3)
            runs.append((first, second, *torch.autograd.grad((first + second).sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][0], runs[0][1])


def test_activation_checkpointing_redraws_the_same_state():
    """Checkpointing reruns the forward in the backward under the saved generator state."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(3))
    results = []
    for wrap in (lambda f, *a: f(*a), lambda f, *a: checkpoint(f, *a, use_reentrant=False)):
        torch.manual_seed(10)
        out = wrap(lambda *a: dash_inductor.attention(*a, dropout_p=0.4), q, k, v)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_no_dropout_draws_nothing_and_passes_no_state():
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    before = torch.get_rng_state()
    dash_inductor.attention(q, k, v, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), before)
    assert kernel_args(None, q) == (q, 0, 1.0)


def test_compiled_sdpa_with_dropout_runs_dash_with_eagers_bits():
    """The rewrite draws the state with the op eager calls draw it with: same seed, same bits."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen, requires_grad=True) for _ in range(3))

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25,
                                                                is_causal=True)

    with config.patch(rewrite="always"):
        (site,) = dash_inductor.explain(sdpa, q, k, v)
        torch.manual_seed(9)
        compiled = torch.compile(sdpa)(q, k, v)
    assert site.rewritten, site.reason
    torch.manual_seed(9)
    eager = dash_inductor.attention(q, k, v, dropout_p=0.25, is_causal=True)
    assert torch.equal(compiled, eager)


def test_the_hopper_forward_takes_dropout_on_two_warpgroups():
    """Both Hopper kernels draw the mask (the GPU tests check it against this file's); the
    forward's mask needs the registers of two softmax warpgroups, at head dim 64 too, and leaves
    none for a second P (the softmax does not run under P V)."""
    from dash_inductor.ops.hopper import config as hopper_config

    for head_dim in hopper_config.HEAD_DIMS:
        cfg = hopper_config.forward_config(head_dim, dropout=True)
        assert cfg == hopper_config.HopperForwardConfig(softmax_under_pv=False)
        assert hopper_config.forward_constexprs(True, 1, cfg, dropout=True)["DROPOUT"]
        assert not hopper_config.forward_constexprs(True, 1, cfg)["DROPOUT"]
    assert hopper_config.forward_config(64) == hopper_config.THREE_WARPGROUPS


def _sm90_signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    floats = ("qk_scale", "sm_scale", "drop_scale")
    return {name: "constexpr" if name in constexprs else pointers.get(name) or (
            "fp32" if name in floats else "i32") for name in kernel.arg_names}


_SM90_CASES = {
    "forward": ("forward", "_attention_forward_kernel", dict(
        GROUP=1, E=64, EV=64, HEAD_E=64, HEAD_EV=64, BLOCK_M=128, BLOCK_N=64, EVEN_M=True,
        CAUSAL=True, MASK_KIND=0, WINDOW=False, VARLEN=False, PRECISION="tf32")),
    "backward": ("backward", "_backward_main_kernel", dict(
        GROUP=1, E=128, EV=128, HEAD_E=128, HEAD_EV=128, BLOCK_M=64, BLOCK_N=128, CAUSAL=False,
        MASK_KIND=0, EVEN_L=True, EVEN_S=True, WINDOW=False, VARLEN=False, SCHEDULE=0,
        NUM_SLOTS=1, ORDERED=True, COMPUTE_DQ=True, ORDERED_WAITS=True, PRECISION="tf32")),
    "dq_pass": ("dq_pass", "_backward_dq_kernel", dict(
        GROUP=1, E=128, EV=128, HEAD_E=128, HEAD_EV=128, BLOCK_M=64, BLOCK_N=64, EVEN_M=True,
        CAUSAL=True, MASK_KIND=0, WINDOW=False, VARLEN=False, PRECISION="tf32")),
}


def _compile_sm90(name: str) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel_name, constexprs = _SM90_CASES[name]
    package = "dash_inductor.ops.shared." if module == "dq_pass" else "dash_inductor.ops.portable."
    kernel = getattr(importlib.import_module(package + module), kernel_name)
    constexprs = dict(constexprs, DROPOUT=True)
    pointers = {n: "*bf16" for n in ("Q", "K", "V", "DO", "MASK", "OUT", "DK", "DV", "DQ")}
    pointers.update(LSE="*fp32", DELTA="*fp32", DQACC="*fp32", RNG="*i64", TICKETS="*i32",
                    ERR="*i32", WORK_COUNTER="*i32", CU_Q="*i32", CU_K="*i32")
    source = ASTSource(fn=kernel, signature=_sm90_signature(kernel, pointers, constexprs),
                       constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8 if name != "dq_pass" else 4))
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("name", list(_SM90_CASES))
def test_dropout_kernels_compile_for_sm90(name):
    """The interpreter never lowers the mask's join/reshape/trans: compile each kernel with
    dropout for capability 90 down to a cubin, in a process without the interpreter (as
    tests/test_hopper_compile.py does for the Gluon kernels)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_dropout; "
            f"test_dropout._compile_sm90({name!r})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
