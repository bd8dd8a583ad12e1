"""A decode token's cache row in one kernel: RMSNorm, RoPE and the store's encoding (V4.1) or rounding (V4).

`dsv4::window_write(kv, weight, eps, cos, sin, data, scale, slots, rows, block, fmt="fp8", hadamard=False) -> ()`
    kv [N, D] (the model's dtype), weight [D] (the norm's), cos / sin [N, R/2] fp32 (each row's RoPE tables, R <= D
    rotated trailing channels). data[slots, rows], scale[slots, rows] = the bytes in `fmt` (1 x block blocks:
    "fp8" e4m3 with ue8m0 scales, "nvfp4", "mxfp4"; `dsv4.quant`'s codecs) of apply_rope(rms_norm(kv)), with
    `hadamard` of hadamard(apply_rope(rms_norm(kv))), each rounded to the model's dtype where the reference rounds
    it (`window_write_twin`). The decode step writes this way V4.1's window rows (wkv's output, kv_norm, FP8), its
    compressed entries (the compressor's pooled latent, its norm, NVFP4) and index keys (wk's output, k_norm,
    MXFP4), and V4's index keys (the indexer compressor's latent and norm, the Hadamard transform, MXFP4).
`dsv4::window_write_rounded(kv, weight, eps, cos, sin, data, slots, rows, block) -> ()`
    V4's window and compressed rows: the same rows with the channels RoPE leaves alone through an FP8 round trip in
    1 x block blocks (the reference's `_window_quant`; the R rotated channels as they are, R a multiple of block),
    stored in the model's dtype at data[slots, rows] (data [slots, rows, D], kv's dtype;
    `window_write_rounded_twin`).

Why: in the compiled decode step the norm, the rotation, the concatenation of rotated and plain channels (V4's
keys: three kernels of Hadamard butterflies) and the quantizing write were four to eight launches a row kind and
layer (inductor kernels and `dsv4::quant_write`), a chain of ~1.5 us kernels that each move a few KB.

One program a row holds its D channels as (even, odd) pairs. Exact as the twin but for the norm's sum of squares,
summed in another order (the row's mean square can differ in its last bit, and so, rarely, a value by one bf16 step
and its code by one): the products, the rotation, the butterflies and the codes are the reference's (fp fusion
off; the butterflies are `indexer_query`'s).
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, start_successor, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.engram import _e4m3_to_f32
from dsv4.fast.kernels.indexer_query import _hadamard_rows
from dsv4.fast.kernels.quant import FORMAT_CODES, _check_write, _fp4_blocks, _fp8_blocks, _widen, quant_write
from dsv4.fast.kernels.rope import check_rope_tables, inverse_rms, rotate_pairs, rounded
from dsv4.reference.attention import round_unrotated
from dsv4.reference.indexer import hadamard as hadamard_transform
from dsv4.reference.linear import rms_norm
from dsv4.reference.rope import apply_rope

__all__ = ["window_rows", "window_write", "window_write_rounded", "window_write_rounded_twin", "window_write_twin"]


def window_rows(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """The reference's window rows of wkv's output kv [N, D]: kv_norm (`rms_norm`), then RoPE at cos, sin [N, R/2]."""
    return apply_rope(rms_norm(kv, weight, eps)[:, None], cos[:, None], sin[:, None])[:, 0]


def window_write_twin(kv, weight, eps: float, cos, sin, data, scale, slots, rows, block: int, fmt: str = "fp8",
                      hadamard: bool = False) -> None:
    """`window_rows` (with `hadamard`, through the reference's `hadamard`) through `quant_write`."""
    x = window_rows(kv, weight, eps, cos, sin)
    quant_write(hadamard_transform(x) if hadamard else x, data, scale, slots, rows, fmt, block)


def window_write_rounded_twin(kv, weight, eps: float, cos, sin, data, slots, rows, block: int) -> None:
    """`window_rows` through the reference's `round_unrotated`, stored in data's dtype."""
    data[slots, rows] = round_unrotated(window_rows(kv, weight, eps, cos, sin), 2 * cos.shape[1], block).to(data.dtype)


@triton.jit
def _window_write_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr, slot_ptr, row_ptr, slot_rows, eps,
                         D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
                         FMT: tl.constexpr, ROUNDED: tl.constexpr, HADAMARD: tl.constexpr, LOG_D: tl.constexpr,
                         INTERP: tl.constexpr, PDL: tl.constexpr, START: tl.constexpr):
    """Program: one row. FMT: `FORMAT_CODES`'s, the codes to q_ptr and the scale bytes to s_ptr; ROUNDED (V4, FMT
    FP8): the FP8 values decoded again and stored in q_ptr's dtype, the RoPE blocks as they are (s_ptr unused).
    START: the successor starts now (`start_successor`)."""
    wait_for_predecessor(PDL)
    start_successor(START)
    n = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, D // 2)[None, :]  # [1, D/2]: channel pairs (2p, 2p + 1)
    even = _widen(tl.load(kv_ptr + n * D + 2 * p))
    odd = _widen(tl.load(kv_ptr + n * D + 2 * p + 1))
    r = inverse_rms(even, odd, eps, D)
    even = rounded(_widen(tl.load(w_ptr + 2 * p)) * (even * r), BF16, INTERP)
    odd = rounded(_widen(tl.load(w_ptr + 2 * p + 1)) * (odd * r), BF16, INTERP)
    even, odd = rotate_pairs(even, odd, cos_ptr + n * (R // 2), sin_ptr + n * (R // 2), tl.arange(0, D // 2), D, R,
                             BF16, INTERP)
    x = tl.reshape(tl.join(even, odd), (1, D))  # the row's channels in order
    if HADAMARD:  # scaled and rounded to the model's dtype, as the reference's transform returns it
        x = rounded(_hadamard_rows(x, D, LOG_D) * (D**-0.5), BF16, INTERP)
    x = tl.reshape(x, (D // BLOCK, BLOCK))  # blocks along the row
    amax = tl.max(tl.abs(x), axis=1)
    dst = tl.load(slot_ptr + n).to(tl.int64) * slot_rows + tl.load(row_ptr + n)
    cols = tl.reshape(tl.arange(0, D), (D // BLOCK, BLOCK))
    if ROUNDED:  # code times 2^(scale byte - 127): exact in fp32, and in the model's dtype (3 mantissa bits)
        codes, scale = _fp8_blocks(x, amax)
        back = _e4m3_to_f32(codes.to(tl.int32)) * (scale << 23).to(tl.float32, bitcast=True)[:, None]
        rotated = (tl.arange(0, D // BLOCK) * BLOCK >= D - R)[:, None]
        tl.store(q_ptr + dst * D + cols, tl.where(rotated, x, back).to(q_ptr.dtype.element_ty))
    else:
        if FMT == 0:
            codes, scale = _fp8_blocks(x, amax)
            tl.store(q_ptr + dst * D + cols, codes)
        else:
            packed, scale = _fp4_blocks(x, amax, FMT)  # [D / BLOCK, BLOCK / 2]
            tl.store(q_ptr + dst * (D // 2) + tl.reshape(tl.arange(0, D // 2), (D // BLOCK, BLOCK // 2)), packed)
        tl.store(s_ptr + dst * (D // BLOCK) + tl.arange(0, D // BLOCK), scale.to(tl.uint8))


def _check_rows(kv, weight, cos, sin, block: int, what: str) -> None:
    """The row inputs both ops take."""
    if kv.dim() != 2 or weight.shape != kv.shape[1:]:
        raise ValueError(f"{what}: kv [N, D] and weight [D] expected, got {tuple(kv.shape)}, {tuple(weight.shape)}")
    N, D = kv.shape
    check_rope_tables(cos, sin, N, D, what)
    if kv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{what}: kv bf16 or fp32 expected, got {kv.dtype}")
    if D & (D - 1) or block & (block - 1) or D % block:
        raise ValueError(f"{what}: the row ({D}) and the block ({block}) must be powers of two, the block "
                         "dividing the row")


def _check(kv, weight, cos, sin, data, scale, slots, rows, block: int, fmt: str) -> None:
    _check_rows(kv, weight, cos, sin, block, "window_write")
    _check_write(kv, data, scale, slots, rows, fmt, block, "window_write")


def _check_rounded(kv, weight, cos, sin, data, slots, rows, block: int) -> None:
    what = "window_write_rounded"
    _check_rows(kv, weight, cos, sin, block, what)
    N, D = kv.shape
    if (2 * cos.shape[1]) % block:
        raise ValueError(f"{what}: the rotated channels ({2 * cos.shape[1]}) must be whole blocks of {block}")
    if data.dtype != kv.dtype or data.dim() != 3 or data.shape[2] != D or not data.is_contiguous():
        raise ValueError(f"{what}: data must be contiguous {kv.dtype} [slots, rows, {D}], got {data.dtype} "
                         f"{tuple(data.shape)}")
    if slots.shape != (N,) or rows.shape != (N,) or {slots.dtype, rows.dtype} - {torch.int32, torch.int64}:
        raise ValueError(f"{what}: slots and rows must be int32 or int64 [{N}], got {slots.dtype} "
                         f"{tuple(slots.shape)} and {rows.dtype} {tuple(rows.shape)}")


def _launch(kv, weight, eps, cos, sin, data, scale, slots, rows, block: int, fmt: str, hadamard: bool,
            rounded_rows: bool, start: bool = False) -> None:
    if kv.shape[0]:
        D = kv.shape[1]
        _window_write_kernel[(kv.shape[0],)](
            kv.contiguous(), weight.contiguous(), cos.contiguous(), sin.contiguous(), data, scale, slots, rows,
            data.shape[1], float(eps), D=D, R=2 * cos.shape[1], BLOCK=block, BF16=kv.dtype == torch.bfloat16,
            FMT=FORMAT_CODES[fmt], ROUNDED=rounded_rows, HADAMARD=hadamard, LOG_D=D.bit_length() - 1,
            INTERP=not kv.is_cuda, PDL=pdl(kv), START=start and pdl(kv), num_warps=2, launch_pdl=pdl(kv),
            enable_fp_fusion=False)


@torch.library.custom_op("dsv4::window_write", mutates_args=("data", "scale"))
def window_write(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, block: int,
                 fmt: str = "fp8", hadamard: bool = False, start_successor: bool = False) -> None:
    """The rows of kv [N, D] written to the `fmt` store (data, scale) at (slots, rows): see the module doc.
    Slots and rows are not bound-checked (that would read them back to the host). start_successor: the next kernel
    starts as this one's programs pass their PDL wait (`dsv4.fast.kernels.start_successor`: the decode step's
    attention, settled); the same values."""
    _check(kv, weight, cos, sin, data, scale, slots, rows, block, fmt)
    if not use_triton(kv):
        window_write_twin(kv, weight, eps, cos, sin, data, scale, slots, rows, block, fmt, hadamard)
        return
    _launch(kv, weight, eps, cos, sin, data, scale, slots, rows, block, fmt, hadamard, False, start_successor)


@window_write.register_fake
def _(kv, weight, eps, cos, sin, data, scale, slots, rows, block, fmt="fp8", hadamard=False, start_successor=False):
    _check(kv, weight, cos, sin, data, scale, slots, rows, block, fmt)


@torch.library.custom_op("dsv4::window_write_rounded", mutates_args=("data",))
def window_write_rounded(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         data: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, block: int) -> None:
    """V4's window rows of kv [N, D] written to the store data [slots, rows, D] at (slots, rows): see the module
    doc. Slots and rows are not bound-checked."""
    _check_rounded(kv, weight, cos, sin, data, slots, rows, block)
    if not use_triton(kv):
        window_write_rounded_twin(kv, weight, eps, cos, sin, data, slots, rows, block)
        return
    _launch(kv, weight, eps, cos, sin, data, data, slots, rows, block, "fp8", False, True)


@window_write_rounded.register_fake
def _(kv, weight, eps, cos, sin, data, slots, rows, block):
    _check_rounded(kv, weight, cos, sin, data, slots, rows, block)
