"""Sparse MQA scoring (the lightning indexer) over MXFP4 index keys, as Triton kernels.

Twin: `dsv4.reference.indexer` (`index_scores`, `top_entries`, the masking in `Indexer.forward`).

    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t])            fp32, k = e2m1 * 2^(e8m0 - 127)
    score[s, t] = -inf  where t >= visible[s]                      (and, with a pool, outside its blocks)

Layouts (one sequence):
    q          [S, H, d]    bf16 or fp32 (fp16 is upcast to fp32); d a power of two >= 32
    k_packed   [T, d/2]     uint8 (int8 accepted): e2m1 codes, even element in the low nibble (dsv4.quant)
    k_scale    [T, d/32]    float8_e8m0fnu (uint8 accepted): one power-of-two scale per 32 elements
    weights    [S, H]       fp32, already multiplied by d^-0.5 * H^-0.5
    visible    [S]          int32: query s sees entries t < visible[s]
    blocks     [S, nb]      int32: the query's candidate pool, block ids of `block_size` entries, -1 = none

Ops:
    dsv4::mqa_index_scores       -> [S, T] fp32, every entry
    dsv4::mqa_index_scores_pool  -> [S, nb * block_size] fp32, laid out per listed block (slot i of block
                                    j at column j * block_size + i); -inf for -1 blocks and invisible entries
    mqa_index_topk               -> [S, min(k, T)] int64 entry ids in position order, -1 for -inf picks;
                                    equals `top_entries(masked twin score, k)`; the selection is
                                    dsv4::topk_select(_pool) (dsv4.fast.kernels.topk, a radix select)

Precision: the dot products are exact-product, fp32-accumulated, i.e. the kernel matches the twin evaluated
in fp32 (`index_scores(q.float(), dequantized keys, w)`) up to fp32 summation order. With bf16 q the
dequantized keys are exact in bf16, so the tensor cores see exact operands. (The reference Indexer run in
bf16 rounds each dot to bf16 first; the kernel does not.) Scales up to 2^113 are supported (index keys sit
near 2^0; dsv4.quant writes scales >= 2^-126).

Kernel shape: keys are the MMA's M side (a key tile of BT entries, 64 rows = one Hopper warpgroup MMA), the
queries' heads its N side (BS queries x HP padded heads), K = d. How the FP4 keys reach the MMA is a mode
(see MODE below): Triton's own MXFP4 upcast (tl.dot_scaled, the default for bf16 q on a GPU), or an
in-kernel dequantization that splits d into even and odd elements (the low and high nibbles) and loads q
to match, so no interleave is needed. Dense: a program takes a run of key tiles (a few waves of programs
in all), dequantizes each tile once and scores it against all its query tiles (queries split over
programs only when the key tiles alone cannot fill the GPU); for decode the query loads once. A prefill
chunk whose query tiles alone fill the GPU turns that around: a program a query tile, loaded once, over the
key tiles its queries see (`_launch_dense`'s queries_stationary). Pool: a
program takes one query and a run of pool tiles, gathers key rows through the block ids, and skips tiles
with nothing visible. No host syncs anywhere: the ops can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import warnings

import torch

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.topk import topk_select, topk_select_pool
from dsv4.quant import dequantize_mxfp4
from dsv4.reference.indexer import candidate_block_scores, index_scores, picks_mask

__all__ = [
    "mqa_index_scores",
    "mqa_index_scores_pool",
    "mqa_index_topk",
    "pool_entry_ids",
    "pool_positions_to_entries",
]

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


# MODE: how the MMA sees the FP4 keys.
#   0 "bf16":   keys dequantized here to bf16 (exact), q bf16, tl.dot
#   1 "fp32":   keys dequantized here to fp32, q fp32, tl.dot with exact ("ieee") products
#   2 "scaled": tl.dot_scaled(e2m1 keys + e8m0 scales, bf16 q): Triton's own MXFP4 upcast (Hopper has no
#               FP4 MMA, so it dequantizes to bf16 in registers before the bf16 MMA; exact as well)
# Modes 0 and 1 split d into even and odd elements (the low and high nibbles) and load q to match.


@triton.jit
def _fp4_key_tile(kp_ptr, ks_ptr, rows, rmask, BT: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Key rows `rows` ([BT]; masked rows read as code 0, i.e. 0.0) as the MMA's left operand.

    Modes 0/1 return (even, odd) elements, each [BT, D/2]. A nibble c becomes the fp16 bit pattern
    sign(c) << 15 | mag(c) << 9: e2m1's 2-bit exponent lands in the low bits of fp16's exponent and its
    mantissa bit on top of fp16's mantissa, so the fp16 value is exactly e2m1(c) * 2^-14 (code 1, the
    e2m1 subnormal, becomes the fp16 subnormal 2^-15). The 2^14 is folded into the e8m0 scale, built
    straight from its bits. Mode 2 returns the raw (bytes [BT, D/2], scales [BT, D/32]).
    """
    D2: tl.constexpr = D // 2
    NSC: tl.constexpr = D // 32
    rows64 = rows.to(tl.int64)
    byte = tl.load(kp_ptr + rows64[:, None] * D2 + tl.arange(0, D2)[None, :], mask=rmask[:, None], other=0)
    e = tl.load(ks_ptr + rows64[:, None] * NSC + tl.arange(0, NSC)[None, :], mask=rmask[:, None], other=127)
    if MODE == 2:
        ka = byte
        kb = e
    else:
        b = byte.to(tl.int32)
        lo = (((b & 0x08) << 12) | ((b & 0x07) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)
        scale = ((tl.minimum(e.to(tl.int32), 240) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(e-113)
        # byte column j holds elements 2j and 2j+1, both in scale block j // 16
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BT, NSC, 16)), (BT, D2))
        ka = lo.to(tl.float32) * scale
        kb = hi.to(tl.float32) * scale
        if MODE == 0:  # exact: 2 significant bits
            ka = ka.to(tl.bfloat16)
            kb = kb.to(tl.bfloat16)
    return ka, kb


@triton.jit
def _load_queries(q_ptr, w_ptr, s0, S, H, stride_qs, stride_qh, stride_ws,
                  BS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Queries s0 .. s0+BS-1, heads padded to HP, as the MMA's right operand: the transposed even/odd
    halves [D/2, BS*HP] (modes 0/1) or q^T [D, BS*HP] twice (mode 2); and the weights [BS*HP]. Padded
    heads and queries past S get q = 0 and w = 0, so they add exactly 0."""
    D2: tl.constexpr = D // 2
    N: tl.constexpr = BS * HP
    n = tl.arange(0, N)
    s = s0 + n // HP
    h = n % HP
    ok = (s < S) & (h < H)
    base = s.to(tl.int64) * stride_qs + h * stride_qh
    q = tl.load(q_ptr + base[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)  # [N, D]
    w = tl.load(w_ptr + s.to(tl.int64) * stride_ws + h, mask=ok, other=0.0)
    if MODE == 2:
        qa = tl.trans(q)
        qb = qa
    else:
        if MODE == 1:
            q = q.to(tl.float32)
        q_even, q_odd = tl.split(tl.reshape(q, (N, D2, 2)))
        qa = tl.trans(q_even)
        qb = tl.trans(q_odd)
    return qa, qb, w


@triton.jit
def _head_reduce(ka, kb, qa, qb, w, BT: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr, MODE: tl.constexpr):
    """[BT, BS]: sum over heads of w * relu(k . q), fp32 accumulation."""
    if MODE == 2:
        acc = tl.dot_scaled(ka, kb, "e2m1", qa, None, "bf16")
    elif MODE == 1:
        acc = tl.dot(ka, qa, input_precision="ieee")
        acc = tl.dot(kb, qb, acc, input_precision="ieee")
    else:
        acc = tl.dot(ka, qa)
        acc = tl.dot(kb, qb, acc)
    contrib = tl.maximum(acc, 0.0) * w[None, :]  # [BT, BS*HP]
    return tl.sum(tl.reshape(contrib, (BT, BS, HP)), axis=2)


@triton.jit
def _dense_kernel(q_ptr, kp_ptr, ks_ptr, w_ptr, vis_ptr, out_ptr,
                  S, T, H, stride_qs, stride_qh, stride_ws, stride_os, t_tiles_per_prog, s_tiles_per_prog,
                  BT: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                  MODE: tl.constexpr, ONE_S: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): key tiles i*t_tiles_per_prog + [0, t_tiles_per_prog) against query tiles
    j*s_tiles_per_prog + [0, s_tiles_per_prog). Each key tile is dequantized once and scored against
    all the program's query tiles; with a single query tile (ONE_S, decode) the queries load once.
    Key tiles no query of the program can see only get -inf (no key reads); the main loop has no
    branches, so Triton's pipeliner may prefetch the next tile's keys."""
    wait_for_predecessor(PDL)
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    first_s = pid_s * s_tiles_per_prog
    n_s = tl.minimum(s_tiles_per_prog, (S + BS - 1) // BS - first_s)
    # the farthest entry any of this program's queries sees
    vmax = tl.zeros((BS,), dtype=tl.int32)
    for i in range(n_s):
        s_idx = (first_s + i) * BS + tl.arange(0, BS)
        vmax = tl.maximum(vmax, tl.load(vis_ptr + s_idx, mask=s_idx < S, other=0))
    vmax = tl.minimum(tl.max(vmax, axis=0), T)
    first_t = pid_t * t_tiles_per_prog
    n_t = tl.minimum(t_tiles_per_prog, (T + BT - 1) // BT - first_t)
    n_live = tl.minimum(tl.maximum((vmax - first_t * BT + BT - 1) // BT, 0), n_t)
    if ONE_S:
        s_idx = first_s * BS + tl.arange(0, BS)
        s_ok = s_idx < S
        vis = tl.load(vis_ptr + s_idx, mask=s_ok, other=0)
        q_a, q_b, w = _load_queries(q_ptr, w_ptr, first_s * BS, S, H, stride_qs, stride_qh, stride_ws,
                                    BS, HP, D, MODE)
    for j in range(n_live):
        t = (first_t + j) * BT + tl.arange(0, BT)
        k_a, k_b = _fp4_key_tile(kp_ptr, ks_ptr, t, t < vmax, BT, D, MODE)
        if ONE_S:
            score = _head_reduce(k_a, k_b, q_a, q_b, w, BT, BS, HP, MODE)
            score = tl.where(t[:, None] < vis[None, :], score, float("-inf"))
            ptrs = out_ptr + s_idx[None, :].to(tl.int64) * stride_os + t[:, None]
            tl.store(ptrs, score, mask=(t < T)[:, None] & s_ok[None, :])
        else:
            for i in range(n_s):
                s0 = (first_s + i) * BS
                qa, qb, wi = _load_queries(q_ptr, w_ptr, s0, S, H, stride_qs, stride_qh, stride_ws,
                                           BS, HP, D, MODE)
                score = _head_reduce(k_a, k_b, qa, qb, wi, BT, BS, HP, MODE)
                si = s0 + tl.arange(0, BS)
                vi = tl.load(vis_ptr + si, mask=si < S, other=0)
                score = tl.where(t[:, None] < vi[None, :], score, float("-inf"))
                ptrs = out_ptr + si[None, :].to(tl.int64) * stride_os + t[:, None]
                tl.store(ptrs, score, mask=(t < T)[:, None] & (si < S)[None, :])
    for j in range(n_live, n_t):
        t = (first_t + j) * BT + tl.arange(0, BT)
        for i in range(n_s):
            si = (first_s + i) * BS + tl.arange(0, BS)
            ptrs = out_ptr + si[None, :].to(tl.int64) * stride_os + t[:, None]
            tl.store(ptrs, tl.full((BT, BS), float("-inf"), tl.float32), mask=(t < T)[:, None] & (si < S)[None, :])


@triton.jit
def _pool_kernel(q_ptr, kp_ptr, ks_ptr, w_ptr, vis_ptr, blk_ptr, out_ptr,
                 S, T, H, E, block_size, stride_qs, stride_qh, stride_ws, stride_bs, stride_os, tiles_per_prog,
                 BT: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    s = tl.program_id(0)
    pid = tl.program_id(1)
    vis = tl.minimum(tl.load(vis_ptr + s), T)
    q_even, q_odd, w = _load_queries(q_ptr, w_ptr, s, S, H, stride_qs, stride_qh, stride_ws, 1, HP, D, MODE)
    for i in range(tiles_per_prog):
        f = (pid * tiles_per_prog + i) * BT + tl.arange(0, BT)  # columns of the pool layout
        f_ok = f < E
        slot = f // block_size
        blk = tl.load(blk_ptr + s.to(tl.int64) * stride_bs + slot, mask=f_ok, other=-1)
        entry = blk * block_size + (f - slot * block_size)
        ok = f_ok & (blk >= 0) & (entry < vis)
        out = out_ptr + s.to(tl.int64) * stride_os + f
        if tl.max(ok.to(tl.int32), axis=0) > 0:
            k_even, k_odd = _fp4_key_tile(kp_ptr, ks_ptr, entry, ok, BT, D, MODE)
            score = tl.reshape(_head_reduce(k_even, k_odd, q_even, q_odd, w, BT, 1, HP, MODE), (BT,))
            tl.store(out, tl.where(ok, score, float("-inf")), mask=f_ok)
        else:
            tl.store(out, tl.full((BT,), float("-inf"), tl.float32), mask=f_ok)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


# the MMA mode for bf16 q on a GPU: "scaled" (tl.dot_scaled) or "bf16" (dequantized here); bench/indexer.py
# times both. fp32 q, and anything under the interpreter (whose bf16 tl.dot multiplies raw 16-bit patterns),
# take "fp32"; the interpreter runs "scaled" correctly, so tests can ask for it.
BF16_MODE = "scaled"
_MODES = {"bf16": 0, "fp32": 1, "scaled": 2}


def _mode(q: torch.Tensor, mode: str | None = None) -> int:
    if mode is not None:
        if mode not in _MODES or (q.dtype == torch.float32 and mode != "fp32") or (mode == "bf16" and not q.is_cuda):
            raise ValueError(f"mode {mode!r} does not fit q {q.dtype} on {q.device}")
        return _MODES[mode]
    if q.dtype == torch.float32 or not q.is_cuda:
        return _MODES["fp32"]
    return _MODES[BF16_MODE]


_MAX_GRID_Y = 65535  # a launch's second grid dimension


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(t: torch.Tensor) -> int:
    """Programs that keep the device busy: a few waves on a GPU, a handful under the interpreter."""
    if t.is_cuda:
        return 4 * _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4


def _check(q, k_packed, k_scale, weights, visible) -> tuple[int, int, int, int]:
    S, H, d = q.shape
    T = k_packed.shape[0]
    if d < 32 or d & (d - 1):
        raise ValueError(f"index head dim must be a power of two >= 32, got {d}")
    if tuple(k_packed.shape) != (T, d // 2) or tuple(k_scale.shape) != (T, d // 32):
        raise ValueError(f"keys {tuple(k_packed.shape)} / scales {tuple(k_scale.shape)} do not fit d={d}")
    if tuple(weights.shape) != (S, H) or tuple(visible.shape) != (S,):
        raise ValueError(f"weights {tuple(weights.shape)} / visible {tuple(visible.shape)} do not fit q {tuple(q.shape)}")
    return S, H, d, T


def _prep(q, k_packed, k_scale, weights, visible):
    """Kernel-ready views: q bf16/fp32 with unit last stride, bytes as uint8, fp32 weights, int32 visible."""
    if q.dtype not in (torch.bfloat16, torch.float32):
        q = q.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    kp = k_packed.contiguous().view(torch.uint8)
    ks = k_scale.contiguous().view(torch.uint8)
    w = weights.float().contiguous()
    vis = visible.to(torch.int32).contiguous()
    return q, kp, ks, w, vis


def _dense_config(S: int, H: int, d: int, q: torch.Tensor) -> dict:
    """Default tiles. Keys are the MMA's M side (64 rows: one Hopper warpgroup MMA); decode puts one query's
    heads on N, prefill about 128 query-heads. fp32 q (no tensor-core path) takes small tiles."""
    if q.is_cuda and q.dtype == torch.float32:
        return {"block_t": 32, "block_s": 1, "num_warps": 4}
    if S == 1:
        return {"block_t": 64, "block_s": 1, "num_warps": 4}
    return {"block_t": 64, "block_s": min(max(1, 128 // _pow2(H)), _pow2(S)), "num_warps": 4}


def dense_grid(t_tiles: int, s_tiles: int, target: int, queries_stationary: bool | None = None):
    """(key-tile programs, query-tile programs, key tiles a program, query tiles a program) of the dense scores'
    grid for `target` programs (`_launch_dense`); queries_stationary None: when the query tiles alone fill it."""
    if queries_stationary is None:
        queries_stationary = target <= s_tiles <= _MAX_GRID_Y
    if queries_stationary:
        return 1, s_tiles, t_tiles, 1
    s_splits = max(1, min(s_tiles, triton.cdiv(target, t_tiles)))
    s_per = triton.cdiv(s_tiles, s_splits)
    s_splits = triton.cdiv(s_tiles, s_per)
    t_per = max(1, t_tiles // max(1, target // s_splits))
    return triton.cdiv(t_tiles, t_per), s_splits, t_per, s_per


def _launch_dense(q, kp, ks, w, vis, out, *, block_t: int, block_s: int, num_warps: int = 4, num_stages: int = 2,
                  programs: int | None = None, mode: str | None = None,
                  queries_stationary: bool | None = None) -> torch.Tensor:
    """Grid: key tiles first; query tiles are split over programs only when key tiles alone cannot fill
    `programs` (default: a few waves of the device), and key tiles are grouped when they overfill it.
    queries_stationary (default: when the query tiles alone fill `programs`, a prefill chunk): a program a query
    tile, its queries loaded once, over the key tiles its queries see; where key tiles lead, every key tile's
    program reloads all its query tiles (an 8K chunk's 64 MB of queries once a key tile) and scores the keys its
    later queries see for all of them."""
    S, H, d = q.shape
    T = kp.shape[0]
    hp = _pow2(H)
    if block_s * hp < 16:  # the MMA's N is at least 16: pad the heads
        hp = 16 // block_s
    target = programs if programs is not None else _target_programs(q)
    t_splits, s_splits, t_per, s_per = dense_grid(triton.cdiv(T, block_t), triton.cdiv(S, block_s), target,
                                                  queries_stationary)
    _dense_kernel[(t_splits, s_splits)](
        q, kp, ks, w, vis, out,
        S, T, H, q.stride(0), q.stride(1), w.stride(0), out.stride(0), t_per, s_per,
        BT=block_t, BS=block_s, HP=hp, D=d, MODE=_mode(q, mode), ONE_S=s_per == 1, PDL=pdl(q),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl(q),
    )
    return out


def _pool_config(S: int, H: int, d: int, q: torch.Tensor) -> dict:
    return {"block_t": 32 if q.dtype == torch.float32 and q.is_cuda else 64, "num_warps": 4}


def _launch_pool(q, kp, ks, w, vis, blocks, block_size, out, *, block_t: int, num_warps: int = 4,
                 num_stages: int = 2, programs: int | None = None, mode: str | None = None) -> torch.Tensor:
    S, H, d = q.shape
    T = kp.shape[0]
    E = out.shape[1]
    hp = max(16, _pow2(H))
    tiles = triton.cdiv(E, block_t)
    target = programs if programs is not None else _target_programs(q)
    splits = max(1, min(tiles, triton.cdiv(target, S)))
    per_prog = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_prog)
    _pool_kernel[(S, splits)](
        q, kp, ks, w, vis, blocks, out,
        S, T, H, E, block_size, q.stride(0), q.stride(1), w.stride(0), blocks.stride(0), out.stride(0), per_prog,
        BT=block_t, HP=hp, D=d, MODE=_mode(q, mode), PDL=pdl(q),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl(q),
    )
    return out


def _with_fallback(launch, q: torch.Tensor) -> torch.Tensor:
    """Run `launch`; should the "scaled" mode (tl.dot_scaled) not compile with this Triton, switch bf16 q to
    the "bf16" mode for good, once, with a warning. Compilation happens before anything is enqueued."""
    global BF16_MODE
    try:
        return launch()
    except Exception as ex:
        if _mode(q) != _MODES["scaled"]:
            raise
        warnings.warn(f"dsv4 indexer: tl.dot_scaled failed ({type(ex).__name__}: {str(ex)[:200]}); "
                      "using the in-kernel bf16 dequantization instead", RuntimeWarning, stacklevel=3)
        BF16_MODE = "bf16"
        return launch()


# --------------------------------------------------------------------------------------------------
# torch twins (the fallback path)
# --------------------------------------------------------------------------------------------------


def _twin_dense(q, k_packed, k_scale, weights, visible) -> torch.Tensor:
    keys = dequantize_mxfp4(k_packed.view(torch.uint8), k_scale.view(torch.float8_e8m0fnu))  # [T, d] fp32
    score = index_scores(q.float()[None], keys[None], weights.float()[None])[0]  # [S, T]
    T = keys.shape[0]
    reachable = torch.arange(T, device=q.device) < visible.view(-1, 1)
    return score.masked_fill(~reachable, NEG_INF)


def _twin_pool(q, k_packed, k_scale, weights, visible, blocks, block_size) -> torch.Tensor:
    T, d = k_packed.shape[0], q.shape[-1]
    ent = pool_entry_ids(blocks, block_size)  # [S, E]
    ok = (ent >= 0) & (ent < visible.view(-1, 1).long()) & (ent < T)
    rows = ent.clamp(0, max(T - 1, 0))
    kp, ks = k_packed.view(torch.uint8), k_scale.view(torch.uint8)
    if T == 0:
        gathered = q.new_zeros(*ent.shape, d, dtype=torch.float32)
    elif rows.numel() < T:  # a pool smaller than the cache (a decode step over a long one): decode only its rows
        gathered = dequantize_mxfp4(kp[rows], ks[rows].view(torch.float8_e8m0fnu))  # [S, E, d]
    else:
        gathered = dequantize_mxfp4(kp, ks.view(torch.float8_e8m0fnu))[rows]
    dots = torch.einsum("shd,sed->she", q.float(), gathered)
    score = (dots.relu() * weights.float().unsqueeze(-1)).sum(1)
    return score.masked_fill(~ok, NEG_INF)


# --------------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv4::mqa_index_scores", mutates_args=())
def mqa_index_scores(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """[S, T] fp32 index scores of every entry; -inf where t >= visible[s]. See the module docstring."""
    S, H, d, T = _check(q, k_packed, k_scale, weights, visible)
    if not use_triton(q):
        return _twin_dense(q, k_packed, k_scale, weights, visible)
    out = torch.empty((S, T), dtype=torch.float32, device=q.device)
    if S == 0 or T == 0:
        return out
    q, kp, ks, w, vis = _prep(q, k_packed, k_scale, weights, visible)
    return _with_fallback(lambda: _launch_dense(q, kp, ks, w, vis, out, **_dense_config(S, H, d, q)), q)


@mqa_index_scores.register_fake
def _(q, k_packed, k_scale, weights, visible):
    return q.new_empty((q.shape[0], k_packed.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dsv4::mqa_index_scores_pool", mutates_args=())
def mqa_index_scores_pool(
    q: torch.Tensor,
    k_packed: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    visible: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """[S, nb * block_size] fp32 scores inside each query's candidate pool (V4.1 level two).

    Column j * block_size + i holds entry blocks[s, j] * block_size + i; -inf where the block is -1 or the
    entry is not visible (or past T). Only pool entries are read: O(pool) work per query, not O(T).
    """
    S, H, d, _ = _check(q, k_packed, k_scale, weights, visible)
    if blocks.dim() != 2 or blocks.shape[0] != S:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be [S={S}, nb]")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not use_triton(q):
        return _twin_pool(q, k_packed, k_scale, weights, visible, blocks, block_size)
    E = blocks.shape[1] * block_size
    out = torch.empty((S, E), dtype=torch.float32, device=q.device)
    if S == 0 or E == 0:
        return out
    q, kp, ks, w, vis = _prep(q, k_packed, k_scale, weights, visible)
    blk = blocks.to(torch.int32).contiguous()
    return _with_fallback(lambda: _launch_pool(q, kp, ks, w, vis, blk, block_size, out, **_pool_config(S, H, d, q)), q)


@mqa_index_scores_pool.register_fake
def _(q, k_packed, k_scale, weights, visible, blocks, block_size):
    return q.new_empty((q.shape[0], blocks.shape[1] * block_size), dtype=torch.float32)


def select_candidate_block_ids(score: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int
                               ) -> torch.Tensor:
    """`select_candidate_blocks` for one query per row (score [S, T], visible [S]) as the kept blocks' ids
    [S, min(nb, topk_blocks)] int64 (each once, ascending, among -1s for none), by the radix select in place of
    the stable sort (the same ties: to the lower block). When every block fits in the pool (a context under
    topk_blocks x block entries) the selection is just the finite blocks."""
    blocks = candidate_block_scores(score[None], visible, block)[0]  # [S, nb]
    if blocks.shape[-1] <= topk_blocks:
        ids = torch.arange(blocks.shape[-1], device=score.device).expand_as(blocks)
        return torch.where(blocks > float("-inf"), ids, -1)
    return topk_select(blocks, topk_blocks)  # -1 for -inf picks


def candidate_mask(ids: torch.Tensor, T: int, block: int) -> torch.Tensor:
    """Kept block ids [..., n] (-1 = none) -> the bool mask [..., T] of their entries (`select_candidate_blocks`'s
    form)."""
    return picks_mask(ids, -(-T // block)).repeat_interleave(block, dim=-1)[..., :T]


def pool_entry_ids(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S, nb] block ids -> [S, nb * block_size] int64 entry ids of the pool layout (-1 for -1 blocks)."""
    b = blocks.long()
    ent = b.unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)
    return torch.where(b.unsqueeze(-1) >= 0, ent, -1).flatten(-2)


def pool_positions_to_entries(pos: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Columns `pos` [S, k] of the pool layout -> entry ids [S, k] int64 (-1 where the block is -1)."""
    blk = blocks.long().gather(-1, pos // block_size)
    return torch.where(blk >= 0, blk * block_size + pos % block_size, -1)


def mqa_index_topk(
    q: torch.Tensor,
    k_packed: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    blocks: torch.Tensor | None = None,
    block_size: int = 8,
    ascending: bool = False,
) -> torch.Tensor:
    """The k best visible entries per query (inside its pool when `blocks` is given): [S, min(k, T)] int64
    entry ids in position order, -1 for picks that are not selectable. Equals the twin's
    `top_entries(score masked to visible [and pool], k)` exactly, ties to the lower entry id included (given
    the same scores); a pool must list each block once, and with `ascending` in ascending order
    (`topk_select_pool`'s). Selection: dsv4::topk_select / topk_select_pool.

    No host syncs: safe to capture in a CUDA graph.
    """
    T = k_packed.shape[0]
    width = min(k, T)
    if blocks is None:
        return topk_select(mqa_index_scores(q, k_packed, k_scale, weights, visible), k)
    score = mqa_index_scores_pool(q, k_packed, k_scale, weights, visible, blocks, block_size)
    ids = topk_select_pool(score, blocks, block_size, k, ascending)
    extra = ids.shape[-1] - width
    if extra > 0:  # the pool is wider than T: the surplus picks are all -1 and sort first
        ids = ids[..., extra:]
    elif extra < 0:  # the pool is narrower than k: the twin's extra picks are -inf, i.e. -1
        ids = torch.cat((ids.new_full((*ids.shape[:-1], -extra), -1), ids), dim=-1)
    return ids
