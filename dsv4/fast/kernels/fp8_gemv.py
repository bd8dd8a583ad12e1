"""Weight-only FP8 GEMV for decode: a block-scaled FP8 linear read as it is stored, not as a bf16 copy.

    y[m, n] = round( sum over k of x[m, k] * e4m3[n, k] * 2^(e8m0[n // bn, k // bk] - 127) )      (fp32 sums)

- `dsv4::fp8_gemv(x, w, w_scale, bn, bk, out_dtype, groups=1, norm_weight=None, eps=0.0, start_successor=False,
    rope_cos=None, rope_sin=None, rope_heads=0, head_dim=0, squares=None) -> [M, N]`: x bf16 /
    fp32 [M, groups * K] (a decode batch), w float8_e4m3fn [N, K], w_scale float8_e8m0fnu [ceil(N / bn), ceil(K /
    bk)], out_dtype bfloat16 / float32. With groups G, output rows g * N / G .. (g + 1) * N / G read x's g-th K
    columns (the attention's grouped `wo_a`); G = 1 is the plain GEMV. With `norm_weight` [K] (G = 1) the GEMV
    reads rms_norm(x, norm_weight, eps) (`dsv4.reference.linear.rms_norm`, rounded to x's dtype) in place of x:
    the RMSNorm before the attention's first linears (attn_norm before wq_a and wkv, q_norm before wq_b), which in
    the compiled decode step was a launch of its own before each GEMV (a one-program reduction, 1.8-2.8 us).
    With `squares` [M, S] (x's partial sums of squares, handed on by the kernel that made x) it takes the norm's
    root from them, not from a pass over x.
    With RoPE tables the first rope_heads heads of head_dim output rows come out rotated (`rotated_heads`): V4.1's
    query heads, whose rotation was an inductor launch after wq_b's GEMV.

The value of `F.linear(x, dequantize_fp8(w, w_scale))` (the fast model's bf16 copies) up to fp32 summation
order: an e4m3 code times a power of two is a bf16 number and its product with a bf16 activation is exact in
fp32. The point is bytes: one byte a weight where the bf16 copy reads two.

A program takes BN weight rows over all of K, in K steps of BK, software-pipelined (`tl.range` stages: the next
steps' weights are in flight while one is decoded); BN divides the block's rows, so the program has one row of
scales, and each int32 word lies in one K block (bk is a multiple of 4): a step folds its words' scales (several K
blocks a step where they are narrow: V4.1's are 32 x 32; read with the step's weights as int32 words where they fill
words, else as bytes the step before) into the activations (exact: powers of two). The codes are read as int32
words, four K positions each, and two cvt instructions (sm_89) widen a word to two fp16x2, exact; the products
accumulate elementwise in registers ([BM, BN, BK/4]) and are summed once after the loop. Under the Triton
interpreter the codes are decoded arithmetically, the same values and sums in the same order;
`tests/fast/test_inline_ptx.py` runs the PTX in an emulator against that.
"""

from __future__ import annotations

import os

import torch

from dsv4.fast.kernels import (TensorDescriptor, pdl, start_successor, tl, to_bf16, triton, use_tma, use_triton,
                               wait_for_predecessor)
from dsv4.fast.kernels.engram import _e4m3_to_f32
from dsv4.fast.kernels.rope import (NORM_CHUNK, check_rope_tables, handed_inverse_rms, rope_factors, rotated_by,
                                   rounded, streamed_inverse_rms)
from dsv4.quant import dequantize_fp8
from dsv4.reference.linear import rms_norm
from dsv4.reference.rope import apply_rope

__all__ = ["MAX_M", "fp8_gemv", "fp8_gemv_reference", "rotated_heads"]

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
MAX_M = 16  # decode batches; larger M belongs to a GEMM (tensor cores)
_OUT_DTYPES = (torch.bfloat16, torch.float32)

# acc + sum_j e4m3_j * x_j over the four codes of one int32 word (K positions 0..3, lowest byte first)
_DOT4_PTX = tl.constexpr("\n".join([
    "{",
    ".reg .b16 lo, hi, h0, h1, h2, h3;",
    ".reg .b32 p0, p1;",
    ".reg .f32 f0, f1, f2, f3;",
    "mov.b32 {lo, hi}, $2;",
    "cvt.rn.f16x2.e4m3x2 p0, lo;",  # (position 0, position 1)
    "cvt.rn.f16x2.e4m3x2 p1, hi;",  # (2, 3)
    "mov.b32 {h0, h1}, p0;",
    "mov.b32 {h2, h3}, p1;",
] + [f"cvt.f32.f16 f{j}, h{j};" for j in range(4)]
  + [f"fma.rn.f32 $0, f{j}, ${j + 3}, {'$1' if j == 0 else '$0'};" for j in range(4)] + ["}"]))
_DOT4_OPERANDS = tl.constexpr("=f,f,r,f,f,f,f")  # $0 the sum; $1 acc, $2 the word, $3..$6 the activations


@triton.jit
def _dot4(acc, w, x0, x1, x2, x3, INTERP: tl.constexpr):
    """acc + the four codes of the int32 words w times x0..x3 (fp32, same shape), in position order."""
    if INTERP:
        acc += _e4m3_to_f32(w & 255) * x0
        acc += _e4m3_to_f32((w >> 8) & 255) * x1
        acc += _e4m3_to_f32((w >> 16) & 255) * x2
        return acc + _e4m3_to_f32((w >> 24) & 255) * x3
    else:
        return tl.inline_asm_elementwise(_DOT4_PTX, _DOT4_OPERANDS, [acc, w, x0, x1, x2, x3],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, w_desc, s_ptr, y_ptr, nw_ptr, sq_ptr, n_sq, eps, M, N, K, KW, KS, block_n, G, cos_ptr, sin_ptr,
    rope_rows, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    OUT_BF16: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr,
    X_BF16: tl.constexpr, NORM_CHUNK: tl.constexpr, START: tl.constexpr, HEAD: tl.constexpr, R: tl.constexpr,
    WORD_SCALES: tl.constexpr, TMA: tl.constexpr, SQP: tl.constexpr,
):
    """Program: weight rows pid * BN .. + BN for all BM <= M activation rows; of G groups of N / G rows (BN
    divides N / G when G > 1), each reading its own K columns of x's rows. KW = K / 4 (words a row) comes as an
    argument so that a launch specializes its divisibility by 16, which K // 4 computed here would not carry to
    the row addresses. EVEN_K (BK divides K): no mask along K, so the loads can be 16-byte vectors (a mask varying
    along K made them one word each: 8 four-byte asynchronous copies a step per thread at wo_a's tile). The scales:
    with WORD_SCALES (`_word_scaled`: V4.1's and V4's blocks) a step reads its own as int32 words (`_step_scales`),
    which the pipeliner copies asynchronously with the weights; otherwise as bytes a step ahead, which it does not
    copy (nothing under 4 bytes): a load that waits on memory in the loop (sm_90 SASS: an LDG.U8 a step in wo_a's
    and wo_b's loops before the words; in the step that used it, it waited a whole latency). BLOCK_K is a constexpr
    so that finding a word's K block is a shift, not a division by a runtime int. NORM: every program first sums
    its rows' squares (x is a few KB, read from L2 by each), then normalizes the activations it loads as
    `rms_norm` does, weight nw_ptr; its first K step is taken out of the loop, its weights asked for before the
    sums' loads. SQP > 0: the sums come as the rows' n_sq partial sums of squares at sq_ptr ([M, n_sq] fp32, the
    producer's: `mhc_post_partial`'s squares), one load where the pass over x took two L2 round trips or more. R > 0:
    the output rows below rope_rows are heads of HEAD rows whose last R are rotated (`_rotated_heads`). TMA: the weight
    steps come through w_desc (a tensor descriptor over the weight as int32 words, tiles [BN, BK/4]) as bulk tensor
    copies, in the same pipelined stages (`_tma_tiles`)."""
    wait_for_predecessor(PDL)
    start_successor(START)
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    nmask = n < N
    NW: tl.constexpr = BK // 4
    c = tl.arange(0, NW)
    mm = tl.arange(0, BM)
    mmask = mm < M
    words = w_ptr.to(tl.pointer_type(tl.int32)) + n.to(tl.int64)[:, None] * KW
    s_row = s_ptr + ((pid * BN) // block_n) * KS  # BN divides block_n: one scale row for the program
    x_rows = x_ptr + ((pid * BN) // (N // G)) * K + mm[:, None, None] * (G * K)  # the program's group's columns
    if R > 0:  # the RoPE tables asked for now, so that their loads run beside the weights' (`_rotated_heads`)
        table = tl.minimum(mm, M - 1)[:, None] * (R // 2)  # [BM, 1]: rows past M read row M - 1's, never stored
        pairs = ((pid * BN) % HEAD) // 2 + tl.arange(0, BN // 2)  # the channel pairs' ids in their head
        rope = rope_factors(cos_ptr + table, sin_ptr + table, pairs, HEAD, R)  # each [1, BM, BN/2]
    acc = tl.zeros((BM, BN, NW), dtype=tl.float32)
    if not WORD_SCALES:
        scale = _byte_scales(s_row, c, KW, BLOCK_K)  # [NW]
    r = 1.0
    if NORM:  # 1 / sqrt(mean square + eps), as torch computes rsqrt on the CPU (correctly rounded)
        # the first step's weights asked for ahead of the norm's loads, so that their memory round trip runs under
        # the norm's L2 round trips (the pipelined loop's first copies issue only once the norm's are in)
        w = _step_words(words, w_desc, pid * BN, 0, c, KW, nmask, EVEN_K, TMA)
        if WORD_SCALES:
            scale = _step_scales(s_row, 0, NW, BLOCK_K)
        if SQP > 0:
            r = handed_inverse_rms(sq_ptr, mm, mmask, n_sq, K, eps, SQP)[:, None, None]
        else:
            r = streamed_inverse_rms(x_ptr, mm, mmask, K, eps, NORM_CHUNK, STAGES)[:, None, None]
        acc = _step_dot(acc, w, scale, x_rows, nw_ptr, c, KW, r, mmask, EVEN_K, NORM, X_BF16, INTERP)
        if not WORD_SCALES:
            scale = _byte_scales(s_row, c + NW, KW, BLOCK_K)
    for k0 in tl.range(NW if NORM else 0, KW, NW, num_stages=STAGES):
        cw = k0 + c  # word columns
        w = _step_words(words, w_desc, pid * BN, k0, cw, KW, nmask, EVEN_K, TMA)
        if WORD_SCALES:
            scale = _step_scales(s_row, k0, NW, BLOCK_K)
        else:
            next_scale = _byte_scales(s_row, cw + NW, KW, BLOCK_K)
        acc = _step_dot(acc, w, scale, x_rows, nw_ptr, cw, KW, r, mmask, EVEN_K, NORM, X_BF16, INTERP)
        if not WORD_SCALES:
            scale = next_scale
    y = tl.sum(acc, axis=2)  # [BM, BN]
    if R > 0:
        y = _rotated_heads(y, pid * BN < rope_rows, *rope, OUT_BF16, INTERP)
    store_rows(y_ptr, y, mm, n, mmask, nmask, N, OUT_BF16, INTERP)


@triton.jit
def _in_row(cw, KW, EVEN_K: tl.constexpr):
    """Which word columns cw lie in the row of KW words: all of them where the steps are whole (EVEN_K), so that
    the loads carry no mask along K."""
    if EVEN_K:
        return tl.full(cw.shape, True, tl.int1)
    else:
        return cw < KW


@triton.jit
def _step_words(words, w_desc, n0, k0, cw, KW, nmask, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """A K step's weight words [BN, NW] (int32, four codes each) at word columns cw = k0 + [0, NW); 0 past the
    row's KW. TMA: one bulk tensor copy of the tile at rows n0.. (`w_desc`, rows past N read as 0)."""
    if TMA:
        return w_desc.load([n0, k0])
    else:
        return tl.load(words + cw[None, :], mask=nmask[:, None] & _in_row(cw, KW, EVEN_K)[None, :], other=0)


@triton.jit
def _step_dot(acc, w, scale, x_rows, nw_ptr, cw, KW, r, mmask, EVEN_K: tl.constexpr, NORM: tl.constexpr,
              X_BF16: tl.constexpr, INTERP: tl.constexpr):
    """acc [BM, BN, NW] + a K step: the activations of word columns cw (with NORM, normalized by r [BM, 1, 1] and
    the norm weight, rounded as `rms_norm` rounds) scaled by the step's scales [NW], times the words w [BN, NW]."""
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    NW: tl.constexpr = acc.shape[2]
    cm = _in_row(cw, KW, EVEN_K)
    cols = (4 * cw)[None, :, None] + tl.arange(0, 4)[None, None, :]  # [1, NW, 4]
    xv = tl.load(x_rows + cols, mask=mmask[:, None, None] & cm[None, :, None], other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=cm[None, :, None], other=0.0).to(tl.float32)
        xv = rounded(nw * (xv * r), X_BF16, INTERP)
    xq = xv * scale[None, :, None]
    even, odd = tl.split(tl.reshape(xq, (BM, NW, 2, 2)))  # positions (0, 2) and (1, 3) of each word
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return _dot4(acc, tl.broadcast_to(w[None, :, :], (BM, BN, NW)), _rows(x0, BN), _rows(x1, BN), _rows(x2, BN),
                 _rows(x3, BN), INTERP)


@triton.jit
def _rotated_heads(y, in_heads, c, s, rot, BF16: tl.constexpr, INTERP: tl.constexpr):
    """A program's outputs y [BM, BN] (fp32 sums; rows within one head) rounded to the output's dtype and, where
    in_heads, rotated as `apply_rope` rotates the trailing channels of each head, by the activation rows' tables
    (`rope_factors`, [1, BM, BN/2]): the query heads' RoPE as wq_b's epilogue."""
    BM: tl.constexpr = y.shape[0]
    BN: tl.constexpr = y.shape[1]
    y = rounded(y, BF16, INTERP)
    even, odd = tl.split(tl.reshape(y, (BM, BN // 2, 2)))
    e, o = rotated_by(even, odd, c, s, rot, BF16, INTERP)  # [1, BM, BN/2]
    return tl.where(in_heads, tl.reshape(tl.join(e, o), (BM, BN)), y)


@triton.jit
def store_rows(y_ptr, y, mm, n, mmask, nmask, N, OUT_BF16: tl.constexpr, INTERP: tl.constexpr):
    """A GEMV's fp32 sums y [BM, BN] into rows mm, columns n of the output [M, N]: as they are, or rounded to bf16
    (to nearest: the interpreter's cast truncates)."""
    dst = y_ptr + mm[:, None] * N + n[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    if OUT_BF16:
        tl.store(dst, to_bf16(y, INTERP), mask=ymask)
    else:
        tl.store(dst, y, mask=ymask)


@triton.jit
def _byte_scales(s_row, cw, KW, BLOCK_K: tl.constexpr):
    """The fp32 scales (2^(e8m0 - 127)) of the int32 word columns cw, a byte load each (a masked step's, or where
    `_step_scales` cannot read them as words); 0 past the row's KW words."""
    e8m0 = tl.load(s_row + (4 * cw) // BLOCK_K, mask=cw < KW, other=0)
    return (e8m0.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _step_scales(s_row, k0, NW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 scales of word columns k0 .. k0 + NW (a whole step; k0 a multiple of NW) from the step's G = NW * 4 /
    BLOCK_K scale bytes, read as int32 words (lowest byte first): column c's is byte c // (BLOCK_K / 4). G < 4
    (V4's 128-wide blocks: 2 a 256-wide step) reads the word that holds the step's bytes."""
    G: tl.constexpr = 4 * NW // BLOCK_K
    first = (4 * k0) // BLOCK_K  # the step's first scale byte
    words = s_row.to(tl.pointer_type(tl.int32)) + first // 4
    if G >= 4:
        e8m0 = tl.load(words + tl.arange(0, G // 4))[:, None] >> (8 * tl.arange(0, 4))[None, :]  # [G/4, 4]
    else:
        e8m0 = tl.load(words + tl.arange(0, 1)) >> (8 * (first % 4) + 8 * tl.arange(0, G))  # [G]
    e8m0 = tl.reshape(e8m0 & 255, (G,))
    per_column = tl.reshape(tl.broadcast_to(e8m0[:, None], (G, BLOCK_K // 4)), (NW,))
    return (per_column << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rows(xj, BN: tl.constexpr):
    """[BM, NW] activations -> [BM, BN, NW], the same for every weight row."""
    return tl.broadcast_to(xj[:, None, :], (xj.shape[0], BN, xj.shape[1]))


def _pow2_divisor(n: int, most: int) -> int:
    return min(most, n & -n)


def _check(x, w, w_scale, bn: int, bk: int, out_dtype, groups: int, norm_weight=None, rope_cos=None, rope_sin=None,
           rope_heads: int = 0, head_dim: int = 0, squares=None) -> None:
    if x.dim() != 2 or w.dim() != 2 or w_scale.dim() != 2:
        raise ValueError("fp8_gemv: x, w and w_scale must be 2-D")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_gemv: x must be bfloat16 or float32, got {x.dtype}")
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"fp8_gemv: w must be float8_e4m3fn and w_scale float8_e8m0fnu, got {w.dtype}, "
                         f"{w_scale.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemv: out_dtype must be bfloat16 or float32, got {out_dtype}")
    (M, GK), (N, K) = x.shape, w.shape
    if groups < 1 or N % groups:
        raise ValueError(f"fp8_gemv: groups ({groups}) must be positive and divide the weight's {N} rows")
    if GK != groups * K:
        raise ValueError(f"fp8_gemv: x [M, {GK}] and w [N, K={K}] disagree on K ({groups} group(s) of K)")
    if M > MAX_M:
        raise ValueError(f"fp8_gemv: a decode GEMV takes at most {MAX_M} rows, got {M}")
    if K % 4 or bk % 4 or bn <= 0:
        raise ValueError(f"fp8_gemv: K ({K}) and the block's K side ({bk}) must be multiples of 4 (int32 words)")
    if w_scale.shape != (-(-N // bn), -(-K // bk)):
        raise ValueError(f"fp8_gemv: w_scale must be [{-(-N // bn)}, {-(-K // bk)}], got {tuple(w_scale.shape)}")
    if norm_weight is not None and (groups != 1 or norm_weight.shape != (K,)):
        raise ValueError(f"fp8_gemv: a norm weight [{K}] goes with one group, got {tuple(norm_weight.shape)} and "
                         f"{groups} groups")
    if squares is not None and (norm_weight is None or squares.dim() != 2 or squares.shape[0] != M
                                or squares.shape[1] < 1 or squares.dtype != torch.float32):
        raise ValueError(f"fp8_gemv: squares go with a norm weight, [{M}, S >= 1] float32; got "
                         f"{tuple(squares.shape)} {squares.dtype}" + ("" if norm_weight is not None else " alone"))
    if (rope_cos is None) != (rope_sin is None) or (rope_cos is None) != (rope_heads == 0):
        raise ValueError("fp8_gemv: RoPE takes cos, sin and rope_heads > 0 together")
    if rope_cos is not None:
        if groups != 1 or head_dim <= 0 or head_dim % 16 or rope_heads * head_dim > N:
            raise ValueError(f"fp8_gemv: {rope_heads} rotated heads of {head_dim} rows (a multiple of 16) must lie in "
                             f"the weight's {N} rows, one group (got {groups})")
        check_rope_tables(rope_cos, rope_sin, M, head_dim, "fp8_gemv")


def fp8_gemv_reference(x, w, w_scale, bn: int, bk: int, out_dtype=torch.bfloat16, groups: int = 1,
                       norm_weight: torch.Tensor | None = None, eps: float = 0.0, rope_cos=None, rope_sin=None,
                       rope_heads: int = 0, head_dim: int = 0, squares=None):
    """The twin: x through `rms_norm` where norm_weight is given (squares, x's partial sums of squares, checked and
    not read: rms_norm sums x's own), the weight dequantized exactly (dsv4.quant), fp32 matmul per group, one
    rounding; then the first rope_heads heads of head_dim rows through `apply_rope`."""
    _check(x, w, w_scale, bn, bk, out_dtype, groups, norm_weight, rope_cos, rope_sin, rope_heads, head_dim, squares)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    M, (N, K) = x.shape[0], w.shape
    wf = dequantize_fp8(w, w_scale, (bn, bk)).view(groups, N // groups, K)
    y = torch.einsum("mgk,gnk->mgn", x.float().view(M, groups, K), wf).reshape(M, N).to(out_dtype)
    return rotated_heads(y, rope_cos, rope_sin, rope_heads, head_dim) if rope_heads else y


def rotated_heads(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """y [M, N] with its first `heads` heads of head_dim columns through `apply_rope` at cos / sin [M, R/2], the
    columns after them as they are: what `fp8_gemv`'s RoPE makes of its output."""
    M, width = y.shape[0], heads * head_dim
    q = y[:, :width].view(M, 1, heads, head_dim)
    return torch.cat((apply_rope(q, cos[:, None], sin[:, None]).flatten(1), y[:, width:]), dim=1)


def _tiles(M: int, N: int, K: int, groups: int, bn: int, cfg: dict) -> tuple[int, int, int, int]:
    """(BN, BK, stages, num_warps). One or two rows (`bench/fp8_gemv.py`'s tile sweep at the decode step's shapes in
    V4.1's 32 x 32 blocks, bench/results/fp8_gemv.json): 8 weight rows a program (16 for the 32K-row wq_b, whose
    programs are plenty), 2 warps, 4 stages; 256-wide K steps along a long K, where the fewer rows' programs need
    more bytes in flight each (wo_a 14.6 -> 12.6 us, wo_b 20.7 -> 17.5 us at one row; 21.4 -> 14.3 and 32.4 -> 19.0
    at two). A short weight (up to 2048 rows: wq_a + wkv of a V4.1 layer without an indexer, 1792 x 5120) takes 4
    rows a program, twice the programs: 7.5 against 9.3 us at one row (`bench/results/dev/micro-mhc-onx-s32.json`).
    More rows: an accumulator of BM x BN x BK/4 fp32 keeps BN at 16."""
    few = M <= 2 and not _INTERP
    BN = cfg.get("BN") or _pow2_divisor(bn, (16 if N >= 16384 else 4 if N <= 2048 else 8) if few else 16)
    if groups > 1:  # a program's rows in one group
        BN = min(BN, _pow2_divisor(N // groups, BN))
    BK = cfg.get("BK") or (256 if few and K > 2048 else 128)
    if bn % BN or BK < 4 or BK & (BK - 1):
        raise ValueError(f"fp8_gemv: tile {BN} x {BK}: BN must divide the block's {bn} rows, BK be a power of two >= 4")
    stages = cfg.get("stages") or (1 if _INTERP else 4 if few else 3)
    return BN, BK, stages, cfg.get("num_warps") or (2 if few else 4)


def _word_scaled(K: int, BK: int, bk: int, scales: torch.Tensor) -> bool:
    """Whether the kernel's steps read their scales as int32 words (`_step_scales`): whole steps (BK divides K) of
    whole blocks, a step's scale bytes whole words (V4.1's 32-wide blocks) or within one (V4's 128-wide: 1 or 2),
    in rows of whole words from a 4-byte aligned start."""
    G = BK // bk if BK % bk == 0 else 0  # scale bytes a step
    return (K % BK == 0 and G > 0 and (G % 4 == 0 or 4 % G == 0) and scales.shape[1] % 4 == 0
            and scales.data_ptr() % 4 == 0)


def gemv_output(M: int, N: int, K: int, out_dtype, device) -> tuple[torch.Tensor, bool]:
    """A GEMV's output [M, N], and whether it is final already (no rows or columns; K = 0: zeros)."""
    y = torch.empty(M, N, dtype=out_dtype, device=device)
    if K == 0:
        y.zero_()
    return y, M == 0 or N == 0 or K == 0


def _fp8_gemv_triton(x, w, w_scale, bn: int, bk: int, out_dtype, groups: int = 1, cfg: dict | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, start_successor: bool = False,
                     rope_cos=None, rope_sin=None, rope_heads: int = 0, head_dim: int = 0, squares=None):
    M, (N, K) = x.shape[0], w.shape
    y, done = gemv_output(M, N, K, out_dtype, x.device)
    if done:
        return y
    cfg = cfg or {}
    BN, BK, stages, warps = _tiles(M, N, K, groups, bn, cfg)
    norm = norm_weight is not None
    rope = (rope_cos.contiguous(), rope_sin.contiguous()) if rope_heads else (x, x)
    if rope_heads and head_dim % BN:
        raise ValueError(f"fp8_gemv: a program's {BN} rows must lie in one head of {head_dim}")
    scales = w_scale.view(torch.uint8).contiguous()
    w = w.contiguous()
    tma = cfg.get("tma", False) and _tma_tiles(w, BN, BK)
    _fp8_gemv_kernel[(triton.cdiv(N, BN),)](
        x.contiguous(), w, TensorDescriptor.from_tensor(w.view(torch.int32), [BN, BK // 4]) if tma else w, scales, y,
        norm_weight.contiguous() if norm else x, x if squares is None else squares.contiguous(),
        0 if squares is None else squares.shape[1], float(eps), M, N, K, K // 4, w_scale.shape[1], bn, groups,
        *rope, rope_heads * head_dim, WORD_SCALES=_word_scaled(K, BK, bk, scales),
        BM=triton.next_power_of_2(M), BN=BN, BK=BK, BLOCK_K=bk, STAGES=stages, OUT_BF16=out_dtype == torch.bfloat16,
        INTERP=_INTERP, PDL=pdl(x), EVEN_K=K % BK == 0, NORM=norm, X_BF16=x.dtype == torch.bfloat16,
        NORM_CHUNK=NORM_CHUNK, START=start_successor and pdl(x), HEAD=max(head_dim, 1),
        R=2 * rope[0].shape[-1] if rope_heads else 0, TMA=tma,
        SQP=0 if squares is None else triton.next_power_of_2(squares.shape[1]), num_warps=warps, launch_pdl=pdl(x))
    return y


def _tma_tiles(w: torch.Tensor, BN: int, BK: int) -> bool:
    """Whether the weight's steps can come as bulk tensor copies (`use_tma`): whole steps along K (BK, a power of two
    >= 16, divides K, so rows are 16-byte multiples), a 16-byte aligned base, tiles [BN, BK/4] of int32 words within
    the copy engine's 256 x 256 box. Asked for by cfg {"tma": True} (`bench/fp8_gemv.py` times both forms); the
    decode step keeps the pointer loads: on the H100 these tiles were slower alone at every tile and in the step
    (BENCHMARKS, session 65; the H200 is untried)."""
    return use_tma(w) and w.shape[1] % BK == 0 and BK >= 16 and w.data_ptr() % 16 == 0 and BN <= 256 and BK <= 1024


@torch.library.custom_op("dsv4::fp8_gemv", mutates_args=())
def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bn: int, bk: int,
             out_dtype: torch.dtype = torch.bfloat16, groups: int = 1, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0, start_successor: bool = False, rope_cos: torch.Tensor | None = None,
             rope_sin: torch.Tensor | None = None, rope_heads: int = 0, head_dim: int = 0,
             squares: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_M, groups * K] (with norm_weight [K], rms_norm(x, norm_weight, eps)) times the block-scaled FP8
    weight w [N, K] transposed, group by group -> [M, N] out_dtype. squares [M, S] fp32, with norm_weight: x's sum
    of squares as S partial sums (`mhc_post_partial`'s), which the kernel normalizes by instead of summing x's own
    (its mean square may differ from rms_norm's in its last bits; the twin: rms_norm of x). start_successor: the next
    kernel starts as this one's last programs do (`dsv4.fast.kernels.start_successor`); the same values. rope_cos /
    rope_sin [M, R/2] fp32 with rope_heads: output rows 0 .. rope_heads * head_dim are that many heads, each rotated by
    `apply_rope` on its trailing R rows at its activation row's tables after the output's rounding (wq_b's query
    heads)."""
    rope = (rope_cos, rope_sin, rope_heads, head_dim)
    _check(x, w, w_scale, bn, bk, out_dtype, groups, norm_weight, *rope, squares)
    if use_triton(x):
        return _fp8_gemv_triton(x, w, w_scale, bn, bk, out_dtype, groups, None, norm_weight, eps, start_successor,
                                *rope, squares)
    return fp8_gemv_reference(x, w, w_scale, bn, bk, out_dtype, groups, norm_weight, eps, *rope, squares)


@fp8_gemv.register_fake
def _(x, w, w_scale, bn, bk, out_dtype=torch.bfloat16, groups=1, norm_weight=None, eps=0.0, start_successor=False,
      rope_cos=None, rope_sin=None, rope_heads=0, head_dim=0, squares=None):
    return x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype)
