"""RoPE inside a kernel, as `dsv4.reference.rope.apply_rope` computes it: shared by the kernels that rotate a row,
and the attention's decode queries.

`rotate_pairs` takes a row's channels as (even, odd) pairs [.., D/2], rotates the trailing R/2 pairs by the row's
tables and rounds them to the model's dtype; the products and sums are the reference's fp32 ones, each rounded: the
products are `mul.rn.f32` (`_ROUNDED_PRODUCT`), which no compiler fuses into a multiply-add (one rounding where the
reference rounds twice), so a kernel may keep fp fusion on for its other arithmetic (wq_b's FP8 GEMV, whose K loop
took 111 instructions a step with fusion off, 102 with it on).

`dsv4::query_heads(q, cos, sin, heads, eps, normed) -> [N, heads, D]`
    q [N, heads * D] (wq_b's output, bf16 or fp32), cos / sin [N, R/2] fp32: the rotated query heads of one position
    a row, `Attention._query_heads`; with `normed` (V4) each head first divided by its root mean square
    (`head_rms_norm`). V4's compiled decode step took three launches a layer for it (the sums of squares, the
    rotation, the concatenation). Exact as the twin (`query_heads_twin`) but for the order of a head's sum of
    squares, as `window_write`'s norm.
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, tl, to_bf16, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.quant import _widen
from dsv4.reference.attention import head_rms_norm
from dsv4.reference.rope import apply_rope

_HEADS_A_PROGRAM = 2
_ROUNDED_PRODUCT = tl.constexpr("mul.rn.f32 $0, $1, $2;")  # a multiply with a rounding modifier is never contracted
NORM_CHUNK = 1024  # x's columns a step of `streamed_inverse_rms`' sum of squares


@triton.jit
def rounded(x, BF16: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x rounded to the model's dtype (bf16: to nearest even), as fp32."""
    if BF16:
        return _widen(to_bf16(x, INTERP))
    else:
        return x


@triton.jit
def load_head_pairs(q_ptr, H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr):
    """A (row, head block) program's HB heads of q [N, H * D] as channel pairs (2p, 2p + 1): (its row n, heads h
    [HB], pair ids p [D/2], even [HB, D/2], odd [HB, D/2] fp32)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    p = tl.arange(0, D // 2)
    at = n * (H * D) + h[:, None] * D + 2 * p[None, :]  # [HB, D/2]
    return n, h, p, _widen(tl.load(q_ptr + at)), _widen(tl.load(q_ptr + at + 1))


@triton.jit
def inverse_rms(even, odd, eps, D: tl.constexpr):
    """1 / sqrt(mean square + eps) of rows given as channel pairs (even, odd) [rows, D/2] -> [rows, 1] fp32
    (`_inverse_root`)."""
    return _inverse_root(tl.sum(even * even + odd * odd, axis=1), D, eps)[:, None]


@triton.jit
def streamed_inverse_rms(x_ptr, rows, rmask, K, eps, CHUNK: tl.constexpr, STAGES: tl.constexpr):
    """1 / sqrt(mean square + eps) of the rows `rows` [R] (mask rmask) of a contiguous x [N, K] read from memory,
    fp32 [R] (`_inverse_root`). The chunks are asynchronous copies STAGES - 1 deep (sm_90 SASS, the FP8 GEMV's
    launch at 4 stages: chunks 0-2 issued together, then one a step), so K = 5120's five take about two L2 round
    trips; a K loop after it issues its first copies only once the last chunk is in."""
    squares = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for k0 in tl.range(0, K, CHUNK, num_stages=STAGES):
        k = k0 + tl.arange(0, CHUNK)
        xs = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)
        xs = xs.to(tl.float32)
        squares += tl.sum(xs * xs, axis=1)
    return _inverse_root(squares, K, eps)


@triton.jit
def handed_inverse_rms(sq_ptr, rows, rmask, n_sq, count, eps, SQP: tl.constexpr):
    """1 / sqrt(mean square + eps) of the rows `rows` [R] (mask rmask) of an x of `count` columns whose sums of
    squares the kernel that made x handed on as n_sq partial sums a row (sq [N, n_sq] fp32, `mhc_post_partial`'s
    squares; SQP: n_sq's power of two): one load where a pass over x takes its own round trips."""
    j = tl.arange(0, SQP)
    sq = tl.load(sq_ptr + rows[:, None] * n_sq + j[None, :], mask=rmask[:, None] & (j < n_sq)[None, :], other=0.0)
    return _inverse_root(tl.sum(sq, axis=1), count, eps)


@triton.jit
def _inverse_root(squares, count, eps):
    """1 / sqrt(squares / count + eps) [rows] fp32, the division and the root correctly rounded: torch's rsqrt on
    the CPU (CUDA's rsqrt is not)."""
    mean_square = tl.math.div_rn(squares, tl.zeros_like(squares) + count)
    return tl.math.div_rn(tl.full(squares.shape, 1.0, tl.float32), tl.sqrt_rn(mean_square + eps))


@triton.jit
def rotate_pairs(even, odd, cos_row, sin_row, p, D: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr,
                 INTERP: tl.constexpr):
    """Channel pairs (even, odd) [..., D/2] of pair ids p [D/2], the last R/2 of them rotated by the row's tables
    (cos_row, sin_row: pointers to its R/2 fp32 values) -> (even, odd): (e cos - o sin, e sin + o cos) rounded to
    the model's dtype where rotated, as they were elsewhere."""
    return rotated_by(even, odd, *rope_factors(cos_row, sin_row, p, D, R), BF16, INTERP)


@triton.jit
def rope_factors(cos_row, sin_row, p, D: tl.constexpr, R: tl.constexpr):
    """`rotate_pairs`' loads, for a kernel that issues them early: (cos, sin, whether rotated), each [1, D/2]."""
    j = p - (D - R) // 2  # the pair's RoPE frequency; < 0: not rotated
    c = tl.load(cos_row + j, mask=j >= 0, other=1.0)[None, :]
    s = tl.load(sin_row + j, mask=j >= 0, other=0.0)[None, :]
    return c, s, (j >= 0)[None, :]


@triton.jit
def rotated_by(even, odd, c, s, rot, BF16: tl.constexpr, INTERP: tl.constexpr):
    """`rotate_pairs` with its tables loaded (`rope_factors`)."""
    return (tl.where(rot, rounded(_product(even, c, INTERP) - _product(odd, s, INTERP), BF16, INTERP), even),
            tl.where(rot, rounded(_product(even, s, INTERP) + _product(odd, c, INTERP), BF16, INTERP), odd))


@triton.jit
def _product(a, b, INTERP: tl.constexpr):
    """a * b rounded to fp32 on its own, never part of a fused multiply-add (the interpreter's numpy never fuses)."""
    if INTERP:
        return a * b
    return tl.inline_asm_elementwise(_ROUNDED_PRODUCT, "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


def check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, N: int, D: int, what: str) -> None:
    """A kernel's RoPE tables for N rows of width D: cos and sin [N, R/2] fp32 with R <= D (`what` names the op)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != N or 2 * cos.shape[1] > D:
        raise ValueError(f"{what}: cos and sin [N, R/2] with R <= {D} expected, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if {cos.dtype, sin.dtype} != {torch.float32}:
        raise ValueError(f"{what}: cos and sin fp32 expected, got {cos.dtype}, {sin.dtype}")


def query_heads_twin(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, eps: float,
                     normed: bool) -> torch.Tensor:
    """The reference's rotated query heads of one position a row: q [N, heads * D] -> [N, heads, D]."""
    x = q.unflatten(-1, (heads, -1))[:, None]  # [N, 1, heads, D]
    return apply_rope(head_rms_norm(x, eps) if normed else x, cos[:, None], sin[:, None])[:, 0]


@triton.jit
def _query_heads_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, eps, H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                        R: tl.constexpr, BF16: tl.constexpr, NORM: tl.constexpr, INTERP: tl.constexpr,
                        PDL: tl.constexpr):
    """Program: HB heads of one row."""
    wait_for_predecessor(PDL)
    n, h, p, even, odd = load_head_pairs(q_ptr, H, HB, D)
    if NORM:
        r = inverse_rms(even, odd, eps, D)
        even, odd = rounded(even * r, BF16, INTERP), rounded(odd * r, BF16, INTERP)
    even, odd = rotate_pairs(even, odd, cos_ptr + n * (R // 2), sin_ptr + n * (R // 2), p, D, R, BF16, INTERP)
    x = tl.reshape(tl.join(even, odd), (HB, D))
    tl.store(out_ptr + n * (H * D) + h[:, None] * D + tl.arange(0, D)[None, :], x.to(out_ptr.dtype.element_ty))


def _check(q, cos, sin, heads: int) -> int:
    if q.dim() != 2 or heads < 1 or q.shape[1] % heads:
        raise ValueError(f"query_heads: q [N, heads * D] with {heads} heads expected, got {tuple(q.shape)}")
    D = q.shape[1] // heads
    check_rope_tables(cos, sin, q.shape[0], D, "query_heads")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"query_heads: q bf16 or fp32 expected, got {q.dtype}")
    if heads & (heads - 1) or D & (D - 1):
        raise ValueError(f"query_heads: heads ({heads}) and head width ({D}) must be powers of two")
    return D


@torch.library.custom_op("dsv4::query_heads", mutates_args=())
def query_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, eps: float,
                normed: bool) -> torch.Tensor:
    """The rotated query heads [N, heads, D] of wq_b's output q [N, heads * D] at RoPE tables cos, sin [N, R/2],
    each head RMS-normed first with `normed` (V4): see the module doc."""
    D = _check(q, cos, sin, heads)
    if not use_triton(q):
        return query_heads_twin(q, cos, sin, heads, eps, normed)
    out = torch.empty(q.shape[0], heads, D, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        hb = min(_HEADS_A_PROGRAM, heads)
        _query_heads_kernel[(q.shape[0], heads // hb)](
            q.contiguous(), cos.contiguous(), sin.contiguous(), out, float(eps), H=heads, HB=hb, D=D,
            R=2 * cos.shape[1], BF16=q.dtype == torch.bfloat16, NORM=bool(normed), INTERP=not q.is_cuda, PDL=pdl(q),
            num_warps=2, launch_pdl=pdl(q), enable_fp_fusion=False)
    return out


@query_heads.register_fake
def _(q, cos, sin, heads, eps, normed):
    D = _check(q, cos, sin, heads)
    return q.new_empty(q.shape[0], heads, D)
