"""Exact top-k selection over fp32 score rows, as a Triton radix select.

Twin: `dsv4.reference.indexer.top_entries` (stable_topk, then -1 for picks that are not > -inf, sorted).

Ops:
    dsv4::topk_select(scores [S, T] fp32, k)                     -> [S, min(k, T)] int64
        the k best columns per row, ties to the lower column; picks whose score is -inf (or NaN) become -1;
        each row sorted ascending (so the -1s come first). Equals `top_entries(scores, k)` exactly.
    dsv4::topk_select_pool(scores [S, E] fp32, blocks [S, nb], block_size, k) -> [S, min(k, E)] int64
        scores in the pool layout of dsv4.fast.kernels.indexer (column j * block_size + i holds entry
        blocks[s, j] * block_size + i; columns of -1 blocks count as -inf). Returns entry ids, ties to the lower
        ENTRY id, -1 for -inf/NaN picks, sorted ascending: `top_entries` of the scores scattered to entry ids
        (entries outside the pool at -inf), provided a row lists each block once.

Order semantics (those of torch.sort(descending=True, stable=True), which the twin uses): -0.0 == 0.0;
NaN ranks above +inf, NaNs tie among themselves; ties go to the lower id.

Algorithm, one program per row (per row chunk in a stage, below): each float maps to an order-preserving 32-bit key (the sign bit flips the
magnitude bits of negatives; -0.0 and NaN are canonicalized first). The k-th largest key `thr` and `need`,
the number of keys equal to `thr` that belong to the top k, come from one of two searches. A row that fits
one chunk (up to RESIDENT_MAX columns) stays in registers and is bisected bit by bit, a count of one
reduction a bit (on the H200: 12 us at 2K-4K columns with all 32 bits, where the histogram passes take 17, 19 us
against 31 at 8K), stopping once the bits left cannot change the answer (some 18 rounds on random scores).
A longer row is streamed: four passes of 8-bit digit histograms (tl.histogram over the row, chunk by
chunk). A last pass compacts the row with one prefix sum a chunk, of the keys > thr and the keys == thr
packed in one int32: a tie is a pick while fewer than `need` ties precede it, so a column's output position is
the keys above before it plus min(ties before it, need).
Dense: columns are visited in order, so the output comes out ascending and the tie rule is "first `need` in
column order"; picks that are -inf/NaN are written as the leading -1s. Pool: when the tie at `thr` is
actually cut, a second search of the same kind finds the need-th smallest entry id among the tied keys;
the compacted entry ids (k of them) are then sorted in-kernel (tl.sort). A pool whose blocks ascend along the
row (`ascending`) has its columns in entry order already and is selected as a dense row.
Long rows go in stages (`_select`): programs per (row, chunk) keep each chunk's top k, ids and scores, read
straight from the row (no padded or gathered copies), and the next launch selects among those candidates.
No host syncs: capturable in CUDA graphs. Work per row: 1 read of a resident row (searched and compacted from
the same registers); 5 of a streamed one (9), which after the first come from L2 for rows up to a few MB.
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import pdl, tl, triton, use_triton, wait_for_predecessor
from dsv4.reference.indexer import top_entries

__all__ = ["topk_select", "topk_select_pool", "twin_topk_select_pool"]

# (BLOCK columns per chunk, num_warps) on a GPU; the interpreter takes bigger chunks (fewer numpy calls)
GPU_BLOCK, GPU_WARPS = 4096, 8
INTERP_BLOCK = 1024
# rows up to this many columns are held in registers and bisected (GPU; the interpreter: INTERP_BLOCK). 16384
# made a lone 16K-column row one program on one SM: inside the V4.1 decode step (batch 1, 8K context) the
# three top-k calls took 150 us, against 64 us with two stages (profile-decode-v41-b1-compiled*.json)
RESIDENT_MAX = 8192
# one program per row reads the row five times: rows this much longer than a chunk go through stages
STAGE_MIN_CHUNK = 4096
# a first stage of fewer programs leaves most of the GPU idle (the H200 has 132 SMs): a few long dense rows
# (decode over a long context) take STAGE_MIN_CHUNK columns a program instead, in more stages
FILL_PROGRAMS = 256


# globals a kernel reads must be constexpr objects (an annotation is not enough for compiled Triton;
# the interpreter accepts either, so only the GPU would notice)
INT_MIN = tl.constexpr(-2147483648)
# keys (signed int32, ordered like the floats) of -inf and of the canonical NaN 0x7FC00000
NEG_KEY = tl.constexpr(-2139095041)  # 0xFF800000 ^ 0x7FFFFFFF = 0x807FFFFF
NAN_KEY = tl.constexpr(2143289344)  # 0x7FC00000


@triton.jit
def _chunk_keys(s_ptr, id_ptr, col0, cols, width, n, block_size, IDS: tl.constexpr):
    """(key, ent, inb) for the columns `cols` of a part that starts at row column col0 (s_ptr points there):
    order-preserving int32 keys (-inf past the n loadable columns and where the entry is -1), the entry id
    of each column (IDS 0: the row column; 1: from the row's block table; 2: read per column from id_ptr,
    which points at the part's first; -1 in -1 blocks), and cols < width (the columns the part ranks)."""
    inb = cols < width
    ld = inb & (cols < n)
    x = tl.load(s_ptr + cols, mask=ld, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == INT_MIN, 0, bits)  # -0.0 -> +0.0
    bits = tl.where(x != x, 2143289344, bits)  # noqa: PLR0124 -- any NaN -> 0x7FC00000
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    if IDS == 1:
        g = col0 + cols
        slot = g // block_size
        blk = tl.load(id_ptr + slot, mask=ld, other=-1)
        ent = tl.where(blk >= 0, blk * block_size + (g - slot * block_size), -1)
        key = tl.where(blk >= 0, key, NEG_KEY)
    elif IDS == 2:  # a later stage's candidates
        ent = tl.load(id_ptr + cols, mask=ld, other=-1)
        key = tl.where(ent >= 0, key, NEG_KEY)
    else:
        ent = col0 + cols
    return key, ent, inb


@triton.jit
def _key_score(key):
    """The fp32 score of an order-preserving key (the map is its own inverse): -0.0 and NaN canonical."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _select_values(key, ent, inb, thr_key, ID_MODE: tl.constexpr):
    """The values a search ranks (unsigned order, as int32 bits) and which columns take part."""
    if ID_MODE:
        return 0x7FFFFFFF - ent, inb & (key == thr_key)
    else:
        return key ^ INT_MIN, inb


@triton.jit
def _bisect_select(key, ent, inb, k_rem, thr_key, ID_MODE: tl.constexpr):
    """_radix_select for a part held in registers (`_chunk_keys` of its one chunk): the k_rem-th largest value is
    built from the top bit down, keeping a bit when at least k_rem values reach the prefix with it.

    The search stops early once the values reaching the prefix are k_rem, or all but one of them reach the
    bound the rejected bits set (prefix + 2 * bit): either way the k_rem-th largest is the least of them. One
    round is one reduction across the program; on distinct scores the gap around the k_rem-th is found after
    some 15-20 of the 32 rounds (ties, all 32)."""
    v, ok = _select_values(key, ent, inb, thr_key, ID_MODE)
    w = v ^ INT_MIN  # signed, in the order of v as unsigned
    prefix = tl.zeros((), tl.int32)
    lo = tl.sum(ok.to(tl.int32), axis=0)  # values reaching the prefix: k_rem or more
    hi = tl.zeros((), tl.int32)  # values reaching the bound the rejected bits set: fewer than k_rem
    bit = tl.full((), INT_MIN, tl.int32)  # the bit a round decides, from the top
    # 32 rounds whose body is skipped once the answer is known: a `while` on the same condition ran ~1 us faster a
    # launch on the H200 but spills under Triton 3.9; 32 unrolled rounds ran slower (2700 more instructions)
    for _ in range(32):
        if (lo > k_rem) & (lo - hi > 1):
            cand = prefix | bit
            reach = tl.sum((ok & (w >= (cand ^ INT_MIN))).to(tl.int32), axis=0)
            keep = reach >= k_rem
            prefix = tl.where(keep, cand, prefix)
            lo = tl.where(keep, reach, lo)
            hi = tl.where(keep, hi, reach)
        bit = (bit >> 1) & 0x7FFFFFFF
    least = tl.min(tl.where(ok & (w >= (prefix ^ INT_MIN)), w, 2147483647), axis=0)
    prefix = tl.where(lo >= k_rem, least ^ INT_MIN, prefix)
    thr = prefix ^ INT_MIN
    above = tl.sum((ok & (w > thr)).to(tl.int32), axis=0)
    cnt = tl.sum((ok & (w == thr)).to(tl.int32), axis=0)
    n_nan = tl.sum((inb & (key == NAN_KEY)).to(tl.int32), axis=0)
    return prefix, k_rem - above, cnt, n_nan


@triton.jit
def _radix_select(s_ptr, id_ptr, col0, width, n, block_size, k_rem, thr_key,
                  ID_MODE: tl.constexpr, IDS: tl.constexpr, BLOCK: tl.constexpr):
    """The k_rem-th largest value v over a streamed part, by four 8-bit digit passes (most significant first).
    Values: v = key ^ INT_MIN (keys as unsigned) or, ID_MODE, v = 0x7FFFFFFF - entry id over the columns whose
    key == thr_key (the largest v = the smallest id). Returns (v as int32 bits, the rank left within the values
    equal to it, how many values equal it, how many keys are NaN (not ID_MODE))."""
    prefix = tl.zeros((), tl.int32)
    cnt = tl.zeros((), tl.int32)
    n_nan = tl.zeros((), tl.int32)
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        SH = 24 - 8 * p  # a constexpr: p is a static_range index
        hist = tl.zeros((256,), tl.int32)
        for c in range(0, width, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            key, ent, inb = _chunk_keys(s_ptr, id_ptr, col0, cols, width, n, block_size, IDS)
            v, ok = _select_values(key, ent, inb, thr_key, ID_MODE)
            if p == 0:
                n_nan += tl.sum((inb & (key == NAN_KEY)).to(tl.int32), axis=0)
            if p > 0:
                HM = -(1 << (SH + 8))
                ok = ok & ((v & HM) == prefix)
            hist += tl.histogram((v >> SH) & 255, 256, mask=ok)
        total = tl.sum(hist, axis=0)
        ge = total - tl.cumsum(hist, axis=0) + hist  # values with digit >= bin
        b = tl.sum((ge >= k_rem).to(tl.int32), axis=0) - 1  # ge is non-increasing
        at = bins == b
        k_rem -= tl.sum(tl.where(at, ge - hist, 0), axis=0)
        cnt = tl.sum(tl.where(at, hist, 0), axis=0)
        prefix = prefix | (b << SH)
    return prefix, k_rem, cnt, n_nan


@triton.jit
def _topk_kernel(s_ptr, id_ptr, out_ptr, out_s_ptr, T, part, K, block_size, stride_s, stride_i, stride_o,
                 IDS: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                 STAGE: tl.constexpr, RESIDENT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, p) selects the top K of the row's columns [p * part, (p + 1) * part), those past T at
    -inf. DENSE: ids ascend with the column, so a cut tie goes to the first columns and the picks come out
    in order; else (a pool) a cut tie goes to the lowest entry ids and the picks are sorted. STAGE (a first
    stage): all K picks, -inf and NaN ones included, in column order, as ids (out_ptr) and scores (out_s_ptr)
    at [row, p * K]; else the row's answer: ids, -1 for -inf/NaN picks, ascending."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    col0 = tl.program_id(1) * part
    s_row = s_ptr + row.to(tl.int64) * stride_s + col0
    id_row = id_ptr + row.to(tl.int64) * stride_i + (col0 if IDS == 2 else 0)
    n = T - col0  # loadable columns of this part
    out = out_ptr + row.to(tl.int64) * stride_o + tl.program_id(1) * K
    out_s = out_s_ptr + row.to(tl.int64) * stride_o + tl.program_id(1) * K
    ar = tl.arange(0, BLOCK)
    if RESIDENT:  # one chunk, loaded once: searched and compacted from the same registers
        res_key, res_ent, res_inb = _chunk_keys(s_row, id_row, col0, ar, part, n, block_size, IDS)
        u, need, cnt_eq, n_nan = _bisect_select(res_key, res_ent, res_inb, K, 0, False)
    else:
        u, need, cnt_eq, n_nan = _radix_select(s_row, id_row, col0, part, n, block_size, K, 0, False, IDS, BLOCK)
    thr = u ^ INT_MIN  # the k-th largest key; `need` of the keys equal to it are picks
    thr_valid = (thr != NEG_KEY) & (thr != NAN_KEY)
    v_thr = tl.zeros((), tl.int32)
    use_id = tl.zeros((), tl.int32)
    m = 0  # leading -1s
    if DENSE:
        if not STAGE:  # picks that are not selectable (-inf or NaN) lead as -1s; valid ones follow in order
            m = K - ((K - need) - tl.where(thr != NAN_KEY, n_nan, 0) + tl.where(thr_valid, need, 0))
            for c in range(0, m, BLOCK):
                pos = c + ar
                tl.store(out + pos, tl.full((BLOCK,), -1, out_ptr.dtype.element_ty), mask=pos < m)
    elif thr_valid & (cnt_eq > need):
        # a cut tie at a selectable threshold goes to the lowest entry ids: find the need-th smallest
        if RESIDENT:
            v_thr, _r, _c, _n = _bisect_select(res_key, res_ent, res_inb, need, thr, True)
        else:
            v_thr, _r, _c, _n = _radix_select(s_row, id_row, col0, part, n, block_size, need, thr, True, IDS, BLOCK)
        use_id = tl.full((), 1, tl.int32)
    # the compaction, one scan a chunk: the keys above the threshold and the ties at it, counted in one int32 as
    # (ties << 16) + above (a chunk has at most 2^13 columns). A tie is a pick while fewer than `need` ties came
    # before it, or by its entry id (use_id: no limit then), so the picks before a column are the keys above before
    # it plus min(ties before it, the limit): no second scan over the picks themselves
    tl.static_assert(BLOCK < 65536, "a chunk's counts share one int32 in 16-bit halves")
    limit = tl.where(use_id != 0, 2147483647, need)
    above_carry = tl.zeros((), tl.int32)
    tie_carry = tl.zeros((), tl.int32)
    for c in range(0, part, BLOCK):
        if RESIDENT:  # the one chunk (c = 0)
            key, ent, inb = res_key, res_ent, res_inb
        else:
            key, ent, inb = _chunk_keys(s_row, id_row, col0, c + ar, part, n, block_size, IDS)
        valid = (key != NEG_KEY) & (key != NAN_KEY)
        above = inb & (key > thr)
        tie = inb & (key == thr)
        if not DENSE:  # a cut tie: the ids from the second search
            tie = tie & tl.where(use_id != 0, (0x7FFFFFFF - ent) >= v_thr, True)
        if DENSE and not STAGE:  # the -inf/NaN picks are the leading -1s
            above = above & valid
            tie = tie & valid
        packed = above.to(tl.int32) + (tie.to(tl.int32) << 16)
        before = tl.cumsum(packed, axis=0) - packed
        ties_before = tie_carry + (before >> 16)
        sel = above | (tie & (ties_before < limit))
        pos = m + above_carry + (before & 0xFFFF) + tl.minimum(ties_before, limit)
        picked = ent if STAGE else tl.where(valid, ent, -1)
        tl.store(out + pos, picked.to(out_ptr.dtype.element_ty), mask=sel)
        if STAGE:
            tl.store(out_s + pos, _key_score(key), mask=sel)
        total = tl.sum(packed, axis=0)
        above_carry += total & 0xFFFF
        tie_carry += total >> 16
    if not DENSE and not STAGE:
        tl.debug_barrier()  # the compaction's stores, made by other threads of this program
        kk = tl.arange(0, KP)
        ids = tl.load(out + kk, mask=kk < K, other=2147483647).to(tl.int32)
        tl.store(out + kk, tl.sort(ids).to(tl.int64), mask=kk < K)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_warps(block: int) -> int:
    """Warps of a program holding `block` columns a chunk."""
    return 16 if block > 4096 else GPU_WARPS if block >= 2048 else 4


def _launch(scores: torch.Tensor, K: int, dense: bool, blocks: torch.Tensor | None = None, block_size: int = 1,
            ids: torch.Tensor | None = None, part: int | None = None, block: int | None = None,
            num_warps: int | None = None, resident: bool | None = None):
    """Programs over scores [S, T]: one per row (the answer, [S, K] int64), or with `part`, one per (row, part
    columns) (a stage: the picks' ids and scores, [S, C * K] int32 and fp32). A column's entry id: through
    `blocks` (a pool's block table [S, nb]), read from `ids` ([S, T] int32, a stage's candidates), or else the
    column itself; `dense`: ids ascend along the row (a dense row or its candidates). `resident`: bisect a part
    held in registers (default: when it fits) rather than stream it through histogram passes."""
    S, T = scores.shape
    part = T if part is None or part >= T else part
    stage = part < T
    C = -(-T // part) if stage else 1
    out = torch.empty((S, C * K), dtype=torch.int32 if stage else torch.int64, device=scores.device)
    out_s = torch.empty((S, C * K), dtype=torch.float32, device=scores.device) if stage else out
    result = (out, out_s) if stage else out
    if S == 0 or K == 0:
        return result
    s = scores.float()
    if s.stride(-1) != 1:
        s = s.contiguous()
    if block is None:
        fits = part <= (RESIDENT_MAX if s.is_cuda else INTERP_BLOCK) and resident is not False
        block = _pow2(part) if fits else GPU_BLOCK if s.is_cuda else INTERP_BLOCK
    block = min(block, max(16, _pow2(part)))
    resident = part <= block if resident is None else resident and part <= block
    if num_warps is None:
        num_warps = block_warps(block)
    table = blocks if blocks is not None else ids
    mode = 1 if blocks is not None else 2 if ids is not None else 0
    idt = table.to(torch.int32).contiguous() if mode else out  # out: a dummy pointer when dense
    _topk_kernel[(S, C)](
        s, idt, out, out_s, T, part, K, block_size, s.stride(0), idt.stride(0) if mode else 0, out.stride(0),
        IDS=mode, DENSE=dense, BLOCK=block, KP=16 if dense or stage else _pow2(K), STAGE=stage,
        RESIDENT=resident, PDL=pdl(s), num_warps=num_warps, launch_pdl=pdl(s),
    )
    return result


def first_stage_chunk(T: int, K: int, block_size: int = 1, rows: int | None = None) -> int | None:
    """Columns per first-stage chunk for a row of T (a multiple of block_size), or None when one pass is better
    (rows a program holds in registers, other short rows, or k not below a chunk). About sqrt(T K), so that both
    stages are about as long; given `rows` whose first stage that leaves under FILL_PROGRAMS programs,
    STAGE_MIN_CHUNK (the candidates then go through the stages again)."""
    chunk = max(STAGE_MIN_CHUNK, _pow2(int((T * K) ** 0.5)))
    if rows is not None and rows * -(-T // chunk) < FILL_PROGRAMS:
        chunk = STAGE_MIN_CHUNK
    chunk = -(-chunk // block_size) * block_size
    return chunk if T > max(2 * chunk, RESIDENT_MAX) and K < chunk else None


def _select(scores: torch.Tensor, blocks: torch.Tensor | None, block_size: int, K: int,
            chunk: int | None = None, ascending: bool = False) -> torch.Tensor:
    """The kernel's selection, in stages for long rows (`chunk` overrides `first_stage_chunk` at every stage).
    `ascending`: the pool's blocks ascend along each row, so its columns' entry ids do, as a dense row's.

    A stage cuts each row into chunks of `chunk` columns (whole blocks; the tail's missing columns at -inf)
    and keeps each chunk's top K, -inf and NaN picks included, with their entry ids and scores; the next
    selects over those candidates, so ties still go to the lower entry id and -inf/NaN picks still come out
    as -1. Exact: the row's top K (a total order: score, then entry id) is among the union of its chunks'
    top K. Candidates stay in the order of their columns, so a dense row's stay a dense row."""
    dense = blocks is None or ascending
    rows, ids = scores.shape[0] if dense else None, None
    while True:
        T = scores.shape[1]
        c = chunk or first_stage_chunk(T, K, block_size, rows)
        if c is None or T <= c or K >= c or -(-T // c) * K >= T:
            return _launch(scores, K, dense, blocks, block_size, ids)
        ids, scores = _launch(scores, K, dense, blocks, block_size, ids, part=c)  # [S, C * K] each
        blocks, block_size = None, 1


# --------------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------------


def _check_scores(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [S, T], got {tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if scores.shape[1] >= 2**31 - 1:
        raise ValueError("rows of 2^31 columns or more are not supported")


@torch.library.custom_op("dsv4::topk_select", mutates_args=())
def topk_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[S, min(k, T)] int64: `top_entries(scores, k)` (see the module docstring)."""
    _check_scores(scores, k)
    if not use_triton(scores):
        return top_entries(scores.float(), k)
    return _select(scores, None, 1, min(k, scores.shape[1]))


@topk_select.register_fake
def _(scores, k):
    return scores.new_empty((scores.shape[0], min(k, scores.shape[1])), dtype=torch.int64)


def twin_topk_select_pool(scores: torch.Tensor, blocks: torch.Tensor, block_size: int, k: int) -> torch.Tensor:
    """Torch twin of topk_select_pool: stable order by (score descending, entry id ascending)."""
    E = scores.shape[1]
    b = blocks.long()
    ent = b.unsqueeze(-1) * block_size + torch.arange(block_size, device=scores.device)
    ent = torch.where(b.unsqueeze(-1) >= 0, ent, -1).flatten(-2)[:, :E]
    s = scores.float().masked_fill(ent < 0, float("-inf"))
    by_id = ent.sort(dim=-1, stable=True).indices  # entry ids ascending (-1 columns first: all -inf)
    s_by_id = s.gather(-1, by_id)
    values, order = s_by_id.sort(dim=-1, descending=True, stable=True)
    K = min(k, E)
    picks = ent.gather(-1, by_id.gather(-1, order[:, :K]))
    return torch.where(values[:, :K] > float("-inf"), picks, -1).sort(dim=-1).values


@torch.library.custom_op("dsv4::topk_select_pool", mutates_args=())
def topk_select_pool(scores: torch.Tensor, blocks: torch.Tensor, block_size: int, k: int,
                     ascending: bool = False) -> torch.Tensor:
    """[S, min(k, E)] int64 entry ids: the k best pool columns, ties to the lower entry id, -1 for -inf/NaN
    picks, ascending (see the module docstring). A row must list each block once. `ascending`: the caller's word
    that each row's block ids ascend (the -1s anywhere), as `select_candidate_block_ids` returns them; the columns
    are then in entry order, so the picks are selected as a dense row's (ties to the first columns) and come out
    in order, without the cut tie's second search and the sort of the picks."""
    _check_scores(scores, k)
    S, E = scores.shape
    if blocks.dim() != 2 or blocks.shape[0] != S or blocks.shape[1] * block_size < E or block_size < 1:
        raise ValueError(f"blocks {tuple(blocks.shape)} x {block_size} do not cover scores {tuple(scores.shape)}")
    if not use_triton(scores):
        return twin_topk_select_pool(scores, blocks, block_size, k)
    return _select(scores, blocks, block_size, min(k, E), ascending=ascending)


@topk_select_pool.register_fake
def _(scores, blocks, block_size, k, ascending=False):
    return scores.new_empty((scores.shape[0], min(k, scores.shape[1])), dtype=torch.int64)
