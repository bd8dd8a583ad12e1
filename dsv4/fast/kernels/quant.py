"""Activation quantization kernels, bit-identical to the codecs in `dsv4.quant`.

Three custom ops, each quantizing x [..., K] in 1 x block blocks along the last dim:

- `dsv4::fp8_quant(x, block)`     -> (q float8_e4m3fn [..., K], scale float8_e8m0fnu [..., K/block])
- `dsv4::mxfp4_quant(x, block=32)` -> (packed uint8 [..., K/2], scale float8_e8m0fnu [..., K/block])
- `dsv4::nvfp4_quant(x, block=16)` -> (packed uint8 [..., K/2], scale float8_e4m3fn [..., K/block])

One Triton kernel serves all three (a constexpr format switch). Every output byte is built with integer
arithmetic on IEEE bits, never with a hardware float->fp8 conversion, so the kernel gives the same bytes
on a GPU and under the Triton interpreter (whose fp8 cast truncates subnormals):

- ue8m0 scale (fp8, mxfp4): s = 2^ceil(log2(amax * fp32(1/qmax))) read off the exponent and mantissa
  bits; x / s is computed as x * 2^-log2(s), the same correctly rounded value.
- e4m3 (fp8 values, nvfp4 scales): round-to-nearest-even on the bits, subnormals via the 2^23 trick.
- e2m1: the magnitude code counts the midpoints passed (ties to the even code), the sign bit is x's.

The kernels do not check for NaN (that would need a host sync); `dsv4.quant` raises on NaN, the kernels
give unspecified bytes. Where `use_triton(x)` is false the ops call `dsv4.quant` itself.
"""

from __future__ import annotations

import torch

from dsv4 import quant as ref
from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor

__all__ = ["fp8_quant", "mxfp4_quant", "nvfp4_quant", "quant_config", "quant_write"]

_FP8, _MXFP4, _NVFP4 = 0, 1, 2
FORMAT_CODES = {"fp8": _FP8, "mxfp4": _MXFP4, "nvfp4": _NVFP4}  # the kernel's FMT switch by format
_TILE, _WARPS = 4096, 4  # padded elements a program and its warps for prefill-size inputs
_SMALL_TILE = 256  # a decode-size input's: 8 values a lane of 1 warp
_SMALL_MAX = 16384  # padded elements up to which the small tiles serve (64 programs)


@triton.jit
def _e4m3_code(v):
    """fp32 v with |v| <= 448 (no NaN) -> e4m3 byte (int32 0..255), round to nearest even, sign kept."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # normal (a >= 2^-6): drop 20 mantissa bits with RNE; a carry moves into the exponent by itself
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: a multiple of 2^-9, rounded to even by adding and removing 2^23
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def _e4m3_value(code):
    """Positive e4m3 byte (int32, not NaN) -> fp32."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e2m1_code(y):
    """fp32 y with |y| <= 6 (no NaN) -> e2m1 code (int32 0..15): ties to the even code, sign in bit 3."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_values(n):
    """e2m1 codes (int32, 0..15: sign bit 3, magnitude bits 0-2) -> their exact values, fp32, by arithmetic
    (indexer_query's decode, and under the interpreter the twin of the MoE kernels' PTX decoders)."""
    m = n & 7
    # magnitude m >= 2 is 2^(m>>1 - 1) * (1 + (m&1)/2): the fp32 with exponent field (m >> 1) + 126 and top
    # mantissa bit m & 1, i.e. bits (m << 22) + (126 << 23); m in {0, 1} is m / 2
    v = tl.where(m < 2, m.to(tl.float32) * 0.5, ((m << 22) + (126 << 23)).to(tl.float32, bitcast=True))
    # the sign as a bit: code 8 is -0.0, as the twins decode it; a negation under a select came out +0.0 on the
    # H200 (the compiler may treat zeros' signs as free)
    return (v.to(tl.int32, bitcast=True) | ((n & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(amax, RECIP: tl.constexpr):
    """amax (> 0, fp32) -> (log2 of the ue8m0 scale for amax * RECIP, exact 1/scale as fp32)."""
    y = amax * tl.full([], RECIP, tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    log2s = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - log2s) << 23).to(tl.float32, bitcast=True)
    return log2s, inv


@triton.jit
def _widen(x):
    """Loaded values -> fp32; bf16 on its bits, exact on the GPU and under the interpreter, whose bf16 -> fp32 cast
    gets subnormals wrong (it normalizes their mantissa and keeps the zero exponent: 0.859 x 2^-126 came out
    0.719 x 2^-126, one FP4 code off)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _fp8_blocks(x, amax):
    """Blocks x [rows, cols] with their absolute maxima amax [rows] -> (e4m3 codes uint8 [rows, cols], ue8m0 scale
    bytes int32 [rows]): `dsv4.quant.quantize_fp8`'s."""
    log2s, inv = _ue8m0(tl.maximum(amax, 1e-4), 1.0 / 448.0)
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    return _e4m3_code(y).to(tl.uint8), log2s + 127


@triton.jit
def _fp4_blocks(x, amax, FMT: tl.constexpr):
    """Blocks x [rows, cols] (cols even) with their absolute maxima amax [rows] -> (e2m1 codes packed in pairs,
    even | odd << 4, uint8 [rows, cols / 2]; scale bytes int32 [rows]): `dsv4.quant.quantize_mxfp4`'s (FMT 1, ue8m0
    scales) or `quantize_nvfp4`'s (FMT 2, e4m3 scales of amax / 6)."""
    if FMT == 1:
        log2s, inv = _ue8m0(tl.maximum(amax, 6.0 * 2.0**-126), 1.0 / 6.0)
        y = x * inv[:, None]
        scale = log2s + 127
    else:
        sb = tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), tl.full(amax.shape, 6.0, tl.float32))
        scale = _e4m3_code(tl.minimum(sb, 448.0))
        eff = tl.broadcast_to(_e4m3_value(scale)[:, None], x.shape)
        y = tl.math.div_rn(x, eff)
    codes = _e2m1_code(tl.minimum(tl.maximum(y, -6.0), 6.0))
    even, odd = tl.split(tl.reshape(codes, [x.shape[0], x.shape[1] // 2, 2]))
    return (even | (odd << 4)).to(tl.uint8), scale


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, slot_ptr, row_ptr, n_blocks, row_blocks, slot_rows,
    FMT: tl.constexpr, BLOCK: tl.constexpr, HALF_P2: tl.constexpr, ROWS: tl.constexpr, SCATTER: tl.constexpr,
    PDL: tl.constexpr,
):
    """Quantize ROWS consecutive blocks of BLOCK elements (padded to 2 * HALF_P2, a power of two); FP4 codes
    pack in pairs (even | odd << 4). With SCATTER, x's row t (row_blocks blocks) is stored as row (slot[t], row[t])
    of q and s [slots, slot_rows, ...], else as row t."""
    wait_for_predecessor(PDL)
    blk = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    live = blk < n_blocks
    col = tl.arange(0, 2 * HALF_P2)[None, :]
    mask = live[:, None] & (col < BLOCK)
    x = _widen(tl.load(x_ptr + blk[:, None] * BLOCK + col, mask=mask, other=0.0))  # [ROWS, 2 * HALF_P2]
    out = blk  # the block's place in q and s
    if SCATTER:
        t = blk // row_blocks
        dst = tl.load(slot_ptr + t, mask=live, other=0).to(tl.int64) * slot_rows + tl.load(row_ptr + t, mask=live, other=0)
        out = dst * row_blocks + blk % row_blocks
    amax = tl.max(tl.abs(x), axis=1)  # [ROWS]

    if FMT == 0:  # FP8 e4m3, ue8m0 scale
        codes, scale = _fp8_blocks(x, amax)
        tl.store(q_ptr + out[:, None] * BLOCK + col, codes, mask=mask)
    else:
        packed, scale = _fp4_blocks(x, amax, FMT)  # [ROWS, HALF_P2]
        pair = tl.arange(0, HALF_P2)
        pmask = live[:, None] & (pair[None, :] < BLOCK // 2)
        tl.store(q_ptr + out[:, None] * (BLOCK // 2) + pair[None, :], packed, mask=pmask)
    tl.store(s_ptr + out, scale.to(tl.uint8), mask=live)


def quant_config(rows: int, cols: int, block: int, cfg: dict | None = None) -> dict:
    """The kernel's tiles for x [rows, cols] in 1 x block blocks: ROWS blocks a program, each padded to 2 * HALF_P2
    columns (a power of two), and num_warps. `cfg` (ROWS, num_warps) overrides.

    A decode step quantizes single cache entries: 512 values (16 FP8 or 32 NVFP4 blocks) or a 128-value index
    key (4 MXFP4 blocks). In the prefill tile (4096 values, 4 warps) such an entry's one program computes 8-32x
    as many padding values as real ones (NVFP4: 32 IEEE divisions a lane). Small inputs get tiles of at most 256
    values in 1 warp instead, as many programs as the blocks fill (H200, graph, one entry: NVFP4 1.23 against
    6.24 us, FP8 0.97 / 1.36, MXFP4 1.09 / 1.98; `bench/results/quant.json`)."""
    cfg = cfg or {}
    half_p2 = triton.next_power_of_2(-(-block // 2))
    width = 2 * half_p2  # a block's padded columns
    n_blocks = rows * cols // block
    small = n_blocks * width <= _SMALL_MAX
    fit = min((_SMALL_TILE if small else _TILE) // width, triton.next_power_of_2(n_blocks))
    return {"ROWS": cfg.get("ROWS") or max(1, fit), "HALF_P2": half_p2,
            "num_warps": cfg.get("num_warps") or (1 if small else _WARPS)}


def _launch(x: torch.Tensor, block: int, fmt: int, cfg: dict | None = None,
            into: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel (tiles from `quant_config`, `cfg` overriding); returns raw bytes: q (uint8 [..., K] or
    [..., K/2]) and scales (uint8 [..., K/block]). `into` (q, s, slots, rows): x [N, K]'s row i goes to
    q[slots[i], rows[i]] and s[slots[i], rows[i]] (uint8 [S, R, ...], contiguous) instead, and they are returned."""
    k = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    x = x.contiguous()
    if into is None:
        q_cols = k if fmt == _FP8 else k // 2
        q = torch.empty((*x.shape[:-1], q_cols), dtype=torch.uint8, device=x.device)
        s = torch.empty((*x.shape[:-1], k // block), dtype=torch.uint8, device=x.device)
        slots = rows = s  # unread
    else:
        q, s, slots, rows = into
    slot_rows = 0 if into is None else q.shape[1]
    n_blocks = x.numel() // block
    if n_blocks:
        c = quant_config(x.numel() // k, k, block, cfg)
        _quant_kernel[(triton.cdiv(n_blocks, c["ROWS"]),)](
            x, q, s, slots, rows, n_blocks, k // block, slot_rows, FMT=fmt, BLOCK=block, HALF_P2=c["HALF_P2"],
            ROWS=c["ROWS"], SCATTER=into is not None, PDL=pdl(x), num_warps=c["num_warps"], launch_pdl=pdl(x),
        )
    return q, s


def _check(x: torch.Tensor, block: int, what: str, even: bool) -> None:
    if x.dim() == 0:
        raise ValueError(f"{what}: expected at least 1 dim, got a scalar")
    if block <= 0 or x.shape[-1] % block != 0:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not divisible by block size {block}")
    if even and block % 2:
        raise ValueError(f"{what}: block {block} must be even (two codes per byte)")


def _scale_shape(x: torch.Tensor, block: int) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // block)


# ---------------------------------------------------------------------------------------------- ops


@torch.library.custom_op("dsv4::fp8_quant", mutates_args=())
def fp8_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/block]) == quantize_fp8(x, (block,))."""
    _check(x, block, "fp8_quant", even=False)
    if not use_triton(x):
        return ref.quantize_fp8(x, (block,))
    q, s = _launch(x, block, _FP8)
    return q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


@fp8_quant.register_fake
def _(x, block):
    _check(x, block, "fp8_quant", even=False)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(_scale_shape(x, block), dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("dsv4::mxfp4_quant", mutates_args=())
def mxfp4_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (uint8 [..., K/2], float8_e8m0fnu [..., K/block]) == quantize_mxfp4(x, block)."""
    _check(x, block, "mxfp4_quant", even=True)
    if not use_triton(x):
        return ref.quantize_mxfp4(x, block)
    q, s = _launch(x, block, _MXFP4)
    return q, s.view(torch.float8_e8m0fnu)


@mxfp4_quant.register_fake
def _(x, block=32):
    _check(x, block, "mxfp4_quant", even=True)
    packed = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return packed, x.new_empty(_scale_shape(x, block), dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("dsv4::nvfp4_quant", mutates_args=())
def nvfp4_quant(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (uint8 [..., K/2], float8_e4m3fn [..., K/block]) == quantize_nvfp4(x, block)."""
    _check(x, block, "nvfp4_quant", even=True)
    if not use_triton(x):
        return ref.quantize_nvfp4(x, block)
    q, s = _launch(x, block, _NVFP4)
    return q, s.view(torch.float8_e4m3fn)


@nvfp4_quant.register_fake
def _(x, block=16):
    _check(x, block, "nvfp4_quant", even=True)
    packed = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return packed, x.new_empty(_scale_shape(x, block), dtype=torch.float8_e4m3fn)


# the reference encoders of the cache's row store formats (dsv4.fast.cache.Rows)
_STORED = {
    "fp8": lambda x, block: ref.quantize_fp8(x, (block,)),
    "mxfp4": ref.quantize_mxfp4,
    "nvfp4": ref.quantize_nvfp4,
}


def _check_write(x, data, scale, slots, rows, fmt: str, block: int, what: str = "") -> None:
    """x [N, K] and its store's places and bytes (data, scale) in `fmt`; `what` names the op in errors."""
    what = what or f"quant_write({fmt})"
    if fmt not in _STORED:
        raise ValueError(f"{what}: unknown format, expected one of {sorted(_STORED)}")
    _check(x, block, what, even=fmt != "fp8")
    if x.dim() != 2 or slots.shape != (x.shape[0],) or rows.shape != (x.shape[0],):
        raise ValueError(f"{what}: x [N, K] with slots [N] and rows [N] expected, got {tuple(x.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(rows.shape)}")
    if {slots.dtype, rows.dtype} - {torch.int32, torch.int64}:
        raise ValueError(f"{what}: slots and rows must be int32 or int64, got {slots.dtype} and {rows.dtype}")
    width = x.shape[1] if fmt == "fp8" else x.shape[1] // 2
    for name, t, cols in (("data", data, width), ("scale", scale, x.shape[1] // block)):
        if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[2] != cols or not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous uint8 [slots, rows, {cols}], got {t.dtype} "
                             f"{tuple(t.shape)}")


@torch.library.custom_op("dsv4::quant_write", mutates_args=("data", "scale"))
def quant_write(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                fmt: str, block: int) -> None:
    """data[slots, rows], scale[slots, rows] = the bytes of x [N, K] in `fmt` ("fp8", "mxfp4", "nvfp4": as the ops
    above, 1 x block blocks), into a cache's row stores (uint8 [S, R, width] and [S, R, K / block]). The decode step
    writes its cache rows this way: one kernel where a quantization and two index writes took three. The kernel
    does not bound-check slots and rows (that would read them back to the host): the caller's rows are in range."""
    _check_write(x, data, scale, slots, rows, fmt, block)
    if use_triton(x):
        _launch(x, block, FORMAT_CODES[fmt], into=(data, scale, slots, rows))
        return
    q, s = _STORED[fmt](x, block)
    data[slots, rows] = q.view(torch.uint8)
    scale[slots, rows] = s.view(torch.uint8)


@quant_write.register_fake
def _(x, data, scale, slots, rows, fmt, block):
    _check_write(x, data, scale, slots, rows, fmt, block)
