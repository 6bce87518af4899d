"""GPU tests of dash.varlen_attention on both CUDA paths, each one launch per pass that reads the
offsets on the device: ``kernel="auto"`` (the portable packed forward, the Hopper packed backward
for the ordered schedules) and ``kernel="hopper"`` (the Hopper packed forward and backward; every
test here runs each, but the Hopper forward takes no window): FlashAttention's accuracy rule
against a float32 reference, 100 bitwise repeats per deterministic schedule, packing invariance,
no host synchronisation and the device check of the offsets raising asynchronously. bf16,
documents of 512 to 8192 tokens packed to 16k. Then small packings of the Hopper packed forward
alone: against float64, at both head dims, with GQA, sequences without queries or keys and causal
rows that see no key, and a sequence's bits beside any neighbour, one full of NaN included.

Only a GPU runs the programs concurrently, so only here are the ordered dQ waits of packed
sequences really exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dash_inductor import config
from dash_inductor.ops.catalog import DETERMINISTIC, ORDERED
from dash_inductor.ops.shared.errors import check_spin_flags
from dash_inductor.testing import assert_flash_rule, low_precision_math_sdpa
from dash_inductor.library.varlen import AuxRequest, varlen_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, DIM = 8, 2, 128


@pytest.fixture(params=["auto", "hopper"], autouse=True)
def cuda_path(request, monkeypatch):
    """Every test runs on both CUDA paths of varlen_attention (``config.kernel``)."""
    monkeypatch.setattr(config, "kernel", request.param)
    return request.param


def _skip_window(cuda_path, window):
    if cuda_path == "hopper" and window not in ((-1, -1), (-1, 0)):
        pytest.skip("the Hopper forward takes no sliding window (kernel='hopper' refuses it)")


def _once(cuda_path, path):
    if cuda_path != path:
        pytest.skip(f"names its kernel path: runs once, under cuda_path {path!r}")

# (query lengths, key lengths): self-attention documents packed to 16k, and cross packings with
# more keys than queries and the reverse (bottom-right alignment), with empty sequences.
PACKINGS = {
    "documents_16k": ([8192, 512, 3000, 1537, 3143],) * 2,
    "cross": ([512, 1000, 0, 2048, 777, 64], [1024, 1000, 300, 4096, 300, 0]),
}
MASKS = {"full": (-1, -1), "causal": (-1, 0), "causal_window_1k": (1024, 0),
         "window_300_200": (300, 200)}


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _inputs(lens_q, lens_k, seed=0, dim=DIM, heads=(HQ, HKV)):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    (tq, tk), (hq, hkv) = (sum(lens_q), sum(lens_k)), heads
    return tuple(torch.randn(t, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for t, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))


def _ours(q, k, v, do, lens_q, lens_k, window, schedule, max_q=None, max_k=None, kernel=None):
    """(out, lse, dq, dk, dv) of varlen_attention; ``kernel`` None: the test's cuda_path."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with config.patch(schedule=schedule, kernel=kernel or config.kernel):
        out, lse = varlen_attention(q, k, v, _offsets(lens_q), _offsets(lens_k),
                                    max_q or max(lens_q), max_k or max(lens_k),
                                    return_aux=AuxRequest(lse=True), window_size=window,
                                    enable_gqa=True)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _keep(lq: int, lk: int, window: tuple[int, int]) -> torch.Tensor:
    """FlashAttention's window of one sequence, aligned bottom-right."""
    i = torch.arange(lq, device="cuda")[:, None] + (lk - lq)
    j = torch.arange(lk, device="cuda")[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device="cuda")
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    return keep


def _sdpa(q, k, v, do, lens_q, lens_k, window, dtype):
    """(out, dq, dk, dv) of SDPA's math backend in ``dtype``, sequence by sequence; bf16 is
    computed in bf16, as FlashAttention's reference is."""
    with low_precision_math_sdpa():
        return _sdpa_sequences(q, k, v, do, lens_q, lens_k, window, dtype)


def _sdpa_sequences(q, k, v, do, lens_q, lens_k, window, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        if lk == 0:
            outs.append(q[q0:q0 + lq] * 0)
        elif lq:
            qs, ks, vs = (t[a:a + n].transpose(0, 1) for t, a, n in ((q, q0, lq), (k, k0, lk),
                                                                     (v, k0, lk)))
            keep = _keep(lq, lk, window)
            with sdpa_kernel(SDPBackend.MATH):  # a row that sees no key gets 0, as in dash
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    out = torch.cat(outs)
    out.backward(do.to(dtype))
    return out.detach(), *(t.grad if t.grad is not None else torch.zeros_like(t) for t in (q, k, v))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("packing", PACKINGS)
def test_flash_rule_every_schedule(packing, mask, cuda_path):
    _skip_window(cuda_path, MASKS[mask])
    lens_q, lens_k = PACKINGS[packing]
    q, k, v, do = _inputs(lens_q, lens_k)
    ref = _sdpa(q, k, v, do, lens_q, lens_k, MASKS[mask], torch.float32)
    same = _sdpa(q, k, v, do, lens_q, lens_k, MASKS[mask], torch.bfloat16)
    for schedule in (*DETERMINISTIC, "atomic"):
        ours = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
        assert_flash_rule((ours[0], *ours[2:]), same, ref, what=f"{packing} {mask} {schedule}")


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("mask", ["causal", "causal_window_1k", "full"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_bitwise_equal_over_100_repeats(packing, mask, schedule, cuda_path):
    _skip_window(cuda_path, MASKS[mask])
    lens_q, lens_k = PACKINGS[packing]
    q, k, v, do = _inputs(lens_q, lens_k, seed=1)
    first = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
    for _ in range(100):
        again = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("schedule", DETERMINISTIC)
@pytest.mark.parametrize("mask", ["causal", "window_300_200"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_packing_invariance(packing, mask, schedule, cuda_path):
    """Each sequence's output, logsumexp and gradients: the same bits packed and alone."""
    _skip_window(cuda_path, MASKS[mask])
    lens_q, lens_k = PACKINGS[packing]
    q, k, v, do = _inputs(lens_q, lens_k, seed=2)
    max_q, max_k = max(lens_q), max(lens_k)
    packed = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        rows, cols = slice(q0, q0 + lq), slice(k0, k0 + lk)
        alone = _ours(q[rows], k[cols], v[cols], do[rows], [lq], [lk], MASKS[mask], schedule,
                      max_q, max_k)
        parts = (packed[0][rows], packed[1][:, rows], packed[2][rows], packed[3][cols],
                 packed[4][cols])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), parts, alone):
            assert torch.equal(a, b), f"sequence ({lq}, {lk}) {name} differs packed and alone"
        q0, k0 = q0 + lq, k0 + lk


@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("schedule", ["shift", "descending", "recompute"])
def test_a_nan_stays_in_its_sequence(schedule, where, cuda_path):
    """A NaN in one sequence reaches that sequence's outputs and gradients only: sequences
    boundaries that are not tile boundaries put neighbours' rows in one tile, which the kernels
    must keep apart (the Hopper kernels zero them in shared memory)."""
    lens = [1000, 700, 1300]
    q, k, v, do = _inputs(lens, lens, seed=3)
    clean = _ours(q, k, v, do, lens, lens, MASKS["causal"], schedule)
    poisoned = dict(q=q, k=k, v=v, do=do)
    poisoned[where] = poisoned[where].clone()
    poisoned[where][1005, 0, 3] = float("nan")
    dirty = _ours(*poisoned.values(), lens, lens, MASKS["causal"], schedule)
    for rows in (slice(0, 1000), slice(1700, 3000)):
        parts = zip(("out", "dq", "dk", "dv"), (clean[0], *clean[2:]), (dirty[0], *dirty[2:]))
        for name, a, b in parts:
            assert torch.equal(a[rows], b[rows]), f"{name} of a neighbour changed"
    assert any(t[1000:1700].isnan().any() for t in (dirty[0], *dirty[2:]))


@pytest.mark.parametrize("mask", ["full", "causal", "window_300_200"])
@pytest.mark.parametrize("schedule", [*DETERMINISTIC, "atomic"])
def test_gradients_are_written_in_full_on_poisoned_memory(schedule, mask, cuda_path,
                                                          poison_allocator):
    """The packed backward allocates its gradients without clearing them (a sequence with keys
    and no queries gets its zero key gradients from the kernels) and the ordered Hopper writer
    stores each row's first dQ partial: on NaN-poisoned memory, with sequences without queries,
    without keys, and with more queries than keys, the gradients are the ones a first call gave,
    and finite."""
    _skip_window(cuda_path, MASKS[mask])
    lens_q, lens_k = PACKINGS["cross"]
    q, k, v, do = _inputs(lens_q, lens_k, seed=5)
    clean = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
    poison_allocator()
    dirty = _ours(q, k, v, do, lens_q, lens_k, MASKS[mask], schedule)
    for name, a, b in zip(("dq", "dk", "dv"), clean[2:], dirty[2:]):
        assert torch.isfinite(b).all(), name
        if schedule == "atomic":  # its dQ sums in any order
            torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2, msg=name)
        else:
            assert torch.equal(a, b), name


def test_a_gradient_whose_head_dim_is_not_contiguous_has_the_same_bits(cuda_path):
    """A query that is a permuted view, its head dim outermost in memory, gets its gradient in
    the same layout (``empty_like``), which the packed kernel's own dQ conversion does not write
    (it writes contiguous rows): the launcher then converts apart, to the same bits."""
    lens = PACKINGS["documents_16k"][0]
    q, k, v, do = _inputs(lens, lens)
    permuted = q.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert permuted.stride(2) != 1 and torch.equal(permuted, q)
    for schedule in ("shift", "auto"):
        base = _ours(q, k, v, do, lens, lens, (-1, 0), schedule)
        other = _ours(permuted, k, v, do, lens, lens, (-1, 0), schedule)
        for a, b in zip(base, other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("schedule", ["shift", "descending", "atomic"])
def test_the_portable_packed_backward_where_hopper_would_run(schedule, cuda_path):
    """``kernel="portable"`` on a GPU where the Hopper kernels would run: the portable packed
    backward (dQ accumulated by its main kernel, then converted by ``ops/shared/dq_convert.py``) meets
    the accuracy rule, and its deterministic schedules repeat their bits."""
    _once(cuda_path, "auto")
    lens_q, lens_k = PACKINGS["cross"]
    q, k, v, do = _inputs(lens_q, lens_k, seed=5)
    window = MASKS["causal"]
    ours = _ours(q, k, v, do, lens_q, lens_k, window, schedule, kernel="portable")
    ref = _sdpa(q, k, v, do, lens_q, lens_k, window, torch.float32)
    same = _sdpa(q, k, v, do, lens_q, lens_k, window, torch.bfloat16)
    assert_flash_rule((ours[0], *ours[2:]), same, ref, what=f"portable {schedule}")
    if schedule != "atomic":
        again = _ours(q, k, v, do, lens_q, lens_k, window, schedule, kernel="portable")
        assert all(torch.equal(a, b) for a, b in zip(ours, again))


@pytest.mark.parametrize("mask", ["causal", "full"])
def test_many_short_sequences_claim_their_items_safely(mask, cuda_path):
    """Over a hundred sequences of 0 to 400 tokens: items of one to four steps, several rounds
    of them per program, so the claimed deal's programs claim often and soon after their
    current item starts, where a claim of the current item's own (sequence, KV head) would wait
    forever (``deal.py``). The spin flags stay clear, every repeat has the same bits, and the
    accuracy rule holds."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 401, (120,), generator=gen).tolist()
    q, k, v, do = _inputs(lens, lens, seed=4)
    first = _ours(q, k, v, do, lens, lens, MASKS[mask], "shift")
    for _ in range(20):
        again = _ours(q, k, v, do, lens, lens, MASKS[mask], "shift")
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    check_spin_flags(wait=True)
    ref = _sdpa(q, k, v, do, lens, lens, MASKS[mask], torch.float32)
    same = _sdpa(q, k, v, do, lens, lens, MASKS[mask], torch.bfloat16)
    assert_flash_rule((first[0], *first[2:]), same, ref, what=f"short sequences {mask}")


@pytest.mark.parametrize("schedule", DETERMINISTIC)
def test_no_host_synchronisation(schedule, cuda_path):
    """Forward and backward on CUDA never wait for the GPU (the offsets stay on the device)."""
    lens = PACKINGS["documents_16k"][0]
    q, k, v, do = _inputs(lens, lens, seed=3)
    cu = _offsets(lens)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        with config.patch(schedule=schedule):
            out = varlen_attention(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0),
                                   enable_gqa=True)
        out.backward(do)

    _without_sync(step)


def _without_sync(step) -> None:
    """Run ``step`` once to compile and allocate, then again with any host sync an error."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("cu_q, max_q, match", [
    ([1, 3, 7], 4, "cu_seq_q must start at 0"),
    ([0, 5, 3, 7], 5, "cu_seq_q must be non-decreasing"),
    ([0, 3, 6], 4, r"cu_seq_q\[-1\] must equal .* Tq=7"),
    ([0, 3, 7], 3, "max_q=3 is smaller than the longest sequence in cu_seq_q"),
])
def test_broken_offsets_raise_asynchronously(cu_q, max_q, match, cuda_path):
    q, k, v = (torch.randn(7, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_k = torch.tensor([0, 3, 7] + [7] * (len(cu_q) - 3), dtype=torch.int32, device="cuda")
    varlen_attention(q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"), cu_k,
                     max_q, 4)
    with pytest.raises(ValueError, match=match):
        check_spin_flags(wait=True)
    good = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    out = varlen_attention(q, k, v, good, good, 4, 4)  # the next call is unaffected
    check_spin_flags(wait=True)
    assert out.isfinite().all()


# Small packings for the Hopper packed forward: a sequence without queries, one without keys, one
# token, more keys than queries, and more queries than keys (causal: its first 200 rows see none).
SMALL = ([300, 0, 129, 64, 1, 517, 300], [300, 45, 0, 200, 1, 517, 100])
HEADS = {"mha": (4, 4), "gqa4": (8, 2)}


def _keyless_rows(lens_q, lens_k, window) -> torch.Tensor:
    """Which packed query rows see no key."""
    return torch.cat([~_keep(lq, lk, window).any(1) for lq, lk in zip(lens_q, lens_k)])


def _lse64(q, k, lens_q, lens_k, window) -> torch.Tensor:
    """The natural-log logsumexp (Hq, Tq) in float64; -inf where a row sees no key."""
    group, scale = q.shape[1] // k.shape[1], q.shape[2] ** -0.5
    rows, q0, k0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        qs = q[q0:q0 + lq].double().transpose(0, 1)
        ks = k[k0:k0 + lk].double().transpose(0, 1).repeat_interleave(group, 0)
        s = (qs @ ks.transpose(1, 2) * scale).masked_fill(~_keep(lq, lk, window), float("-inf"))
        rows.append(torch.logsumexp(s, -1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(rows, 1)


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_packed_forward_meets_the_flash_rule(dim, heads, mask, cuda_path):
    """``kernel="hopper"``, forward and backward, against float64 under every ordered schedule
    and ``auto``: rows that see no key get 0 and an lse of -inf, the others the float64 lse."""
    _once(cuda_path, "hopper")
    lens_q, lens_k = SMALL
    window = MASKS[mask]
    q, k, v, do = _inputs(lens_q, lens_k, seed=11, dim=dim, heads=HEADS[heads])
    ref = _sdpa(q, k, v, do, lens_q, lens_k, window, torch.float64)
    same = _sdpa(q, k, v, do, lens_q, lens_k, window, torch.bfloat16)
    lse_ref = _lse64(q, k, lens_q, lens_k, window).float()
    keyless = _keyless_rows(lens_q, lens_k, window)
    for schedule in ("auto", *ORDERED):
        out, lse, *grads = _ours(q, k, v, do, lens_q, lens_k, window, schedule)
        assert_flash_rule((out, *grads), same, ref, what=f"d{dim} {heads} {mask} {schedule}")
        assert not out[keyless].any() and (lse[:, keyless] == float("-inf")).all()
        torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("dim, heads", [(64, "mha"), (128, "gqa4")])
def test_hopper_packed_sequence_bits_do_not_depend_on_neighbours(dim, heads, mask, cuda_path):
    """Under ``kernel="hopper"`` a sequence's out, lse and gradients are the same bits alone,
    between two neighbours, and between neighbours whose q, k, v and dO are all NaN; its edges
    are no tile edges, so its boxes hold its neighbours' rows."""
    _once(cuda_path, "hopper")
    window, lens_before, lens_after = MASKS[mask], ([77], [130]), ([130], [77])
    neighbours = (_inputs(*lens_before, seed=13, dim=dim, heads=HEADS[heads]),
                  _inputs(*lens_after, seed=14, dim=dim, heads=HEADS[heads]))
    poisoned = tuple(tuple(torch.full_like(t, float("nan")) for t in side) for side in neighbours)
    for lq, lk in ((333, 333), (150, 333), (333, 150)):
        mine = _inputs([lq], [lk], seed=12, dim=dim, heads=HEADS[heads])
        lens_q, lens_k = [77, lq, 130], [130, lk, 77]
        rows, cols = slice(77, 77 + lq), slice(130, 130 + lk)
        for schedule in ("auto", "ascending"):
            alone = _ours(*mine, [lq], [lk], window, schedule, max(lens_q), max(lens_k))
            for before, after in (neighbours, poisoned):
                packed = [torch.cat(parts) for parts in zip(before, mine, after)]
                got = _ours(*packed, lens_q, lens_k, window, schedule)
                parts = (got[0][rows], got[1][:, rows], got[2][rows], got[3][cols], got[4][cols])
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), parts, alone):
                    assert torch.equal(a, b), (f"({lq}, {lk}) {name} {schedule}: differs beside "
                                               f"{'NaN ' if before is poisoned[0] else ''}"
                                               f"neighbours")


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("dim, heads", [(64, "mha"), (128, "gqa4")])
def test_hopper_packed_pass_without_host_sync(dim, heads, mask, cuda_path):
    _once(cuda_path, "hopper")
    lens_q, lens_k = SMALL
    q, k, v, do = _inputs(lens_q, lens_k, seed=15, dim=dim, heads=HEADS[heads])
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        out = varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                               window_size=MASKS[mask], enable_gqa=True)
        out.backward(do)

    _without_sync(step)
