"""RoPE inside a kernel, as `dsv4.reference.rope.apply_rope` computes it: shared by the kernels that rotate a row.

`rotate_pairs` takes a row's channels as (even, odd) pairs [.., D/2], rotates the trailing R/2 pairs by the row's
tables and rounds them to the model's dtype; the products and sums are the reference's fp32 ones, exact only where
the kernel compiles with fp fusion off (a fused multiply-add rounds once where the reference rounds twice).
"""

from __future__ import annotations

from dsv4.fast.kernels import tl, to_bf16, triton
from dsv4.fast.kernels.quant import _widen


@triton.jit
def rounded(x, BF16: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x rounded to the model's dtype (bf16: to nearest even), as fp32."""
    if BF16:
        return _widen(to_bf16(x, INTERP))
    else:
        return x


@triton.jit
def rotate_pairs(even, odd, cos_row, sin_row, p, D: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr,
                 INTERP: tl.constexpr):
    """Channel pairs (even, odd) [..., D/2] of pair ids p [D/2], the last R/2 of them rotated by the row's tables
    (cos_row, sin_row: pointers to its R/2 fp32 values) -> (even, odd): (e cos - o sin, e sin + o cos) rounded to
    the model's dtype where rotated, as they were elsewhere."""
    j = p - (D - R) // 2  # the pair's RoPE frequency; < 0: not rotated
    rot = (j >= 0)[None, :]
    c = tl.load(cos_row + j, mask=j >= 0, other=1.0)[None, :]
    s = tl.load(sin_row + j, mask=j >= 0, other=0.0)[None, :]
    return (tl.where(rot, rounded(even * c - odd * s, BF16, INTERP), even),
            tl.where(rot, rounded(even * s + odd * c, BF16, INTERP), odd))
