"""A compressor's decode step in one kernel: the token's raw projections into its slot's ring, then the softmax
pooling of the group that ends at the token.

`dsv4::compressor_pool(kv, score, ape, kv_ring, score_ring, pos, slots, ratio, overlap, dtype) -> pooled`
    kv, score [N, C] fp32 (the compressor's wkv and wgate outputs for one token a row; C = 2 d where groups overlap,
    else d), ape [ratio, C] fp32 or None (V4's bias of a score by its place in the group), the rings kv_ring,
    score_ring [slots, R, C] fp32 (row p % R holds position p; R >= 2 ratio), pos, slots [N] int64. Stores kv and
    score + ape[pos % ratio] at ring row pos % R of each row's slot, and returns the pooled latent [N, d] in `dtype`
    of the group ending at pos, as `Compressor.forward` pools a completed group: the ratio positions pos - ratio + 1
    .. pos, and where groups overlap first the ratio before them (their first halves, zero / -inf before position
    0) with the group's own second halves; softmax over those rows per channel, in fp32 (`compressor_pool_twin`).
    Meaningful where ratio divides pos + 1; elsewhere the caller drops it.

Why: in the compiled decode step the ring writes, the gather of the group and its softmax pooling were two to three
inductor kernels a compressor (~1.5-5 us each), and V4 runs two compressors in 21 of its 43 layers and one in 20.

One program a (row, channel block) holds its channels of the group's rows; the token's own row comes from its
inputs rather than the ring it just wrote (another thread of the program may own that address). Exact as the twin
where the softmax's sums are: the order of the sums over the group differs (the pooled value can move by a few fp32
ulps, and so, rarely, by one step of `dtype`).
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, tl, to_bf16, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.torch_math import exp

__all__ = ["compressor_pool", "compressor_pool_twin"]

NEG_INF = float("-inf")


def compressor_pool_twin(kv, score, ape, kv_ring, score_ring, pos, slots, ratio: int, overlap: bool,
                         dtype: torch.dtype) -> torch.Tensor:
    """The ring writes and the pooling in torch ops, as the compiled step ran them."""
    r, R = ratio, kv_ring.shape[1]
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    if ape is not None:
        score = score + ape[pos % r]
    kv_ring[slots, pos % R] = kv
    score_ring[slots, pos % R] = score
    group = pos[:, None] - (r - 1) + torch.arange(r, device=pos.device)  # [N, r]: the group ending at pos
    if overlap:  # rows 0..r-1: the previous group's first halves (padding before group 0)
        group = torch.cat((group - r, group), dim=1)
    kv = kv_ring[slots[:, None], group % R]  # [N, r or 2r, C]
    score = score_ring[slots[:, None], group % R]
    if overlap:
        has_prev = (group[:, :r] >= 0)[..., None]
        kv = torch.cat((torch.where(has_prev, kv[:, :r, :d], 0.0), kv[:, r:, d:]), dim=1)
        score = torch.cat((torch.where(has_prev, score[:, :r, :d], NEG_INF), score[:, r:, d:]), dim=1)
    return (kv * score.softmax(dim=1)).sum(dim=1).to(dtype)  # [N, d]


@triton.jit
def _carry(kv_ptr, score_ptr, ape_ptr, kv_ring_ptr, score_ring_ptr, cols, n, p, ring, R, stride_kv, stride_score,
           C: tl.constexpr, RATIO: tl.constexpr, APE: tl.constexpr):
    """The token's projections at columns `cols` (score + ape) stored at its ring row -> (kv, score) [len(cols)]."""
    kv = tl.load(kv_ptr + n * stride_kv + cols)
    score = tl.load(score_ptr + n * stride_score + cols)
    if APE:
        score += tl.load(ape_ptr + (p % RATIO) * C + cols)
    tl.store(kv_ring_ptr + (ring + p % R) * C + cols, kv)
    tl.store(score_ring_ptr + (ring + p % R) * C + cols, score)
    return kv, score


@triton.jit
def _compressor_pool_kernel(kv_ptr, score_ptr, ape_ptr, kv_ring_ptr, score_ring_ptr, pos_ptr, slot_ptr, out_ptr, R,
                            stride_kv, stride_score, D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
                            APE: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
                            PDL: tl.constexpr):
    """Program: BD channels of one row's pooled latent. ROWS: the group's rows (2 RATIO overlapping, else RATIO)
    rounded up to a power of two. stride_kv, stride_score: the inputs' rows (views of the step's shared GEMV)."""
    wait_for_predecessor(PDL)
    n = tl.program_id(0).to(tl.int64)
    C: tl.constexpr = 2 * D if OVERLAP else D
    c = tl.program_id(1) * BD + tl.arange(0, BD)  # [BD]: the latent's channels
    p = tl.load(pos_ptr + n).to(tl.int64)
    ring = tl.load(slot_ptr + n).to(tl.int64) * R
    # the token: its second halves (all of it without overlap) pool into this group, its first halves into the next
    args = (kv_ptr, score_ptr, ape_ptr, kv_ring_ptr, score_ring_ptr)
    kv_new, score_new = _carry(*args, C - D + c, n, p, ring, R, stride_kv, stride_score, C, RATIO, APE)
    if OVERLAP:
        _carry(*args, c, n, p, ring, R, stride_kv, stride_score, C, RATIO, APE)
    # the group's rows i: position p - (rows - 1) + i, the first halves below RATIO where groups overlap
    n_rows: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    i = tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    q = p - (n_rows - 1) + i
    col = c[None, :] + (D if OVERLAP else 0) * (i >= n_rows - RATIO)  # [ROWS, BD]
    # the rows before the token's, from the ring: the previous group's before position 0 are padding, the group's
    # own are read as they are (as the twin reads them; the caller drops that result)
    stored = i < n_rows - 1
    if OVERLAP:
        stored &= (q >= 0) | (i >= RATIO)
    at = (ring + (q % R + R) % R) * C + col  # Python's modulo, as the twin indexes the ring
    kv = tl.load(kv_ring_ptr + at, mask=stored, other=0.0)
    score = tl.load(score_ring_ptr + at, mask=stored, other=float("-inf"))
    token = i == n_rows - 1
    kv = tl.where(token, kv_new[None, :], kv)
    score = tl.where(token, score_new[None, :], score)
    e = exp(score - tl.max(score, axis=0)[None, :], not INTERP)  # [ROWS, BD]; padding rows: exp(-inf) = 0
    pooled = tl.sum(kv * tl.div_rn(e, tl.sum(e, axis=0)[None, :]), axis=0)  # [BD]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        pooled = to_bf16(pooled, INTERP)
    tl.store(out_ptr + n * D + c, pooled.to(out_ptr.dtype.element_ty))


def _check(kv, score, ape, kv_ring, score_ring, pos, slots, ratio: int, overlap: bool, dtype) -> None:
    what = "compressor_pool"
    if kv.dim() != 2 or score.shape != kv.shape or {kv.dtype, score.dtype} != {torch.float32} \
            or kv.stride(1) != 1 or score.stride(1) != 1:
        raise ValueError(f"{what}: kv and score fp32 [N, C] with unit channel strides expected, got {kv.dtype} "
                         f"{tuple(kv.shape)} {kv.stride()} and {score.dtype} {tuple(score.shape)} {score.stride()}")
    N, C = kv.shape
    d = C // 2 if overlap else C
    if ratio < 2 or d < 1 or d & (d - 1) or (overlap and C % 2):
        raise ValueError(f"{what}: a ratio above 1 and a power-of-two latent width expected, got ratio {ratio} and "
                         f"{C} channels{' (overlapping)' if overlap else ''}")
    for name, ring in (("kv_ring", kv_ring), ("score_ring", score_ring)):
        if ring.dim() != 3 or ring.shape[2] != C or ring.shape[1] < 2 * ratio or ring.dtype != torch.float32 \
                or not ring.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous fp32 [slots, R >= {2 * ratio}, {C}], got "
                             f"{ring.dtype} {tuple(ring.shape)}")
    if score_ring.shape != kv_ring.shape:
        raise ValueError(f"{what}: the rings differ: {tuple(kv_ring.shape)} and {tuple(score_ring.shape)}")
    if ape is not None and (ape.shape != (ratio, C) or ape.dtype != torch.float32):
        raise ValueError(f"{what}: ape fp32 [{ratio}, {C}] expected, got {ape.dtype} {tuple(ape.shape)}")
    if pos.shape != (N,) or slots.shape != (N,) or {pos.dtype, slots.dtype} - {torch.int32, torch.int64}:
        raise ValueError(f"{what}: pos and slots int32 or int64 [{N}] expected, got {pos.dtype} {tuple(pos.shape)} "
                         f"and {slots.dtype} {tuple(slots.shape)}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{what}: the latent bf16 or fp32 expected, got {dtype}")


@torch.library.custom_op("dsv4::compressor_pool", mutates_args=("kv_ring", "score_ring"))
def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor | None, kv_ring: torch.Tensor,
                    score_ring: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ratio: int, overlap: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """The token's projections into the rings and the pooled latent of the group ending at it: see the module doc.
    Positions and slots are not bound-checked (that would read them back to the host)."""
    _check(kv, score, ape, kv_ring, score_ring, pos, slots, ratio, overlap, dtype)
    if not use_triton(kv):
        return compressor_pool_twin(kv, score, ape, kv_ring, score_ring, pos, slots, ratio, overlap, dtype)
    N, C = kv.shape
    d = C // 2 if overlap else C
    out = kv.new_empty(N, d, dtype=dtype)
    rows = triton.next_power_of_2(2 * ratio if overlap else ratio)
    BD = min(d, max(16, 2048 // rows))  # ~2K values of each ring a program, at most 64 registers a thread each
    if N:
        _compressor_pool_kernel[(N, d // BD)](
            kv, score, kv if ape is None else ape.contiguous(), kv_ring, score_ring, pos, slots, out, kv_ring.shape[1],
            kv.stride(0), score.stride(0), D=d, RATIO=ratio, OVERLAP=overlap, APE=ape is not None, ROWS=rows, BD=BD,
            INTERP=not kv.is_cuda, PDL=pdl(kv), num_warps=4, launch_pdl=pdl(kv), enable_fp_fusion=False)
    return out


@compressor_pool.register_fake
def _(kv, score, ape, kv_ring, score_ring, pos, slots, ratio, overlap, dtype):
    _check(kv, score, ape, kv_ring, score_ring, pos, slots, ratio, overlap, dtype)
    return kv.new_empty(kv.shape[0], kv.shape[1] // 2 if overlap else kv.shape[1], dtype=dtype)
