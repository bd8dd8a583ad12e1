"""Sparse latent-MQA attention over quantized KV: an FP8 window plus global (compressed) entries.

Each query row s attends, in one softmax, to the window slots `win_idx[s]` and the global entries
`glob_idx[s]` (-1 = skip). One D-wide latent row is both key and value for all H heads. A per-head sink
logit adds exp(sink - max) to the denominator only; probabilities are rounded to bf16 before P @ V, the
output is rounded to bf16 and then rotated back by the query position (inverse RoPE, interleaved pairs on
the trailing R dims), as `dsv4.reference.attention.sparse_attention` followed by `apply_rope(inverse=True)`.
A row with no valid index gets 0 (only the sink is left in the softmax). Indices must be in range and, within
a row's list, duplicate-free (as the twin's `allowed` mask assumes; the kernel would count a repeat twice).

Three storage formats, one kernel (a constexpr format per store), dequantized in-kernel to bf16, which is
exact for all three:
- FP8: e4m3 values [*, D] and an e8m0 scale per 32 [*, D/32]   (V4.1 window, 528 B per row at D=512)
- FP4: e2m1 codes, two per byte (even element low) [*, D/2] and an e4m3 scale per 16 [*, D/16]
       (V4.1 compressed KV, 288 B per row); each code is rewritten as the e4m3 byte of (value * 2^-6),
       (c & 7) << 2 | sign << 7 (e2m1 and e4m3 subnormals line up), and the 2^6 goes into the scale
- BF16: plain rows [*, D] (1024 B per row)

Ops (all return o [S, H, D] bf16; fp32 when the twin serves fp32 queries, i.e. off the GPU without the interpreter):
- `dsv4::sparse_attn_fp4(q, win_q8, win_scale, win_idx, glob_packed, glob_scale, glob_idx, sink, softmax_scale, cos, sin, split_size=0, settled=False)`
- `dsv4::sparse_attn_fp8(q, win_q8, win_scale, win_idx, glob_q8, glob_scale, glob_idx, sink, softmax_scale, cos, sin, split_size=0, settled=False)`
- `dsv4::sparse_attn_bf16(q, win_kv, win_idx, glob_kv, glob_idx, sink, softmax_scale, cos, sin, split_size=0, settled=False)`

Work split: programs over (query row, split of the index list, head block). The index list of a row is the
window's tiles then the global tiles; when rows x head blocks would not fill the GPU (decode), the list is cut
into splits that each write a partial (running max, sum, fp32 accumulator) and a combine kernel merges them
(split_size forces the entries per split; 0 picks it from the shapes). With one split (prefill) the main
kernel writes the output itself.

settled (the decode step's layers that neither compress nor index: their global entries and index lists come from
earlier layers, and the window row's write ahead starts the attention early): a program whose split begins past
the window loads its first global tile before its PDL wait, beside the write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from dsv4.fast.kernels import pdl, tl, to_bf16, triton, use_triton, wait_for_predecessor
from dsv4.quant import dequantize_fp8, dequantize_nvfp4
from dsv4.reference.attention import sparse_attention
from dsv4.reference.rope import apply_rope

__all__ = [
    "KV",
    "Config",
    "sparse_attn",
    "sparse_attn_bf16",
    "sparse_attn_fp4",
    "sparse_attn_fp8",
    "sparse_attn_reference",
]

BF16, FP8, FP4 = 0, 1, 2
FORMAT_NAMES = {BF16: "bf16", FP8: "fp8", FP4: "fp4"}
LOG2E = 1.4426950408889634
_INTERP = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton.jit is, at import


@dataclass(frozen=True)
class KV:
    """One KV store: `data` rows [N, D] (bf16 or e4m3) or [N, D/2] (packed e2m1), `scale` rows or None."""

    fmt: int
    data: torch.Tensor
    scale: torch.Tensor | None = None

    def row_bytes(self) -> int:
        """Bytes one row occupies (data plus scales)."""
        n = self.data[0].numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale[0].numel() * self.scale.element_size())

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows (long, any shape) -> [..., D] in dtype, with dsv4.quant (packed formats: exact in bf16)."""
        if self.fmt == BF16:
            return self.data[rows].to(dtype)
        if self.fmt == FP8:
            return dequantize_fp8(self.data[rows], self.scale[rows], (32,)).to(dtype)
        return dequantize_nvfp4(self.data[rows], self.scale[rows], 16).to(dtype)


# below this many tiles (query rows x tiles per row) a launch is short of programs: split the heads
SHORT_LIST_TILES = 128


@dataclass(frozen=True)
class Config:
    """Kernel launch choices; 0 = chosen by `resolve` from the rows and list lengths. block_n: KV rows per tile
    (>= 32 on the GPU: with 16, Triton 3.6 on the H200 computed wrong outputs at block_h <= 32). block_h: heads per
    program (>= 16, a power of two). Decode choices measured on the H200 (H 64, D 512, window 128 + top-512): batch 1
    went from 26 to 14 us with 16 heads per program and one tile per split, batch 8 from 28 to 26 us."""

    block_n: int = 0
    block_h: int = 0
    num_warps: int = 0
    num_stages: int = 0
    combine_splits: int = 16  # split partials the combine kernel merges per load

    def resolve(self, S: int, H: int, kw: int, kg: int) -> Config:
        """The choices for S query rows of H heads over kw window and kg global entries a row.

        Heads: fewer per program only pay while the lists are short, as every head block dequantizes the rows
        again (a 512K-entry list at batch 1 took 1412 us with 16 heads per program, 450 us with 64): 16 at one
        query row, 32 up to 16 rows, else 64, capped at H rounded up. A lone row over a long list takes 64-row
        tiles in 2 stages (512K entries, FP4: 306 against 441 us at 32 rows; FP8 267 / 415, bf16 168 / 214;
        `dev/attention-decode-sweep-s30.json`); prefill chunks keep 32 rows (not timed at 64). 8 warps: at 16 heads
        4 warps took 255 registers and a 64-byte stack for sm_90, 8 warps 218 and none, 11.8 against 12.4 us."""
        rows = self.block_n or 32
        tiles = triton.cdiv(kw, rows) + triton.cdiv(kg, rows)
        short = S * tiles < SHORT_LIST_TILES
        block_h = self.block_h or min(16 if short and S == 1 else 32 if short and S <= 16 else 64,
                                      max(16, triton.next_power_of_2(H)))
        block_n = self.block_n or (64 if S == 1 and block_h == 64 else 32)
        return replace(self, block_n=block_n, block_h=block_h, num_warps=self.num_warps or 8,
                       num_stages=self.num_stages or (2 if block_n == 64 else 3))


INTERPRETER_CONFIG = Config(block_n=16, num_warps=4, num_stages=1, combine_splits=4)  # several combine steps


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_kv(FMT: tl.constexpr, data_ptr, scale_ptr, rows, valid, D: tl.constexpr):
    """Rows [BN] (int64; only where valid) of a store -> [BN, D] bf16, dequantized exactly: a value times its
    scale has at most 6 significant bits (e4m3 x 2^k: 4; e2m1 x e4m3: 2 + 4), bf16 holds 8."""
    BN: tl.constexpr = rows.shape[0]
    if FMT == 1:  # FP8: e4m3 * 2^(e8m0 - 127), block 32
        d = tl.arange(0, D)
        v = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        g = tl.arange(0, D // 32)
        sb = tl.load(scale_ptr + rows[:, None] * (D // 32) + g[None, :], mask=valid[:, None], other=127)
        # the e8m0 byte is fp32's exponent field (byte 0, 2^-127, which no quantizer writes, reads as 0)
        s = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        kv = tl.reshape(tl.reshape(v, [BN, D // 32, 32]) * s[:, :, None], [BN, D])
    elif FMT == 2:  # FP4: e2m1 * e4m3, block 16, two codes per byte (even element low)
        j = tl.arange(0, D // 2)
        b = tl.load(data_ptr + rows[:, None] * (D // 2) + j[None, :], mask=valid[:, None], other=0)  # uint8
        # e2m1 code c -> e4m3 byte of value * 2^-6: magnitude bits (c & 7) << 2, sign bit 3 -> bit 7
        lo = (((b & 7) << 2) | ((b & 8) << 4)).to(tl.uint8)
        hi = (((b >> 2) & 0x1C) | (b & 0x80)).to(tl.uint8)
        e = tl.reshape(tl.join(lo, hi), [BN, D]).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        g = tl.arange(0, D // 16)
        sc = tl.load(scale_ptr + rows[:, None] * (D // 16) + g[None, :], mask=valid[:, None], other=0.0)
        s = sc.to(tl.float32) * 64.0
        kv = tl.reshape(tl.reshape(e, [BN, D // 16, 16]) * s[:, :, None], [BN, D])
    else:  # BF16
        d = tl.arange(0, D)
        kv = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    return kv.to(tl.bfloat16)


@triton.jit
def _tile(FMT: tl.constexpr, data_ptr, scale_ptr, idx_ptr, k, s, t, limit, BLOCK_N: tl.constexpr,
          D: tl.constexpr):
    """Tile t of query row s's index list (k entries, -1 = skip) -> (its rows [BLOCK_N, D] bf16, which are valid);
    entries from `limit` on (k, or 0 for none) are not loaded."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(idx_ptr + s * k + cols, mask=cols < limit, other=-1)
    valid = rows >= 0
    return _load_kv(FMT, data_ptr, scale_ptr, tl.where(valid, rows, 0).to(tl.int64), valid, D), valid


@triton.jit
def _dot(a, b, INTERP: tl.constexpr):
    """bf16 a @ b, fp32 accumulation. The interpreter multiplies bf16 bit patterns as integers, so there
    the (exactly representable) operands go in as fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _attend(q, kv, valid, m, l, acc, qk_scale, INTERP: tl.constexpr):
    """One online-softmax step over a KV tile [BN, D] (key = value) for q [BH, D]; m is in log2 units."""
    qk = _dot(q, tl.trans(kv), INTERP)  # [BH, BN] fp32
    qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(to_bf16(p, INTERP), kv, INTERP)
    return m_new, l, acc


@triton.jit
def _store_out(o_ptr, cos_ptr, sin_ptr, acc, denom, s, heads, hmask, d0, H, D: tl.constexpr, R: tl.constexpr,
               INTERP: tl.constexpr):
    """o = acc / denom rounded to bf16, then rotated back on the trailing R dims; acc covers dims d0.. of D."""
    BH: tl.constexpr = acc.shape[0]
    DC: tl.constexpr = acc.shape[1]
    o = to_bf16(acc / denom[:, None], INTERP).to(tl.float32)
    ev, od = tl.split(tl.reshape(o, [BH, DC // 2, 2]))
    pair = d0 // 2 + tl.arange(0, DC // 2) - (D - R) // 2  # RoPE pair index, < 0 outside the RoPE dims
    rope = pair >= 0
    c = tl.load(cos_ptr + s * (R // 2) + pair, mask=rope, other=1.0)[None, :]
    sn = tl.load(sin_ptr + s * (R // 2) + pair, mask=rope, other=0.0)[None, :]
    out = tl.reshape(tl.join(ev * c + od * sn, od * c - ev * sn), [BH, DC])
    cols = d0 + tl.arange(0, DC)
    tl.store(o_ptr + (s * H + heads)[:, None] * D + cols[None, :], to_bf16(out, INTERP), mask=hmask[:, None])


@triton.jit
def _attn_kernel(
    q_ptr, o_ptr, sink_ptr, cos_ptr, sin_ptr,
    wd_ptr, ws_ptr, widx_ptr, kw,
    gd_ptr, gs_ptr, gidx_ptr, kg,
    part_o_ptr, part_ml_ptr,
    H, qk_scale, tiles_per_split,
    WIN_FMT: tl.constexpr, GLOB_FMT: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
    SETTLED: tl.constexpr,
):
    """Program (query row, split of its tile list, head block). SETTLED (`sparse_attn`'s settled): where no window
    tile comes first in its split, a program loads its first global tile before its PDL wait; the query, the window
    rows and the stores wait (the query comes from the layer's own launches, one of which may be the kernel ahead)."""
    if not SETTLED:
        wait_for_predecessor(PDL)
    s = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    nw = tl.cdiv(kw, BLOCK_N)  # window tiles come first, then global tiles
    t0 = split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, nw + tl.cdiv(kg, BLOCK_N))
    g0 = tl.maximum(t0, nw)  # the split's first global tile
    if SETTLED:
        early = t0 >= nw
        kv, valid = _tile(GLOB_FMT, gd_ptr, gs_ptr, gidx_ptr, kg, s, g0 - nw, tl.where(early, kg, 0), BLOCK_N, D)
        wait_for_predecessor(PDL)
    q = tl.load(q_ptr + (s * H + heads)[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    # the running max starts at the sink: it is the reference's floor for the softmax max, and keeps m finite
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    if SETTLED:
        if early:
            m, l, acc = _attend(q, kv, valid, m, l, acc, qk_scale, INTERP)
            g0 += 1
    for t in range(t0, tl.minimum(t1, nw)):
        kv, valid = _tile(WIN_FMT, wd_ptr, ws_ptr, widx_ptr, kw, s, t, kw, BLOCK_N, D)
        m, l, acc = _attend(q, kv, valid, m, l, acc, qk_scale, INTERP)
    for t in range(g0, t1):
        kv, valid = _tile(GLOB_FMT, gd_ptr, gs_ptr, gidx_ptr, kg, s, t - nw, kg, BLOCK_N, D)
        m, l, acc = _attend(q, kv, valid, m, l, acc, qk_scale, INTERP)

    if SPLIT:
        part = (s * n_splits + split) * H + heads  # [BLOCK_H] rows of the partials
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(part_ml_ptr + part * 2, m, mask=hmask)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=hmask)
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
        _store_out(o_ptr, cos_ptr, sin_ptr, acc, l + tl.exp2(sink - m), s, heads, hmask, 0, H, D, R, INTERP)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_ml_ptr, o_ptr, sink_ptr, cos_ptr, sin_ptr, H, n_splits,
    D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the splits' partials for BLOCK_H heads x BLOCK_D dims of one query row, then finish. BLOCK_S splits
    a load: one split per loop step put an L2 round trip per split in series. The maxima and sums are kept a split
    lane each across the steps and taken over the lanes once after each loop (across threads: shuffles a step)."""
    wait_for_predecessor(PDL)
    s = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d0 = tl.program_id(2) * BLOCK_D
    cols = d0 + tl.arange(0, BLOCK_D)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
    top = tl.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32) + sink[None, :]
    for j0 in tl.range(0, n_splits, BLOCK_S, num_stages=2):
        part, pmask = _split_rows(s, j0, n_splits, heads, hmask, H, BLOCK_S)
        top = tl.maximum(top, tl.load(part_ml_ptr + part * 2, mask=pmask, other=float("-inf")))
    top = tl.max(top, axis=0)
    denom = tl.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_H, BLOCK_D], dtype=tl.float32)
    for j0 in tl.range(0, n_splits, BLOCK_S, num_stages=2):
        part, pmask = _split_rows(s, j0, n_splits, heads, hmask, H, BLOCK_S)
        w = tl.exp2(tl.load(part_ml_ptr + part * 2, mask=pmask, other=float("-inf")) - top[None, :])  # [BLOCK_S, BLOCK_H]
        denom += w * tl.load(part_ml_ptr + part * 2 + 1, mask=pmask, other=0.0)
        o = tl.load(part_o_ptr + part[:, :, None] * D + cols[None, None, :], mask=pmask[:, :, None], other=0.0)
        acc += w[:, :, None] * o
    denom = tl.exp2(sink - top) + tl.sum(denom, axis=0)
    _store_out(o_ptr, cos_ptr, sin_ptr, tl.sum(acc, axis=0), denom, s, heads, hmask, d0, H, D, R, INTERP)


@triton.jit
def _split_rows(s, j0, n_splits, heads, hmask, H, BLOCK_S: tl.constexpr):
    """Rows [BLOCK_S, BLOCK_H] of the partials of splits j0.. of query row s, and where they exist."""
    j = j0 + tl.arange(0, BLOCK_S)
    return (s * n_splits + j)[:, None] * H + heads[None, :], (j < n_splits)[:, None] & hmask[None, :]


# ---------------------------------------------------------------------------------------------- launch


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check(q, win: KV, win_idx, glob: KV, glob_idx, sink, cos, sin) -> None:
    S, H, D = q.shape
    if D < 32 or D & (D - 1):
        raise ValueError(f"sparse_attn: head dim {D} must be a power of two >= 32")
    R = 2 * cos.shape[-1]
    if cos.shape != (S, R // 2) or sin.shape != cos.shape or R > D or R % 2:
        raise ValueError(f"sparse_attn: cos/sin must be [S={S}, R/2] with R <= D, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if win_idx.dim() != 2 or win_idx.shape[0] != S or glob_idx.dim() != 2 or glob_idx.shape[0] != S:
        raise ValueError(f"sparse_attn: index lists must be [S={S}, k], got {tuple(win_idx.shape)}, {tuple(glob_idx.shape)}")
    if sink.shape != (H,):
        raise ValueError(f"sparse_attn: sink must be [H={H}], got {tuple(sink.shape)}")
    for kv in (win, glob):
        width = D // 2 if kv.fmt == FP4 else D
        if kv.data.dim() != 2 or kv.data.shape[1] != width:
            raise ValueError(f"sparse_attn: {FORMAT_NAMES[kv.fmt]} store rows must be {width} wide, got {tuple(kv.data.shape)}")


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """Triton sees fp8 scales as raw bytes (e8m0) or e4m3; everything contiguous."""
    if t is None:
        return None
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def _read_as_given(kv: KV, idx: torch.Tensor) -> bool:
    """Whether the launch reads a store and its index list as given, no conversion launched ahead of it."""
    stored = [t for t in (kv.data, kv.scale) if t is not None]
    return idx.dtype == torch.int32 and all(t.is_contiguous() for t in (idx, *stored))


def plan_splits(S: int, H: int, kw: int, kg: int, device: torch.device, config: Config, split_size: int = 0) -> tuple[int, int]:
    """(number of splits, tiles per split) of each row's index list (window tiles, then global tiles)."""
    config = config.resolve(S, H, kw, kg)
    tiles = triton.cdiv(kw, config.block_n) + triton.cdiv(kg, config.block_n)
    if tiles == 0:
        return 1, 1
    if split_size > 0:
        per = triton.cdiv(split_size, config.block_n)
    else:
        programs = S * triton.cdiv(H, config.block_h)
        sms = _sm_count(device)
        want = 1 if programs >= sms else min(triton.cdiv(sms, programs), tiles)
        per = triton.cdiv(tiles, max(want, 1))
    return triton.cdiv(tiles, per), per


def sparse_attn(
    q: torch.Tensor, win: KV, win_idx: torch.Tensor, glob: KV, glob_idx: torch.Tensor, sink: torch.Tensor,
    softmax_scale: float, cos: torch.Tensor, sin: torch.Tensor, split_size: int = 0, config: Config | None = None,
    settled: bool = False,
) -> torch.Tensor:
    """Launch the kernels (no dispatch): q [S, H, D] bf16 -> o [S, H, D] bf16. settled: the caller vouches that the
    global entries and their index lists were written before the kernel ahead of this launch (in the decode step,
    before the layer's first launch); the attention then loads a tile of them before its PDL wait (`_attn_kernel`'s
    SETTLED), unless one had to be converted here first."""
    _check(q, win, win_idx, glob, glob_idx, sink, cos, sin)
    settled = settled and _read_as_given(glob, glob_idx)
    if config is None:
        config = Config() if q.is_cuda else INTERPRETER_CONFIG
    S, H, D = q.shape
    R = 2 * cos.shape[-1]
    q = q.to(torch.bfloat16).contiguous()
    o = torch.empty_like(q)
    if S == 0 or H == 0:
        return o
    kw, kg = win_idx.shape[1], glob_idx.shape[1]
    config = config.resolve(S, H, kw, kg)
    if q.is_cuda and config.block_n < 32:
        raise ValueError(f"sparse_attn: block_n {config.block_n} < 32 is not supported on the GPU (see Config)")
    n_splits, per = plan_splits(S, H, kw, kg, q.device, config, split_size)
    split = n_splits > 1
    if split:
        part_o = torch.empty(S, n_splits, H, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(S, n_splits, H, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = o  # unused
    sink = sink.float().contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    win_idx, glob_idx = win_idx.to(torch.int32).contiguous(), glob_idx.to(torch.int32).contiguous()
    ws = _bytes(win.scale) if win.scale is not None else win.data
    gs = _bytes(glob.scale) if glob.scale is not None else glob.data
    _attn_kernel[(S, n_splits, triton.cdiv(H, config.block_h))](
        q, o, sink, cos, sin,
        win.data.contiguous(), ws, win_idx, kw,
        glob.data.contiguous(), gs, glob_idx, kg,
        part_o, part_ml,
        H, softmax_scale * LOG2E, per,
        WIN_FMT=win.fmt, GLOB_FMT=glob.fmt, D=D, R=R, BLOCK_H=config.block_h, BLOCK_N=config.block_n, SPLIT=split,
        INTERP=_INTERP, PDL=pdl(q), SETTLED=settled,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl(q),
    )
    if split:
        c = combine_tiles(H, D, n_splits, config)
        _combine_kernel[(S, triton.cdiv(H, c["BLOCK_H"]), D // c["BLOCK_D"])](
            part_o, part_ml, o, sink, cos, sin, H, n_splits, D=D, R=R, BLOCK_H=c["BLOCK_H"], BLOCK_D=c["BLOCK_D"],
            BLOCK_S=c["BLOCK_S"], INTERP=_INTERP, PDL=pdl(q), num_warps=c["num_warps"], launch_pdl=pdl(q),
        )
    return o


def combine_tiles(H: int, D: int, n_splits: int, config: Config) -> dict:
    """The combine kernel's tiles: heads and dims a program, split partials merged a load, warps."""
    return {"BLOCK_H": min(4, triton.next_power_of_2(H)), "BLOCK_D": min(32, D),
            "BLOCK_S": min(config.combine_splits, triton.next_power_of_2(n_splits)), "num_warps": 1}


def sparse_attn_reference(
    q: torch.Tensor, win: KV, win_idx: torch.Tensor, glob: KV, glob_idx: torch.Tensor, sink: torch.Tensor,
    softmax_scale: float, cos: torch.Tensor, sin: torch.Tensor, max_chunk_bytes: int = 2**31,
) -> torch.Tensor:
    """The twin: dequantize with dsv4.quant, gather the rows, mask the -1s, `sparse_attention`, inverse RoPE.

    Query rows go through in chunks so that the gathered fp32 KV stays under max_chunk_bytes.
    """
    _check(q, win, win_idx, glob, glob_idx, sink, cos, sin)
    S, _, D = q.shape
    k = win_idx.shape[1] + glob_idx.shape[1]
    if k == 0:  # only the sink: every output is 0
        return torch.zeros_like(q, dtype=_out_dtype(q))
    idx = torch.cat((win_idx, glob_idx), dim=1).long()  # [S, k]
    chunk = max(1, max_chunk_bytes // (k * D * 6))
    out = []
    for s0 in range(0, S, chunk):
        rows = idx[s0 : s0 + chunk].clamp(min=0)
        kw = win_idx.shape[1]
        dt = _out_dtype(q)
        kv = torch.cat((win.dequantize(rows[:, :kw], dt), glob.dequantize(rows[:, kw:], dt)), dim=1)  # [s, k, D]
        allowed = (idx[s0 : s0 + chunk] >= 0).unsqueeze(1)  # [s, 1, k]
        o = sparse_attention(q[s0 : s0 + chunk, None].to(dt), kv, allowed, sink, softmax_scale)
        out.append(o[:, 0])
    o = torch.cat(out)  # [S, H, D]
    return apply_rope(o[None], cos[None].float(), sin[None].float(), inverse=True)[0]


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 queries are served in fp32 by the twin (the CPU path); everything else computes in bf16."""
    return torch.float32 if q.dtype == torch.float32 and not use_triton(q) else torch.bfloat16


def _run(q, win: KV, win_idx, glob: KV, glob_idx, sink, softmax_scale, cos, sin, split_size,
         settled) -> torch.Tensor:
    if use_triton(q):
        return sparse_attn(q, win, win_idx, glob, glob_idx, sink, softmax_scale, cos, sin, split_size, settled=settled)
    return sparse_attn_reference(q, win, win_idx, glob, glob_idx, sink, softmax_scale, cos, sin)


# ---------------------------------------------------------------------------------------------- ops


@torch.library.custom_op("dsv4::sparse_attn_fp4", mutates_args=())
def sparse_attn_fp4(
    q: torch.Tensor, win_q8: torch.Tensor, win_scale: torch.Tensor, win_idx: torch.Tensor,
    glob_packed: torch.Tensor, glob_scale: torch.Tensor, glob_idx: torch.Tensor, sink: torch.Tensor,
    softmax_scale: float, cos: torch.Tensor, sin: torch.Tensor, split_size: int = 0, settled: bool = False,
) -> torch.Tensor:
    """FP8 window (e4m3 + e8m0 per 32) and FP4 global entries (packed e2m1 + e4m3 per 16) -> o [S, H, D] bf16."""
    win, glob = KV(FP8, win_q8, win_scale), KV(FP4, glob_packed, glob_scale)
    return _run(q, win, win_idx, glob, glob_idx, sink, softmax_scale, cos, sin, split_size, settled)


@torch.library.custom_op("dsv4::sparse_attn_fp8", mutates_args=())
def sparse_attn_fp8(
    q: torch.Tensor, win_q8: torch.Tensor, win_scale: torch.Tensor, win_idx: torch.Tensor,
    glob_q8: torch.Tensor, glob_scale: torch.Tensor, glob_idx: torch.Tensor, sink: torch.Tensor,
    softmax_scale: float, cos: torch.Tensor, sin: torch.Tensor, split_size: int = 0, settled: bool = False,
) -> torch.Tensor:
    """FP8 window and FP8 global entries (both e4m3 + e8m0 per 32) -> o [S, H, D] bf16."""
    win, glob = KV(FP8, win_q8, win_scale), KV(FP8, glob_q8, glob_scale)
    return _run(q, win, win_idx, glob, glob_idx, sink, softmax_scale, cos, sin, split_size, settled)


@torch.library.custom_op("dsv4::sparse_attn_bf16", mutates_args=())
def sparse_attn_bf16(
    q: torch.Tensor, win_kv: torch.Tensor, win_idx: torch.Tensor, glob_kv: torch.Tensor, glob_idx: torch.Tensor,
    sink: torch.Tensor, softmax_scale: float, cos: torch.Tensor, sin: torch.Tensor, split_size: int = 0,
    settled: bool = False,
) -> torch.Tensor:
    """Plain bf16 window and global rows -> o [S, H, D] bf16."""
    win, glob = KV(BF16, win_kv), KV(BF16, glob_kv)
    return _run(q, win, win_idx, glob, glob_idx, sink, softmax_scale, cos, sin, split_size, settled)


def _fake(q, *args, **kwargs):
    return torch.empty_like(q, dtype=_out_dtype(q))


for _op in (sparse_attn_fp4, sparse_attn_fp8, sparse_attn_bf16):
    _op.register_fake(_fake)
