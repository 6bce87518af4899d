"""The Hopper backward's unpadded deal of packed work items (``ops/hopper/deal.py``), on the CPU:
the item counts that the packed preprocess builds (``packed_prep.py``, Triton interpreter) are the
schedule catalog's for each sequence's tiles, so the kernel deals exactly the items of the packed
model's unpadded deal (``packed_schedule.packed_plans(pad=False)``; the kernel itself is checked
on a GPU, tests/gpu)."""

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dash_inductor.model import schedule
from dash_inductor.ops import catalog
from dash_inductor.ops.hopper.dq_tail import CHUNKS, chunk_rows
from dash_inductor.ops.hopper.packed_prep import packed_prepare
from dash_inductor.ops.shared.launch import Launches
from dash_inductor.model.packed_schedule import packed_plans

BLOCK_N = 16


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def item_prefix(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int,
                max_k: int, **options) -> torch.Tensor:
    """The deal's prefix as the packed preprocess writes it (one head of width 16)."""
    out = torch.randn(total_q, 1, 16)
    lse = torch.randn(1, total_q)
    _, _, prefix = packed_prepare(out, out, lse, cu_q, cu_k, total_k, max_q, max_k,
                                  block_m=options["block_n"] // 2, with_prefix=True,
                                  launches=Launches(), **options)
    return prefix


def _tiles_kv(len_q: int, len_k: int, aligned: bool) -> int:
    """KV tiles of a sequence: keys shifted right by L - S when aligned (bottom-right); none
    without keys, all of them without queries (their gradients are written as zeros)."""
    if not len_k:
        return 0
    k_lo = max(len_q - len_k, 0) if aligned else 0
    return -(-(k_lo + len_k) // BLOCK_N)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 90)), min_size=1,
                        max_size=40),
       name=st.sampled_from(catalog.NAMES), mask=st.sampled_from(["none", "causal", "window"]))
@example(lengths=[(0, 30), (40, 40), (17, 0)], name="shift", mask="causal")
def test_prefix_counts_each_sequences_items(lengths, name, mask):
    causal, aligned = mask == "causal", mask != "none"
    lens_q, lens_k = [q for q, _ in lengths], [k for _, k in lengths]
    prefix = item_prefix(_offsets(lens_q), _offsets(lens_k), sum(lens_q), sum(lens_k),
                         max(lens_q), max(lens_k), block_n=BLOCK_N, aligned=aligned,
                         causal=causal, schedule=catalog.get(name))
    tiles = [_tiles_kv(q, k, aligned) for q, k in lengths]
    order = sorted(range(len(lengths)), key=lambda b: -tiles[b])  # most tiles first, stable
    items = [catalog.items_per_head(tiles[b], causal, name) if tiles[b] else 0 for b in order]
    assert prefix.tolist() == [0, *itertools.accumulate(items), *order]


def test_prefix_over_more_sequences_than_one_block():
    """Past the sequences one block sorts (``deal.MAX_SORTED``) the deal keeps the offsets'
    order, and the kernel carries its sum from block to block."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 70, (2500,), generator=gen).tolist()
    prefix = item_prefix(_offsets(lens), _offsets(lens), sum(lens), sum(lens), max(lens),
                         max(lens), block_n=BLOCK_N, aligned=True, causal=True,
                         schedule=catalog.get("shift"))
    items = [catalog.items_per_head(-(-n // BLOCK_N), True, "shift") if n else 0 for n in lens]
    assert prefix.tolist() == [0, *itertools.accumulate(items), *range(len(lens))]


@pytest.mark.parametrize("causal", [False, True])
def test_the_prefix_deals_the_models_unpadded_items(causal):
    """Work index w of the kernel's unpadded deal, decoded from the prefix as the kernel does
    (``walk.work_head``: the last place j with prefix[j] * heads <= w, and the sequence at
    place j), gives every program the steps of the model's unpadded deal."""
    lens, heads, programs = [80, 0, 33, 16, 1, 47], 3, 7
    prefix = item_prefix(_offsets(lens), _offsets(lens), sum(lens), sum(lens), max(lens),
                         max(lens), block_n=BLOCK_N, aligned=causal, causal=causal,
                         schedule=catalog.get("shift")).tolist()
    count_of, order = prefix[:len(lens) + 1], prefix[len(lens) + 1:]
    assert order == [0, 2, 5, 3, 4, 1]  # most tiles first (5, 3, 3, 1, 1, 0), ties by offset
    tiles = [-(-n // BLOCK_N) for n in lens]
    plans: list[list[schedule.Step]] = [[] for _ in range(programs)]
    for work in range(count_of[-1] * heads):
        j = max(i for i in range(len(lens)) if count_of[i] * heads <= work)
        b, count = order[j], count_of[j + 1] - count_of[j]
        head, item = divmod(work - count_of[j] * heads, count)
        steps = schedule.item_steps(item, tiles[b], tiles[b], causal, "shift")
        plans[work % programs] += [dataclasses.replace(s, head=b * heads + head) for s in steps]
    assert plans == packed_plans("shift", tiles=tiles, n_heads=heads, programs=programs,
                                 causal=causal, pad=False)


def test_only_schedules_whose_items_run_at_once_deal_unpadded():
    """The kernels deal packed items unpadded under ``shift`` alone (the schedules whose items of
    a head wait on each other both ways), never dense problems."""
    from dash_inductor.ops.hopper.config import HopperBackwardConfig, unpadded_deal

    cfg = HopperBackwardConfig()
    for name in catalog.NAMES:
        assert unpadded_deal(cfg, name, True) == catalog.needs_coresident_head(name)
        assert not unpadded_deal(cfg, name, False)
    assert any(unpadded_deal(cfg, name, True) for name in catalog.NAMES)
    assert not unpadded_deal(HopperBackwardConfig(unpadded_deal=False), "shift", True)


def test_the_tail_conversion_runs_where_the_deal_is_unpadded_and_the_config_asks():
    """The packed kernel converts dQ in its tail only under the unpadded deal (whose order it
    claims rows in) and where its config asks (head dim 128), and needs one counter per
    (sequence, KV head) and a claim counter after the tickets."""
    from dash_inductor.ops.hopper import dq_tail
    from dash_inductor.ops.hopper.config import backward_config, tail_convert, unpadded_deal

    for head_dim, causal, name, varlen in itertools.product(
            (64, 128), (False, True), catalog.NAMES, (False, True)):
        cfg = backward_config(head_dim, causal, packed=varlen)
        assert tail_convert(cfg, name, varlen) == (
            head_dim == 128 and unpadded_deal(cfg, name, varlen))
    assert dq_tail.counters(num_seqs=5, hkv=4) == 5 * 4 + 1


@triton.jit
def _chunk_bounds_kernel(CU_Q, LO, HI, UNITS: tl.constexpr):
    b, chunk = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(CU_Q + b)
    lo, hi = chunk_rows(q0, tl.load(CU_Q + b + 1) - q0, chunk, UNITS)
    tl.store(LO + b * UNITS + chunk, lo)
    tl.store(HI + b * UNITS + chunk, hi)


@pytest.mark.parametrize("seed", range(3))
def test_the_tail_conversion_units_cover_every_packed_row_once(seed):
    """Each sequence's units (``dq_tail.chunk_rows``, run by the interpreter) split its rows
    into disjoint runs that cover them, empty sequences and ones shorter than their units
    included."""
    chunks = CHUNKS.value
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 3, chunks, *torch.randint(0, 300, (6,), generator=gen).tolist()]
    cu_q = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    lo, hi = (torch.empty(len(lengths) * chunks, dtype=torch.int32) for _ in range(2))
    _chunk_bounds_kernel[(len(lengths), chunks)](cu_q, lo, hi, UNITS=chunks)
    covered = torch.zeros(int(cu_q[-1]), dtype=torch.int32)
    for b in range(len(lengths)):
        for c in range(chunks):
            first, last = int(lo[b * chunks + c]), int(hi[b * chunks + c])
            if first < last:
                assert cu_q[b] <= first and last <= cu_q[b + 1]
                covered[first:last] += 1
    assert bool((covered == 1).all())


@pytest.mark.parametrize("causal", [False, True])
def test_the_claimed_deal_runs_where_the_deal_is_unpadded_and_the_config_asks(causal):
    """The load partition claims work from the counter only under the unpadded deal (the dense
    and padded deals keep each program's fixed indices) and where the config asks (causal)."""
    from dash_inductor.ops.hopper.config import (HopperBackwardConfig, backward_config,
                                                 backward_constexprs)

    for head_dim, name, varlen in itertools.product((64, 128), catalog.NAMES, (False, True)):
        cfg = backward_config(head_dim, causal, packed=varlen)
        constexprs = backward_constexprs(catalog.get(name), causal, 1, False, cfg, varlen=varlen)
        assert constexprs["CLAIMED"] == (causal and constexprs["UNPADDED"])
    off = HopperBackwardConfig(claimed_deal=False)
    assert not backward_constexprs(catalog.get("shift"), causal, 1, False, off,
                                   varlen=True)["CLAIMED"]
