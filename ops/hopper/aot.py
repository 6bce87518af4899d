"""Compile the Hopper kernels for sm90 without a GPU (what CI runs, and what reads their PTX here).

``triton.compile`` with a CUDA target of capability 90 runs the whole Gluon pipeline down to PTX and
cubin on a CPU-only machine; a kernel variant that no longer compiles fails there, not on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from ..catalog import NAMES
from ..catalog import get as get_schedule
from .backward import backward_kernel
from .config import (HEAD_DIMS, HopperBackwardConfig, HopperForwardConfig, backward_config,
                     backward_constexprs, forward_config, forward_constexprs)
from .dq_order import flat_box, flat_layout
from .forward import forward_kernel

SM90 = GPUTarget("cuda", 90, 32)
_GL_DTYPES = {"bf16": gl.bfloat16, "fp16": gl.float16}


def _descriptor(dtype: str, block: list[int]) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])
    return f"tensordesc<{dtype}{block},{layout!r}>"


def compile_backward(dtype: str, head_dim: int, schedule: str, causal: bool, group: int = 1,
                     even_s: bool = True, cfg: HopperBackwardConfig | None = None,
                     window: bool = False, varlen: bool = False, dropout: bool = False):
    """The compiled backward kernel (``triton.compiler.CompiledKernel``) for one variant, for sm90."""
    cfg = cfg or backward_config(head_dim, causal, packed=varlen)
    constexprs = backward_constexprs(get_schedule(schedule), causal, group, even_s and not varlen,
                                     cfg, window, varlen, dropout)
    q_block = _descriptor(dtype, [1, 1, cfg.block_m, head_dim])
    kv_block = _descriptor(dtype, [1, 1, cfg.block_n, head_dim])
    stats_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m], gl.float32)
    stats_block = f"tensordesc<fp32[{cfg.block_m}],{stats_layout!r}>"
    if constexprs["DQ_FRAGMENT"]:
        dq_box, dq_layout = list(flat_box(cfg.block_m, head_dim)), flat_layout()
    else:
        dq_box = [cfg.block_m, head_dim]
        dq_layout = gl.NVMMASharedLayout.get_default_for(dq_box, gl.float32)
    dq_block = f"tensordesc<fp32{dq_box},{dq_layout!r}>"
    signature = {"q_desc": q_block, "k_desc": kv_block, "v_desc": kv_block, "do_desc": q_block,
                 "lse_desc": stats_block, "delta_desc": stats_block, "dq_desc": dq_block,
                 "DK": f"*{dtype}", "DV": f"*{dtype}", "DQACC": "*fp32", "DQ": f"*{dtype}",
                 "STASH": "*fp32", "TICKETS": "*i32", "ERR": "*i32", "CU_Q": "*i32",
                 "CU_K": "*i32", "PREFIX": "*i32"}
    signature.update({name: "i64" for name in ("stride_dkb", "stride_dkh", "stride_dkn",
                                               "stride_dvb", "stride_dvh", "stride_dvn",
                                               "stride_dqt", "stride_dqh")})
    signature.update({name: "i32" for name in ("HQ", "HKV", "L", "S", "n_q", "n_kv", "max_q",
                                               "max_k", "row_stride", "stats_stride", "win_left",
                                               "win_right", "items_per_head", "total_items")})
    signature.update({"qk_scale": "fp32", "sm_scale": "fp32", "max_spin": "i32", "RNG": "*i64",
                      "drop_threshold": "i32", "drop_scale": "fp32"})
    signature.update({name: "constexpr" for name in constexprs})
    # As the launcher's calls specialize them: pointers and strides (multiples of the head dim)
    # divisible by 16, which lets dK and dV go out 16 bytes a thread.
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind.startswith("*") or name.startswith("stride_")}
    source = GluonASTSource(backward_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options={"num_warps": cfg.num_warps})


def compile_forward(dtype: str, head_dim: int, causal: bool, group: int = 1,
                    cfg: HopperForwardConfig | None = None, varlen: bool = False,
                    dropout: bool = False):
    """The compiled forward kernel for one variant, for sm90."""
    cfg = cfg or forward_config(head_dim, varlen, dropout)
    constexprs = forward_constexprs(causal, group, cfg, varlen, dropout)
    q_block = _descriptor(dtype, [1, 1, cfg.warpgroup_rows, head_dim])
    kv_block = _descriptor(dtype, [1, 1, cfg.block_n, head_dim])
    signature = {"q_desc": q_block, "k_desc": kv_block, "v_desc": kv_block, "o_desc": q_block,
                 "O": f"*{dtype}", "LSE": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
    signature.update({name: "i32" for name in ("stride_oh", "stride_om", "L", "S", "HQ", "max_q",
                                               "max_k")})
    signature.update({"qk_scale": "fp32", "RNG": "*i64", "drop_threshold": "i32",
                      "drop_scale": "fp32"})
    signature.update({name: "constexpr" for name in constexprs})
    # As Triton specialises a launch: pointers 16-byte aligned, and the strides of (T, H, D)
    # outputs, multiples of 16 elements at these head dims.
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind.startswith("*") or name.startswith("stride")}
    source = GluonASTSource(forward_kernel, signature=signature, constexprs=constexprs,
                            attrs=attrs)
    return triton.compile(source, target=SM90, options={"num_warps": cfg.num_warps})


_PTX_FEATURES = {
    "wgmma": r"wgmma\.mma_async",
    "tma_loads": r"cp\.async\.bulk\.tensor\.[34]d\.shared::\w+\.global",
    "tma_stores": r"cp\.async\.bulk\.tensor\.[34]d\.global\.shared::",
    "masked_stores": r"@%p\d+ st\.global\.v4\.b32",
    # 4-byte global stores: dK and dV straight from the accumulator's layout (two 16-bit values)
    "narrow_stores": r"st\.global\.b32",
    "setmaxnreg_inc": r"setmaxnreg\.inc",
    "setmaxnreg_dec": r"setmaxnreg\.dec",
    "dq_adds": r"red\.global\.gpu\.relaxed\.add\.v4\.f32",
    "dq_tma_adds": r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add",
    "ticket_release": r"(?:atom|red)\.global\.gpu\.release\.add",
    "named_arrives": r"\bbar\.arrive\b",
    # 8-byte shared stores: the row-major dQ staging's (the fragment order stores 16 bytes)
    "shared_v2_stores": r"st\.shared\.v2\.[bf]32",
    # Philox rounds: each a 32 x 32 -> 64-bit product (dropout's keep mask)
    "wide_multiplies": r"mul\.wide\.u32",
    "shuffles": r"shfl\.sync",
}


def ptxas_report(ptx: str) -> dict[str, int]:
    """What ``ptxas -v`` says of the PTX: whether it serialized the wgmma (advisory C7512, which
    makes every MMA wait for the previous one: in this kernel that halved the throughput) and how
    many bytes it spilled."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src.name, "-o", "/dev/null"],
                              capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", info)
    return {"wgmma_serialized": int("C7512" in info), "spill_store_bytes": int(spills.group(1))}


def ex2_under_pv(compiled) -> int:
    """The fewest exponentials a forward's softmax warpgroup computes, in the SASS, between the
    wait for a step's S (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the wait for the previous P V
    (``0x0``): 0 where ptxas retires P V before the softmax."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    counts, since_s = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            since_s = 0
        elif since_s is not None and "MUFU.EX2" in line:
            since_s += 1
        elif since_s is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            counts.append(since_s)
            since_s = None
    return min(counts, default=0)


def forward_summary(compiled) -> dict[str, int]:
    """``summary`` and, from the SASS, ``ex2_under_pv``."""
    return {**summary(compiled), "ex2_under_pv": ex2_under_pv(compiled)}


def summary(compiled) -> dict[str, int]:
    """Counts of the PTX instructions the design relies on, ptxas's report, shared memory and
    cubin size."""
    ptx = compiled.asm["ptx"]
    counts = {name: len(re.findall(pattern, ptx)) for name, pattern in _PTX_FEATURES.items()}
    return {**counts, **ptxas_report(ptx), "shared": compiled.metadata.shared,
            "cubin_bytes": len(compiled.asm["cubin"])}


#: The sliding-window and packed variants CI compiles besides every dense one, in bf16 (fp16 takes
#: the same code paths): (schedule, causal, window, varlen); ``shift`` has no windowed ranks (the
#: launchers fall back).
MASKED_VARIANTS = (("descending", True, True, False), ("ascending", False, True, False),
                   ("shift", True, False, True), ("ascending", False, False, True),
                   ("recompute", True, False, True), ("descending", True, True, True))


#: The ``red.v4`` dQ writer (``HopperBackwardConfig.dq_tma=False``, kept for A/B runs), compiled
#: besides in bf16 for one ordered schedule of each mask: variant "dense-red-writer".
RED_WRITER_VARIANTS = (("shift", False), ("descending", True))

#: The backward with attention dropout (``dropout.py``), compiled besides in bf16 for dense
#: problems (packed ones with dropout run the portable kernels): variant "dense-dropout".
DROPOUT_VARIANTS = (("descending", False), ("shift", True), ("recompute", True))

#: dQ's columns split over the warpgroups at head dim 64 (``dq_row_warps=4``, the default before
#: the row split, kept for A/B runs), compiled besides in bf16 for ``auto``'s schedule of each
#: mask: variant "dense-dq-columns".
DQ_COLUMNS_VARIANTS = (("ascending", False), ("shift", True))


#: One variant of each of the kernels' code paths (dense, windowed, packed with the claimed deal
#: and the tail conversion, the packed forward; d64 and d128), for compiling under another Triton
#: quickly: (head dim, schedule or "forward", causal, window, varlen).
FEW_VARIANTS = ((128, "forward", True, False, False), (64, "forward", False, False, False),
                (64, "forward", True, False, True), (128, "forward", False, False, True),
                (128, "descending", False, False, False), (64, "shift", True, False, False),
                (128, "descending", True, True, False), (128, "shift", True, False, True),
                (64, "ascending", False, False, True))


def variant_name(window: bool, varlen: bool) -> str:
    """"dense", "window", "varlen" or "varlen+window"."""
    return "+".join(name for name, on in (("varlen", varlen), ("window", window)) if on) or "dense"


def main(argv: list[str] | None = None) -> None:
    """Compile every forward variant (dense and packed) and dense backward variant of one dtype,
    and in bf16 MASKED_VARIANTS, DROPOUT_VARIANTS and RED_WRITER_VARIANTS; print one JSON line per variant
    (``schedule`` is "forward" for the forward kernel)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dtype", choices=sorted(_GL_DTYPES), required=True)
    parser.add_argument("--few", action="store_true",
                        help="only FEW_VARIANTS, each kernel's code paths once")
    args = parser.parse_args(argv)
    if args.few:
        for head_dim, schedule, causal, window, varlen in FEW_VARIANTS:
            compiled = (compile_forward(args.dtype, head_dim, causal, group=4 if causal else 1,
                                        varlen=varlen) if schedule == "forward"
                        else compile_backward(args.dtype, head_dim, schedule, causal,
                                              group=4 if causal else 1, even_s=not causal,
                                              window=window, varlen=varlen))
            key = dict(dtype=args.dtype, head_dim=head_dim, schedule=schedule, causal=causal,
                       variant=variant_name(window, varlen), triton=triton.__version__)
            row = forward_summary(compiled) if schedule == "forward" else summary(compiled)
            print(json.dumps({**key, **row}), flush=True)
        return
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for varlen in (False, True):
                group = (4 if varlen else 2) if causal else 1
                compiled = compile_forward(args.dtype, head_dim, causal, group=group,
                                           varlen=varlen)
                key = dict(dtype=args.dtype, head_dim=head_dim, schedule="forward",
                           causal=causal, variant=variant_name(False, varlen))
                print(json.dumps({**key, **forward_summary(compiled)}), flush=True)
                if not varlen and args.dtype == "bf16":
                    compiled = compile_forward(args.dtype, head_dim, causal, group=group,
                                               dropout=True)
                    print(json.dumps({**key, "variant": "dense-dropout",
                                      **forward_summary(compiled)}), flush=True)
                if head_dim == 64 and not varlen:  # the two-warpgroup tile, kept for A/B runs
                    compiled = compile_forward(args.dtype, head_dim, causal, group=group,
                                               cfg=HopperForwardConfig())
                    print(json.dumps({**key, "variant": "2wg", **forward_summary(compiled)}),
                          flush=True)
    backward_variants = [(schedule, causal, False, False) for schedule in NAMES
                         for causal in (False, True)]
    if args.dtype == "bf16":
        backward_variants += MASKED_VARIANTS
    for head_dim in HEAD_DIMS:
        for schedule, causal, window, varlen in backward_variants:
            compiled = compile_backward(args.dtype, head_dim, schedule, causal,
                                        group=4 if causal else 1, even_s=not causal,
                                        window=window, varlen=varlen)
            key = dict(dtype=args.dtype, head_dim=head_dim, schedule=schedule, causal=causal,
                       variant=variant_name(window, varlen))
            print(json.dumps({**key, **summary(compiled)}), flush=True)
        for schedule, causal in DROPOUT_VARIANTS if args.dtype == "bf16" else ():
            compiled = compile_backward(args.dtype, head_dim, schedule, causal,
                                        group=4 if causal else 1, even_s=not causal, dropout=True)
            key = dict(dtype=args.dtype, head_dim=head_dim, schedule=schedule, causal=causal,
                       variant="dense-dropout")
            print(json.dumps({**key, **summary(compiled)}), flush=True)
        for schedule, causal in RED_WRITER_VARIANTS if args.dtype == "bf16" else ():
            cfg = dataclasses.replace(backward_config(head_dim, causal), dq_tma=False)
            compiled = compile_backward(args.dtype, head_dim, schedule, causal, even_s=not causal,
                                        cfg=cfg)
            key = dict(dtype=args.dtype, head_dim=head_dim, schedule=schedule, causal=causal,
                       variant="dense-red-writer")
            print(json.dumps({**key, **summary(compiled)}), flush=True)
    for schedule, causal in DQ_COLUMNS_VARIANTS if args.dtype == "bf16" else ():
        cfg = dataclasses.replace(backward_config(64, causal), dq_row_warps=4)
        compiled = compile_backward(args.dtype, 64, schedule, causal, group=4 if causal else 1,
                                    even_s=not causal, cfg=cfg)
        key = dict(dtype=args.dtype, head_dim=64, schedule=schedule, causal=causal,
                   variant="dense-dq-columns")
        print(json.dumps({**key, **summary(compiled)}), flush=True)


if __name__ == "__main__":
    main()
