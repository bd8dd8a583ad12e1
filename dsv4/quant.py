"""Exact low-precision codecs used by DeepSeek-V4 checkpoints and kernels.

Everything here is pure torch, so it runs unchanged on CPU and GPU and can
serve as the bit-exact reference the fused kernels are tested against.

Formats:
  * FP8 e4m3 values with power-of-two (ue8m0) scales, per 1xN activation block
    or per 2-D weight block (edge blocks may be partial).
  * E2M1 (FP4) element codes and their two-per-byte packing.
  * MXFP4: e2m1 elements + e8m0 scale per 32 elements, no global scale.
  * NVFP4-style: e2m1 elements + e4m3 scale per 16 elements, with an optional
    fp32 per-tensor global scale.

Unless stated otherwise, functions accept arbitrary leading dims and work along
the last dim (activation style).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES",
    "ue8m0_scale",
    "scale_values",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quant_fp8",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "fake_quant_mxfp4",
    "quantize_nvfp4",
    "nvfp4_global_scale",
    "dequantize_nvfp4",
    "fake_quant_nvfp4",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude

# The 16 e2m1 code values: bit 3 is the sign, bits 0..2 index the magnitudes.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between neighbouring e2m1 magnitudes, split by how a tie resolves.
# Round-to-nearest-even sends a tie to the even code, so a midpoint whose upper
# neighbour has an odd code (1, 3, 5, 7) must be strictly exceeded, while one
# whose upper neighbour is even (2, 4, 6) is reached already at equality.
_E2M1_MIDPOINTS_UP_ODD = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=torch.float32)
_E2M1_MIDPOINTS_UP_EVEN = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)

# Smallest amax the block quantizers accept; keeps every scale a normal,
# non-zero number so that x / s never divides by zero.
_FP8_AMAX_MIN = 1e-4
_MXFP4_AMAX_MIN = FP4_MAX * 2.0**-126  # -> e8m0 scale >= 2**-126
_NVFP4_AMAX_MIN = FP4_MAX * 2.0**-9  # -> e4m3 scale >= smallest subnormal 2**-9


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------

def _check_no_nan(x: Tensor, what: str) -> None:
    """Encoders have no NaN code (e2m1) or would silently spread NaN into a
    whole block's scale (fp8), so reject NaN loudly instead."""
    if torch.isnan(x).any():
        raise ValueError(f"{what}: input contains NaN")


def _split_last(x: Tensor, block: int, what: str) -> Tensor:
    """View [..., K] as [..., K // block, block]; K must be divisible."""
    if x.dim() == 0:
        raise ValueError(f"{what}: expected at least 1 dim, got a scalar")
    k = x.shape[-1]
    if block <= 0 or k % block != 0:
        raise ValueError(f"{what}: last dim {k} is not divisible by block size {block}")
    return x.unflatten(-1, (k // block, block))  # [..., K/B, B]


def _block_amax(xb: Tensor, amin: float) -> Tensor:
    """Per-block max |x| over the last dim of [..., nB, B], clamped from below."""
    return xb.abs().amax(dim=-1).clamp(min=amin)  # [..., nB]


# --------------------------------------------------------------------------
# scale rounding
# --------------------------------------------------------------------------

def ue8m0_scale(amax: Tensor, qmax: float) -> Tensor:
    """Power-of-two scale 2**ceil(log2(amax / qmax)), fp32.

    Computed from the IEEE bits of amax * fp32(1/qmax) exactly like DeepSeek's
    kernels (multiply by the rounded reciprocal, never divide), because the two
    differ by one ulp near powers of two and thus can pick a different scale.
    Callers clamp amax to a positive minimum first.
    """
    recip = torch.tensor(1.0 / qmax, dtype=torch.float32, device=amax.device)
    x = amax.float() * recip
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    log2_ceil = exponent - 127 + (mantissa != 0).to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


def scale_values(scale: Tensor) -> Tensor:
    """Block scales -> fp32. A ue8m0 scale (float8_e8m0fnu) is decoded from its bits as torch's cast does:
    byte b is 2^(b - 127), b = 0 the subnormal 2^-127, b = 255 NaN. Integer arithmetic, so torch.compile fuses
    it into the dequantization; inductor has no e8m0 cast and gives `.float()` of one a copy kernel of its own."""
    if scale.dtype != torch.float8_e8m0fnu:
        return scale.float()
    b = scale.view(torch.uint8).to(torch.int32)
    v = torch.where(b == 0, 2.0**-127, (b << 23).view(torch.float32))
    return torch.where(b == 255, float("nan"), v)


# --------------------------------------------------------------------------
# FP8 e4m3 with ue8m0 block scales
# --------------------------------------------------------------------------

def _check_fp8_block(x: Tensor, block: tuple[int, ...]) -> None:
    """Blocks are 1xN (activations) or 2-D (weights) over the trailing dims."""
    if len(block) not in (1, 2) or any(int(b) <= 0 for b in block):
        raise ValueError(f"fp8 block must be (N,) or (R, C) of positive ints, got {block}")
    if x.dim() < len(block):
        raise ValueError(f"fp8 block {block} needs >= {len(block)} dims, got shape {tuple(x.shape)}")


def _expand_2d(scale: Tensor, block: tuple[int, ...], rows: int, cols: int) -> Tensor:
    """Broadcast a per-2-D-block scale [..., Rb, Cb] to [..., rows, cols],
    cropping the partial edge blocks."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]  # [..., rows, cols]


def _fp8_cast(y: Tensor) -> Tensor:
    """Saturating RNE cast to e4m3: torch's cast is RNE but maps overflow to NaN."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(x: Tensor, block: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 values + ue8m0 (float8_e8m0fnu) scales.

    block=(N,): 1xN blocks along the last dim (must divide it), scale [..., K/N].
    block=(R, C): 2-D blocks over the last two dims, edge blocks may be partial,
    scale [..., ceil(rows/R), ceil(cols/C)] (DeepSeek's weight layout).
    """
    _check_fp8_block(x, block)
    _check_no_nan(x, "quantize_fp8")
    x = x.float()
    if len(block) == 1:
        xb = _split_last(x, block[0], "quantize_fp8")  # [..., K/N, N]
        scale = ue8m0_scale(_block_amax(xb, _FP8_AMAX_MIN), FP8_MAX)  # [..., K/N]
        q = _fp8_cast(xb / scale.unsqueeze(-1)).flatten(-2)  # [..., K]
    else:
        b0, b1 = block
        rows, cols = x.shape[-2], x.shape[-1]
        nr, nc = -(-rows // b0), -(-cols // b1)
        # zero padding cannot raise any block's amax
        padded = torch.nn.functional.pad(x, (0, nc * b1 - cols, 0, nr * b0 - rows))
        tiles = padded.unflatten(-1, (nc, b1)).unflatten(-3, (nr, b0))  # [..., nr, b0, nc, b1]
        amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=_FP8_AMAX_MIN)  # [..., nr, nc]
        scale = ue8m0_scale(amax, FP8_MAX)
        q = _fp8_cast(x / _expand_2d(scale, block, rows, cols))  # [..., rows, cols]
    return q, scale.to(torch.float8_e8m0fnu)


def dequantize_fp8(q: Tensor, scale: Tensor, block: tuple[int, ...]) -> Tensor:
    """Inverse of quantize_fp8: q * scale in fp32, same layout rules."""
    _check_fp8_block(q, block)
    qf, sf = q.float(), scale_values(scale)
    if len(block) == 1:
        qb = _split_last(qf, block[0], "dequantize_fp8")  # [..., K/N, N]
        return (qb * sf.unsqueeze(-1)).flatten(-2)  # [..., K]
    return qf * _expand_2d(sf, block, qf.shape[-2], qf.shape[-1])  # [..., rows, cols]


def fake_quant_fp8(x: Tensor, block_size: int) -> Tensor:
    """Quantize-dequantize in 1 x block_size blocks (the reference model's QAT
    simulation of FP8 activations); returns x's dtype."""
    block = (block_size,)
    return dequantize_fp8(*quantize_fp8(x, block), block).to(x.dtype)


# --------------------------------------------------------------------------
# E2M1 (FP4) elements and packing
# --------------------------------------------------------------------------

def e2m1_encode(x: Tensor) -> Tensor:
    """Round to the nearest e2m1 code (ties to even code), saturating at +-6.

    The magnitude code is the number of midpoints passed; the sign (signbit,
    so -0.0 and tiny negatives keep it) goes to bit 3. Returns uint8 codes.
    """
    _check_no_nan(x, "e2m1_encode")
    x = x.float()
    mag = x.abs().contiguous()  # bucketize warns on (and copies) strided input
    up_odd = _E2M1_MIDPOINTS_UP_ODD.to(x.device)
    up_even = _E2M1_MIDPOINTS_UP_EVEN.to(x.device)
    # right=False counts midpoints < mag (tie stays below), right=True counts <= mag
    code = torch.bucketize(mag, up_odd, right=False) + torch.bucketize(mag, up_even, right=True)
    sign = torch.signbit(x).to(code.dtype) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """Code (0..15, any integer dtype) -> fp32 value: the E2M1_VALUES table on the CPU (the dequantizers' cost
    there), computed elsewhere (a table on another device would need a copy, which a CUDA graph cannot capture)."""
    if codes.device.type == "cpu":
        return E2M1_VALUES[codes.long()]
    return _e2m1_computed(codes)


def _e2m1_computed(codes: Tensor) -> Tensor:
    """e2m1_decode without a table. Bits s eem: exponent field e, mantissa bit m; subnormal (e = 0) m / 2, else
    2^(e-1) (1 + m / 2)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte, even element in the low nibble: [..., K] -> [..., K/2].

    Codes must already be in 0..15 (as produced by e2m1_encode).
    """
    pairs = _split_last(codes.to(torch.uint8), 2, "pack_fp4")  # [..., K/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of pack_fp4: [..., K2] bytes -> [..., 2*K2] uint8 codes.

    Accepts uint8, int8 (how official DeepSeek-V4 checkpoints store the bytes)
    or float4_e2m1fn_x2; all are reinterpreted as uint8 so the high-nibble
    shift is logical, not arithmetic.
    """
    if packed.dtype not in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        raise ValueError(f"unpack_fp4: unsupported dtype {packed.dtype}")
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # [..., 2*K2]


def _dequant_fp4(packed: Tensor, scale: Tensor, block: int, what: str) -> Tensor:
    """e2m1 values times a per-block scale (already fp32) -> fp32 [..., K]."""
    vals = _split_last(e2m1_decode(unpack_fp4(packed)), block, what)  # [..., K/B, B]
    return (vals * scale.unsqueeze(-1)).flatten(-2)  # [..., K]


# --------------------------------------------------------------------------
# MXFP4: e2m1 + e8m0 scale per block of 32
# --------------------------------------------------------------------------

def quantize_mxfp4(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """MXFP4 (DeepSeek's routed-expert weights, indexer q/k simulation).

    Returns packed e2m1 codes uint8 [..., K/2] and float8_e8m0fnu scales
    [..., K/block]; the power-of-two scale maps the block amax to <= 6.
    """
    _check_no_nan(x, "quantize_mxfp4")
    xb = _split_last(x.float(), block, "quantize_mxfp4")  # [..., K/B, B]
    scale = ue8m0_scale(_block_amax(xb, _MXFP4_AMAX_MIN), FP4_MAX)  # [..., K/B]
    codes = e2m1_encode((xb / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return pack_fp4(codes.flatten(-2)), scale.to(torch.float8_e8m0fnu)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """Inverse of quantize_mxfp4 -> fp32 [..., K]."""
    return _dequant_fp4(packed, scale_values(scale), block, "dequantize_mxfp4")


def fake_quant_mxfp4(x: Tensor, block: int = 32) -> Tensor:
    """MXFP4 quantize-dequantize in fp32; returns x's dtype."""
    return dequantize_mxfp4(*quantize_mxfp4(x, block), block).to(x.dtype)


# --------------------------------------------------------------------------
# NVFP4-style: e2m1 + e4m3 scale per block of 16 (+ optional global scale)
# --------------------------------------------------------------------------

def quantize_nvfp4(
    x: Tensor, block: int = 16, global_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """NVFP4-style codes uint8 [..., K/2] and float8_e4m3fn scales [..., K/block].

    Without global_scale (DeepSeek-V4.1 compressed-KV cache): s = e4m3(amax/6).
    With global_scale g (torchao convention): s = e4m3((amax/6)/g), clamped to
    the normal e4m3 range, and the effective block scale is s * g.
    """
    _check_no_nan(x, "quantize_nvfp4")
    xb = _split_last(x.float(), block, "quantize_nvfp4")  # [..., K/B, B]
    if global_scale is None:
        amax = _block_amax(xb, _NVFP4_AMAX_MIN)  # [..., K/B]
        scale = _fp8_cast(amax / FP4_MAX)
        eff = scale.float()
    else:
        g = global_scale.float().to(x.device)
        amax = xb.abs().amax(dim=-1)  # [..., K/B]
        tiny = torch.finfo(torch.float8_e4m3fn).tiny
        scale = ((amax / FP4_MAX) / g).clamp(tiny, FP8_MAX).to(torch.float8_e4m3fn)
        eff = scale.float() * g
    codes = e2m1_encode((xb / eff.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return pack_fp4(codes.flatten(-2)), scale


def nvfp4_global_scale(x: Tensor) -> Tensor:
    """Per-tensor fp32 scale amax / (448 * 6), so block scales use e4m3's range.

    An all-zero tensor gets the smallest normal fp32 instead of 0, keeping the
    encoder's division finite.
    """
    amax = x.abs().amax().float()
    return (amax / (FP8_MAX * FP4_MAX)).clamp(min=torch.finfo(torch.float32).tiny)


def dequantize_nvfp4(
    packed: Tensor, scale: Tensor, block: int = 16, global_scale: Tensor | None = None
) -> Tensor:
    """Inverse of quantize_nvfp4 -> fp32 [..., K] = e2m1 * scale [* g]."""
    eff = scale.float()
    if global_scale is not None:
        eff = eff * global_scale.float().to(eff.device)
    return _dequant_fp4(packed, eff, block, "dequantize_nvfp4")


def fake_quant_nvfp4(x: Tensor, block: int = 16) -> Tensor:
    """NVFP4 quantize-dequantize (no global scale) in fp32; returns x's dtype."""
    return dequantize_nvfp4(*quantize_nvfp4(x, block), block).to(x.dtype)
