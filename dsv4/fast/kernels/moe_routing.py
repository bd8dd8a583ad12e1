"""Fused MoE routing: score function, top-k selection and weight normalization in one kernel.

`dsv4::route_topk(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func) -> (weights, ids)`
    logits [N, E] fp32, bias [E] fp32 or None, hashed_ids [N, k] int64 or None.
    scores = score_func(logits / temp) (sqrtsoftplus, sigmoid or softmax); the experts are the top-k of
    scores + bias, or `hashed_ids` when given; weights [N, k] fp32 are the chosen unbiased scores,
    divided by their sum + 1e-20 when `normalize` and k > 1, times `scale`; ids [N, k] int64.
    Order: ids come sorted by descending biased score (ties: the lower expert id first); on the hashed
    path, in the table's order. Twin: `route(router_scores(logits / temp, score_func), ...)`, whose
    top-k order is the same up to ties.
`dsv4::gate_route(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count) -> (weights, ids)`
    The same, with the gate GEMM in front: logits = x [N, D] @ weight [E, D]^T in fp32 (bf16 products
    are exact in fp32, so this is F.linear(x.float(), weight.float()) up to summation order). Twin:
    `Gate.forward`'s sequence. With `count` (the decode step's), up to 8 rows are routed in the GEMM's launch.
`dsv4::gate_route_normed(x, squares, norm_weight, eps, weight, ..., count) -> (weights, ids, xn, planes)`
    gate_route of xn = rms_norm(x, norm_weight, eps), normalized by the GEMM as it loads x, x's sum of squares
    handed on as partial sums (`mhc_post_partial`'s); it stores xn and its activation planes for the MoE's gather.

One program holds a block of rows, all E experts padded to a power of two (E <= 1024), in registers;
top-k is k rounds of argmax with the winner masked out. gate_route first runs a split-K GEMM on the
tensor cores into a [S, N, E] fp32 workspace that the routing kernel sums while loading; given a count, the
GEMM's last program to store its partials routes instead (an atomic count of the programs, release and acquire),
and the routing's launch and its hand-off (5.6 us of a V4.1 layer's batch-1 step, H100, session 49) go.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.moe_experts import activation_planes
from dsv4.fast.kernels.rope import handed_inverse_rms, rounded
from dsv4.fast.kernels.torch_math import exp, log1p
from dsv4.reference.linear import rms_norm
from dsv4.reference.moe import route, router_scores

_SCORE_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MAX_EXPERTS = 1024
# The most K splits the gate GEMM takes in decode (`gate_config`): the routing sums the splits' partials in series
# after it (in the GEMM's last program at up to 8 rows). On the H100 (session 57, V4.1, the 4-layer bench step,
# the gate_route launches' own time over its 4 layers, one call): 64 experts a tile and 40 splits 36.8 us, 10 splits
# 34.3, 5 splits 39.5; 32 experts a tile and 10 splits 32.7; at batch 8 176.2 against 209.8 for 64 and 40
DECODE_SPLITS = 10


def route_topk_twin(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func):
    scores = router_scores(logits.float() / temp, score_func)
    if bias is None and hashed_ids is None:
        bias = scores.new_zeros(scores.shape[-1])  # `route` wants a bias on the top-k path
    return route(scores, bias, hashed_ids, topk, normalize, scale)


def gate_route_twin(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func):
    logits = F.linear(x.float(), weight.float())
    return route_topk_twin(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func)


# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _better_expert(sel_a, id_a, score_a, sel_b, id_b, score_b):
    """Of two (biased score, expert id, score) candidates the one routing prefers: the higher biased score, on a
    tie the lower id."""
    a = (sel_a > sel_b) | ((sel_a == sel_b) & (id_a < id_b))
    return tl.where(a, sel_a, sel_b), tl.where(a, id_a, id_b), tl.where(a, score_a, score_b)


@triton.jit
def _take_best(sel, col2, scores, COMBINE: tl.constexpr):
    """Per row, the column routing prefers (the highest `sel`, on a tie the lowest id) -> (its id, its `scores`):
    one reduction of triples (COMBINE, `_better_expert`), or the same choice by three vectorized ones (the max, the
    lowest id reaching it, the score at that id), which the interpreter runs ~30x faster: its reduce with a
    combine function calls it element by element."""
    if COMBINE:
        _best, idx, wi = tl.reduce((sel, col2, scores), axis=1, combine_fn=_better_expert)
    else:
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], col2, sel.shape[1]), axis=1)
        wi = tl.sum(tl.where(col2 == idx[:, None], scores, 0.0), axis=1)
    return idx, wi


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, hashed_ptr, w_ptr, ids_ptr,
    N, E, n_split, stride_split, stride_ln, temp, scale,
    TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr, SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, NORMALIZE: tl.constexpr, ACCURATE: tl.constexpr,
    COMBINE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    _route_rows(logits_ptr, bias_ptr, hashed_ptr, w_ptr, ids_ptr, tl.program_id(0) * BR + tl.arange(0, BR), N, E,
                n_split, stride_split, stride_ln, temp, scale, TOPK, KP, EP, SB, SCORE, HAS_BIAS, HASHED, NORMALIZE,
                ACCURATE, COMBINE, "")


@triton.jit
def _route_rows(
    logits_ptr, bias_ptr, hashed_ptr, w_ptr, ids_ptr, rows,
    N, E, n_split, stride_split, stride_ln, temp, scale,
    TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, SB: tl.constexpr, SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, NORMALIZE: tl.constexpr, ACCURATE: tl.constexpr,
    COMBINE: tl.constexpr, CACHE: tl.constexpr,
):
    """The routing of rows [BR] (weights and ids stored) from their n_split partial logits. CACHE: the partials'
    cache modifier (".cg" where other programs of the same launch wrote them: `_gate_gemm_kernel`'s ROUTE)."""
    BR: tl.constexpr = rows.shape[0]
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, EP)
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]

    # logits: the sum of n_split partial products (1 for route_topk), SB partials per load: one a loop step put an
    # L2 round trip per split in series
    x = tl.zeros((BR, EP), dtype=tl.float32)
    for s0 in tl.range(0, n_split, SB, num_stages=2):
        s = s0 + tl.arange(0, SB)
        part = logits_ptr + s[:, None, None] * stride_split + rows64[None, :, None] * stride_ln + cols[None, None, :]
        x += tl.sum(tl.load(part, mask=(s < n_split)[:, None, None] & m2[None, :, :], other=0.0,
                            cache_modifier=CACHE), axis=0)
    x = tl.div_rn(x, temp)
    if SCORE == 0:  # sqrt(softplus(x)), softplus with torch's threshold 20
        sp = log1p(exp(tl.minimum(x, 20.0), ACCURATE), ACCURATE)
        scores = tl.sqrt_rn(tl.where(x > 20.0, x, sp))
    elif SCORE == 1:
        scores = tl.div_rn(1.0, 1.0 + exp(-x, ACCURATE))
    else:
        xm = tl.where(cmask[None, :], x, float("-inf"))
        ex = exp(xm - tl.max(xm, axis=1)[:, None], ACCURATE)
        scores = tl.div_rn(ex, tl.sum(ex, axis=1)[:, None])
    scores = tl.where(cmask[None, :], scores, 0.0)

    kk = tl.arange(0, KP)
    weights = tl.zeros((BR, KP), dtype=tl.float32)
    if HASHED:
        ids = tl.load(hashed_ptr + rows64[:, None] * TOPK + kk[None, :],
                      mask=rmask[:, None] & (kk[None, :] < TOPK), other=0).to(tl.int32)
        for i in tl.static_range(TOPK):
            idx = tl.sum(tl.where(kk[None, :] == i, ids, 0), axis=1)
            wi = tl.sum(tl.where(cols[None, :] == idx[:, None], scores, 0.0), axis=1)
            weights = tl.where(kk[None, :] == i, wi[:, None], weights)
    else:
        sel = scores
        if HAS_BIAS:
            sel = scores + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        sel = tl.where(cmask[None, :], sel, float("-inf"))
        ids = tl.zeros((BR, KP), dtype=tl.int32)
        col2 = tl.broadcast_to(cols[None, :], (BR, EP))
        for i in tl.static_range(TOPK):
            idx, wi = _take_best(sel, col2, scores, COMBINE)
            idx = tl.minimum(idx, E - 1)  # a NaN row finds no maximum: keep the id in range
            sel = tl.where(col2 == idx[:, None], float("-inf"), sel)
            weights = tl.where(kk[None, :] == i, wi[:, None], weights)
            ids = tl.where(kk[None, :] == i, idx[:, None], ids)
    if NORMALIZE and TOPK > 1:
        weights = tl.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scale
    om = rmask[:, None] & (kk[None, :] < TOPK)
    tl.store(w_ptr + rows64[:, None] * TOPK + kk[None, :], weights, mask=om)
    tl.store(ids_ptr + rows64[:, None] * TOPK + kk[None, :], ids.to(tl.int64), mask=om)


@triton.jit
def _gate_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, count_ptr, bias_ptr, hashed_ptr, rw_ptr, ids_ptr, sq_ptr, nw_ptr, xn_ptr, planes_ptr,
    N, E, D, steps_per_prog, stride_xn, stride_we, temp, scale, n_sq, eps,
    BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr, ROUTE: tl.constexpr, BR: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
    EP: tl.constexpr, SB: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
    NORMALIZE: tl.constexpr, ACCURATE: tl.constexpr, COMBINE: tl.constexpr, NORM: tl.constexpr,
    SQP: tl.constexpr,
):
    """Partial logits ws[s, n, e] = sum over split s's K range of x[n, :] * w[e, :], fp32 accumulation. ROUTE (one
    row block, N <= BR: `fused_route_rows`): each program counts itself in at count_ptr once its partials are
    stored, and the last to arrive routes the rows from them (`_route_rows`: weights at rw_ptr, ids at ids_ptr;
    the route's arguments as `_route_kernel`'s), then sets the count back to 0 for the next launch. NORM: x is
    rms_norm(x) as loaded, by the rows' partial sums of squares sq [N, n_sq] and the norm weight nw [D], rounded to
    x's dtype as `rms_norm` rounds; the first expert tile's programs store their K range of it, as rows (xn
    [N, D]) and as activation planes (planes [N, 8, D / 8], `activation_planes`), once counted in. The first K
    step's weights are asked for before the PDL wait (nothing in the step writes the gate's weight), so that their
    round trip runs beside the kernel ahead where that one starts this one early (`mhc_post_partial`'s
    start_next)."""
    pid_m = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ex = pid_e * BE + tl.arange(0, BE)
    emask = ex < E
    kk = tl.arange(0, BK)
    k_begin = pid_s * steps_per_prog * BK  # every program has a step: the launch's splits are cdiv(steps, per)
    k_end = tl.minimum(k_begin + steps_per_prog * BK, D)
    b = _gate_weights(w_ptr, ex, emask, stride_we, k_begin + kk, D)
    wait_for_predecessor(PDL)
    r = tl.full((BM, 1), 1.0, tl.float32)
    if NORM:
        r = handed_inverse_rms(sq_ptr, rows64, rmask, n_sq, D, eps, SQP)[:, None]  # [BM, 1]
    acc = _gate_step(tl.zeros((BM, BE), dtype=tl.float32), x_ptr, nw_ptr, rows, rmask, k_begin + kk, D, r,
                     stride_xn, b, NORM, F32, INTERP)
    for k0 in range(k_begin + BK, k_end, BK):
        b = _gate_weights(w_ptr, ex, emask, stride_we, k0 + kk, D)
        acc = _gate_step(acc, x_ptr, nw_ptr, rows, rmask, k0 + kk, D, r, stride_xn, b, NORM, F32, INTERP)
    tl.store(ws_ptr + (pid_s * N + rows.to(tl.int64))[:, None] * E + ex[None, :], acc,
             mask=rmask[:, None] & emask[None, :])
    if ROUTE:
        tl.debug_barrier()  # every thread's partials stored before the count's release
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(1) * tl.num_programs(2) - 1:
            _route_rows(ws_ptr, bias_ptr, hashed_ptr, rw_ptr, ids_ptr, tl.arange(0, BR), N, E, tl.num_programs(2),
                        N * E, E, temp, scale, TOPK, KP, EP, SB, SCORE, HAS_BIAS, HASHED, NORMALIZE, ACCURATE, COMBINE,
                        ".cg")
            # relaxed: the next launch is ordered after this one by the stream, and nothing here reads the count again;
            # the default acq_rel put a GPU-wide fence, waiting for the routing's stores, ahead of the exit
            tl.atomic_xchg(count_ptr, 0, sem="relaxed")
    if NORM:  # the normalized rows for the gather, stored once counted in: the count's release would wait for them
        if pid_e == 0:
            for k0 in range(k_begin, k_end, BK):
                kmask = (k0 + kk) < D
                a = _normed_tile(x_ptr, nw_ptr, rows, rmask, k0 + kk, kmask, r, stride_xn, F32, INTERP)
                _store_normed(xn_ptr, planes_ptr, a, rows64, k0 + kk, rmask[:, None] & kmask[None, :], D)


@triton.jit
def _gate_weights(w_ptr, ex, emask, stride_we, k, D):
    """The gate weight's rows ex [BE] at columns k [BK] (0 from D on), transposed: [BK, BE]."""
    return tl.trans(tl.load(w_ptr + ex.to(tl.int64)[:, None] * stride_we + k[None, :],
                            mask=emask[:, None] & (k < D)[None, :], other=0.0))


@triton.jit
def _gate_step(acc, x_ptr, nw_ptr, rows, rmask, k, D, r, stride_xn, b, NORM: tl.constexpr, F32: tl.constexpr,
               INTERP: tl.constexpr):
    """acc [BM, BE] + x's columns k [BK] of rows [BM] (NORM: normalized by r [BM, 1], `_normed_tile`) times the
    step's weights b [BK, BE]. Each step's product joins acc through an fp32 add: the tensor cores' accumulation
    rounding stays within the step."""
    kmask = k < D
    if NORM:
        a = _normed_tile(x_ptr, nw_ptr, rows, rmask, k, kmask, r, stride_xn, F32, INTERP)
    else:
        a = _x_tile(x_ptr, rows, rmask, k, kmask, stride_xn)
    if INTERP:  # the interpreter's dot mishandles bf16; fp32 gives the same exact products
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif F32:
        return acc + tl.dot(a, b.to(tl.float32), input_precision="tf32x3")
    else:
        return acc + tl.dot(a, b)


@triton.jit
def _x_tile(x_ptr, rows, rmask, k, kmask, stride_xn):
    """x's columns k [BK] of rows [BM], 0 outside them."""
    return tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xn + k[None, :], mask=rmask[:, None] & kmask[None, :],
                   other=0.0)


@triton.jit
def _normed_tile(x_ptr, nw_ptr, rows, rmask, k, kmask, r, stride_xn, F32: tl.constexpr, INTERP: tl.constexpr):
    """rms_norm of x's columns k [BK] of rows [BM], by their inverse roots r [BM, 1] and the norm weight, rounded as
    `rms_norm` rounds, in x's dtype. The weight is loaded in x's tile (its rows alike): 16-byte loads the pipeliner
    copies ahead, as x's."""
    a = _x_tile(x_ptr, rows, rmask, k, kmask, stride_xn)
    nw = tl.load(nw_ptr + (0 * rows)[:, None] + k[None, :], mask=kmask[None, :], other=0.0)
    return rounded(nw.to(tl.float32) * (a.to(tl.float32) * r), not F32, INTERP).to(x_ptr.dtype.element_ty)


@triton.jit
def _store_normed(xn_ptr, planes_ptr, a, rows64, k, mask, D):
    """Columns k [BK] of the normalized rows a [BM, BK], as rows of xn [N, D] and into the planes [N, 8, D / 8]
    (plane k % 8, column k // 8) as fp32."""
    tl.store(xn_ptr + rows64[:, None] * D + k[None, :], a, mask=mask)
    tl.store(planes_ptr + rows64[:, None] * D + ((k % 8) * (D // 8) + k // 8)[None, :], a.to(tl.float32), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launch


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _supported(E: int, topk: int, score_func: str) -> bool:
    return 1 <= topk <= E <= MAX_EXPERTS and score_func in _SCORE_FUNCS


def _route_outputs(N: int, topk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing's weights [N, topk] fp32 and ids [N, topk] int64, to be written."""
    return (torch.empty(N, topk, dtype=torch.float32, device=device),
            torch.empty(N, topk, dtype=torch.int64, device=device))


def _route_args(c: dict, bias, hashed_ids, topk: int, score_func: str, normalize: bool, cuda: bool,
                fallback: torch.Tensor) -> tuple[tuple, dict]:
    """The routing's pointer arguments (bias, hashed ids; `fallback` stands in for those absent) and constexprs, as
    `_route_kernel` and `_gate_gemm_kernel`'s ROUTE take them."""
    hashed = hashed_ids.contiguous() if hashed_ids is not None else None
    b = bias.float().contiguous() if bias is not None else None
    consts = {"TOPK": topk, "KP": triton.next_power_of_2(topk), "EP": c["EP"], "SCORE": _SCORE_FUNCS[score_func],
              "SB": c["SB"], "HAS_BIAS": b is not None, "HASHED": hashed is not None, "NORMALIZE": bool(normalize),
              "ACCURATE": cuda, "COMBINE": c["combine"]}
    return (b if b is not None else fallback, hashed if hashed is not None else fallback), consts


def _route_launch(logits, n_split, stride_split, N, E, bias, hashed_ids, topk, temp, scale, normalize, score_func,
                  cfg: dict | None = None):
    weights, ids = _route_outputs(N, topk, logits.device)
    if N == 0:
        return weights, ids
    c = route_config(N, E, n_split, logits.is_cuda, cfg)
    pointers, consts = _route_args(c, bias, hashed_ids, topk, score_func, normalize, logits.is_cuda, logits)
    _route_kernel[(triton.cdiv(N, c["BR"]),)](
        logits, *pointers, weights, ids,
        N, E, n_split, stride_split, logits.stride(-2), float(temp), float(scale),
        BR=c["BR"], **consts, PDL=pdl(logits), num_warps=c["num_warps"], launch_pdl=pdl(logits),
    )
    return weights, ids


def _most_rows(EP: int) -> int:
    """The most rows of EP padded experts a routing program keeps in registers ([BR, EP] in 4 warps)."""
    return min(8, 4096 // EP)


def route_config(N: int, E: int, n_split: int, cuda: bool, cfg: dict | None = None) -> dict:
    """The routing kernel's tiles for N rows of E logits in n_split partials: EP (E padded), BR rows a program,
    SB partials summed a step, warps, and `combine` (a top-k round as one reduction of triples: on the GPU; see
    `_take_best`). `cfg` (BR, SB, num_warps, combine) overrides."""
    cfg = cfg or {}
    EP = triton.next_power_of_2(E)
    # rows a program: on the GPU enough programs to spread over the chip, few rows so the [BR, EP] row
    # block stays in registers; the interpreter pays per program, so it takes many rows at once
    if not cuda:
        BR = cfg.get("BR") or min(32, triton.next_power_of_2(N))
    else:
        BR = cfg.get("BR") or max(1, min(_most_rows(EP), triton.next_power_of_2(triton.cdiv(N, 128))))
    return {"EP": EP, "BR": BR, "SB": cfg.get("SB") or max(1, min(triton.next_power_of_2(n_split), 8192 // (BR * EP))),
            "num_warps": cfg.get("num_warps", 4 if EP <= 512 else 8), "combine": cfg.get("combine", cuda)}


def route_topk_triton(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func, cfg=None):
    logits = logits.float().contiguous()
    N, E = logits.shape
    return _route_launch(logits, 1, 0, N, E, bias, hashed_ids, topk, temp, scale, normalize, score_func, cfg)


def gate_config(N: int, E: int, D: int, elt: int, target: int, BM=None, BE=None, BK=None, split=None):
    """The gate GEMM's tiles for N rows, E experts, D wide: BM rows, BE experts and BK columns a step, the K splits
    and the steps a split takes."""
    decode = N <= 16  # one 16-row block
    BM = BM or (16 if decode else 32 if N <= 32 else 64)
    # defaults that compile without register spills for sm_90 (ptxas -v, Triton 3.9)
    BE = BE or min(32 if decode else 64, triton.next_power_of_2(E))
    BK = BK or (128 if elt <= 2 else 32)
    nb = max(1, triton.cdiv(N, BM) * triton.cdiv(E, BE))  # no rows: no launch, yet the tiles are asked for
    steps = triton.cdiv(D, BK)
    # split K until about `target` programs run, but keep the fp32 partials ([S, N, E]) under the bytes of
    # the weight itself; in decode at most DECODE_SPLITS, as the routing sums the partials after the GEMM
    most = DECODE_SPLITS if decode else steps
    split = split or max(1, min(most, steps, triton.cdiv(target, nb), D // (2 * max(N, 1))))
    per = triton.cdiv(steps, split)
    return BM, BE, BK, triton.cdiv(steps, per), per


def fused_route_rows(N: int, E: int, BM: int) -> int:
    """Rows the gate GEMM's last program routes when it routes (`_gate_gemm_kernel`'s ROUTE), 0 where the routing
    takes a launch of its own: one program's row block of the routing kernel (`route_config`: at most 8 rows of
    up to 512 experts in its 4 warps, the gate's) holding all N rows, which the gate's one row block holds too."""
    BR, EP = triton.next_power_of_2(max(N, 1)), triton.next_power_of_2(E)
    return BR if 0 < N <= BM and EP <= 512 and BR <= _most_rows(EP) else 0


# the gate GEMM's routing constexprs where it does not route (`_gate_gemm_kernel`'s ROUTE off)
_NO_ROUTE = {"ROUTE": False, "BR": 1, "TOPK": 1, "KP": 1, "EP": 1, "SB": 1, "SCORE": 0, "HAS_BIAS": False,
             "HASHED": False, "NORMALIZE": False, "ACCURATE": False, "COMBINE": False}


def gate_route_triton(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count=None, cfg=None,
                      norm=None):
    """The Triton path of gate_route. With `count` (an int32 zero) and few rows (`fused_route_rows`) the gate GEMM's
    last program routes: one launch. norm (squares, norm_weight, eps; x and weight of one dtype): gate_route_normed's
    path, which returns the normalized rows and their planes too."""
    cfg = cfg or {}
    if x.dtype != weight.dtype:
        x, weight = x.float(), weight.float()
    x, weight = x.contiguous(), weight.contiguous()
    N, D = x.shape
    E = weight.shape[0]
    interp = not x.is_cuda
    target = 2 * _num_sms(x.device.index or 0) if x.is_cuda else 2
    BM, BE, BK, split, per = gate_config(N, E, D, x.element_size(), target,
                                         cfg.get("BM"), cfg.get("BE"), cfg.get("BK"), cfg.get("split"))
    ws = torch.empty(split, max(N, 1), E, dtype=torch.float32, device=x.device)
    BR = fused_route_rows(N, E, BM) if count is not None and not cfg.get("route") else 0
    if BR:
        outputs = _route_outputs(N, topk, x.device)
        c = route_config(N, E, split, x.is_cuda, {"BR": BR})
        pointers, consts = _route_args(c, bias, hashed_ids, topk, score_func, normalize, x.is_cuda, ws)
        route = (count, *pointers, *outputs), {"ROUTE": True, "BR": BR, **consts}
    else:
        route = (ws,) * 5, _NO_ROUTE
    normed, sq, nw, eps = (), ws, ws, 0.0  # ws stands in for the pointers where the GEMM does not normalize
    if norm is not None:
        sq, nw, eps = norm[0].float().contiguous(), norm[1].contiguous(), float(norm[2])
        normed = (torch.empty_like(x), torch.empty(N, 8, D // 8, dtype=torch.float32, device=x.device))
    n_sq = sq.shape[-1] if normed else 1
    if N > 0:
        _gate_gemm_kernel[(triton.cdiv(N, BM), triton.cdiv(E, BE), split)](
            x, weight, ws, *route[0], sq, nw, *(normed or (ws, ws)), N, E, D, per, x.stride(0), weight.stride(0),
            float(temp), float(scale), n_sq, eps,
            BM=BM, BE=BE, BK=BK, F32=x.dtype == torch.float32, INTERP=interp, PDL=pdl(x), **route[1],
            NORM=bool(normed), SQP=triton.next_power_of_2(n_sq),
            num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), launch_pdl=pdl(x),
        )
    if not BR:
        outputs = _route_launch(ws, split, N * E, N, E, bias, hashed_ids, topk, temp, scale, normalize, score_func,
                                cfg.get("route"))
    return (*outputs, *normed)


# ------------------------------------------------------------------------------------------------
# Ops


@torch.library.custom_op("dsv4::route_topk", mutates_args=())
def route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hashed_ids: torch.Tensor | None,
    topk: int,
    temp: float,
    scale: float,
    normalize: bool,
    score_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits [N, E] -> weights [N, k] fp32, ids [N, k] int64 (by descending biased score)."""
    if use_triton(logits) and _supported(logits.shape[-1], topk, score_func):
        return route_topk_triton(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func)
    w, idx = route_topk_twin(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func)
    return w.contiguous(), idx.clone()  # the hashed path's ids are the input itself: an op output must not alias


@route_topk.register_fake
def _(logits, bias, hashed_ids, topk, temp, scale, normalize, score_func):
    N = logits.shape[0]
    return logits.new_empty(N, topk, dtype=torch.float32), logits.new_empty(N, topk, dtype=torch.int64)


@torch.library.custom_op("dsv4::gate_route", mutates_args=())
def gate_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hashed_ids: torch.Tensor | None,
    topk: int,
    temp: float,
    scale: float,
    normalize: bool,
    score_func: str,
    count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate GEMM + router: x [N, D], weight [E, D] -> weights [N, k] fp32, ids [N, k] int64. count: an int32 [1]
    zero the caller keeps for this op alone (one stream at a time); with it, few rows are routed by the gate GEMM's
    last program (`fused_route_rows`), which counts the programs in it and sets it back to 0 before it exits."""
    _check_count(count, x, "gate_route")
    if use_triton(x) and _supported(weight.shape[0], topk, score_func):
        return gate_route_triton(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count)
    w, idx = gate_route_twin(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func)
    return w.contiguous(), idx.clone()


@gate_route.register_fake
def _(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count=None):
    N = x.shape[0]
    return x.new_empty(N, topk, dtype=torch.float32), x.new_empty(N, topk, dtype=torch.int64)


def _check_count(count: torch.Tensor | None, x: torch.Tensor, what: str) -> None:
    if count is not None and (count.dtype != torch.int32 or count.numel() != 1 or count.device != x.device):
        raise ValueError(f"{what}: count must be one int32 on x's device, got {count.dtype} "
                         f"{tuple(count.shape)} on {count.device}")


def _check_normed(x, squares, norm_weight, weight) -> None:
    if x.dim() != 2 or squares.dim() != 2 or squares.shape[0] != x.shape[0] or norm_weight.shape != x.shape[1:]:
        raise ValueError(f"gate_route_normed: x [N, D], squares [N, S] and norm_weight [D] expected, got "
                         f"{tuple(x.shape)}, {tuple(squares.shape)}, {tuple(norm_weight.shape)}")
    if x.dtype != weight.dtype or x.shape[1] % 8:
        raise ValueError(f"gate_route_normed: x and the gate weight of one dtype and D a multiple of 8, got "
                         f"{x.dtype}, {weight.dtype}, D {x.shape[1]}")


@torch.library.custom_op("dsv4::gate_route_normed", mutates_args=())
def gate_route_normed(
    x: torch.Tensor,
    squares: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hashed_ids: torch.Tensor | None,
    topk: int,
    temp: float,
    scale: float,
    normalize: bool,
    score_func: str,
    count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate_route of xn = rms_norm(x, norm_weight, eps), x's sum of squares given as partial sums squares [N, S]
    (`mhc_post_partial`'s, of x as stored) -> (weights, ids, xn [N, D], activation_planes(xn) [N, 8, D / 8]). The
    gate GEMM normalizes x as it loads it and stores xn and its planes, which the MoE's gather reads: the decode
    step's norm and planes launches go. The kernel's mean square is the squares' sum over D, which may differ from
    rms_norm's in its last bits (the twin: rms_norm of x)."""
    _check_normed(x, squares, norm_weight, weight)
    _check_count(count, x, "gate_route_normed")
    if use_triton(x) and _supported(weight.shape[0], topk, score_func):
        return gate_route_triton(x, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count,
                                 norm=(squares, norm_weight, eps))
    xn = rms_norm(x, norm_weight, eps)
    w, idx = gate_route_twin(xn, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func)
    return w.contiguous(), idx.clone(), xn, activation_planes(xn)


@gate_route_normed.register_fake
def _(x, squares, norm_weight, eps, weight, bias, hashed_ids, topk, temp, scale, normalize, score_func, count=None):
    _check_normed(x, squares, norm_weight, weight)
    N, D = x.shape
    return (x.new_empty(N, topk, dtype=torch.float32), x.new_empty(N, topk, dtype=torch.int64), x.new_empty(N, D),
            x.new_empty(N, 8, D // 8, dtype=torch.float32))
