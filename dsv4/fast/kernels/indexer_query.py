"""The indexer's decode queries in one kernel: RoPE, V4's Hadamard transform, MXFP4 rounding and the head weights.

`dsv4::indexer_query(q, w, cos, sin, w_scale, hadamard=False) -> (q' [N, H, d], w' [N, H] fp32)`
    q [N, H * d] (the indexer's wq_b output), w [N, H] (its weights_proj output), both bf16 or both fp32 (the
    model's dtype), cos / sin [N, R/2] fp32 (each row's RoPE tables, R <= d rotated trailing channels).
    q' = fake_quant_mxfp4(apply_rope(q)) in q's dtype, blocks of 32 along d (V4.1), or with `hadamard` (V4)
    fake_quant_mxfp4(hadamard(apply_rope(q))); w' = fp32(w * w_scale rounded to w's dtype). What
    `Indexer._query_heads` gives, one position a row: in V4.1's compiled decode step those were six launches an
    indexer layer (the RoPE, the concatenation, the quantization kernel, its dequantization, a cast, the weights),
    in V4's ~9 (the Hadamard's butterflies took three more).

Twin: `indexer_query_twin` (the reference's `apply_rope`, `hadamard` and `dsv4.quant.fake_quant_mxfp4`).
Bit-exact: the rotation is computed as the reference's fp32 products and sums (no fused multiply-add: the kernel
compiles with fp fusion off) and rounded to the model's dtype (bf16 to nearest even, as `to_bf16`); the Hadamard
transform is the reference's butterflies, the same fp32 sums and differences in the same pairs level by level, then
its scale and rounding; the MXFP4 codes and values are those of `dsv4::mxfp4_quant` and the MoE kernels (the same
helpers), an e2m1 value times a power-of-two scale, exact.

A program takes HB heads of a row (H and d powers of two; V4.1: 32 x 128): one program for a row's 32 heads
spent 5.6 us a launch in the batch-1 step on the H200, a chain of dependent work in 4 warps on one multiprocessor.
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.quant import _e2m1_code, _e2m1_values, _ue8m0, _widen
from dsv4.fast.kernels.rope import check_rope_tables, load_head_pairs, rotate_pairs, rounded
from dsv4.quant import fake_quant_mxfp4
from dsv4.reference.indexer import hadamard as hadamard_transform
from dsv4.reference.rope import apply_rope

__all__ = ["indexer_query", "indexer_query_twin"]

_BLOCK = 32  # MXFP4: values one scale covers
_HEADS_A_PROGRAM = 2


def indexer_query_twin(q, w, cos, sin, w_scale: float, hadamard: bool = False):
    """The reference's indexer queries for one position a row: (q' [N, H, d] in q's dtype, w' [N, H] fp32)."""
    heads = q.unflatten(-1, (w.shape[-1], -1))[:, None]  # [N, 1, H, d]
    x = apply_rope(heads, cos[:, None], sin[:, None])
    q = fake_quant_mxfp4(hadamard_transform(x) if hadamard else x, _BLOCK)[:, 0]
    return q, (w * w_scale).float()


@triton.jit
def _hadamard_rows(x, D: tl.constexpr, LOG_D: tl.constexpr):
    """The reference's `hadamard` butterflies on rows x [HB, D] fp32 (unscaled): level by level, h = 1, 2, .., D/2,
    the pairs (j, j + h) of every 2h-block become (a + b, a - b)."""
    HB: tl.constexpr = x.shape[0]
    for i in tl.static_range(LOG_D):  # h = 2^i
        pairs = tl.permute(tl.reshape(x, (HB, D >> (i + 1), 2, 1 << i)), (0, 1, 3, 2))  # [HB, blocks, h, (a, b)]
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (HB, D))
    return x


@triton.jit
def _indexer_query_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, wout_ptr, w_scale,
                          H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr,
                          HADAMARD: tl.constexpr, LOG_D: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    n, h, p, even, odd = load_head_pairs(q_ptr, H, HB, D)
    even, odd = rotate_pairs(even, odd, cos_ptr + n * (R // 2), sin_ptr + n * (R // 2), p, D, R, BF16, INTERP)

    x = tl.reshape(tl.join(even, odd), (HB, D))  # the heads' channels in order
    if HADAMARD:  # then scaled and rounded to the model's dtype, as the reference's transform returns it
        x = rounded(_hadamard_rows(x, D, LOG_D) * (D**-0.5), BF16, INTERP)
    x = tl.reshape(x, (HB * D // 32, 32))  # blocks of 32 along d
    log2s, inv = _ue8m0(tl.maximum(tl.max(tl.abs(x), axis=1), 6.0 * 2.0**-126), 1.0 / 6.0)
    code = _e2m1_code(tl.minimum(tl.maximum(x * inv[:, None], -6.0), 6.0))
    scale = ((log2s + 127) << 23).to(tl.float32, bitcast=True)  # >= 2^-126: a normal number
    val = tl.reshape(_e2m1_values(code) * scale[:, None], (HB, D))  # exact: two significant bits
    tl.store(out_ptr + n * (H * D) + h[:, None] * D + tl.arange(0, D)[None, :], val.to(out_ptr.dtype.element_ty))

    wv = rounded(_widen(tl.load(w_ptr + n * H + h)) * w_scale, BF16, INTERP)
    tl.store(wout_ptr + n * H + h, wv)


def _check(q, w, cos, sin) -> tuple[int, int, int, int]:
    if w.dim() != 2 or q.dim() != 2 or q.shape[0] != w.shape[0] or q.shape[1] % max(w.shape[1], 1):
        raise ValueError(f"indexer_query: q [N, H * d] and w [N, H] expected, got {tuple(q.shape)}, {tuple(w.shape)}")
    N, H = w.shape
    D = q.shape[1] // H
    check_rope_tables(cos, sin, N, D, "indexer_query")
    if q.dtype not in (torch.bfloat16, torch.float32) or w.dtype != q.dtype:
        raise ValueError(f"indexer_query: q and w both bf16 or both fp32 expected, got {q.dtype}, {w.dtype}")
    if H & (H - 1) or D & (D - 1) or D < _BLOCK:
        raise ValueError(f"indexer_query: heads ({H}) and head width ({D}) must be powers of two, the width >= 32")
    return N, H, D, 2 * cos.shape[1]


@torch.library.custom_op("dsv4::indexer_query", mutates_args=())
def indexer_query(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  w_scale: float, hadamard: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q' [N, H, d] bf16, w' [N, H] fp32) of the indexer's projections q [N, H * d] and w [N, H] at RoPE tables
    cos, sin [N, R/2], Hadamard-transformed before the rounding with `hadamard` (V4): see the module doc."""
    N, H, D, R = _check(q, w, cos, sin)
    if not use_triton(q):
        return indexer_query_twin(q, w, cos, sin, w_scale, hadamard)
    out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
    w_out = torch.empty(N, H, dtype=torch.float32, device=q.device)
    if N:
        hb = min(_HEADS_A_PROGRAM, H)
        _indexer_query_kernel[(N, H // hb)](q.contiguous(), w.contiguous(), cos.contiguous(), sin.contiguous(), out,
                                            w_out, float(w_scale), H=H, HB=hb, D=D, R=R,
                                            BF16=q.dtype == torch.bfloat16, HADAMARD=bool(hadamard),
                                            LOG_D=D.bit_length() - 1, INTERP=not q.is_cuda, PDL=pdl(q),
                                            num_warps=1, launch_pdl=pdl(q), enable_fp_fusion=False)
    return out, w_out


@indexer_query.register_fake
def _(q, w, cos, sin, w_scale, hadamard=False):
    N, H, D, _ = _check(q, w, cos, sin)
    return q.new_empty(N, H, D), q.new_empty(N, H, dtype=torch.float32)
