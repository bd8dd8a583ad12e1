"""Registers, local-memory stack, spills and shared memory of the batch-1 decode step's Triton kernels (and the
prefill's MoE and attention), compiled for sm_90 at the tiles the ops choose for V4.1-Flash widths, offline: no GPU
needed (Triton's own ptxas; registers and stack are what `cuobjdump -res-usage` reads from each cubin, spills the
bytes ptxas's log reports spilled; a stack without spills is a local array).

    python bench/registers.py            # the table, and bench/results/registers.json ($OUT/registers.json)
    python bench/registers.py --json     # one JSON object a kernel on stdout, nothing written (the test's form)

A kernel's registers bound how many of its programs an SM holds (65536 a multiprocessor, 255 a thread at most),
and spills cost: a decode GEMV that spills runs fewer programs, each waiting on local memory.
`tests/fast/test_registers.py` keeps the kernels marked `spills_ok=False` free of spills.

The numbers are the installed Triton's (the device's may differ by a few registers); each kernel's tiles come from
its op's own configuration code, so the table follows the defaults. The decode kernels `LAUNCH_INTS` lists are
compiled as their batch-1 launches specialize them (an int argument of 1 a constant, a multiple of 16 known
divisible by 16), since a kernel's vector loads and its software pipeline can hinge on those: with its ints left
open, the gather MoE's up kernel read 255 registers and a 344-byte stack, the mHC pre partial 211 registers, where
their launches compile to 118 and 95, without a stack (Triton 3.6); the prefill's grouped MoE kernels 255 registers
and ~450 spilled bytes, where an 8K-token chunk's launch compiles them to 159 / 125 and none.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels (the interpreter's are not JIT functions)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.fast.kernels import (
    attention,
    compressor,
    dense_gemv,
    fp8_gemv,
    indexer_query,
    mhc,
    moe_experts,
    moe_routing,
    quant,
    rope,
    topk,
    window_write,
)

SM90 = GPUTarget("cuda", 90, 32)
CUDA = SimpleNamespace(is_cuda=True)  # what the ops' tile choices ask of a tensor
TARGET = 2 * 132  # the programs the ops' D and K splits aim at on the H200: two a multiprocessor
# V4.1-Flash: width, mHC streams, expert width, routed experts and their top-k, heads, head dim, RoPE dims, the
# attention's window, the indexer's top-k and head dim
D, HC, I, EXPERTS, TOP_K, H, DH, ROPE, WINDOW, INDEX_TOPK, INDEX_DH = 5120, 4, 2304, 384, 6, 64, 512, 64, 128, 512, 128


def aligned(columns: int = 0) -> SimpleNamespace:
    """A scale tensor of `columns` columns as the caching allocator places it, to the ops' alignment checks."""
    return SimpleNamespace(shape=(1, columns), data_ptr=lambda: 0)


@dataclass
class Kernel:
    """One kernel at one configuration: `types` names the argument types that are not the defaults (a `*_ptr`
    argument points at fp32, any other is i32)."""

    name: str
    fn: triton.runtime.JITFunction
    types: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 3
    spills_ok: bool = False  # a known spill the tests tolerate (the reason in `note`)
    note: str = ""
    fp_fusion: bool = True  # off where the launch turns it off (most RoPE kernels: the reference's roundings)


def without_fp_fusion(kernels: list[Kernel]) -> list[Kernel]:
    """The kernels as launched with `enable_fp_fusion=False` (the RoPE kernels round products and sums apart)."""
    return [replace(k, fp_fusion=False) for k in kernels]


def signature(k: Kernel) -> dict:
    sig = {}
    for p in k.fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = k.types.get(p.name, "*fp32" if p.name.endswith("_ptr") else "i32")
    return sig


def launch_attrs(k: Kernel) -> dict:
    """What a launch tells the compiler that an offline compile must say itself: the pointers' 16-byte alignment
    (the caching allocator's tensors start on 512 bytes and Triton specializes such pointers), without which
    vectorizable loads compile to single words (the FP8 GEMV's asynchronous weight copies: 4 bytes, not 16)."""
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(k.fn.params)
            if not p.is_constexpr and p.name.endswith("_ptr")}


def compile_sm90(k: Kernel, sig: dict | None = None, constexprs: dict | None = None, attrs: dict | None = None):
    """k compiled for sm_90 by Triton's own toolchain (its signature, constexprs and launch attributes unless
    given): (the compiled kernel, ptxas's log)."""
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True  # ptxas runs (and logs) even where Triton's cache has the kernel
        knobs.nvidia.dump_ptxas_log = True
        source = ASTSource(k.fn, sig or signature(k), constexprs=constexprs or k.constexprs,
                           attrs=launch_attrs(k) if attrs is None else attrs)
        compiled = triton.compile(source, target=SM90, options={"num_warps": k.num_warps, "num_stages": k.num_stages,
                                                                "enable_fp_fusion": k.fp_fusion})
    return compiled, log.getvalue()


def cuobjdump(compiled, *flags: str) -> str:
    """What Triton's cuobjdump prints of the compiled kernel's cubin with `flags`."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True, check=True).stdout


def resources(k: Kernel) -> dict:
    """{registers, stack, spills, shared} of k compiled for sm_90 as its launch specializes it (`launch_compile`):
    registers and stack (spills and local arrays) from the cubin, the bytes spilled from the log of the ptxas run
    that made it (Triton's own options)."""
    compiled, log = launch_compile(k)
    spills = re.search(r"(\d+) bytes spill stores", log)
    usage = cuobjdump(compiled, "-res-usage")
    fields = dict(item.split(":") for item in next(line for line in usage.splitlines() if "REG:" in line).split())
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "spills": int(spills.group(1)),
            "shared": compiled.metadata.shared}


def mhc_kernels() -> list[Kernel]:
    """The pre pass at one token collapsing with the previous site's pre (V4.1), its finish, the finish that
    collapses with its own pre (V4's decode) and the post (prefill), the post that finishes the coefficients itself
    and the one that also runs the next site's partial pass (V4.1's decode), and that one with the coefficients
    given (V4's decode)."""
    c = mhc.pre_config(1, D, HC, 2, TARGET)
    M = (2 + HC) * HC
    partial = Kernel("mhc_pre partial", mhc._pre_partial_kernel, {"h_ptr": "*bf16", "x_ptr": "*bf16"},
                     {"HC": HC, "M": M, "MP": c["MP"], "BN": c["BN"], "BD": c["BD"], "COLLAPSE": True,
                      "BF16_SPLIT": True, "INTERP": False, "PDL": True}, c["num_warps"], c["num_stages"])
    f = mhc.finish_config(1, D, c["split"], True, TARGET)
    finish = Kernel("mhc_pre finish", mhc._pre_finish_kernel,
                    {"h_ptr": "*bf16", "x_ptr": "*bf16", "norm_eps": "fp32", "hc_eps": "fp32"},
                    {"HC": HC, "M": M, "BN": f["BN"], "BD": f["BD"], "SB": f["SB"], "COLLAPSE": False,
                     "ACCURATE": True, "THREAD_SINKHORN": mhc.sinkhorn_in_threads(HC, f["BN"]), "PDL": True},
                    f["num_warps"])
    f_own = mhc.finish_config(1, D, mhc.partial_splits(D, 2), False, TARGET)
    finish_own = Kernel("mhc_pre finish collapsing", mhc._pre_finish_kernel, finish.types,
                        {**finish.constexprs, "BN": f_own["BN"], "BD": f_own["BD"], "SB": f_own["SB"], "COLLAPSE": True,
                         "THREAD_SINKHORN": mhc.sinkhorn_in_threads(HC, f_own["BN"])}, f_own["num_warps"])
    p = mhc.post_config(1, D)
    post = Kernel("mhc_post", mhc._post_kernel, {"f_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16"},
                  {"HC": HC, "BN": p["BN"], "BD": p["BD"], "INTERP": False, "PDL": True}, p["num_warps"])
    # the step's: the FFN site's before an Engram layer and after the last, on the MoE's slots
    post_finish = Kernel("mhc_post finish (MoE slots)", mhc._post_finish_kernel,
                         {**post.types, "f_ptr": "*fp32", "norm_eps": "fp32", "hc_eps": "fp32"},
                         {"HC": HC, "M": M, "BN": p["BN"], "BD": p["BD"], "SB": f["SB"], "SLOTS": TOP_K + 1,
                          "ACCURATE": True, "THREAD_SINKHORN": mhc.sinkhorn_in_threads(HC, p["BN"]), "INTERP": False,
                          "PDL": True, "SETTLED": True},
                         p["num_warps"])
    splits = mhc.partial_splits(D, 2)
    post_partial = Kernel("mhc_post partial", mhc._post_partial_kernel,
                          {**post_finish.types, "f_ptr": "*bf16", "x_ptr": "*bf16"},
                          {"HC": HC, "M": M, "MP": c["MP"], "BD": D // splits, "SB": f["SB"], "FINISH": True,
                           "SLOTS": 0, "ACCURATE": True, "THREAD_SINKHORN": True, "INTERP": False, "PDL": True,
                           "SETTLED": True, "SQUARES": True, "START": True},
                          mhc.post_partial_warps(1))
    post_sums = Kernel("mhc_post sums", mhc._post_partial_kernel, post_partial.types,
                       {**post_partial.constexprs, "FINISH": False, "SQUARES": False, "START": False},
                       mhc.post_partial_warps(1))
    # the FFN sites' posts at one token, summing the MoE's slots (TOP_K routed and the shared one, fp32)
    ffn = {"types": {**post_partial.types, "f_ptr": "*fp32"}, "num_warps": mhc.post_partial_warps(1)}
    post_partial_slots = Kernel("mhc_post partial (MoE slots)", mhc._post_partial_kernel,
                                constexprs={**post_partial.constexprs, "SLOTS": TOP_K + 1, "SQUARES": False,
                                            "START": False}, **ffn)
    post_sums_slots = Kernel("mhc_post sums (MoE slots)", mhc._post_partial_kernel,
                             constexprs={**post_sums.constexprs, "SLOTS": TOP_K + 1}, **ffn)
    return [partial, finish, finish_own, post, post_finish, post_partial, post_sums, post_partial_slots,
            post_sums_slots]


def routing_kernels() -> list[Kernel]:
    """The gate GEMM at one token (K split over the chip's programs), its last program routing as the decode step
    runs it, and the router over the partial logits as a launch of its own (more than 8 rows)."""
    BM, BE, BK, split, _ = moe_routing.gate_config(1, EXPERTS, D, 2, TARGET)
    c = moe_routing.route_config(1, EXPERTS, split, True)
    # V4.1's router (a bias, sqrt-softplus scores, normalized), its constexprs as the launch derives them
    _, consts = moe_routing._route_args(c, torch.zeros(EXPERTS), None, TOP_K, "sqrtsoftplus", True, True,
                                        torch.empty(0))
    routing = {**consts, "BR": c["BR"]}
    gate = Kernel("moe gate GEMM routing", moe_routing._gate_gemm_kernel,
                  {"x_ptr": "*bf16", "w_ptr": "*bf16", "count_ptr": "*i32", "hashed_ptr": "*i64", "ids_ptr": "*i64",
                   "temp": "fp32", "scale": "fp32"},
                  {"BM": BM, "BE": BE, "BK": BK, "F32": False, "INTERP": False, "PDL": True, "ROUTE": True, **routing,
                   "NORM": False, "SQP": 1}, 4)
    # the decode step's: x normalized as loaded, by the post's sums of squares (one a d step of its 64 columns)
    normed = Kernel("moe gate GEMM routing (normed)", moe_routing._gate_gemm_kernel,
                    {**gate.types, "nw_ptr": "*bf16", "xn_ptr": "*bf16", "eps": "fp32"},
                    {**gate.constexprs, "NORM": True, "SQP": triton.next_power_of_2(mhc.partial_splits(D, 2))}, 4)
    route = Kernel("moe route", moe_routing._route_kernel,
                   {"ids_ptr": "*i64", "hashed_ptr": "*i64", "temp": "fp32", "scale": "fp32"},
                   {**routing, "PDL": True}, c["num_warps"])
    return [gate, normed, route]


def moe_kernels() -> list[Kernel]:
    """The gather path's up and down kernels: at one token (2 warps) with the shared expert's FP8 rows, as the
    batch-1 decode step launches them, and at the most tokens "auto" gives it (4 warps), the shared expert dense
    bf16."""
    out = []
    for N, label in ((1, ""), (moe_experts.GATHER_MAX_N, f" ({moe_experts.GATHER_MAX_N} tokens)")):
        c = moe_experts._cfg(CUDA, N, "gather")
        bk_down = moe_experts.down_k_step(c)
        tail = moe_experts.down_tail(I, bk_down, aligned())
        common = {"STAGES": c["gather_stages"], "IS_BF16": True, "INTERP": False, "SHARED": True, "SH_FP8": N == 1,
                  "PDL": True}
        out.append(Kernel(f"moe gather up{label}", moe_experts._gather_up_kernel,
                          {"x_ptr": "*bf16", "ids_ptr": "*i64", "w13_ptr": "*i32", "s13_ptr": "*u8",
                           "sh13_ptr": "*bf16", "shq13_ptr": "*i64", "she13_ptr": "*u8", "limit": "fp32"},
                          {"BI": c["BI"], "BK": c["BK"], "EVEN_K": D % c["BK"] == 0, **common}, c["gather_warps"]))
        out.append(Kernel(f"moe gather down{label}", moe_experts._gather_down_kernel,
                          {"ids_ptr": "*i64", "w2_ptr": "*i32", "s2_ptr": "*u8", "sh2_ptr": "*bf16",
                           "shq2_ptr": "*i64", "she2_ptr": "*u8"},
                          {"BD": c["BD"], "BK": bk_down, "EVEN_K": (I - tail) % bk_down == 0, "TAIL": tail,
                           **common},
                          c["gather_warps"]))
    return out


def batched_moe_kernels() -> list[Kernel]:
    """The MoE's grouped tensor-core kernels at an 8K-token prefill chunk (52% of a V4.1 prefill's time by module)."""
    tables = {"ids_ptr": "*i64", "order_ptr": "*i64", "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32", "tile_r1_ptr": "*i32"}
    up_types = {**tables, "x_ptr": "*bf16", "w13_ptr": "*u8", "s13_ptr": "*u8", "sh13_ptr": "*bf16", "h_ptr": "*bf16",
                "limit": "fp32"}
    down_types = {**tables, "h_ptr": "*bf16", "w2_ptr": "*u8", "s2_ptr": "*u8", "sh2_ptr": "*bf16", "out_ptr": "*bf16"}
    c = moe_experts._cfg(CUDA, 8192, "grouped")
    constexprs = {"BM": moe_experts.grouped_block_m(8192, TOP_K + 1, EXPERTS), "BK": c["BKG"], "IS_BF16": True,
                  "INTERP": False, "SH_LOW": True, "FIND": 0, "SHARED": True}
    note = "4 warps at 64 x 64 tiles (the down kernel's 64 x 128): 20.3 ms at 8192 tokens, 8 warps 70.8 ms"
    return [Kernel(f"moe grouped (prefill) {part}", fn, types, {**constexprs, "BN": bn}, c["warps"], c["stages"],
                   note=note)
            for part, fn, types, bn in (("up", moe_experts._grouped_up_kernel, up_types, c["BN"]),
                                        ("down", moe_experts._grouped_down_kernel, down_types, c["BND"]))]


# the attention's FP8 GEMVs at one row, V4.1's 32 x 32 blocks: (name, weight rows N, K, groups)
FP8_GEMV_SHAPES = (("wq_b + indexer wq_b", 32768 + 4096, 1280, 1), ("wo_a", 8192, 4096, 8), ("wo_b", D, 8192, 1),
                   ("wq_a + wkv", 1280 + DH, D, 1))
# x's sum of squares as the mHC post hands it on to wq_a + wkv: a partial sum a d step (`mhc.partial_splits`)
HANDED_SQUARES = mhc.partial_splits(D, 2)
HANDED_SQUARES_P2 = 1 << (HANDED_SQUARES - 1).bit_length()


# the attention's dense parts on x at one row: (name, weight rows N, K, output dtype)
DENSE_GEMV_SHAPES = (("x, bf16 (wq_a + wkv + indexer weights_proj)", 1280 + DH + 32, D, "bf16"),
                     ("x, fp32 (the compressors')", 2 * 1024 + 2 * 256, D, "fp32"))


def dense_gemv_kernels() -> list[Kernel]:
    """The batch-1 GEMVs of the attention's dense linears on x (`DENSE_GEMV_SHAPES`)."""
    out = []
    for name, N, K, out_dtype in DENSE_GEMV_SHAPES:
        BN, BK, stages, warps = dense_gemv._tiles(1, N)
        out.append(Kernel(f"dense_gemv {name}", dense_gemv._dense_gemv_kernel,
                          {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": f"*{out_dtype}"},
                          {"BM": 1, "BN": BN, "BK": BK, "STAGES": stages, "OUT_BF16": out_dtype == "bf16",
                           "INTERP": False, "PDL": True, "EVEN_K": K % BK == 0}, warps, stages))
    return out


def fp8_gemv_kernels() -> list[Kernel]:
    """The attention's FP8 GEMVs at one row (`FP8_GEMV_SHAPES`): wq_b with the indexer's, wo_a, wo_b, and wq_a
    with wkv (a layer without an indexer); those on x and on the query latent with their RMSNorm in the kernel (x's
    by the squares the FFN post before handed on, as in every layer but the first and those after an Engram layer),
    and wq_b's with the query heads' RoPE (V4.1), as the step launches them."""
    out = []
    for name, N, K, groups in FP8_GEMV_SHAPES:
        BN, BK, stages, warps = fp8_gemv._tiles(1, N, K, groups, 32, {})
        out.append(Kernel(f"fp8_gemv {name}", fp8_gemv._fp8_gemv_kernel,
                          {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_desc": "*fp8e4nv", "s_ptr": "*u8",
                           "y_ptr": "*bf16", "nw_ptr": "*bf16", "sq_ptr": "*fp32", "eps": "fp32"},
                          {"BM": 1, "BN": BN, "BK": BK, "BLOCK_K": 32, "STAGES": stages, "OUT_BF16": True, "INTERP": False,
                           "PDL": True, "EVEN_K": K % BK == 0, "NORM": name.startswith("wq_"), "X_BF16": True,
                           "NORM_CHUNK": rope.NORM_CHUNK, "START": name == "wo_b",
                           "WORD_SCALES": fp8_gemv._word_scaled(K, BK, 32, aligned(K // 32)),
                           "TMA": False, "SQP": HANDED_SQUARES_P2 if name.startswith("wq_a") else 0,
                           **({"HEAD": DH, "R": ROPE} if name.startswith("wq_b") else {"HEAD": 1, "R": 0})},
                          warps, stages))
    # the weight steps as bulk tensor copies (cfg {"tma": True}; the step does not launch it: slower on the H100)
    wo_b = next(k for k in out if k.name == "fp8_gemv wo_b")
    BN, BK = wo_b.constexprs["BN"], wo_b.constexprs["BK"]
    tile = f"tensordesc<i32[{BN}, {BK // 4}]>"
    out.append(Kernel("fp8_gemv wo_b (TMA tiles)", wo_b.fn, {**wo_b.types, "w_desc": tile},
                      {**wo_b.constexprs, "TMA": True}, wo_b.num_warps, wo_b.num_stages))
    return out


def attention_kernels() -> list[Kernel]:
    """Sparse attention of one query row over the FP8 window and FP4 entries (window 128 + top-512), split."""
    cfg = attention.Config().resolve(1, H, WINDOW, INDEX_TOPK)
    attn = Kernel("sparse_attn_fp4", attention._attn_kernel,
                  {"q_ptr": "*bf16", "o_ptr": "*bf16", "wd_ptr": "*fp8e4nv", "ws_ptr": "*u8", "widx_ptr": "*i32",
                   "gd_ptr": "*u8", "gs_ptr": "*fp8e4nv", "gidx_ptr": "*i32", "qk_scale": "fp32"},
                  {"WIN_FMT": attention.FP8, "GLOB_FMT": attention.FP4, "D": DH, "R": ROPE, "BLOCK_H": cfg.block_h,
                   "BLOCK_N": cfg.block_n, "SPLIT": True, "INTERP": False, "PDL": True, "SETTLED": False},
                  cfg.num_warps, cfg.num_stages)
    # a layer that neither compresses nor indexes (V4.1's readers): a global tile loaded before the PDL wait
    settled = Kernel("sparse_attn_fp4 (settled)", attention._attn_kernel, attn.types,
                     {**attn.constexprs, "SETTLED": True}, cfg.num_warps, cfg.num_stages)
    # a prefill chunk's rows: 64 heads a program, no split; a lone row over a long list: 64-row tiles
    chunk = attention.Config().resolve(8192, H, WINDOW, INDEX_TOPK)
    prefill = Kernel("sparse_attn_fp4 (prefill)", attention._attn_kernel, attn.types,
                     {**attn.constexprs, "BLOCK_H": chunk.block_h, "SPLIT": False}, chunk.num_warps, chunk.num_stages,
                     spills_ok=True, note="64 heads in 8 warps (32 heads: 252 registers, no stack; each head block "
                     "dequantizes the rows again)")
    lone = attention.Config().resolve(1, H, WINDOW, 1 << 18)
    long_list = Kernel("sparse_attn_fp4 (long list)", attention._attn_kernel, attn.types,
                       {**attn.constexprs, "BLOCK_H": lone.block_h, "BLOCK_N": lone.block_n}, lone.num_warps,
                       lone.num_stages, spills_ok=True,
                       note="64 heads x 64 rows in 8 warps: spills, yet 31% faster than 32 rows at 512K entries")
    tiles = triton.cdiv(WINDOW, cfg.block_n) + triton.cdiv(INDEX_TOPK, cfg.block_n)
    c = attention.combine_tiles(H, DH, tiles, cfg)  # batch 1 on the H200: a split a tile (plan_splits)
    combine = Kernel("sparse_attn combine", attention._combine_kernel, {"o_ptr": "*bf16"},
                     {"D": DH, "R": ROPE, "BLOCK_H": c["BLOCK_H"], "BLOCK_D": c["BLOCK_D"], "BLOCK_S": c["BLOCK_S"],
                      "INTERP": False, "PDL": True}, c["num_warps"])
    return [attn, settled, prefill, long_list, combine]


def topk_kernels() -> list[Kernel]:
    """The indexer's top-k at one row: a row held in registers (up to RESIDENT_MAX columns), a first stage's
    chunk of a longer row, and a candidate pool's row (ids through the block table, the picks sorted)."""
    out = []
    for name, block, stage, dense in (("resident row", topk.RESIDENT_MAX, False, True),
                                      ("first-stage chunk", topk.STAGE_MIN_CHUNK, True, True),
                                      ("pool row", topk.RESIDENT_MAX, False, False)):
        ids = 0 if dense else 1
        out.append(Kernel(f"topk {name}", topk._topk_kernel,
                          {"id_ptr": "*i32", "out_ptr": "*i32" if stage else "*i64"},
                          {"IDS": ids, "DENSE": dense, "BLOCK": block, "KP": 16 if dense or stage else INDEX_TOPK,
                           "STAGE": stage, "RESIDENT": True, "PDL": True},
                          topk.block_warps(block)))
    return out


def quant_kernels() -> list[Kernel]:
    """The cache writes (quantization and store, `quant_write`) of one token's bf16 rows: a window entry (FP8), a
    compressed entry (NVFP4), an index key (MXFP4)."""
    out = []
    for name, fmt, cols, block in (("fp8 window entry", "fp8", DH, 32), ("nvfp4 entry", "nvfp4", DH, 16),
                                   ("mxfp4 index key", "mxfp4", INDEX_DH, 32)):
        c = quant.quant_config(1, cols, block)
        out.append(Kernel(f"quant {name}", quant._quant_kernel,
                          {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "slot_ptr": "*i64", "row_ptr": "*i64"},
                          {"FMT": quant.FORMAT_CODES[fmt], "BLOCK": block, "HALF_P2": c["HALF_P2"], "ROWS": c["ROWS"],
                           "SCATTER": True, "PDL": True}, c["num_warps"]))
    return out


def window_write_kernels() -> list[Kernel]:
    """The cache rows of one bf16 token (norm, RoPE, encoding into the store): V4.1's window row (FP8), compressed
    entry (NVFP4) and index key (MXFP4); V4's window row (the unrotated channels' FP8 round trip in blocks of 64,
    stored as bf16) and index key (the Hadamard transform, then MXFP4)."""
    types = {"kv_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "slot_ptr": "*i64",
             "row_ptr": "*i64", "eps": "fp32"}
    constexprs = {"D": DH, "R": ROPE, "BLOCK": 32, "BF16": True, "FMT": quant.FORMAT_CODES["fp8"], "ROUNDED": False,
                  "HADAMARD": False, "LOG_D": DH.bit_length() - 1, "INTERP": False, "PDL": True, "START": False}
    key = {"D": INDEX_DH, "LOG_D": INDEX_DH.bit_length() - 1, "FMT": quant.FORMAT_CODES["mxfp4"]}
    return without_fp_fusion([
            Kernel("window write", window_write._window_write_kernel, types, {**constexprs, "START": True}, 2),
            Kernel("window write nvfp4 entry", window_write._window_write_kernel, types,
                   {**constexprs, "BLOCK": 16, "FMT": quant.FORMAT_CODES["nvfp4"]}, 2),
            Kernel("window write mxfp4 index key", window_write._window_write_kernel, types, {**constexprs, **key}, 2),
            Kernel("window write rounded (V4)", window_write._window_write_kernel,
                   {**types, "q_ptr": "*bf16", "s_ptr": "*bf16"},
                   {**constexprs, "BLOCK": 64, "ROUNDED": True}, 2),
            Kernel("window write hadamard index key (V4)", window_write._window_write_kernel, types,
                   {**constexprs, **key, "HADAMARD": True}, 2)])


def compressor_kernels() -> list[Kernel]:
    """V4's compressors' decode step of one row (ring writes and the pooling of a group): its ratio-4 ones
    (overlapping, with ape: the KV latent of 512 and the indexer's of 128; a ring of resume span 128) and its ratio-128
    one (no overlap); V4.1's ratio 2 (no overlap, no ape)."""
    types = {"pos_ptr": "*i64", "slot_ptr": "*i64", "out_ptr": "*bf16"}
    out = []
    for name, d, ratio, overlap, ape in (("ratio 4 (V4)", DH, 4, True, True),
                                         ("ratio 4 index key (V4)", INDEX_DH, 4, True, True),
                                         ("ratio 128 (V4)", DH, 128, False, True), ("ratio 2", DH, 2, False, False)):
        rows = triton.next_power_of_2(2 * ratio if overlap else ratio)
        out.append(Kernel(f"compressor pool {name}", compressor._compressor_pool_kernel, types,
                          {"D": d, "RATIO": ratio, "OVERLAP": overlap, "APE": ape, "ROWS": rows,
                           "BD": min(d, max(16, 2048 // rows)), "INTERP": False, "PDL": True}, 4))
    return without_fp_fusion(out)


def query_heads_kernels() -> list[Kernel]:
    """V4's decode queries of one bf16 row (64 heads of 512: each head RMS-normed, then rotated)."""
    return without_fp_fusion([Kernel("query heads (V4)", rope._query_heads_kernel,
                                     {"q_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
                                     {"H": H, "HB": rope._HEADS_A_PROGRAM, "D": DH, "R": ROPE, "BF16": True,
                                      "NORM": True, "INTERP": False, "PDL": True}, 2)])


def indexer_query_kernels() -> list[Kernel]:
    """The indexer's decode queries (RoPE, MXFP4 rounding, head weights) of one bf16 row: V4.1's, and V4's (64
    heads, the Hadamard transform before the rounding)."""
    types = {"q_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "w_scale": "fp32"}
    constexprs = {"H": 32, "HB": indexer_query._HEADS_A_PROGRAM, "D": INDEX_DH, "R": ROPE, "BF16": True,
                  "HADAMARD": False, "LOG_D": INDEX_DH.bit_length() - 1, "INTERP": False, "PDL": True}
    return without_fp_fusion([Kernel("indexer queries", indexer_query._indexer_query_kernel, types, constexprs, 1),
                              Kernel("indexer queries (V4, Hadamard)", indexer_query._indexer_query_kernel, types,
                                     {**constexprs, "H": 64, "HADAMARD": True}, 1)])


_ATTN = {"stride_hn": HC * D, "stride_hk": D, "stride_xn": D}
# the int arguments a batch-1 V4.1 decode step launches each kernel with (the prefill kernels: an 8K-token chunk's),
# which a launch specializes as Triton does (1 a constant, a multiple of 16 known divisible by 16; an argument a
# kernel does not take is ignored, one not listed is compiled unspecialized): 80 mHC partials (D / 64), 40 gate
# partials (D / 128), 20 attention splits (window + top-k tiles of 32)
LAUNCH_INTS = {
    "mhc_pre partial": {"N": 1, "D": D, "steps_per_prog": 1, "stride_wn": HC, **_ATTN},
    "mhc_pre finish": {"N": 1, "D": D, "n_split": 80, "d_per_prog": D, **_ATTN},
    "mhc_post finish (MoE slots)": {"N": 1, "D": D, "n_split": 80, "stride_fs": D},
    "mhc_post partial": {"N": 1, "D": D, "n_split": 80},
    "mhc_post partial (MoE slots)": {"N": 1, "D": D, "n_split": 80, "stride_fs": D},
    "mhc_post sums (MoE slots)": {"N": 1, "D": D, "n_split": 1, "stride_fs": D},
    # V4's decode pair: the finish alone, its collapse over d chunks of 64; the post with given coefficients, whose
    # unused split count is the stand-in's rows
    "mhc_pre finish collapsing": {"N": 1, "D": D, "n_split": 80, "d_per_prog": 64, **_ATTN},
    "mhc_post sums": {"N": 1, "D": D, "n_split": 1},
    "moe gate GEMM routing": {"N": 1, "E": EXPERTS, "D": D, "steps_per_prog": 1, "stride_xn": D, "stride_we": D},
    "moe gate GEMM routing (normed)": {"N": 1, "E": EXPERTS, "D": D, "steps_per_prog": 1, "stride_xn": D,
                                       "stride_we": D, "n_sq": mhc.partial_splits(D, 2)},
    "moe route": {"N": 1, "E": EXPERTS, "n_split": 40, "stride_split": EXPERTS, "stride_ln": EXPERTS},
    **{f"moe gather {part}{tokens}": {"D": D, "I": I, "E": EXPERTS}
       for part in ("up", "down") for tokens in ("", f" ({moe_experts.GATHER_MAX_N} tokens)")},
    "sparse_attn combine": {"H": H, "n_splits": 20},
    # one query row: a tile a split (plan_splits on the H200); an 8K prefill chunk: one split of its 20 tiles; a lone
    # row over 2^18 entries in 64-row tiles: 4098 tiles in 132 splits
    "sparse_attn_fp4": {"kw": WINDOW, "kg": INDEX_TOPK, "H": H, "tiles_per_split": 1},
    "sparse_attn_fp4 (settled)": {"kw": WINDOW, "kg": INDEX_TOPK, "H": H, "tiles_per_split": 1},
    "sparse_attn_fp4 (prefill)": {"kw": WINDOW, "kg": INDEX_TOPK, "H": H, "tiles_per_split": 20},
    "sparse_attn_fp4 (long list)": {"kw": WINDOW, "kg": 1 << 18, "H": H, "tiles_per_split": 32},
    **{f"fp8_gemv {name}{form}": {"M": 1, "N": N, "K": K, "KW": K // 4, "KS": K // 32, "block_n": 32, "G": G,
                                  "n_sq": HANDED_SQUARES if name.startswith("wq_a") else 0}
       for name, N, K, G in FP8_GEMV_SHAPES for form in ("", " (TMA tiles)") if not form or name == "wo_b"},
    **{f"dense_gemv {name}": {"M": 1, "N": N, "K": K} for name, N, K, _ in DENSE_GEMV_SHAPES},
    # the prefill's grouped MoE at its 8K-token chunk (`batched_moe_kernels`): R = 8192 tokens x 7 slots
    **{f"moe grouped (prefill) {part}": {"D": D, "I": I, "S": TOP_K + 1, "E": EXPERTS, "R": 8192 * (TOP_K + 1)}
       for part in ("up", "down")},
}


def launch_compile(k: Kernel):
    """k compiled for sm_90 as its batch-1 launch specializes it (`LAUNCH_INTS`): (the compiled kernel, ptxas's
    log)."""
    ints = LAUNCH_INTS.get(k.name, {})
    sig, constexprs, attrs = signature(k), dict(k.constexprs), launch_attrs(k)
    for i, p in enumerate(k.fn.params):
        value = ints.get(p.name)
        if value == 1:
            sig[p.name], constexprs[p.name] = "constexpr", 1
        elif value is not None and value % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return compile_sm90(k, sig, constexprs, attrs)


def kernels() -> list[Kernel]:
    return (mhc_kernels() + routing_kernels() + moe_kernels() + fp8_gemv_kernels() + dense_gemv_kernels()
            + attention_kernels() + topk_kernels() + quant_kernels() + window_write_kernels() + compressor_kernels()
            + query_heads_kernels() + indexer_query_kernels() + batched_moe_kernels())


def report(name: str, rows: Iterable[dict], as_json: bool, columns: list, save: bool = True) -> None:
    """The rows (made as the loop reaches each: a kernel compiles then) each as a JSON line on stdout, or all as
    a table of `columns` and, if save, bench/results/<name>.json ($OUT/<name>.json)."""
    done = []
    for row in rows:
        done.append(row)
        if as_json:
            print(json.dumps(row), flush=True)
    if as_json:
        return
    common.print_table(columns, done)
    if save:
        result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "commit": common.git_commit(),
                  "triton": triton.__version__, "target": "sm_90, compiled offline (no GPU)", "kernels": done}
        print(f"json: {common.write_result(name, False, result)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object a kernel, no table")
    args = p.parse_args()
    rows = ({"kernel": k.name, "launch_ints": k.name in LAUNCH_INTS, "num_warps": k.num_warps, "spills_ok": k.spills_ok,
             "note": k.note, **resources(k)} for k in kernels())
    report("registers", rows, args.json, [("kernel", "kernel", ""), ("launch ints", "launch_ints", ""),
                                          ("warps", "num_warps", "d"),
                                          ("regs", "registers", "d"), ("stack", "stack", "d"),
                                          ("spills", "spills", "d"), ("shared", "shared", "d"), ("note", "note", "")])


if __name__ == "__main__":
    main()
