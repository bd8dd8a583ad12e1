"""Dense GEMV for decode: a bf16 (or fp32) linear at a few rows, in one launch.

    y[m, n] = round( sum over k of x[m, k] * w[n, k] )      (fp32 sums, one rounding to out_dtype)

- `dsv4::dense_gemv(x, w, out_dtype) -> [M, N]`: x [M <= MAX_M, K] and w [N, K], both bfloat16 or both float32;
    out_dtype float32, or x's dtype.

The value of `F.linear(x, w)` (bf16 operands: exact products, fp32 sums, one rounding) or, with fp32 output, of the
fast model's `fp32_linear`, up to fp32 summation order. Why: at one row cuBLAS runs such a GEMV as split K plus a
reduce launch; in the V4.1 batch-1 step (1d4fadb's profile) an index layer's bf16 linears on x (wq_a, wkv and
the indexer's weights_proj, 1824 x 5120: 18.7 MB, 4.3 us at the copy rate) took 7.3-9.6 us and a 1.6-1.7 us
reduce. The fast model's `SharedInput` takes it at the rows where `bench/dense_gemv.py` timed it faster than
cuBLAS (`beats_cublas`).

A program takes BN weight rows over all of K, in K steps of BK, software-pipelined (`tl.range` stages: the next
steps' weights are in flight while one is summed); the products accumulate elementwise in registers ([BM, BN,
BK] fp32) and are summed once after the loop, as `dsv4::fp8_gemv` does (a sum across threads a step would cross
threads every step). Where BK divides K the loads carry no K mask (16-byte vectors).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.fp8_gemv import gemv_output, store_rows

__all__ = ["MAX_M", "beats_cublas", "dense_gemv", "dense_gemv_reference"]

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
MAX_M = 16  # decode batches; larger M belongs to a GEMM (tensor cores)
FASTER_M = 2  # rows up to which it beat cuBLAS in `bench/dense_gemv.py` (1.18-1.30x at 1-2 rows, 0.12-0.14x at 4)
_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, OUT_BF16: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Program: weight rows pid * BN .. + BN for all BM >= M activation rows."""
    wait_for_predecessor(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    mm = tl.arange(0, BM)
    mmask = mm < M
    kk = tl.arange(0, BK)
    rows = w_ptr + n.to(tl.int64)[:, None] * K
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k = k0 + kk
        if EVEN_K:
            km = tl.full((BK,), True, tl.int1)
        else:
            km = k < K
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & km[None, :], other=0.0).to(tl.float32)  # [BN, BK]
        xv = tl.load(x_ptr + mm[:, None] * K + k[None, :], mask=mmask[:, None] & km[None, :],
                     other=0.0).to(tl.float32)  # [BM, BK]
        acc += xv[:, None, :] * w[None, :, :]
    store_rows(y_ptr, tl.sum(acc, axis=2), mm, n, mmask, nmask, N, OUT_BF16, INTERP)


def _check(x, w, out_dtype) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError("dense_gemv: x and w must be 2-D")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"dense_gemv: x and w must be both bfloat16 or both float32, got {x.dtype}, {w.dtype}")
    if out_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"dense_gemv: out_dtype must be float32 or x's {x.dtype}, got {out_dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_gemv: x [M, {x.shape[1]}] and w [N, {w.shape[1]}] disagree on K")
    if x.shape[0] > MAX_M:
        raise ValueError(f"dense_gemv: a decode GEMV takes at most {MAX_M} rows, got {x.shape[0]}")


def beats_cublas(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [M, K] times w [N, K] is a decode GEMV that the fast model takes here rather than to cuBLAS."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] <= FASTER_M and x.dtype == w.dtype


def dense_gemv_reference(x, w, out_dtype):
    """The twin: fp32 products and sums, one rounding."""
    _check(x, w, out_dtype)
    return F.linear(x.float(), w.float()).to(out_dtype)


def _tiles(M: int, N: int) -> tuple[int, int, int, int]:
    """(BN, BK, stages, num_warps). One or two rows: 4 rows a program, 256-wide K steps six deep, the fastest of
    `bench/dense_gemv.py`'s sweep at both of the V4.1 step's parts (7.15 / 8.77 us, session 38). More rows:
    BN and BK kept small, so the BM x BN x BK accumulator stays in registers (16 x 16 x 32 in 4 warps: 64 a
    thread)."""
    if _INTERP:
        return 16, 64, 1, 4
    if M <= 2:
        return 4, 256, 6, 2
    return 16, 32, 3, 4


def _dense_gemv_triton(x, w, out_dtype, cfg: dict | None = None):
    """The kernel's launch; `cfg` (BN, BK, stages, num_warps) overrides the tiles (`bench/dense_gemv.py`'s sweep)."""
    M, (N, K) = x.shape[0], w.shape
    y, done = gemv_output(M, N, K, out_dtype, x.device)
    if done:
        return y
    BN, BK, stages, warps = _tiles(M, N)
    cfg = cfg or {}
    BN, BK, stages, warps = cfg.get("BN", BN), cfg.get("BK", BK), cfg.get("stages", stages), cfg.get("num_warps", warps)
    _dense_gemv_kernel[(triton.cdiv(N, BN),)](
        x.contiguous(), w.contiguous(), y, M, N, K, BM=triton.next_power_of_2(M), BN=BN, BK=BK,
        STAGES=stages, OUT_BF16=out_dtype == torch.bfloat16, INTERP=_INTERP, PDL=pdl(x), EVEN_K=K % BK == 0,
        num_warps=warps, launch_pdl=pdl(x))
    return y


@torch.library.custom_op("dsv4::dense_gemv", mutates_args=())
def dense_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M <= MAX_M, K] times w [N, K] transposed -> [M, N] out_dtype (fp32 sums, one rounding)."""
    _check(x, w, out_dtype)
    if use_triton(x):
        return _dense_gemv_triton(x, w, out_dtype)
    return dense_gemv_reference(x, w, out_dtype)


@dense_gemv.register_fake
def _(x, w, out_dtype):
    return x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype)
