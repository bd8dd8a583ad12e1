"""Block-scaled FP8 GEMM (DeepSeek's `fp8_gemm`) and the FP8 linear layer built on it.

    y[m, n] = sum over K blocks b of  (a_q[m, b] . w[n, b]) * sa[m, b] * sw[n // bn, b]      (fp32), cast once

- `dsv4::fp8_block_gemm(a_q, a_scale, w, w_scale, bn, bk, out_dtype) -> [M, N]`
    a_q float8_e4m3fn [M, K], a_scale float8_e8m0fnu [M, K / ak] (1 x ak activation blocks, ak = K / its width),
    w float8_e4m3fn [N, K], w_scale float8_e8m0fnu [ceil(N / bn), ceil(K / bk)] (bn x bk weight blocks, the last
    row/column of blocks may be partial), out_dtype float32 / bfloat16 / float16.
- `fp8_linear(x, weight, scale, block, act_block, out_dtype=None)`: `dsv4.reference.linear.Linear.forward` of an
    "fp8" layer under quant_sim: x quantized by `dsv4::fp8_quant` (bit-exact), then the GEMM.

Each tensor-core MMA covers KB = min(ak, bk) of K (one scale of each operand); its fp32 partial is multiplied by
the two power-of-two scales (exact) and added to an fp32 accumulator in registers, so the result equals the twin
(dequantize, fp32 matmul) up to fp32 summation order (on Hopper, plus the FP8 MMA's own accumulation inside one
KB-wide product, as in DeepSeek's kernel). A loop step loads SUB = step_k / KB such sub-blocks (GemmConfig.step_k;
128 makes the weight stream in 128-byte row segments also with 32 x 32 blocks).

Layout ("swap AB"): programs tile the weight rows N (BN, the MMA's M side, 64 or 128) and the activation rows M
(BM >= 16, the MMA's N side), so a decode batch of 1..64 rows wastes no 64-row MMA tile. When the tiles would not
fill the GPU, K is split: each split writes an fp32 partial and a second kernel sums them in a fixed order
(deterministic) and casts. Under the Triton interpreter the dot runs in fp32 on the exact e4m3 values and the bf16
cast rounds on the bits (helpers shared with the attention kernels).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4.fast.kernels import tl, to_bf16, triton, use_triton
from dsv4.fast.kernels.attention import _dot
from dsv4.fast.kernels.quant import fp8_quant
from dsv4.quant import dequantize_fp8, fake_quant_fp8

__all__ = ["GemmConfig", "fp8_block_gemm", "fp8_block_gemm_reference", "fp8_gemm", "fp8_linear",
           "fp8_linear_reference", "pick_config"]

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is, at import
_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class GemmConfig:
    """Tile of one program: BN weight rows x BM activation rows, K cut into `split` ranges."""

    bn: int = 64
    bm: int = 16
    split: int = 1  # K ranges (1 = no split-K); clipped to the number of K steps
    step_k: int = 128  # K columns per loop step: step_k // kb scale blocks (at least one)
    num_warps: int = 4
    num_stages: int = 4


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _e8m0(byte):
    """e8m0 byte (uint8) -> fp32 2^(byte - 127); the byte is fp32's exponent field (0 reads as 0)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store(ptr, val, rm, rn, mmask, nmask, N, OUT: tl.constexpr, INTERP: tl.constexpr):
    """val [BN, BM] fp32 -> out[m, n] (row-major [M, N]) in the output dtype."""
    offs = rm[None, :].to(tl.int64) * N + rn[:, None]
    mask = nmask[:, None] & mmask[None, :]
    if OUT == 0:
        tl.store(ptr + offs, val, mask=mask)
    elif OUT == 1:
        tl.store(ptr + offs, to_bf16(val, INTERP), mask=mask)
    else:
        tl.store(ptr + offs, val.to(tl.float16), mask=mask)


@triton.jit
def _gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr,
    M, N, K, as_sm, as_sk, n_ws, k_per_split,
    AK: tl.constexpr, WN: tl.constexpr, WK: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, OUT: tl.constexpr, INTERP: tl.constexpr,
):
    """One [BN, BM] tile of out^T over the K range of split program_id(2); k_per_split is a multiple of KB * SUB.

    The activation scales are read through strides (as_sm, as_sk): each thread holds BM / 4 of them in the MMA's
    layout, and with as_sm == 1 (a column-major copy; Triton specializes the 1) their addresses are one register
    plus constant offsets. With a run-time row stride every one needed its own 64-bit pointer, and 128 x 128 tiles
    spilled to local memory."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)  # weight rows
    rm = pid_m * BM + tl.arange(0, BM)  # activation rows
    nmask = rn < N
    mmask = rm < M
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K  # [BN, 1]
    a_rows = a_ptr + rm[:, None].to(tl.int64) * K  # [BM, 1]
    ws_rows = ws_ptr + (rn // WN) * n_ws  # [BN] scale row of each weight row
    as_rows = rm * as_sm  # [BM] int32 offsets: the scale tensor has fewer than 2^31 bytes
    kk = tl.arange(0, KB)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, KB * SUB):
        for j in tl.static_range(SUB):
            kb = k0 + j * KB  # first column of this scale block (KB divides both AK and WK)
            cols = kb + kk
            kmask = cols < K
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BN, KB] e4m3
            a = tl.load(a_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, KB] e4m3
            sw = _e8m0(tl.load(ws_rows + kb // WK, mask=nmask & (rn * 0 + kb < K), other=0))  # [BN]
            sa = _e8m0(tl.load(as_ptr + as_rows + (kb // AK) * as_sk, mask=mmask & (rm * 0 + kb < K), other=0))  # [BM]
            part = _dot(w, tl.trans(a), INTERP)  # [BN, BM] fp32
            acc += part * (sw[:, None] * sa[None, :])
    if SPLIT:
        _store(part_ptr + pid_s.to(tl.int64) * M * N, acc, rm, rn, mmask, nmask, N, 0, INTERP)
    else:
        _store(out_ptr, acc, rm, rn, mmask, nmask, N, OUT, INTERP)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, MN, n_splits, BLOCK: tl.constexpr, OUT: tl.constexpr, INTERP: tl.constexpr):
    """out = sum over splits (in order) of part[s], cast once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(n_splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if OUT == 0:
        tl.store(out_ptr + offs, acc, mask=mask)
    elif OUT == 1:
        tl.store(out_ptr + offs, to_bf16(acc, INTERP), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(tl.float16), mask=mask)


# ---------------------------------------------------------------------------------------------- host side


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check(a_q, a_scale, w, w_scale, bn: int, bk: int, out_dtype) -> int:
    """Validate; returns ak, the activation scale block."""
    if a_q.dim() != 2 or w.dim() != 2 or a_scale.dim() != 2 or w_scale.dim() != 2:
        raise ValueError("fp8_block_gemm: a_q, a_scale, w, w_scale must be 2-D")
    if a_q.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm: a_q and w must be float8_e4m3fn, got {a_q.dtype}, {w.dtype}")
    if a_scale.dtype != torch.float8_e8m0fnu or w_scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"fp8_block_gemm: scales must be float8_e8m0fnu, got {a_scale.dtype}, {w_scale.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_block_gemm: out_dtype must be one of {list(_OUT_DTYPES)}, got {out_dtype}")
    (M, K), (N, K2) = a_q.shape, w.shape
    if K != K2:
        raise ValueError(f"fp8_block_gemm: a_q [M, K={K}] and w [N, K={K2}] disagree on K")
    if bn <= 0 or bk <= 0:
        raise ValueError(f"fp8_block_gemm: block ({bn}, {bk}) must be positive")
    if w_scale.shape != (-(-N // bn), -(-K // bk)):
        raise ValueError(f"fp8_block_gemm: w_scale must be [{-(-N // bn)}, {-(-K // bk)}], got {tuple(w_scale.shape)}")
    n_as = a_scale.shape[1]
    if a_scale.shape[0] != M or (K > 0 and (n_as == 0 or K % n_as)):
        raise ValueError(f"fp8_block_gemm: a_scale must be [M={M}, K/ak] with ak dividing K={K}, got {tuple(a_scale.shape)}")
    return K // n_as if n_as else bk


def _kernel_block(ak: int, bk: int) -> int:
    """K width of one MMA (one scale of each operand), or 0 when the kernel cannot take the block sizes."""
    kb, other = min(ak, bk), max(ak, bk)
    if kb < 32 or kb & (kb - 1) or other % kb:
        return 0
    return kb


def pick_config(M: int, N: int, K: int, kb: int, device: torch.device) -> GemmConfig:
    """Tile and split-K for a shape, from the H200 sweep of bench/fp8_gemm.py (bench/results/fp8_gemm.json).

    Decode (M <= 64): 64-row weight tiles, 4 stages (8 stages were 1.3-1.5x slower), K split until ~2 programs
    per SM. M <= 128: 128 x 128 tiles over 8 warps. Prefill: 128 x 64 tiles over 4 warps with 64 K columns per
    step (128 x 128 over 8 warps was 1.6x slower at M = 512), split only while the tiles do not fill the SMs."""
    if device.type != "cuda":  # interpreter: small tiles, and split-K whenever there are >= 2 steps
        steps = triton.cdiv(K, kb * max(1, 128 // kb))
        return GemmConfig(bn=32, bm=16, split=2 if steps >= 2 else 1, num_warps=4, num_stages=1)
    if M <= 64:
        bn, bm, step_k, warps, stages = 64, max(16, triton.next_power_of_2(M)), 128, 4, 4
    elif M <= 128:
        bn, bm, step_k, warps, stages = 128, 128, 128, 8, 3
    else:
        bn, bm, step_k, warps, stages = 128, 64, 64, 4, 3
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    steps = triton.cdiv(K, max(kb, step_k))
    sms = _sm_count(device)
    split = 1
    if M <= 64 and tiles < 2 * sms:  # decode: the weight is the traffic; >= 2 steps per split keep loads in flight
        split = max(1, min(triton.cdiv(2 * sms, tiles), steps // 2))
    elif M <= 128 and tiles < sms:
        split = max(1, min(triton.cdiv(2 * sms, tiles), steps // 4))
    elif tiles < sms:
        split = max(1, min(triton.cdiv(sms, tiles), 4, steps // 4))
    return GemmConfig(bn=bn, bm=bm, split=split, step_k=step_k, num_warps=warps, num_stages=stages)


def fp8_gemm(
    a_q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bn: int, bk: int,
    out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig | None = None,
) -> torch.Tensor:
    """Launch the kernels (no dispatch, no custom op); `config` overrides `pick_config`."""
    ak = _check(a_q, a_scale, w, w_scale, bn, bk, out_dtype)
    kb = _kernel_block(ak, bk)
    if not kb:
        raise ValueError(f"fp8_gemm: min(ak={ak}, bk={bk}) must be a power of two >= 32 dividing the other")
    (M, K), N = a_q.shape, w.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = config or pick_config(M, N, K, kb, a_q.device)
    sub = max(1, cfg.step_k // kb)
    step = kb * sub
    steps = triton.cdiv(K, step)
    per = triton.cdiv(steps, max(1, min(cfg.split, steps)))  # steps per split
    n_splits = triton.cdiv(steps, per)
    split = n_splits > 1
    part = torch.empty(n_splits, M, N, dtype=torch.float32, device=a_q.device) if split else out
    a_s = a_scale.view(torch.uint8)
    if cfg.bm >= 64:  # column-major copy (M * K / ak bytes), see _gemm_kernel
        a_s = a_s.t().contiguous().t()
    w_s = w_scale.contiguous().view(torch.uint8)
    grid = (triton.cdiv(N, cfg.bn), triton.cdiv(M, cfg.bm), n_splits)
    _gemm_kernel[grid](
        a_q.contiguous(), a_s, w.contiguous(), w_s, out, part,
        M, N, K, a_s.stride(0), a_s.stride(1), w_s.shape[1], per * step,
        AK=ak, WN=bn, WK=bk, KB=kb, SUB=sub, BN=cfg.bn, BM=cfg.bm, SPLIT=split, OUT=_OUT_DTYPES[out_dtype],
        INTERP=_INTERP, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        block = 1024
        _reduce_kernel[(triton.cdiv(M * N, block),)](
            part, out, M * N, n_splits, BLOCK=block, OUT=_OUT_DTYPES[out_dtype], INTERP=_INTERP, num_warps=4
        )
    return out


def fp8_block_gemm_reference(
    a_q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bn: int, bk: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The twin: dequantize both operands exactly (dsv4.quant), fp32 matmul, cast once."""
    ak = _check(a_q, a_scale, w, w_scale, bn, bk, out_dtype)
    a = dequantize_fp8(a_q, a_scale, (ak,)) if a_q.shape[1] else a_q.float()
    return F.linear(a, dequantize_fp8(w, w_scale, (bn, bk))).to(out_dtype)


# ---------------------------------------------------------------------------------------------- ops


@torch.library.custom_op("dsv4::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(
    a_q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bn: int, bk: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[M, K] e4m3 (1 x ak e8m0 scales) @ ([N, K] e4m3, bn x bk e8m0 scales)^T -> [M, N] out_dtype."""
    ak = _check(a_q, a_scale, w, w_scale, bn, bk, out_dtype)
    if not use_triton(a_q) or not _kernel_block(ak, bk):
        return fp8_block_gemm_reference(a_q, a_scale, w, w_scale, bn, bk, out_dtype)
    return fp8_gemm(a_q, a_scale, w, w_scale, bn, bk, out_dtype)


@fp8_block_gemm.register_fake
def _(a_q, a_scale, w, w_scale, bn, bk, out_dtype):
    _check(a_q, a_scale, w, w_scale, bn, bk, out_dtype)
    return a_q.new_empty((a_q.shape[0], w.shape[0]), dtype=out_dtype)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], act_block: int | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The twin: `Linear.forward` of an fp8 layer with quant_sim=True (fp32 matmul of the dequantized values)."""
    out_dtype = out_dtype or x.dtype
    if act_block:
        x = fake_quant_fp8(x, act_block)
    return F.linear(x.float(), dequantize_fp8(weight, scale, tuple(block))).to(out_dtype)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], act_block: int | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = Linear(fmt="fp8", block, act_block).forward(x) under quant_sim (out_dtype fp32 for an `fp32` layer):
    `dsv4::fp8_quant` of x in 1 x act_block blocks, then `dsv4::fp8_block_gemm`. Without act_block (no
    activation quantization) or where the kernel cannot run, the twin."""
    out_dtype = out_dtype or x.dtype
    bn, bk = int(block[0]), int(block[1])
    K = x.shape[-1]
    if (
        not act_block or not use_triton(x) or K % act_block or not _kernel_block(act_block, bk)
        or out_dtype not in _OUT_DTYPES
    ):
        return fp8_linear_reference(x, weight, scale, (bn, bk), act_block, out_dtype)
    x2 = x.reshape(-1, K)
    q, s = fp8_quant(x2, act_block)
    y = fp8_block_gemm(q, s, weight, scale, bn, bk, out_dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
