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
    limit    the SwiGLU clamp (<= 0: none); path "auto" | "gather" | "grouped"
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

Paths (both free of host syncs, so they can be captured in a CUDA graph):
- gather (decode, N <= GATHER_MAX_N by default): kernel 1, one program per (token, slot, I tile), streams the
  slot's expert rows of w1 and w3 once, GEMV on the CUDA cores in fp32 (each 32-wide scale group summed
  unscaled, then scaled), SwiGLU epilogue, h to a [N, S, I] workspace (S = k, + 1 with the shared expert);
  kernel 2, one program per (token, D tile, slot), streams w2 rows and writes the slot's rounded output to
  [N, S, D]; a torch sum over slots gives y. At batch 1 every selected expert's weights are read exactly once.
- grouped: token-slots sorted by expert on the device (argsort, scatter_add counts, cumsum, searchsorted),
  a tile table padded to a static upper bound cdiv(N*S, BM) + min(E+1, N*S) (empty tiles exit at once);
  tiles never straddle experts. Kernel 1 is a grouped GEMM (tensor cores, bf16 operands: dequantized e2m1 is
  exact in bf16) writing h in sorted order; kernel 2 the grouped down GEMM writing each slot's rounded
  output to [N*S, D]; a torch sum over slots gives y.
The shared expert is one more slot (expert id E) in both paths, so the layer's expert part is one op.
FP4 decoding: the packed bytes split K into even (low nibble) and odd (high nibble) elements; activations are
split to match, so no interleave is needed. On the GPU the nibbles are decoded by a few PTX integer ops per
pair of values (`_E2M1_PTX`), the interpreter computes the same values arithmetically. Under the Triton interpreter (TRITON_INTERPRET=1) all dots run
in fp32 and bf16 rounding is done on the bits (the interpreter mishandles bf16 arithmetic and truncates casts).
Scales are assumed in 2^-126 .. 2^127 (what dsv4.quant writes).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4.fast.kernels import use_triton
from dsv4.fast.kernels.attention import _to_bf16
from dsv4.quant import dequantize_mxfp4

__all__ = [
    "GATHER_MAX_N",
    "moe_experts_mxfp4",
    "moe_experts_twin",
    "moe_mxfp4_with_shared",
    "stack_expert_weights",
]

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
GATHER_MAX_N = 16  # "auto": gather path up to this many tokens


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


def moe_experts_twin(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None):
    """Pure torch: y [N, D] fp32, the reference math (host syncs; not for graphs)."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        w13e = dequantize_mxfp4(w13[e], s13[e].view(torch.float8_e8m0fnu))
        w2e = dequantize_mxfp4(w2[e], s2[e].view(torch.float8_e8m0fnu))
        y.index_add_(0, tok, _expert_math(x[tok], w13e, w2e, weights[tok, slot, None], limit).float())
    if shared13 is not None:
        y = y + _expert_math(x, shared13, shared2, None, limit).float()
    return y


# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round(v, IS_BF16: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> the activation dtype and back (round to nearest even), or v itself for fp32 activations."""
    if IS_BF16:
        return _to_bf16(v, INTERP).to(tl.float32)
    else:
        return v


def _nibble_ptx(magnitude_shift: int, sign_shift: int, first_out: int) -> str:
    """PTX turning the nibbles at one position of the four bytes (spread to 16-bit lanes in t0, t1) into four
    fp32 outputs $first_out.. : magnitude to bits 9-11, sign to bit 15, times 2^14, to fp32."""
    lines = []
    for t, m, s in (("t0", "m0", "s0"), ("t1", "m1", "s1")):
        lines += [f"shl.b32 {m}, {t}, {magnitude_shift};", f"and.b32 {m}, {m}, 0x0E000E00;",
                  f"shl.b32 {s}, {t}, {sign_shift};", f"and.b32 {s}, {s}, 0x80008000;", f"or.b32 {m}, {m}, {s};",
                  f"mul.rn.f16x2 {m}, {m}, k;"]
    lines += ["mov.b32 {v0, v1}, m0;", "mov.b32 {v2, v3}, m1;"]
    lines += [f"cvt.f32.f16 ${first_out + n}, v{n};" for n in range(4)]
    return "\n".join(lines)


# four packed bytes -> their low and high nibbles as exact fp32 values: the nibble's magnitude bits go to
# fp16's exponent/mantissa boundary (bits 9-11) and its sign to bit 15, making e2m1 times 2^-14 (an fp16
# subnormal for codes 0 and 1); an fp16x2 multiply by 2^14 (exact: fp16 math keeps subnormals) gives the
# value, and the fp16 -> fp32 conversion is exact. Two values per 32-bit instruction.
_E2M1_PTX = tl.constexpr("\n".join([
    "{",
    ".reg .b32 z, k, t0, t1, m0, m1, s0, s1;",
    ".reg .b16 v0, v1, v2, v3;",
    "mov.b32 z, 0;",
    "mov.b32 k, 0x74007400;",  # 2^14 in both fp16 lanes
    "prmt.b32 t0, $8, z, 0x4140;",  # bytes 0, 1 -> the low bytes of two 16-bit lanes
    "prmt.b32 t1, $8, z, 0x4342;",  # bytes 2, 3
    _nibble_ptx(9, 12, 0),  # low nibbles: bits 0-2 -> 9-11, bit 3 -> 15
    _nibble_ptx(5, 8, 4),  # high nibbles: bits 4-6 -> 9-11, bit 7 -> 15
    "}",
]))


@triton.jit
def _e2m1_pairs(b, INTERP: tl.constexpr):
    """Packed uint8 codes -> (low nibble, high nibble) as exact unscaled e2m1 values, fp32."""
    if INTERP:  # no inline PTX in the interpreter: the same values by arithmetic
        b = b.to(tl.int32)
        m_lo = b & 7
        m_hi = (b >> 4) & 7
        # magnitude m >= 2 is 2^(m>>1 - 1) * (1 + (m&1)/2): the fp32 with exponent field (m >> 1) + 126 and
        # top mantissa bit m & 1, i.e. bits (m << 22) + (126 << 23); m in {0, 1} is m / 2
        v_lo = tl.where(m_lo < 2, m_lo.to(tl.float32) * 0.5, ((m_lo << 22) + (126 << 23)).to(tl.float32, bitcast=True))
        v_hi = tl.where(m_hi < 2, m_hi.to(tl.float32) * 0.5, ((m_hi << 22) + (126 << 23)).to(tl.float32, bitcast=True))
        return tl.where((b & 0x08) != 0, -v_lo, v_lo), tl.where((b & 0x80) != 0, -v_hi, v_hi)
    else:
        return tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, rows64, rmask, row_bytes, row_scales, k0, BK: tl.constexpr, INTERP: tl.constexpr):
    """Packed rows `rows64` ([R]), K elements k0 .. k0+BK-1 -> (even, odd) elements, fp32 [R, BK/2] each,
    e2m1 * 2^(e8m0 - 127) exactly; masked rows and K past the row read as 0."""
    R: tl.constexpr = rows64.shape[0]
    HB: tl.constexpr = BK // 2
    NS: tl.constexpr = BK // 32
    j = k0 // 2 + tl.arange(0, HB)
    g = k0 // 32 + tl.arange(0, NS)
    b = tl.load(w_ptr + rows64[:, None] * row_bytes + j[None, :], mask=rmask[:, None] & (j < row_bytes)[None, :], other=0)
    e = tl.load(s_ptr + rows64[:, None] * row_scales + g[None, :],
                mask=rmask[:, None] & (g < row_scales)[None, :], other=0).to(tl.int32)
    s = tl.reshape(tl.broadcast_to((e << 23).to(tl.float32, bitcast=True)[:, :, None], (R, NS, 16)), (R, HB))
    v_lo, v_hi = _e2m1_pairs(b, INTERP)
    return v_lo * s, v_hi * s


@triton.jit
def _gemv_fp4(acc, w_ptr, s_ptr, rows64, rmask, row_bytes, row_scales, a_row, k0, NS: tl.constexpr,
              INTERP: tl.constexpr):
    """acc [R] + packed FP4 rows `rows64` . a[k0 : k0 + 32 NS] (a_row: fp32 or bf16 activations), each
    32-element scale group summed unscaled (exact e2m1 x activation products) and then scaled."""
    g = k0 // 32 + tl.arange(0, NS)
    gmask = g < row_scales
    byte = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [NS, 16]
    b = tl.load(w_ptr + rows64[:, None, None] * row_bytes + byte[None, :, :],
                mask=rmask[:, None, None] & gmask[None, :, None], other=0)  # [R, NS, 16] uint8
    lo, hi = _e2m1_pairs(b, INTERP)
    av = tl.load(a_row + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=gmask[:, None], other=0.0)
    ae, ao = tl.split(tl.reshape(av.to(tl.float32), (NS, 16, 2)))  # even / odd elements [NS, 16]
    part = tl.sum(lo * ae[None, :, :] + hi * ao[None, :, :], axis=2)  # [R, NS]
    e = tl.load(s_ptr + rows64[:, None] * row_scales + g[None, :], mask=rmask[:, None] & gmask[None, :],
                other=0).to(tl.int32)
    return acc + tl.sum(part * (e << 23).to(tl.float32, bitcast=True), axis=1)


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
def _gather_up_kernel(
    x_ptr, ids_ptr, wts_ptr, w13_ptr, s13_ptr, sh13_ptr, h_ptr,
    D, I, S, E, limit,
    BI: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr, INTERP: tl.constexpr,
):
    """Program (t, slot, i tile): h[t, slot, i] = swiglu(x[t] . w1[e, i], x[t] . w3[e, i]) * weight."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    i = tl.program_id(2) * BI + tl.arange(0, BI)
    imask = i < I
    e = tl.load(ids_ptr + t * S + slot)
    wt = tl.load(wts_ptr + t * S + slot)
    acc_g = tl.zeros((BI,), dtype=tl.float32)
    acc_u = tl.zeros((BI,), dtype=tl.float32)
    x_row = x_ptr + t * D
    if e < E:
        rows_g = e * 2 * I + i.to(tl.int64)
        for k0 in range(0, D, BK):
            acc_g = _gemv_fp4(acc_g, w13_ptr, s13_ptr, rows_g, imask, D // 2, D // 32, x_row, k0, BK // 32, INTERP)
            acc_u = _gemv_fp4(acc_u, w13_ptr, s13_ptr, rows_g + I, imask, D // 2, D // 32, x_row, k0, BK // 32, INTERP)
    else:  # the shared expert, dense
        i64 = i.to(tl.int64)
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < D
            xv = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)
            m2 = imask[:, None] & km[None, :]
            wg = tl.load(sh13_ptr + i64[:, None] * D + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(sh13_ptr + (i64 + I)[:, None] * D + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xv[None, :], axis=1)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
    h = _swiglu(acc_g, acc_u, wt, limit, IS_BF16, INTERP)
    dst = h_ptr + (t * S + slot) * I + i
    if IS_BF16:
        tl.store(dst, _to_bf16(h, INTERP), mask=imask)
    else:
        tl.store(dst, h, mask=imask)


@triton.jit
def _gather_down_kernel(
    h_ptr, ids_ptr, w2_ptr, s2_ptr, sh2_ptr, out_ptr,
    D, I, S, E,
    BD: tl.constexpr, BK: tl.constexpr, IS_BF16: tl.constexpr, INTERP: tl.constexpr,
):
    """Program (t, d tile, slot): out[t, slot, d] = round(h[t, slot] . w2[e, d]) (the caller sums the slots)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    slot = tl.program_id(2)
    dmask = d < D
    d64 = d.to(tl.int64)
    e = tl.load(ids_ptr + t * S + slot)
    h_row = h_ptr + (t * S + slot) * I
    acc = tl.zeros((BD,), dtype=tl.float32)
    if e < E:
        rows = e * D + d64
        for k0 in range(0, I, BK):
            acc = _gemv_fp4(acc, w2_ptr, s2_ptr, rows, dmask, I // 2, I // 32, h_row, k0, BK // 32, INTERP)
    else:
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            hv = tl.load(h_row + kk, mask=km, other=0.0).to(tl.float32)
            w = tl.load(sh2_ptr + d64[:, None] * I + kk[None, :], mask=dmask[:, None] & km[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * hv[None, :], axis=1)
    tl.store(out_ptr + (t * S + slot) * D + d, _round(acc, IS_BF16, INTERP), mask=dmask)


@triton.jit
def _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, BM: tl.constexpr):
    """This program's grouped tile: (expert, or -1 for an empty tile; sorted rows [BM]; their mask; each row's
    token * S + slot)."""
    p = tl.program_id(0)
    e = tl.load(tile_e_ptr + p).to(tl.int64)
    rows = tl.load(tile_r0_ptr + p) + tl.arange(0, BM)
    rmask = rows < tl.load(tile_r1_ptr + p)  # an empty tile's range lies inside the table too
    return e, rows, rmask, tl.load(order_ptr + rows, mask=rmask, other=0)


@triton.jit
def _grouped_up_kernel(
    x_ptr, order_ptr, wts_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, w13_ptr, s13_ptr, sh13_ptr, h_ptr,
    D, I, S, E, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    IS_BF16: tl.constexpr, INTERP: tl.constexpr, SH_LOW: tl.constexpr,
):
    """Program (tile, i tile): the tile's sorted rows (token-slots of one expert) x w1/w3 columns -> h rows."""
    e, rows, rmask, src = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, BM)
    if e < 0:
        return
    tok = src // S
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < I
    n64 = n.to(tl.int64)
    LOW: tl.constexpr = IS_BF16 and not INTERP
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if e < E:
        rows_g = e * 2 * I + n64
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            xa = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=rmask[:, None] & (kk < D)[None, :], other=0.0)
            xe, xo = tl.split(tl.reshape(xa, (BM, BK // 2, 2)))
            lo, hi = _fp4_tile(w13_ptr, s13_ptr, rows_g, nmask, D // 2, D // 32, k0, BK, INTERP)
            acc_g = _mma(xe, tl.trans(lo), acc_g, LOW)
            acc_g = _mma(xo, tl.trans(hi), acc_g, LOW)
            lo, hi = _fp4_tile(w13_ptr, s13_ptr, rows_g + I, nmask, D // 2, D // 32, k0, BK, INTERP)
            acc_u = _mma(xe, tl.trans(lo), acc_u, LOW)
            acc_u = _mma(xo, tl.trans(hi), acc_u, LOW)
    else:
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < D
            xa = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            m2 = nmask[:, None] & km[None, :]
            wg = tl.load(sh13_ptr + n64[:, None] * D + kk[None, :], mask=m2, other=0.0)
            wu = tl.load(sh13_ptr + (n64 + I)[:, None] * D + kk[None, :], mask=m2, other=0.0)
            acc_g = _mma(xa, tl.trans(wg), acc_g, SH_LOW)
            acc_u = _mma(xa, tl.trans(wu), acc_u, SH_LOW)
    wt = tl.load(wts_ptr + src, mask=rmask, other=0.0)
    h = _swiglu(acc_g, acc_u, wt[:, None], limit, IS_BF16, INTERP)
    dst = h_ptr + rows.to(tl.int64)[:, None] * I + n[None, :]
    m = rmask[:, None] & nmask[None, :]
    if IS_BF16:
        tl.store(dst, _to_bf16(h, INTERP), mask=m)
    else:
        tl.store(dst, h, mask=m)


@triton.jit
def _grouped_down_kernel(
    h_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, w2_ptr, s2_ptr, sh2_ptr, out_ptr,
    D, I, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    IS_BF16: tl.constexpr, INTERP: tl.constexpr, SH_LOW: tl.constexpr,
):
    """Program (tile, d tile): round(h rows . w2[e] columns) -> out[token * S + slot, d]."""
    e, rows, rmask, src = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, order_ptr, BM)
    if e < 0:
        return
    rows64 = rows.to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    n64 = n.to(tl.int64)
    LOW: tl.constexpr = IS_BF16 and not INTERP
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if e < E:
        rows_w = e * D + n64
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            ha = tl.load(h_ptr + rows64[:, None] * I + kk[None, :], mask=rmask[:, None] & (kk < I)[None, :], other=0.0)
            he, ho = tl.split(tl.reshape(ha, (BM, BK // 2, 2)))
            lo, hi = _fp4_tile(w2_ptr, s2_ptr, rows_w, nmask, I // 2, I // 32, k0, BK, INTERP)
            acc = _mma(he, tl.trans(lo), acc, LOW)
            acc = _mma(ho, tl.trans(hi), acc, LOW)
    else:
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            ha = tl.load(h_ptr + rows64[:, None] * I + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            w = tl.load(sh2_ptr + n64[:, None] * I + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
            acc = _mma(ha, tl.trans(w), acc, SH_LOW)
    dst = out_ptr + src[:, None] * D + n[None, :]
    m = rmask[:, None] & nmask[None, :]
    if IS_BF16:
        tl.store(dst, _to_bf16(acc, INTERP), mask=m)
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


def _cfg(x, D, I, path):
    if not x.is_cuda:  # the interpreter pays per program: large tiles
        return {"BI": 64, "BK": 64, "BD": 64, "BM": 16, "BN": 64, "BKG": 64, "gather_warps": 4, "warps": 4, "stages": 1}
    # gather tiles measured on the H200 at V4.1 widths: for one or two tokens 4 rows x 512 K in 2 warps
    # (batch 1: 116 us against 125 us for 8 rows in 4 warps, in two runs), 16 x 256 in 4 warps above
    BI, BK, warps = (4, 512, 2) if x.shape[0] <= 2 else (16, 256, 4)
    return {"BI": BI, "BK": BK, "BD": BI, "BM": None, "BN": 64, "BKG": 64, "gather_warps": warps, "warps": 4,
            "stages": 3}


def moe_triton(x, ids, weights, w13, s13, w2, s2, limit, shared13=None, shared2=None, path="auto", cfg=None):
    N, D, E, I = _check(x, ids, weights, w13, s13, w2, s2, shared13, shared2)
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    has_shared = shared13 is not None
    ids_s, wts_s = _slots(ids, weights, E, has_shared)
    S = ids_s.shape[1]
    c = {**_cfg(x, D, I, path), **(cfg or {})}
    w13, s13, w2, s2 = (_u8(t).contiguous() for t in (w13, s13, w2, s2))
    sh13 = shared13.contiguous() if has_shared else w13
    sh2 = shared2.contiguous() if has_shared else w2
    is_bf16 = x.dtype == torch.bfloat16
    sh_low = has_shared and shared13.dtype == torch.bfloat16 and is_bf16 and not _INTERP
    if N == 0 or S == 0:
        return torch.zeros(N, D, dtype=torch.float32, device=x.device)
    if path == "auto":
        path = "gather" if N <= GATHER_MAX_N else "grouped"
    lim = float(limit)
    if path == "gather":
        h = torch.empty(N, S, I, dtype=x.dtype, device=x.device)
        _gather_up_kernel[(N, S, triton.cdiv(I, c["BI"]))](
            x, ids_s, wts_s, w13, s13, sh13, h, D, I, S, E, lim,
            BI=c["BI"], BK=c["BK"], IS_BF16=is_bf16, INTERP=_INTERP, num_warps=c["gather_warps"],
            num_stages=c["stages"])
        out = torch.empty(N, S, D, dtype=torch.float32, device=x.device)
        _gather_down_kernel[(N, triton.cdiv(D, c["BD"]), S)](
            h, ids_s, w2, s2, sh2, out, D, I, S, E,
            BD=c["BD"], BK=c["BK"], IS_BF16=is_bf16, INTERP=_INTERP, num_warps=c["gather_warps"],
            num_stages=c["stages"])
        return out.sum(dim=1)
    if path != "grouped":
        raise ValueError(f"moe_experts: path must be 'auto', 'gather' or 'grouped', got {path!r}")
    BM = c["BM"] or grouped_block_m(N, S, E)
    order, te, r0, r1 = tile_table(ids_s, E, BM)
    T = te.numel()
    h = torch.empty(N * S, I, dtype=x.dtype, device=x.device)
    out = torch.empty(N * S, D, dtype=x.dtype, device=x.device)
    _grouped_up_kernel[(T, triton.cdiv(I, c["BN"]))](
        x, order, wts_s, te, r0, r1, w13, s13, sh13, h, D, I, S, E, lim,
        BM=BM, BN=c["BN"], BK=c["BKG"], IS_BF16=is_bf16, INTERP=_INTERP, SH_LOW=sh_low,
        num_warps=c["warps"], num_stages=c["stages"])
    _grouped_down_kernel[(T, triton.cdiv(D, c["BN"]))](
        h, order, te, r0, r1, w2, s2, sh2, out, D, I, E,
        BM=BM, BN=c["BN"], BK=c["BKG"], IS_BF16=is_bf16, INTERP=_INTERP, SH_LOW=sh_low,
        num_warps=c["warps"], num_stages=c["stages"])
    return out.view(N, S, D).float().sum(dim=1)


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
