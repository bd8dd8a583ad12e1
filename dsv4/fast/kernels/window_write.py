"""A decode token's window KV row in one kernel: RMSNorm, RoPE and the store's FP8 encoding (V4.1) or rounding (V4).

`dsv4::window_write(kv, weight, eps, cos, sin, data, scale, slots, rows, block) -> ()`
    kv [N, D] (wkv's output, the model's dtype), weight [D] (kv_norm's), cos / sin [N, R/2] fp32 (each row's RoPE
    tables, R <= D rotated trailing channels). data[slots, rows], scale[slots, rows] = the FP8 bytes (1 x block
    blocks, ue8m0 scales: `dsv4.quant.quantize_fp8`) of apply_rope(rms_norm(kv)), rounded to the model's dtype after
    the norm and after the rotation as the reference rounds them (`window_write_twin`).
`dsv4::window_write_rounded(kv, weight, eps, cos, sin, data, slots, rows, block) -> ()`
    V4's window: the same rows with the channels RoPE leaves alone through an FP8 round trip in 1 x block blocks
    (the reference's `_window_quant`; the R rotated channels as they are, R a multiple of block), stored in the
    model's dtype at data[slots, rows] (data [slots, rows, D], kv's dtype; `window_write_rounded_twin`).

Why: in the compiled decode step the norm, the rotation, the concatenation of rotated and plain channels and the
quantizing write were four launches a layer (three inductor kernels and `dsv4::quant_write`), a chain of ~1.5 us
kernels that each move a few KB.

One program a row holds its D channels as (even, odd) pairs. Exact as the twin but for the norm's sum of squares,
summed in another order (the row's mean square can differ in its last bit, and so, rarely, a value by one bf16 step
and its FP8 code by one): the products, the rotation and the codes are the reference's (fp fusion off).
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.engram import _e4m3_to_f32
from dsv4.fast.kernels.quant import _check_write, _fp8_blocks, _widen, quant_write
from dsv4.fast.kernels.rope import rotate_pairs, rounded
from dsv4.reference.attention import round_unrotated
from dsv4.reference.linear import rms_norm
from dsv4.reference.rope import apply_rope

__all__ = ["window_rows", "window_write", "window_write_rounded", "window_write_rounded_twin", "window_write_twin"]


def window_rows(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """The reference's window rows of wkv's output kv [N, D]: kv_norm (`rms_norm`), then RoPE at cos, sin [N, R/2]."""
    return apply_rope(rms_norm(kv, weight, eps)[:, None], cos[:, None], sin[:, None])[:, 0]


def window_write_twin(kv, weight, eps: float, cos, sin, data, scale, slots, rows, block: int) -> None:
    """`window_rows` through `quant_write`."""
    quant_write(window_rows(kv, weight, eps, cos, sin), data, scale, slots, rows, "fp8", block)


def window_write_rounded_twin(kv, weight, eps: float, cos, sin, data, slots, rows, block: int) -> None:
    """`window_rows` through the reference's `round_unrotated`, stored in data's dtype."""
    data[slots, rows] = round_unrotated(window_rows(kv, weight, eps, cos, sin), 2 * cos.shape[1], block).to(data.dtype)


@triton.jit
def _window_write_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr, slot_ptr, row_ptr, slot_rows, eps,
                         D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
                         ROUNDED: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """Program: one row. ROUNDED (V4): the FP8 values decoded again and stored in q_ptr's dtype, the RoPE blocks as
    they are (s_ptr unused); else the codes and scales."""
    wait_for_predecessor(PDL)
    n = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, D // 2)[None, :]  # [1, D/2]: channel pairs (2p, 2p + 1)
    even = _widen(tl.load(kv_ptr + n * D + 2 * p))
    odd = _widen(tl.load(kv_ptr + n * D + 2 * p + 1))
    mean_square = tl.math.div_rn(tl.sum(even * even + odd * odd, axis=1), tl.full([1], D, tl.float32))
    r = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.sqrt_rn(mean_square + eps))[:, None]  # 1 / sqrt, as torch
    even = rounded(_widen(tl.load(w_ptr + 2 * p)) * (even * r), BF16, INTERP)
    odd = rounded(_widen(tl.load(w_ptr + 2 * p + 1)) * (odd * r), BF16, INTERP)
    even, odd = rotate_pairs(even, odd, cos_ptr + n * (R // 2), sin_ptr + n * (R // 2), tl.arange(0, D // 2), D, R,
                             BF16, INTERP)
    x = tl.reshape(tl.join(even, odd), (D // BLOCK, BLOCK))  # blocks along the row, in channel order
    codes, scale = _fp8_blocks(x, tl.max(tl.abs(x), axis=1))
    dst = tl.load(slot_ptr + n).to(tl.int64) * slot_rows + tl.load(row_ptr + n)
    cols = tl.reshape(tl.arange(0, D), (D // BLOCK, BLOCK))
    if ROUNDED:  # code times 2^(scale byte - 127): exact in fp32, and in the model's dtype (3 mantissa bits)
        back = _e4m3_to_f32(codes.to(tl.int32)) * (scale << 23).to(tl.float32, bitcast=True)[:, None]
        rotated = (tl.arange(0, D // BLOCK) * BLOCK >= D - R)[:, None]
        tl.store(q_ptr + dst * D + cols, tl.where(rotated, x, back).to(q_ptr.dtype.element_ty))
    else:
        tl.store(q_ptr + dst * D + cols, codes)
        tl.store(s_ptr + dst * (D // BLOCK) + tl.arange(0, D // BLOCK), scale.to(tl.uint8))


def _check_rows(kv, weight, cos, sin, block: int, what: str) -> None:
    """The row inputs both ops take."""
    if kv.dim() != 2 or weight.shape != kv.shape[1:]:
        raise ValueError(f"{what}: kv [N, D] and weight [D] expected, got {tuple(kv.shape)}, {tuple(weight.shape)}")
    N, D = kv.shape
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != N or 2 * cos.shape[1] > D:
        raise ValueError(f"{what}: cos and sin [N, R/2] with R <= {D} expected, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if kv.dtype not in (torch.bfloat16, torch.float32) or {cos.dtype, sin.dtype} != {torch.float32}:
        raise ValueError(f"{what}: kv bf16 or fp32 and cos, sin fp32 expected, got {kv.dtype}, {cos.dtype}, "
                         f"{sin.dtype}")
    if D & (D - 1) or block & (block - 1) or D % block:
        raise ValueError(f"{what}: the row ({D}) and the block ({block}) must be powers of two, the block "
                         "dividing the row")


def _check(kv, weight, cos, sin, data, scale, slots, rows, block: int) -> None:
    _check_rows(kv, weight, cos, sin, block, "window_write")
    _check_write(kv, data, scale, slots, rows, "fp8", block, "window_write")


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


def _launch(kv, weight, eps, cos, sin, data, scale, slots, rows, block: int, rounded_rows: bool) -> None:
    if kv.shape[0]:
        _window_write_kernel[(kv.shape[0],)](
            kv.contiguous(), weight.contiguous(), cos.contiguous(), sin.contiguous(), data, scale, slots, rows,
            data.shape[1], float(eps), D=kv.shape[1], R=2 * cos.shape[1], BLOCK=block,
            BF16=kv.dtype == torch.bfloat16, ROUNDED=rounded_rows, INTERP=not kv.is_cuda, PDL=pdl(kv), num_warps=2,
            launch_pdl=pdl(kv), enable_fp_fusion=False)


@torch.library.custom_op("dsv4::window_write", mutates_args=("data", "scale"))
def window_write(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, block: int) -> None:
    """The window rows of kv [N, D] written to the FP8 store (data, scale) at (slots, rows): see the module doc.
    Slots and rows are not bound-checked (that would read them back to the host)."""
    _check(kv, weight, cos, sin, data, scale, slots, rows, block)
    if not use_triton(kv):
        window_write_twin(kv, weight, eps, cos, sin, data, scale, slots, rows, block)
        return
    _launch(kv, weight, eps, cos, sin, data, scale, slots, rows, block, False)


@window_write.register_fake
def _(kv, weight, eps, cos, sin, data, scale, slots, rows, block):
    _check(kv, weight, cos, sin, data, scale, slots, rows, block)


@torch.library.custom_op("dsv4::window_write_rounded", mutates_args=("data",))
def window_write_rounded(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         data: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, block: int) -> None:
    """V4's window rows of kv [N, D] written to the store data [slots, rows, D] at (slots, rows): see the module
    doc. Slots and rows are not bound-checked."""
    _check_rounded(kv, weight, cos, sin, data, slots, rows, block)
    if not use_triton(kv):
        window_write_rounded_twin(kv, weight, eps, cos, sin, data, slots, rows, block)
        return
    _launch(kv, weight, eps, cos, sin, data, data, slots, rows, block, True)


@window_write_rounded.register_fake
def _(kv, weight, eps, cos, sin, data, slots, rows, block):
    _check_rounded(kv, weight, cos, sin, data, slots, rows, block)
