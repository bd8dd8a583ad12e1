"""Routed MXFP4 experts (and the shared expert) of a MoE layer as Triton kernels.

Ops (namespace dsv4, each with a fake for tracing; the torch twin runs when `use_triton` is false):

`dsv4::moe_experts_mxfp4(x, ids, weights, w13, s13, w2, s2, limit, path="auto") -> y [N, D] fp32`
`dsv4::moe_mxfp4_with_shared(x, ids, weights, w13, s13, w2, s2, shared13, shared2, limit, path="auto") -> y`
    x        [N, D]        bf16 (or fp32)
    ids      [N, k]        int64 expert ids (dsv4::route_topk), weights [N, k] fp32 routing weights
    w13      [E, 2I, D/2]  uint8 (int8 accepted): w1 rows 0..I-1 then w3 rows I..2I-1, packed e2m1, even
                           element in the low nibble; s13 [E, 2I, D/32] float8_e8m0fnu (uint8 accepted)
    w2       [E, D, I/2]   uint8, s2 [E, D, I/32] e8m0
    shared13 [2I, D], shared2 [D, I]: the shared expert, dense (bf16 at load: the checkpoint's FP8 e4m3
                           x 2^k weights are exact in bf16; an fp32 copy is accepted too)
    limit    the SwiGLU clamp (<= 0: none); path "auto" | "gather" | "grouped" | "gather_tc"
    y = sum_j expert_{ids[:, j]}(x, weights[:, j]) (+ shared_expert(x)), summed in fp32.

Math, per (token, expert) exactly as `dsv4.reference.moe.Expert.forward` with `quant_sim=False` (no FP8
activation fake-quant; the weights are dequantized exactly, e2m1 x 2^(e8m0 - 127)):
    g = round(x @ w1^T), u = round(x @ w3^T)          products exact, fp32 accumulation, round = to x.dtype
    u = clamp(u, -limit, limit), g = min(g, limit)
    h = round(silu(g) * u * route_weight)
    out = round(h @ w2^T)                              then summed over the token's experts in fp32
The shared expert is the same with weight 1 (the reference's FP8 linear also accumulates in fp32 and rounds
once). The kernel matches the twin up to fp32 summation order; in bf16 a rounding of g, u, h or out may then
land on the other side of a bf16 tie, one bf16 ulp.

Paths (all free of host syncs, so they can be captured in a CUDA graph):
- gather (decode, N <= GATHER_MAX_N under "auto"): kernel 1, one program per (token, slot, I tile), streams the
  slot's expert rows of w1 and w3 once, GEMV on the CUDA cores in fp32 (each 32-wide scale group summed
  unscaled, then scaled), SwiGLU epilogue, h (rounded) to an fp32 [N, S, I] workspace as activation planes
  (`activation_planes`, S = k, + 1 with the shared expert); kernel 2, one program per (token, D tile, slot),
  streams w2 rows and writes the slot's rounded output to [N, S, D]; a torch sum over slots gives y (the
  caller's compiled sum with `moe_gather_slots`, which takes the planes from the caller too). Both read
  the router's ids and weights as they are (the shared expert is the slot past them). Summing the slots inside
  kernel 2 (one program per token and D tile) measured slower on the H200: 104.4 against 99.7 us at V4.1 batch
  1, 195 against 171 us at two tokens. At batch 1 every selected expert's weights are read exactly once.
  V4.1 batch 1 takes ~90 us against a 42.7 us byte floor on the H200 (graph, shared expert included). Not the
  access pattern: a plain read of the routed rows in the up kernel's own pattern (8 rows x 128 bytes a step
  per 2 warps) streams at 3.6 TB/s, 89-92% of the copy rate, like contiguous tiles. What holds the GEMV is its
  instructions per byte and the loads in flight: the K loops are software-pipelined (`tl.range` stages; a plain
  loop issues a step's loads after the last step's math) and decode whole words (below); together they took
  the routed up GEMV from 50.8 to 38.5 us, but it still streams at ~1.9 TB/s. gather_tc (tensor cores)
  measured no faster at one token (118 us, against 114.7 for gather then).
- grouped: token-slots sorted by expert on the device (argsort, scatter_add counts, cumsum, searchsorted),
  a tile table padded to a static upper bound cdiv(N*S, BM) + min(E+1, N*S) (empty tiles exit at once);
  tiles never straddle experts. Kernel 1 is a grouped GEMM (tensor cores, bf16 operands: dequantized e2m1 is
  exact in bf16) writing h in sorted order; kernel 2 the grouped down GEMM writing each slot's rounded
  output to [N*S, D], its output tile (BND) twice kernel 1's (BN: kernel 1 holds two accumulators, gate and up);
  a torch sum over slots gives y.
- gather_tc (decode on the tensor cores; not chosen by "auto", see GATHER_MAX_N): the grouped kernels without the
  sort and the tile table. A program (row tile, token-slot q) scans the N*S expert ids itself: q leads the chunk of
  up to BM = 16 token-slots of its expert (in token-slot order) that starts at q, other programs exit at once; so
  every token of the batch that selected an expert is served from one read of that expert's rows (up to 16 per
  read). The MMA is swapped: the weight rows are its M side (A [BN, BK/4] per K phase) and the chunk's activations
  its N side (B [BK/4, 16], zero columns past the chunk), so one token needs no 64-row M tile. Each program streams
  its BN rows over all of K once (h rows are the token-slots, [N*S, I] and [N*S, D] as above); the grid is
  cdiv(rows, BN) x N*S, 7 slots x 2304/BN up-programs and 7 x 5120/BN down-programs at V4.1 batch 1. Each token's
  slots are visited last first, so the dense shared expert (4x the bytes per row of an MXFP4 one) starts first.
  Meant for decode sizes: every program scans all N*S ids.
The shared expert is one more slot (expert id E) in every path, so the layer's expert part is one op.
FP4 decoding. gather: the codes are read as int32 words (eight K positions); each code's sign and magnitude
bits placed as an FP8 e4m3 byte are its value times 2^-6, which one cvt per two codes widens to fp16x2
(`_WORD_DOT_PTX`), and the activations come as eight planes (plane j holds elements 8c + j), so the eight that
meet a word are one vector load per plane and nothing is split across threads; in sm_90 SASS (Triton 3.6) the
batch-1 up loop runs ~35 instructions per word (16 rows x 256 K, 2 warps, two stages; 27 of them the decode and the
FMAs), 55 with the earlier nibble-to-fp16 decode and the activations split into even and odd halves through shared
memory. Tensor-core paths: the codes are read as
16-bit words (four K positions each) and decoded straight to scaled bf16 MMA operands, one per K phase (k mod 4), by byte-permute lookups and one
bf16x2 FMA per pair (`_E2M1_BF16_PTX`); the activations are split into the same phases (`_quarters`). In sm_90
SASS (Triton 3.9) gather_tc's up / down loops run ~4.6 / ~5.3 instructions per weight value per thread, MMA and
activation handling included (BN 64, K step 128, 4 warps). The interpreter computes the same values arithmetically
(`tests/fast/test_inline_ptx.py` runs both PTX snippets in an emulator against that). Under the Triton interpreter
(TRITON_INTERPRET=1) all dots run in fp32 and bf16 rounding is done on the bits (the interpreter mishandles bf16
arithmetic and truncates casts).
Scales are assumed in 2^-126 .. 2^127 (what dsv4.quant writes); the tensor-core decode is exact up to 2^123.
The tensor-core paths step K by a power of two dividing D (and I), at least 64 on the GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dsv4.fast.kernels import pdl, start_successor, tl, to_bf16, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.fp8_gemv import _dot4
from dsv4.fast.kernels.quant import _e2m1_values
from dsv4.quant import dequantize_mxfp4

__all__ = [
    "GATHER_MAX_N",
    "activation_planes",
    "fp8_rows",
    "moe_experts_mxfp4",
    "moe_experts_twin",
    "moe_gather_slots",
    "moe_mxfp4_with_shared",
    "moe_slots_twin",
    "stack_expert_weights",
]

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# "auto", from the H200 at V4.1 widths (graph replay, shared expert fused; `dev/moe-experts-sweeps-s30.json`,
# `dev/moe-experts-crossover-s30.json`): gather up to 16 tokens, grouped above. Since the gather's 16 x 256 tiles it
# beats gather_tc at every N measured (N = 4: 262.5 against 329.5 us, 8: 494.6 / 586.4, 16: 956.5 / 1057.1) and
# grouped up to 16 (N = 12: 725.1 against 803.1 us, 16: 956.5 / 1002.1); gather_tc is an explicit path only
GATHER_MAX_N = 16
MAX_SCALE_EXP = 123  # largest MXFP4 scale exponent the tensor-core decode (`_E2M1_BF16_PTX`) keeps exact


# ------------------------------------------------------------------------------------------------
# Load-time re-layout and the twin


def stack_expert_weights(moe, shared_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The reference `MoE` module's routed experts (fmt "fp4") stacked for the kernels: w13 [E, 2I, D/2]
    uint8 (w1 rows then w3 rows), s13 [E, 2I, D/32] e8m0, w2 [E, D, I/2], s2 [E, D, I/32]; the shared expert
    dequantized to `shared_dtype` (shared13 [2I, D], shared2 [D, I]); limit. Checkpoint names stay per expert."""
    ex = list(moe.experts)
    if any(e.w1.fmt != "fp4" for e in ex):
        raise ValueError("stack_expert_weights: routed experts must be MXFP4 (fmt 'fp4')")
    u8 = lambda t: t.detach().view(torch.uint8) if t.dtype == torch.int8 else t.detach()
    w13 = torch.stack([torch.cat([u8(e.w1.weight), u8(e.w3.weight)]) for e in ex])
    s13 = torch.stack([torch.cat([e.w1.scale.detach(), e.w3.scale.detach()]) for e in ex])
    w2 = torch.stack([u8(e.w2.weight) for e in ex])
    s2 = torch.stack([e.w2.scale.detach() for e in ex])
    top = max(int(s.view(torch.uint8).max()) for s in (s13, s2)) - 127 if s13.numel() else 0
    if top > MAX_SCALE_EXP:
        raise ValueError(f"stack_expert_weights: an MXFP4 expert scale is 2^{top}, above 2^{MAX_SCALE_EXP}, where "
                         "the tensor-core decode stops being exact")
    sh = moe.shared_experts
    shared13 = torch.cat([sh.w1.dequantized_weight(), sh.w3.dequantized_weight()]).to(shared_dtype)
    shared2 = sh.w2.dequantized_weight().to(shared_dtype)
    return {"w13": w13, "s13": s13, "w2": w2, "s2": s2, "shared13": shared13, "shared2": shared2,
            "limit": float(ex[0].limit)}


def _expert_math(x, w13, w2, route_w, limit):
    """Expert.forward (quant_sim=False) from the dequantized fp32 (or dense) stacked weights."""
    inter = w13.shape[0] // 2
    gu = F.linear(x.float(), w13.float()).to(x.dtype).float()
    g, u = gu[:, :inter], gu[:, inter:]
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if route_w is not None:
        h = h * route_w
    return F.linear(h.to(x.dtype).float(), w2.float()).to(x.dtype)


def moe_slots_twin(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None):
    """Pure torch: each slot's output [N, S, D] fp32, the reference math: slot j < k the routed expert ids[:, j]
    (weighted), slot k the shared expert when there is one (host syncs; not for graphs)."""
    N, k = ids.shape
    out = torch.zeros(N, k + (shared13 is not None), x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        w13e = dequantize_mxfp4(w13[e], s13[e].view(torch.float8_e8m0fnu))
        w2e = dequantize_mxfp4(w2[e], s2[e].view(torch.float8_e8m0fnu))
        out[tok, slot] = _expert_math(x[tok], w13e, w2e, weights[tok, slot, None], limit).float()
    if shared13 is not None:
        out[:, k] = _expert_math(x, shared13, shared2, None, limit).float()
    return out


def moe_experts_twin(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None):
    """Pure torch: y [N, D] fp32, the slots' outputs summed in fp32 (host syncs; not for graphs)."""
    return moe_slots_twin(x, ids, weights, w13, s13, w2, s2, limit, shared13, shared2).sum(dim=1)


# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round(v, IS_BF16: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> the activation dtype and back (round to nearest even), or v itself for fp32 activations."""
    if IS_BF16:
        return to_bf16(v, INTERP).to(tl.float32)
    else:
        return v


# One 32-bit word of packed codes (eight K positions, low nibble first) and the eight activations (fp32) ->
# sum_j e2m1_j * a_j / 64, exactly the products, summed in K order (a multiply, then seven FMAs). A code's sign
# and magnitude bits placed as an FP8 e4m3 byte (sign at bit 7, magnitude at bits 2-4) are its e2m1 value times
# 2^-6, subnormal codes included; sm_89's cvt widens two such bytes to fp16x2 in one instruction, fp16 -> fp32 is
# exact. ~9 integer ops for the eight bytes, 4 cvt, 8 widenings and 8 FMAs per word.
_WORD_DOT_PTX = tl.constexpr("\n".join([
    "{",
    ".reg .b32 t, u, l, h, p0, p1, p2, p3;",
    ".reg .b16 l0, l1, h0, h1, x0, x1, x2, x3, x4, x5, x6, x7;",
    ".reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;",
    "shl.b32 t, $1, 4;",  # low nibbles (elements 0, 2, 4, 6): sign bit 3 -> 7
    "and.b32 t, t, 0x80808080;",
    "shl.b32 u, $1, 2;",  # magnitude bits 0-2 -> 2-4
    "and.b32 u, u, 0x1C1C1C1C;",
    "or.b32 l, t, u;",
    "and.b32 t, $1, 0x80808080;",  # high nibbles (elements 1, 3, 5, 7): the sign is at bit 7 already
    "shr.b32 u, $1, 2;",  # magnitude bits 4-6 -> 2-4
    "and.b32 u, u, 0x1C1C1C1C;",
    "or.b32 h, t, u;",
    "mov.b32 {l0, l1}, l;",
    "mov.b32 {h0, h1}, h;",
    "cvt.rn.f16x2.e4m3x2 p0, l0;",  # (element 0, element 2)
    "cvt.rn.f16x2.e4m3x2 p1, l1;",  # (4, 6)
    "cvt.rn.f16x2.e4m3x2 p2, h0;",  # (1, 3)
    "cvt.rn.f16x2.e4m3x2 p3, h1;",  # (5, 7)
    "mov.b32 {x0, x2}, p0;",
    "mov.b32 {x4, x6}, p1;",
    "mov.b32 {x1, x3}, p2;",
    "mov.b32 {x5, x7}, p3;",
] + [f"cvt.f32.f16 f{j}, x{j};" for j in range(8)] + ["mul.f32 $0, f0, $2;"]
  + [f"fma.rn.f32 $0, f{j}, ${j + 2}, $0;" for j in range(1, 8)] + ["}"]))
_WORD_DOT_OPERANDS = tl.constexpr("=f,r,f,f,f,f,f,f,f,f")  # $0 the sum; $1 the word, $2..$9 the activations
_WORD_DOT_UNIT = tl.constexpr(64.0)  # `_word_dot` returns the dot product divided by this


@triton.jit
def _word_dot(w, a0, a1, a2, a3, a4, a5, a6, a7, INTERP: tl.constexpr):
    """w int32 (eight codes) and a0..a7 fp32 (same shape) -> sum_j e2m1_j * a_j / _WORD_DOT_UNIT, fp32."""
    if INTERP:  # the same products (exact) and sums, in the same order
        s = _e2m1_values(w & 15) * a0 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 4) & 15) * a1 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 8) & 15) * a2 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 12) & 15) * a3 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 16) & 15) * a4 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 20) & 15) * a5 / _WORD_DOT_UNIT
        s += _e2m1_values((w >> 24) & 15) * a6 / _WORD_DOT_UNIT
        return s + _e2m1_values((w >> 28) & 15) * a7 / _WORD_DOT_UNIT
    else:
        return tl.inline_asm_elementwise(_WORD_DOT_PTX, _WORD_DOT_OPERANDS, [w, a0, a1, a2, a3, a4, a5, a6, a7],
                                         dtype=tl.float32, is_pure=True, pack=1)


# Two 16-bit words of packed codes (four K positions each, low nibble first) and their scales (bf16x2, one per
# word) -> the four K phases, each as bf16x2 (word 0, word 1) of e2m1 * scale, exactly, for the tensor cores.
# Each code is first made X = 24 + v (v its signed e2m1 value): X lies in [18, 30], one binade, so its bf16 is
# 0x41 over the low byte 0x80 | (64 + 8v), and that byte comes from a byte permute (PRMT) over a table indexed by
# the code. PRMT takes 3 index bits and, with the 4th (the code's sign) set, returns the table byte's top bit
# spread instead (0xFF: every entry has its top bit set); so one permute over the v >= 0 table and one over the
# v <= 0 table with the sign bits flipped, ANDed, give every code's byte. A third permute places two codes'
# bytes (and 0xFF above each, ANDed to 0x41), and v * scale = fma(X, scale, -24 * scale), exact (both terms and
# the result are bf16 numbers for scales <= 2^123). 22 instructions per 8 values.
_E2M1_BF16_PTX = tl.constexpr("\n".join([
    "{",
    ".reg .b32 pa, pb, na, nb, m24, z, x, q1, x1, l0, l1, c, a;",
    "mov.b32 pa, 0xCCC8C4C0;",  # v >= 0 table: 0x80 | (64 + 8|v|), |v| = 0, .5, 1, 1.5
    "mov.b32 pb, 0xF0E0D8D0;",  # |v| = 2, 3, 4, 6
    "mov.b32 na, 0xB4B8BCC0;",  # v <= 0 table: 0x80 | (64 - 8|v|)
    "mov.b32 nb, 0x90A0A8B0;",
    "mov.b32 m24, 0xC1C0C1C0;",  # bf16x2 (-24, -24)
    "mov.b32 z, 0x80008000;",  # bf16x2 (-0, -0)
    "xor.b32 x, $4, 0x88888888;",  # sign bits flipped: v <= 0 codes index the second table
    "shr.u32 q1, $4, 16;",  # PRMT reads its four selectors from bits 0-15: word 1's codes
    "shr.u32 x1, x, 16;",
    "prmt.b32 l0, pa, pb, $4;",
    "prmt.b32 a, na, nb, x;",
    "and.b32 l0, l0, a;",  # X's low bytes for word 0's four codes
    "prmt.b32 l1, pa, pb, q1;",
    "prmt.b32 a, na, nb, x1;",
    "and.b32 l1, l1, a;",  # word 1's
    "fma.rn.bf16x2 c, $5, m24, z;",  # -24 * scale (bf16x2 multiplies need sm_90, FMAs sm_80)
] + [line for k, sel in enumerate(("0xC480", "0xD591", "0xE6A2", "0xF7B3")) for line in (
    f"prmt.b32 a, l0, l1, {sel};",  # (word 0 code k, 0xFF, word 1 code k, 0xFF)
    "and.b32 a, a, 0x41FF41FF;",
    f"fma.rn.bf16x2 ${k}, a, $5, c;",
)] + ["}"]))
# $0..$3 the four K phases (bf16 pairs); $4 two int16 words of codes, $5 their two bf16 scales (pack=2)
_E2M1_BF16_OPERANDS = tl.constexpr("=r,=r,=r,=r,r,r")


@triton.jit
def _e2m1_quads(q, s, INTERP: tl.constexpr):
    """Packed codes as int16 words q (four K positions each) and their scales s (bf16, same shape) -> the four K
    phases e2m1 * s exactly: bf16 MMA operands, fp32 under the interpreter (its dots run in fp32)."""
    if INTERP:
        q = q.to(tl.int32)
        s = s.to(tl.float32)
        return (_e2m1_values(q & 15) * s, _e2m1_values((q >> 4) & 15) * s, _e2m1_values((q >> 8) & 15) * s,
                _e2m1_values((q >> 12) & 15) * s)
    else:
        return tl.inline_asm_elementwise(_E2M1_BF16_PTX, _E2M1_BF16_OPERANDS, [q, s], dtype=(tl.bfloat16,) * 4,
                                         is_pure=True, pack=2)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, rows64, rmask, row_bytes, row_scales, k0, BK: tl.constexpr, INTERP: tl.constexpr):
    """Packed rows `rows64` ([R]), K elements k0 .. k0+BK-1 (BK divides K) -> their four phases (elements k0 + 4j
    + p, p = 0..3) [R, BK/4] each, e2m1 * 2^(e8m0 - 127) exactly, as MMA operands (`_e2m1_quads`); masked rows
    read as 0. The codes are read as 16-bit words, so the MMA operand layout holds a word pair per register."""
    R: tl.constexpr = rows64.shape[0]
    QB: tl.constexpr = BK // 4
    NS: tl.constexpr = BK // 32
    # BK divides K, so each row's step starts a multiple of QB words and NS scales in: aligned vector loads (and
    # asynchronous copies, which need at least 4 bytes) once the compiler knows it
    q0 = tl.multiple_of(rows64 * (row_bytes // 2) + k0 // 4, QB)
    e0 = tl.multiple_of(rows64 * row_scales + k0 // 32, NS)
    q = tl.load(w_ptr.to(tl.pointer_type(tl.int16)) + q0[:, None] + tl.arange(0, QB)[None, :], mask=rmask[:, None],
                other=0)
    e = tl.load(s_ptr + e0[:, None] + tl.arange(0, NS)[None, :], mask=rmask[:, None], other=0)
    s = (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(e - 127) for e >= 1 (masked rows: 0)
    return _e2m1_quads(q, tl.reshape(tl.broadcast_to(s[:, :, None], (R, NS, 8)), (R, QB)), INTERP)


@triton.jit
def _quarters(a):
    """a [M, K] -> its four K phases (columns 4j + p, p = 0..3) [M, K/4] each, matching `_fp4_tile`."""
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    even, odd = tl.split(tl.reshape(a, (M, K // 4, 2, 2)))  # [M, K/4, 2]: columns 4j + {0, 2}, 4j + {1, 3}
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def _plane_offset(k, K):
    """Where element k of a K-long row sits in its activation planes (`activation_planes`): plane k % 8, column
    k // 8."""
    return (k % 8) * (K // 8) + k // 8


@triton.jit
def _activation_plane(planes, j: tl.constexpr, plane, c, R: tl.constexpr, EVEN: tl.constexpr):
    """Activations 8c + j ([NW] for the word columns c) of `planes` (see `activation_planes`), as [R, NW]."""
    if EVEN:  # planes of K / 8 columns, K % 128 == 0, c starting at a multiple of 16: 16-byte copies
        a = tl.load(planes + tl.multiple_of(j * plane + c, 16))
    else:
        a = tl.load(planes + j * plane + c, mask=c < plane, other=0.0)
    return tl.broadcast_to(a[None, :], (R, c.shape[0]))


@triton.jit
def _group_exponents(s_ptr, rows64, rmask, row_scales, k0, G: tl.constexpr, EVEN: tl.constexpr):
    """The e8m0 exponents [R, G] (int32) of scale groups k0 / 32 .. + G of the rows. EVEN (the step's groups lie
    in the row, G a multiple of 4, rows of 4-byte multiples at a 4-byte aligned s_ptr): read as int32 words of four,
    lowest byte first, so each load is an asynchronous copy; bytes are not (the pipeliner staged them through
    registers: a load, a shared-memory store and a barrier more a step)."""
    if EVEN:
        sw = k0 // 128 + tl.arange(0, G // 4)
        words = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + rows64[:, None] * (row_scales // 4) + sw[None, :],
                        mask=rmask[:, None], other=0)  # [R, G/4]
        shifts = 8 * tl.arange(0, 4)
        return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 255, (rows64.shape[0], G))
    else:
        g = k0 // 32 + tl.arange(0, G)
        live = rmask[:, None] & (g < row_scales)[None, :]
        return tl.load(s_ptr + rows64[:, None] * row_scales + g[None, :], mask=live, other=0).to(tl.int32)


@triton.jit
def _sum_eights(p):
    """p [R, K] -> [R, K/8], sums of eight neighbours: the eight bf16 weights of one 16-byte load sit in one
    thread, so this stays in registers, where a sum over K per step crossed threads every step."""
    return tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 8, 8)), axis=2)


@triton.jit
def _code_dot(w, a0, a1, a2, a3, a4, a5, a6, a7, FP8: tl.constexpr, INTERP: tl.constexpr):
    """Eight codes and the eight activations they meet -> their exact products summed in K order, fp32: packed
    FP4 (w an int32 word; the sum over _WORD_DOT_UNIT) or FP8 e4m3 (w an int64, lowest byte first)."""
    if FP8:
        lo = _dot4(tl.zeros(w.shape, tl.float32), w.to(tl.int32), a0, a1, a2, a3, INTERP)
        return _dot4(lo, (w >> 32).to(tl.int32), a4, a5, a6, a7, INTERP)
    else:
        return _word_dot(w, a0, a1, a2, a3, a4, a5, a6, a7, INTERP)


@triton.jit
def _gemv_words(acc, w_ptr, s_ptr, rows64, rmask, row_words, row_scales, planes, k0, NW: tl.constexpr,
                INTERP: tl.constexpr, EVEN: tl.constexpr, FP8: tl.constexpr):
    """acc [R, NW/4] + rows `rows64` of eight-code words . activations k0 .. k0 + 8 NW - 1 (`planes`: see
    `activation_planes`), per 32-element scale group: the four words' exact products summed unscaled, then scaled.
    The words are packed FP4 (int32, `_word_dot`'s units) or FP8 e4m3 with a scale per row and 32 elements (int64,
    `fp8_rows`): either way a row is K / 8 words and word c meets column c of the eight planes. The caller sums
    over the groups once, after its K loop (a sum per step crossed threads every step: on the H200 the routed down
    GEMV took 36.0 us with it, 28.0 without). EVEN: the step lies in the
    row (no K masks) and the scales come as words (`_group_exponents`); rows then start on multiples of 16 words
    (K % 128 == 0), said to the compiler: it knew K // 8 only as even, so it copied 8 bytes at a time and split
    each scale group's four words over two threads (a shuffle a group); told, 16-byte copies and a group a thread
    (sm_90 SASS, Triton 3.6: the batch-1 up loop 623 -> 553 instructions)."""
    c = k0 // 8 + tl.arange(0, NW)  # word columns
    if EVEN:
        row0 = tl.multiple_of(rows64 * row_words, 16)
        w = tl.load(w_ptr + row0[:, None] + c[None, :], mask=rmask[:, None], other=0)  # [R, NW] int32
    else:
        w = tl.load(w_ptr + rows64[:, None] * row_words + c[None, :], mask=rmask[:, None] & (c < row_words)[None, :],
                    other=0)
    part = _group_dots(w, planes, row_words, c, EVEN, FP8, INTERP)
    e = _group_exponents(s_ptr, rows64, rmask, row_scales, k0, NW // 4, EVEN)
    return acc + part * (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_dots(w, planes, n, c, EVEN: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr):
    """Words w [R, NW] (`_gemv_words`' codes) . the activations of their word columns c ([NW], planes of n columns),
    summed per 32-element scale group (four words), unscaled: [R, NW/4]."""
    R: tl.constexpr = w.shape[0]
    NW: tl.constexpr = w.shape[1]
    p = _code_dot(w, _activation_plane(planes, 0, n, c, R, EVEN), _activation_plane(planes, 1, n, c, R, EVEN),
                  _activation_plane(planes, 2, n, c, R, EVEN), _activation_plane(planes, 3, n, c, R, EVEN),
                  _activation_plane(planes, 4, n, c, R, EVEN), _activation_plane(planes, 5, n, c, R, EVEN),
                  _activation_plane(planes, 6, n, c, R, EVEN), _activation_plane(planes, 7, n, c, R, EVEN), FP8,
                  INTERP)
    return tl.sum(tl.reshape(p, (R, NW // 4, 4)), axis=2)


@triton.jit
def _mma(a, b, acc, LOW: tl.constexpr):
    """acc + a @ b with fp32 accumulation: bf16 tensor cores (operands exact in bf16) or exact fp32."""
    if LOW:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _swiglu(g, u, wt, limit, IS_BF16: tl.constexpr, INTERP: tl.constexpr):
    g = _round(g, IS_BF16, INTERP)
    u = _round(u, IS_BF16, INTERP)
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    return g / (1.0 + tl.exp(-g)) * u * wt


@triton.jit
def _slot_expert(ids_ptr, t, slot, K, E):
    """Token t's expert in `slot`: the router's [N, K] ids, then the shared expert (id E) past them, so the
    gather path reads the router's outputs as they are (no slot table built by torch before it)."""
    return tl.load(ids_ptr + t * K + slot, mask=slot < K, other=E)


@triton.jit
def _up_sums(w_ptr, s_ptr, rows_g, rows_u, imask, D, planes, BK: tl.constexpr, STAGES: tl.constexpr,
             INTERP: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr):
    """x . w1 rows and x . w3 rows ([BI] fp32 each) of eight-code words (`_gemv_words`), x as its planes."""
    BI: tl.constexpr = rows_g.shape[0]
    part_g = tl.zeros((BI, BK // 32), dtype=tl.float32)
    part_u = tl.zeros((BI, BK // 32), dtype=tl.float32)
    # software-pipelined: the next steps' weights are in flight while this one is decoded (a plain loop issued
    # each step's loads after the last step's math; on the H200, with the word decode, the routed up GEMV alone
    # 50.8 -> 38.5 us)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        part_g = _gemv_words(part_g, w_ptr, s_ptr, rows_g, imask, D // 8, D // 32, planes, k0, BK // 8, INTERP,
                             EVEN_K, FP8)
        part_u = _gemv_words(part_u, w_ptr, s_ptr, rows_u, imask, D // 8, D // 32, planes, k0, BK // 8, INTERP,
                             EVEN_K, FP8)
    unit = 1.0 if FP8 else _WORD_DOT_UNIT
    return tl.sum(part_g, axis=1) * unit, tl.sum(part_u, axis=1) * unit


@triton.jit
def _gather_up_kernel(
    x_ptr, xp_ptr, ids_ptr, wts_ptr, w13_ptr, s13_ptr, sh13_ptr, shq13_ptr, she13_ptr, hp_ptr,
    D, I, S, K, E, limit,
    BI: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, IS_BF16: tl.constexpr, INTERP: tl.constexpr,
    SHARED: tl.constexpr, SH_FP8: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Program (t, slot, i tile): h[t, slot, i] = swiglu(x[t] . w1[e, i], x[t] . w3[e, i]) * weight, rounded,
    written as activation planes (`activation_planes`) for the down kernel. x [N, D] as given (the shared
    expert's dense rows read it) and as planes xp [N, 8, D/8]; w13 as int32 words; SH_FP8: the shared expert's
    rows as FP8 words (shq13, int64) and their scales (she13, `fp8_rows`), not its dense rows."""
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    i = tl.program_id(2) * BI + tl.arange(0, BI)
    imask = i < I
    e = _slot_expert(ids_ptr, t, slot, K, E)
    wt = tl.load(wts_ptr + t * K + slot, mask=slot < K, other=1.0)  # the shared expert's weight is 1
    acc_g = tl.zeros((BI,), dtype=tl.float32)
    acc_u = tl.zeros((BI,), dtype=tl.float32)
    x_row = x_ptr + t * D
    planes = xp_ptr + t * D
    if e < E:
        rows_g = e * 2 * I + i.to(tl.int64)
        acc_g, acc_u = _up_sums(w13_ptr, s13_ptr, rows_g, rows_g + I, imask, D, planes, BK, STAGES, INTERP, EVEN_K,
                                False)
    elif SHARED and SH_FP8:
        acc_g, acc_u = _up_sums(shq13_ptr, she13_ptr, i.to(tl.int64), i.to(tl.int64) + I, imask, D, planes, BK,
                                STAGES, INTERP, EVEN_K, True)
    elif SHARED:  # the shared expert, dense (see SHARED in moe_triton)
        i64 = i.to(tl.int64)
        sh_g = tl.zeros((BI, BK // 8), dtype=tl.float32)
        sh_u = tl.zeros((BI, BK // 8), dtype=tl.float32)
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            km = kk < D
            xv = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)
            m2 = imask[:, None] & km[None, :]
            wg = tl.load(sh13_ptr + i64[:, None] * D + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(sh13_ptr + (i64 + I)[:, None] * D + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            sh_g += _sum_eights(wg * xv[None, :])
            sh_u += _sum_eights(wu * xv[None, :])
        acc_g = tl.sum(sh_g, axis=1)
        acc_u = tl.sum(sh_u, axis=1)
    h = _round(_swiglu(acc_g, acc_u, wt, limit, IS_BF16, INTERP), IS_BF16, INTERP)
    tl.store(hp_ptr + (t * S + slot) * I + _plane_offset(i, I), h, mask=imask)


@triton.jit
def _down_sum(w_ptr, s_ptr, rows, dmask, I, planes, BK: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr,
              EVEN_K: tl.constexpr, FP8: tl.constexpr, TAIL: tl.constexpr):
    """h . w2 rows ([BD] fp32) of eight-code words (`_gemv_words`), h as its planes. TAIL > 0 (`down_tail`): the
    row's last TAIL columns, short of a whole step, are one narrower step of their own, so that every step reads
    whole (EVEN_K: no K masks, 16-byte copies, the scales as words); it comes before the loop, its registers free
    again for the pipelined loop's (after it, the kernel took 121 registers where it takes 96)."""
    total = tl.zeros((rows.shape[0],), dtype=tl.float32)
    if TAIL > 0:
        last = tl.zeros((rows.shape[0], TAIL // 32), dtype=tl.float32)
        last = _gemv_words(last, w_ptr, s_ptr, rows, dmask, I // 8, I // 32, planes, I - TAIL, TAIL // 8, INTERP,
                           True, FP8)
        total = tl.sum(last, axis=1)
    part = tl.zeros((rows.shape[0], BK // 32), dtype=tl.float32)
    for k0 in tl.range(0, I - TAIL, BK, num_stages=STAGES):
        part = _gemv_words(part, w_ptr, s_ptr, rows, dmask, I // 8, I // 32, planes, k0, BK // 8, INTERP, EVEN_K,
                           FP8)
    return (total + tl.sum(part, axis=1)) * (1.0 if FP8 else _WORD_DOT_UNIT)


@triton.jit
def _gather_down_kernel(
    hp_ptr, ids_ptr, w2_ptr, s2_ptr, sh2_ptr, shq2_ptr, she2_ptr, out_ptr,
    D, I, S, K, E,
    BD: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, IS_BF16: tl.constexpr, INTERP: tl.constexpr,
    SHARED: tl.constexpr, SH_FP8: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr, TAIL: tl.constexpr,
):
    """Program (t, d tile, slot): out[t, slot, d] = round(h[t, slot] . w2[e, d]) (the caller sums the slots);
    h as the up kernel's planes, w2 as int32 words; SH_FP8 as in the up kernel (shq2, she2); TAIL as `_down_sum`'s.
    Its successor (the slots' reader: the FFN site's fused post, `settled`) starts as its last programs do."""
    wait_for_predecessor(PDL)
    start_successor(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    slot = tl.program_id(2)
    dmask = d < D
    d64 = d.to(tl.int64)
    e = _slot_expert(ids_ptr, t, slot, K, E)
    planes = hp_ptr + (t * S + slot) * I
    acc = tl.zeros((BD,), dtype=tl.float32)
    if e < E:
        acc = _down_sum(w2_ptr, s2_ptr, e * D + d64, dmask, I, planes, BK, STAGES, INTERP, EVEN_K, False, TAIL)
    elif SHARED and SH_FP8:
        acc = _down_sum(shq2_ptr, she2_ptr, d64, dmask, I, planes, BK, STAGES, INTERP, EVEN_K, True, TAIL)
    elif SHARED:
        sh_part = tl.zeros((BD, BK // 8), dtype=tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            hv = tl.load(planes + _plane_offset(kk, I), mask=km, other=0.0)
            w = tl.load(sh2_ptr + d64[:, None] * I + kk[None, :], mask=dmask[:, None] & km[None, :],
                        other=0.0).to(tl.float32)
            sh_part += _sum_eights(w * hv[None, :])
        acc = tl.sum(sh_part, axis=1)
    tl.store(out_ptr + (t * S + slot) * D + d, _round(acc, IS_BF16, INTERP), mask=dmask)


@triton.jit
def _mma_rows(xa, w, acc, LOW: tl.constexpr, SWAP: tl.constexpr):
    """acc + xa @ w^T (xa [BM, K] token rows, w [BN, K] weight rows; acc [BM, BN]), or with SWAP acc^T + w @ xa^T
    (acc [BN, BM]): the weight rows on the MMA's M side, so a few tokens need no 64-row M tile."""
    if SWAP:
        return _mma(w, tl.trans(xa), acc, LOW)
    else:
        return _mma(xa, tl.trans(w), acc, LOW)


@triton.jit
def _mma_fp4(a0, a1, a2, a3, w_ptr, s_ptr, rows64, rmask, K, k0, BK: tl.constexpr, acc, LOW: tl.constexpr,
             SWAP: tl.constexpr, INTERP: tl.constexpr):
    """acc + the K step k0 .. k0+BK-1 of activations (as `_quarters`) against packed FP4 rows (`_mma_rows`)."""
    w0, w1, w2, w3 = _fp4_tile(w_ptr, s_ptr, rows64, rmask, K // 2, K // 32, k0, BK, INTERP)
    acc = _mma_rows(a0, w0, acc, LOW, SWAP)
    acc = _mma_rows(a1, w1, acc, LOW, SWAP)
    acc = _mma_rows(a2, w2, acc, LOW, SWAP)
    return _mma_rows(a3, w3, acc, LOW, SWAP)


@triton.jit
def _group(ids_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, R, S, BM: tl.constexpr, FIND: tl.constexpr):
    """This program's token-slots, all of one expert, and its weight-row tile: (expert, or -1 when it has none; the
    token-slots' h rows [BM]; their mask; token * S + slot [BM]; row tile index).
    FIND = 0 (grouped): grid (tile, row tile) over the sorted tile table. FIND = a power of two >= R = N * S
    (gather_tc): grid (row tile, token-slot), each token's slots taken last first; token-slot q has rows when it
    leads a chunk of BM of its expert's token-slots (in q order), and the h rows are the token-slots."""
    if FIND:
        p = tl.program_id(1)
        q = p + S - 1 - 2 * (p % S)
        e = tl.load(ids_ptr + q)
        qq = tl.arange(0, FIND)
        same = (tl.load(ids_ptr + qq, mask=qq < R, other=-1) == e).to(tl.int32)  # [FIND]
        before = tl.cumsum(same, 0) - same  # same-expert token-slots before each
        rank = tl.sum(tl.where(qq < q, same, 0))  # ... before q
        pick = (same[None, :] != 0) & (before[None, :] == rank + tl.arange(0, BM)[:, None])  # [BM, FIND]
        src = tl.sum(tl.where(pick, qq[None, :], 0), axis=1).to(tl.int64)
        rmask = tl.sum(pick.to(tl.int32), axis=1) > 0
        return tl.where(rank % BM == 0, e, -1), src, rmask, src, tl.program_id(0)
    else:
        p = tl.program_id(0)
        e = tl.load(tile_e_ptr + p).to(tl.int64)
        rows = tl.load(tile_r0_ptr + p) + tl.arange(0, BM)
        rmask = rows < tl.load(tile_r1_ptr + p)  # an empty tile's range lies inside the table too
        return e, rows, rmask, tl.load(order_ptr + rows, mask=rmask, other=0), tl.program_id(1)


@triton.jit
def _grouped_up_kernel(
    x_ptr, ids_ptr, order_ptr, wts_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, w13_ptr, s13_ptr, sh13_ptr, h_ptr,
    D, I, S, E, R, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    IS_BF16: tl.constexpr, INTERP: tl.constexpr, SH_LOW: tl.constexpr, FIND: tl.constexpr, SHARED: tl.constexpr,
):
    """Program (group, i tile) (`_group`): the group's token-slots (of one expert) x w1/w3 rows -> h rows."""
    e, rows, rmask, src, it = _group(ids_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, R, S, BM, FIND)
    if e < 0:
        return
    tok = src // S
    n = it * BN + tl.arange(0, BN)
    nmask = n < I
    n64 = n.to(tl.int64)
    LOW: tl.constexpr = IS_BF16 and not INTERP
    SWAP: tl.constexpr = FIND > 0
    acc_g = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
    if e < E:
        rows_g = e * 2 * I + n64
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            xa = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=rmask[:, None], other=0.0)
            x0, x1, x2, x3 = _quarters(xa)
            acc_g = _mma_fp4(x0, x1, x2, x3, w13_ptr, s13_ptr, rows_g, nmask, D, k0, BK, acc_g, LOW, SWAP, INTERP)
            acc_u = _mma_fp4(x0, x1, x2, x3, w13_ptr, s13_ptr, rows_g + I, nmask, D, k0, BK, acc_u, LOW, SWAP, INTERP)
    elif SHARED:  # the shared expert's dense rows (see SHARED in moe_triton)
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            xa = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=rmask[:, None], other=0.0)
            wg = tl.load(sh13_ptr + n64[:, None] * D + kk[None, :], mask=nmask[:, None], other=0.0)
            wu = tl.load(sh13_ptr + (n64 + I)[:, None] * D + kk[None, :], mask=nmask[:, None], other=0.0)
            acc_g = _mma_rows(xa, wg, acc_g, SH_LOW, SWAP)
            acc_u = _mma_rows(xa, wu, acc_u, SH_LOW, SWAP)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    wt = tl.load(wts_ptr + src, mask=rmask, other=0.0)
    h = _swiglu(acc_g, acc_u, wt[:, None], limit, IS_BF16, INTERP)
    dst = h_ptr + rows.to(tl.int64)[:, None] * I + n[None, :]
    m = rmask[:, None] & nmask[None, :]
    if IS_BF16:
        tl.store(dst, to_bf16(h, INTERP), mask=m)
    else:
        tl.store(dst, h, mask=m)


@triton.jit
def _grouped_down_kernel(
    h_ptr, ids_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, w2_ptr, s2_ptr, sh2_ptr, out_ptr,
    D, I, S, E, R,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    IS_BF16: tl.constexpr, INTERP: tl.constexpr, SH_LOW: tl.constexpr, FIND: tl.constexpr, SHARED: tl.constexpr,
):
    """Program (group, d tile) (`_group`): round(h rows . w2[e] rows) -> out[token * S + slot, d]."""
    e, rows, rmask, src, dt = _group(ids_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, R, S, BM, FIND)
    if e < 0:
        return
    rows64 = rows.to(tl.int64)
    n = dt * BN + tl.arange(0, BN)
    nmask = n < D
    n64 = n.to(tl.int64)
    LOW: tl.constexpr = IS_BF16 and not INTERP
    SWAP: tl.constexpr = FIND > 0
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
    if e < E:
        rows_w = e * D + n64
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            ha = tl.load(h_ptr + rows64[:, None] * I + kk[None, :], mask=rmask[:, None], other=0.0)
            h0, h1, h2, h3 = _quarters(ha)
            acc = _mma_fp4(h0, h1, h2, h3, w2_ptr, s2_ptr, rows_w, nmask, I, k0, BK, acc, LOW, SWAP, INTERP)
    elif SHARED:
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            ha = tl.load(h_ptr + rows64[:, None] * I + kk[None, :], mask=rmask[:, None], other=0.0)
            w = tl.load(sh2_ptr + n64[:, None] * I + kk[None, :], mask=nmask[:, None], other=0.0)
            acc = _mma_rows(ha, w, acc, SH_LOW, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    dst = out_ptr + src[:, None] * D + n[None, :]
    m = rmask[:, None] & nmask[None, :]
    if IS_BF16:
        tl.store(dst, to_bf16(acc, INTERP), mask=m)
    else:
        tl.store(dst, acc, mask=m)


# ------------------------------------------------------------------------------------------------
# Launch


def _check(x, ids, weights, w13, s13, w2, s2, shared13, shared2):
    N, D = x.shape
    E, I2, D2 = w13.shape
    I = I2 // 2
    if D % 32 or I % 32 or D2 * 2 != D or tuple(w2.shape) != (E, D, I // 2):
        raise ValueError(f"moe_experts: bad shapes x {tuple(x.shape)} w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}")
    if tuple(s13.shape) != (E, I2, D // 32) or tuple(s2.shape) != (E, D, I // 32):
        raise ValueError(f"moe_experts: bad scale shapes s13 {tuple(s13.shape)} s2 {tuple(s2.shape)}")
    if ids.shape != weights.shape or ids.shape[0] != N:
        raise ValueError(f"moe_experts: ids {tuple(ids.shape)} / weights {tuple(weights.shape)} vs N = {N}")
    if shared13 is not None and (tuple(shared13.shape) != (I2, D) or tuple(shared2.shape) != (D, I)):
        raise ValueError(f"moe_experts: bad shared shapes {tuple(shared13.shape)} {tuple(shared2.shape)}")
    return N, D, E, I


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled FP8 weight (e4m3 [N, K], e8m0 scales [ceil(N / bn), ceil(K / bk)]) -> (its codes [N, K]
    uint8, each row's scale exponents a 32-element group [N, K / 32] uint8): the MXFP4 experts' scale layout, so
    the gather kernels read it the way they read theirs. Exact: every 32-element group lies in one scale block."""
    (N, K), (bn, bk) = weight.shape, block
    if weight.dtype != torch.float8_e4m3fn or K % 32 or bk % 32:
        raise ValueError(f"fp8_rows: needs an e4m3 weight of K % 32 == 0 in blocks of bk % 32 == 0, got {weight.dtype} "
                         f"{tuple(weight.shape)} in {tuple(block)} blocks")
    exps = _u8(scale).repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk // 32, dim=1)[:, : K // 32]
    codes = _u8(weight).contiguous()
    if codes.storage_offset() % 16:  # a view into a checkpoint's bytes: the kernels read the codes as 8-byte words
        codes = codes.clone()
    return codes, exps.contiguous()


def _check_fp8_rows(tensors, shared13, shared2) -> tuple | None:
    """moe_gather_slots' shared expert as stored (`fp8_rows` of shared13's and shared2's rows): all four or none,
    in those shapes, byte-sized."""
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("moe_gather_slots: the shared expert's FP8 rows come as all four of codes and exponents of "
                         "shared13 and shared2, or none")
    want = [shape for w in (shared13, shared2) for shape in (tuple(w.shape), (w.shape[0], w.shape[1] // 32))]
    got = [tuple(t.shape) for t in tensors]
    if got != want or any(t.element_size() != 1 for t in tensors):
        raise ValueError(f"moe_gather_slots: the shared expert's FP8 rows must be byte tensors of shapes {want} "
                         f"(fp8_rows), got {got}, {[t.dtype for t in tensors]}")
    return tensors


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _slots(ids, weights, E, has_shared):
    """ids/weights with the shared expert as slot k (id E, weight 1): [N, S] int64 / fp32, contiguous."""
    ids, weights = ids.to(torch.int64), weights.float()
    if has_shared:
        N = ids.shape[0]
        ids = torch.cat([ids, ids.new_full((N, 1), E)], dim=1)
        weights = torch.cat([weights, weights.new_ones(N, 1)], dim=1)
    return ids.contiguous(), weights.contiguous()


def grouped_block_m(N: int, S: int, E: int) -> int:
    """Rows per grouped tile: about the mean rows per expert, 16 .. 64."""
    mean = N * S / max(E, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def tile_table(ids_s: torch.Tensor, E: int, BM: int):
    """Sorted token-slot order and the tile table (expert or -1, first row, end row) with a static number of
    tiles cdiv(R, BM) + min(E + 1, R) for R = N * S; all on the device, no host sync."""
    flat = ids_s.flatten()
    R = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tiles = (counts + BM - 1) // BM
    tile_end = tiles.cumsum(0)
    tile_start = tile_end - tiles
    T = triton.cdiv(R, BM) + min(E + 1, R)
    p = torch.arange(T, device=flat.device)
    te = torch.searchsorted(tile_end, p, right=True)  # E + 1 past the last tile
    tec = te.clamp(max=E)
    r0 = seg_start[tec] + (p - tile_start[tec]) * BM
    r1 = seg_end[tec]
    te = torch.where(te > E, -1, te)
    return order, te.to(torch.int32), r0.to(torch.int32), r1.to(torch.int32)


def activation_planes(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] -> [N, 8, K/8] fp32, plane j holding elements 8c + j: the eight activations that meet one int32
    word of codes (`_word_dot`) are then one element of each plane, and a thread's run of words reads each plane
    in one vector load."""
    N, K = x.shape
    return torch.empty(N, 8, K // 8, dtype=torch.float32, device=x.device).copy_(x.view(N, K // 8, 8).transpose(1, 2))


def _block_k(K: int, most: int, cuda: bool) -> int:
    """The grouped kernels' K step: the largest power of two <= `most` dividing K (K is a multiple of 32), so
    their loads need no K mask (a mask varying along K stops 16-byte loads); on the GPU at least 64, each K
    phase's MMA taking at least 16."""
    bk = min(most, K & -K)
    if cuda and bk < 64:
        raise ValueError(f"moe_experts: on the GPU the tensor-core paths need D and I multiples of 64 (K = {K})")
    return bk


def _cfg(x, N, path):
    if not x.is_cuda:  # the interpreter pays per program: large tiles
        return {"BI": 64, "BK": 64, "BD": 64, "BM": 16, "BN": 64, "BKG": 64, "gather_warps": 4, "gather_stages": 1,
                "warps": 4, "stages": 1}
    if path == "gather_tc":  # BM: the MMA's smallest N side; 32 rows in 2 warps (mma.sync) beat the 64-row
        # warpgroup tiles at every N measured (N = 4: 332 us against 365-428)
        return {"BM": 16, "BN": 32, "BKG": 128, "warps": 2, "stages": 3}
    # gather tiles measured on the H200 at V4.1 widths (the whole op, shared expert included, graph), K pipelined
    # two steps deep: for one or two tokens 16 up rows and 16 down rows x 256 K in 2 warps (74.1 / 128.0 us at one
    # / two tokens, against 81.7 / 140.0 for 4 up rows x 512 K and 83.0-89.1 / 141.7-157.1 for the other tiles
    # tried; the batch-1 step 1.312 -> 1.275 ms), the same in 4 warps above. Then on the H100 (session 42,
    # dev/moe_experts-318eddd-h100-s42.json): at one token 512-wide K steps, 64.2 us against 68.5 (its up grid is
    # under one wave, so only a program's bytes in flight can grow; at two tokens 142.7 against 135.1), and at 8 and
    # 16 tokens 32 down rows a program, 467.7 / 903.8 us against 507.0 / 979.8. At one token the down kernel's 512
    # steps do not divide V4.1's I = 2304 (its masked path), yet 256-wide ones (9 a row, unmasked) were slower: 63.3
    # against 62.3 us, the 6-layer step 1.629 against 1.596 ms (H100, session 46)
    # The grouped down kernel's output tile, BND, twice the up kernel's: it holds one accumulator to the up kernel's
    # two, so each activation tile it loads serves twice the MMAs (H100, session 51, V4.1 widths: 22.75 -> 20.33 ms
    # at 8192 tokens, 8.86 -> 8.18 at 2048; 32 columns 30.7 / 10.7)
    BI, BD, BK, warps = (16, 16 if N <= 2 else 32, 512 if N == 1 else 256, 2 if N <= 2 else 4)
    return {"BI": BI, "BK": BK, "BD": BD, "BM": None, "BN": 64, "BND": 128, "BKG": 64, "gather_warps": warps,
            "gather_stages": 2, "warps": 4, "stages": 3}


def _operands(x, w13, s13, w2, s2, shared13, shared2):
    """What the kernels read: x bf16 or fp32, contiguous; the experts' bytes as uint8; the shared expert (the
    routed weights stand in for it where there is none: its branch is compiled out)."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    w13, s13, w2, s2 = (_u8(t).contiguous() for t in (w13, s13, w2, s2))
    if shared13 is None:
        return x.contiguous(), w13, s13, w2, s2, w13, w2
    return x.contiguous(), w13, s13, w2, s2, shared13.contiguous(), shared2.contiguous()


def _even_k(K: int, BK: int, scales: torch.Tensor) -> bool:
    """Whether the gather kernels' K loop over rows of K elements may drop its K masks and read the scales as
    int32 words (`_gemv_words`): BK divides K and spans whole words of four scale groups, and the scales sit
    4-byte aligned (every row then starts on a word: K / 32 bytes a row, a multiple of 4)."""
    return K % BK == 0 and BK % 128 == 0 and scales.data_ptr() % 4 == 0


def _all_even_k(K: int, BK: int, *scales: torch.Tensor) -> bool:
    """`_even_k` for every scale tensor one launch reads (the routed experts' and the shared expert's)."""
    return all(_even_k(K, BK, t) for t in scales)


def down_tail(K: int, BK: int, *scales: torch.Tensor) -> int:
    """The gather down kernel's last step apart (`_down_sum`'s TAIL), or 0: where BK does not divide its rows of K
    (V4.1's I = 2304 in the one-token 512-wide steps), the remainder as a step of its own, a power of two of whole
    scale words, lets every step drop its K masks; a masked step read the scales a byte at a time, each load
    waited on in its step (4 a step, sm_90 SASS), and its weights 8 bytes a copy."""
    tail = K % BK
    whole = tail % 128 == 0 and tail & (tail - 1) == 0
    return tail if tail and whole and _all_even_k(K - tail, BK, *scales) else 0


def down_k_step(c: dict) -> int:
    """The gather down kernel's K step in a `_cfg` config: the up kernel's (BK) unless the config sets its own (BKD)."""
    return c.get("BKD") or c["BK"]


def _gather(x, planes, ids, weights, w13, s13, w2, s2, sh13, sh2, limit: float, has_shared: bool, c: dict,
            shared_fp8: tuple | None = None):
    """The gather path's kernels on prepared operands (x contiguous, planes = activation_planes(x), expert bytes
    uint8): each slot's output [N, S, D] fp32. The router's ids and weights go in as they are. `shared_fp8`: the
    shared expert's rows as `fp8_rows` gives them (codes and exponents of w1 / w3, then of w2), read in place of
    sh13 / sh2."""
    (N, D), (E, I2, _) = x.shape, w13.shape
    I, S = I2 // 2, ids.shape[1] + has_shared
    ids_r, wts_r = ids.contiguous(), weights.float().contiguous()
    hp = torch.empty(N, S, I, dtype=torch.float32, device=x.device)  # h as planes, rounded to x's dtype
    is_bf16 = x.dtype == torch.bfloat16
    q13, e13, q2, e2 = shared_fp8 or (w13, s13, w2, s2)  # the routed bytes stand in where the branch is compiled out
    words = lambda q: q.view(torch.int64 if shared_fp8 else torch.int32)
    bk_down = down_k_step(c)
    tail = down_tail(I, bk_down, s2, e2)
    kw = {"STAGES": c["gather_stages"], "IS_BF16": is_bf16, "INTERP": _INTERP, "SHARED": has_shared,
          "SH_FP8": shared_fp8 is not None, "PDL": pdl(x), "num_warps": c["gather_warps"], "launch_pdl": pdl(x)}
    _gather_up_kernel[(N, S, triton.cdiv(I, c["BI"]))](
        x, planes, ids_r, wts_r, w13.view(torch.int32), s13, sh13, words(q13), e13, hp, D, I, S, ids.shape[1], E,
        limit, BI=c["BI"], BK=c["BK"], EVEN_K=_all_even_k(D, c["BK"], s13, e13), **kw)
    out = torch.empty(N, S, D, dtype=torch.float32, device=x.device)
    _gather_down_kernel[(N, triton.cdiv(D, c["BD"]), S)](
        hp, ids_r, w2.view(torch.int32), s2, sh2, words(q2), e2, out, D, I, S, ids.shape[1], E, BD=c["BD"],
        BK=bk_down, EVEN_K=_all_even_k(I - tail, bk_down, s2, e2), TAIL=tail, **kw)
    return out


def moe_triton(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None, path="auto", cfg=None):
    N, D, E, I = _check(x, ids, weights, w13, s13, w2, s2, shared13, shared2)
    x, w13, s13, w2, s2, sh13, sh2 = _operands(x, w13, s13, w2, s2, shared13, shared2)
    has_shared = shared13 is not None
    S = ids.shape[1] + has_shared
    if path == "auto":
        path = "gather" if N <= GATHER_MAX_N else "grouped"
    if path not in ("gather", "grouped", "gather_tc"):
        raise ValueError(f"moe_experts: path must be 'auto', 'gather', 'grouped' or 'gather_tc', got {path!r}")
    c = {**_cfg(x, N, path), **(cfg or {})}
    is_bf16 = x.dtype == torch.bfloat16
    sh_low = has_shared and shared13.dtype == torch.bfloat16 and is_bf16 and not _INTERP
    if N == 0 or S == 0:
        return torch.zeros(N, D, dtype=torch.float32, device=x.device)
    lim = float(limit)
    # SHARED (every path): without a shared expert the dense branch is not compiled (compiled in but dead, it made
    # routed-only gather_tc take 2.8 ms at 4 tokens on the H200, against 0.33 ms for the same call with one)
    if path == "gather":
        return _gather(x, activation_planes(x), ids, weights, w13, s13, w2, s2, sh13, sh2, lim, has_shared,
                       c).sum(dim=1)
    ids_s, wts_s = _slots(ids, weights, E, has_shared)
    R = N * S
    if path == "grouped":
        BM, find = c["BM"] or grouped_block_m(N, S, E), 0
        order, te, r0, r1 = tile_table(ids_s, E, BM)
        groups = lambda rows, bn: (te.numel(), triton.cdiv(rows, bn))
    else:  # gather_tc: the groups are found in the kernels, no tile table; scanning at least 128 ids makes one
        # compiled variant serve every batch up to 18 tokens at 7 slots (the scan is a few instructions per id)
        BM, find = c["BM"], triton.next_power_of_2(max(R, 128))
        order = te = r0 = r1 = ids_s  # the table's arguments, unused
        groups = lambda rows, bn: (triton.cdiv(rows, bn), R)
    kw = {"BM": BM, "IS_BF16": is_bf16, "INTERP": _INTERP, "SH_LOW": sh_low, "FIND": find, "SHARED": has_shared,
          "num_warps": c["warps"], "num_stages": c["stages"]}
    bn_down = c.get("BND") or c["BN"]  # the down kernel's own output tile, where a config sets one
    h = torch.empty(R, I, dtype=x.dtype, device=x.device)
    out = torch.empty(R, D, dtype=x.dtype, device=x.device)
    _grouped_up_kernel[groups(I, c["BN"])](x, ids_s, order, wts_s, te, r0, r1, w13, s13, sh13, h, D, I, S, E, R,
                                           lim, BN=c["BN"], BK=_block_k(D, c["BKG"], x.is_cuda), **kw)
    _grouped_down_kernel[groups(D, bn_down)](h, ids_s, order, te, r0, r1, w2, s2, sh2, out, D, I, S, E, R,
                                             BN=bn_down, BK=_block_k(I, c["BKG"], x.is_cuda), **kw)
    return out.view(N, S, D).sum(dim=1, dtype=torch.float32)  # summed in fp32 as read: no fp32 copy of the slots


# ------------------------------------------------------------------------------------------------
# Ops


def _twin_out(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None):
    return moe_experts_twin(x, ids, weights, _u8(w13), _u8(s13), _u8(w2), _u8(s2), limit, shared13, shared2)


@torch.library.custom_op("dsv4::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    limit: float, path: str = "auto",
) -> torch.Tensor:
    """Routed MXFP4 experts: x [N, D] -> y [N, D] fp32, the sum over each token's k experts."""
    if use_triton(x):
        return moe_triton(x, ids, weights, w13, s13, w2, s2, limit, path=path)
    return _twin_out(x, ids, weights, w13, s13, w2, s2, limit)


@moe_experts_mxfp4.register_fake
def _(x, ids, weights, w13, s13, w2, s2, limit, path="auto"):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4::moe_mxfp4_with_shared", mutates_args=())
def moe_mxfp4_with_shared(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    shared13: torch.Tensor, shared2: torch.Tensor, limit: float, path: str = "auto",
) -> torch.Tensor:
    """Routed MXFP4 experts plus the dense shared expert: x [N, D] -> y [N, D] fp32 (the MoE output
    before the cast to x.dtype)."""
    if use_triton(x):
        return moe_triton(x, ids, weights, w13, s13, w2, s2, limit, shared13, shared2, path=path)
    return _twin_out(x, ids, weights, w13, s13, w2, s2, limit, shared13, shared2)


@moe_mxfp4_with_shared.register_fake
def _(x, ids, weights, w13, s13, w2, s2, shared13, shared2, limit, path="auto"):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4::moe_gather_slots", mutates_args=())
def moe_gather_slots(
    x: torch.Tensor, planes: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
    shared13: torch.Tensor, shared2: torch.Tensor, limit: float,
    shared13_fp8: torch.Tensor | None = None, shared13_exp: torch.Tensor | None = None,
    shared2_fp8: torch.Tensor | None = None, shared2_exp: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gather path of moe_mxfp4_with_shared for a token or two (decode): x [N, D] and its activation planes
    (`activation_planes(x)`) -> each slot's output [N, k + 1, D] fp32, the routed experts in the router's order
    (weighted), then the shared expert; the op's y is their sum over slots. A compiled caller that makes the
    planes and sums the slots fuses both into its own kernels, where the op spends a copy and a reduction launch
    on them. shared13_fp8 .. shared2_exp, all or none: the shared expert's weights as stored, per row (`fp8_rows`
    of the rows of shared13 and of shared2: the same values), which the kernels then read instead, in half the
    bytes."""
    N, D, _, _ = _check(x, ids, weights, w13, s13, w2, s2, shared13, shared2)
    if tuple(planes.shape) != (N, 8, D // 8) or planes.dtype != torch.float32:
        raise ValueError(f"moe_gather_slots: planes must be [{N}, 8, {D // 8}] float32 (activation_planes(x)), got "
                         f"{tuple(planes.shape)} {planes.dtype}")
    shared_fp8 = _check_fp8_rows((shared13_fp8, shared13_exp, shared2_fp8, shared2_exp), shared13, shared2)
    if not use_triton(x):
        return moe_slots_twin(x, ids, weights, _u8(w13), _u8(s13), _u8(w2), _u8(s2), limit, shared13, shared2)
    if N == 0:
        return x.new_zeros((0, ids.shape[1] + 1, D), dtype=torch.float32)
    x, w13, s13, w2, s2, sh13, sh2 = _operands(x, w13, s13, w2, s2, shared13, shared2)
    if shared_fp8 is not None:
        shared_fp8 = tuple(_u8(t).contiguous() for t in shared_fp8)
    return _gather(x, planes.contiguous(), ids, weights, w13, s13, w2, s2, sh13, sh2, float(limit), True,
                   _cfg(x, N, "gather"), shared_fp8)


@moe_gather_slots.register_fake
def _(x, planes, ids, weights, w13, s13, w2, s2, shared13, shared2, limit, shared13_fp8=None, shared13_exp=None,
      shared2_fp8=None, shared2_exp=None):
    return x.new_empty((x.shape[0], ids.shape[1] + 1, x.shape[1]), dtype=torch.float32)
