"""Sparse MQA scoring (the lightning indexer) over FP4 index keys: kernels vs the naive torch path.

    python bench/indexer.py              # H200: correctness on CUDA at every size, then timings; < 4 minutes
    python bench/indexer.py --no-sweep   # skip the tile/mode sweep at the largest context
    python bench/indexer.py --smoke      # tiny sizes on the CPU under the Triton interpreter (proves it runs)

Cases (V4.1-Flash: index_n_heads H = 32, index_head_dim d = 128, top-512), at contexts 8K, 64K, 512K tokens:
- decoder (ratio 1): T = context entries; level two rescoring inside a pool of 2048 blocks x 8 entries.
- encoder (ratio 2): T = context / 2 entries; no pool.
each for decode (S = 1, every entry visible) and a prefill chunk (S = --prefill queries, causal, ending at T).
Variants:
- naive: dequantize every key to bf16, einsum, relu, weight, sum over heads, mask (visible; pool), top-512:
  the reference's computation on the FP4 cache.
- dense: dsv4::mqa_index_scores over all T; pool: dsv4::mqa_index_scores_pool over the pool only (decoder).
- *+topk(kernel): mqa_index_topk, i.e. the scores, then the radix select dsv4::topk_select(_pool)
  (dsv4/fast/kernels/topk.py: exact twin ties, ascending ids, no sort or mapping pass after it).
- *+topk(torch): the scores, then torch.topk, the pool -> entry mapping, -1 for -inf picks, sort (the
  previous path, kept for comparison).
- select(kernel) / select(torch): the selection alone on precomputed scores (pool: decode only); on dense
  scores also the exact torch route, select(stable sort) (the reference's `top_entries`).
- *+graph: the decode top-k path captured in a CUDA graph and replayed (no launch gaps, how decode runs).
Before timing, every size is checked on CUDA against the fp32 twin: scores within 1e-5 of the sum's scale,
-inf patterns identical, top-512 index sets identical up to ties (the naive bf16 path's overlap is info only).
Timing: CUDA events around each call, the L2 flushed (256 MB written) before each, median of --iters after
--warmup calls. Bytes: the fewest each kernel must move: 68 B per visible key entry read once (64 B e2m1 +
4 B e8m0 scales), 4 B per score written, q, w, blocks. GB/s is reported against 4.3 TB/s (this workplace's
measured device copy rate on the H200) and against the copy rate measured here at start. TFLOP/s counts
2*S*H*d per scored entry.
JSON (git commit, GPU, exact command, every number) goes to $OUT/indexer.json if OUT is set, else
bench/results/indexer.json (indexer-smoke.json with --smoke); a PNG beside it when matplotlib imports.
The table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--contexts", type=int, nargs="*", default=None, help="context lengths in tokens")
    p.add_argument("--prefill", type=int, default=None, help="queries in the prefill chunk (default 64)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per case (median; default 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile/mode sweep")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decode timings")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch
from common import git_commit, synchronizer  # git_commit: $DSV4_COMMIT wins over a stale .git

import dsv4.fast.kernels.indexer as ix
import dsv4.fast.kernels.topk as tk
from dsv4.quant import dequantize_mxfp4, quantize_mxfp4
from dsv4.reference.indexer import index_scores, top_entries

HBM_BPS = 4.3e12  # measured device copy rate on this workplace's H200s (KINDS.md)
MAX_GPU_BYTES = 40e9
RTOL = ATOL = 1e-5

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not ARGS.smoke:
    sys.exit("no CUDA device: run with --smoke for the CPU interpreter check")

if ARGS.smoke:
    CFG = {"contexts": ARGS.contexts or [256, 1024], "prefill": ARGS.prefill or 3, "iters": ARGS.iters or 2,
               "warmup": ARGS.warmup or 1, "H": 32, "d": 128, "topk": 32, "pool_blocks": 16, "block_size": 8}
else:
    CFG = {"contexts": ARGS.contexts or [8192, 65536, 524288], "prefill": ARGS.prefill or 64, "iters": ARGS.iters or 30,
               "warmup": ARGS.warmup or 5, "H": 32, "d": 128, "topk": 512, "pool_blocks": 2048, "block_size": 8}


sync = synchronizer(DEV)


# ------------------------------------------------------------------------------------------------
# timing

_FLUSH = torch.empty(256 * 2**20 if DEV == "cuda" else 1, dtype=torch.uint8, device=DEV)


def time_us(fn, iters: int | None = None, warmup: int | None = None, flush: bool = True) -> float:
    """Median microseconds per call of fn (CUDA events, L2 flushed before each call)."""
    iters, warmup = iters or CFG["iters"], warmup or CFG["warmup"]
    for _ in range(warmup):
        fn()
    sync()
    if DEV != "cuda":
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
        return statistics.median(samples)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        if flush:
            _FLUSH.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def graph_us(fn) -> float | None:
    """Median microseconds per replay of fn captured in a CUDA graph (L2 flushed before each replay)."""
    if DEV != "cuda" or ARGS.no_graph:
        return None
    fn()
    sync()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_us(g.replay)


def copy_rate() -> float | None:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    if DEV != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = time_us(functools.partial(dst.copy_, src), iters=10, warmup=3, flush=False)
    return 2 * 2**30 / (us * 1e-6)


# ------------------------------------------------------------------------------------------------
# inputs, the naive path, checks


def make_case(T: int, S: int, pool: bool, seed: int):
    H, d = CFG["H"], CFG["d"]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(S, H, d, generator=g, device=DEV).to(torch.bfloat16)
    kp, ks = quantize_mxfp4(torch.randn(T, d, generator=g, device=DEV))
    w = torch.randn(S, H, generator=g, device=DEV) * (d**-0.5 * H**-0.5)
    vis = (torch.full((S,), T) if S == 1 else torch.arange(T - S + 1, T + 1).clamp(min=0)).to(torch.int32).to(DEV)
    blocks = mask = None
    if pool:
        bs, nb = CFG["block_size"], CFG["pool_blocks"]
        n_blocks = -(-T // bs)
        order = torch.rand(S, n_blocks, generator=g, device=DEV).argsort(-1)[:, :nb]  # distinct, random
        blocks = torch.nn.functional.pad(order, (0, max(0, nb - n_blocks)), value=-1).to(torch.int32)
        ent = ix.pool_entry_ids(blocks, bs)
        ok = (ent >= 0) & (ent < T)
        mask = torch.zeros(S, T + 1, dtype=torch.bool, device=DEV)
        mask.scatter_(1, torch.where(ok, ent, T), True)
        mask = mask[:, :T].contiguous()
    return {"q": q, "kp": kp, "ks": ks, "w": w, "vis": vis, "blocks": blocks, "mask": mask, "T": T, "S": S}


def naive_topk(c):
    """The reference computation on the FP4 cache: dequantize all keys to bf16, score, mask, top-k."""
    keys = dequantize_mxfp4(c["kp"], c["ks"]).to(torch.bfloat16)
    score = index_scores(c["q"][None], keys[None], c["w"][None])[0]
    reach = torch.arange(c["T"], device=DEV) < c["vis"].view(-1, 1)
    if c["mask"] is not None:
        reach = reach & c["mask"]
    return top_entries(score.masked_fill(~reach, float("-inf")), CFG["topk"])


def twin_rows(c, rows: slice):
    """fp32 twin scores and the fp64 scale of each sum for query rows `rows` (masked to visible only)."""
    keys = dequantize_mxfp4(c["kp"], c["ks"])
    q, w = c["q"][rows].float(), c["w"][rows]
    score = index_scores(q[None], keys[None], w[None])[0]
    mag = (q.double().abs() * w.double().abs().unsqueeze(-1)).sum(1) @ keys.double().abs().T
    reach = torch.arange(c["T"], device=DEV) < c["vis"][rows].view(-1, 1)
    return score.masked_fill(~reach, float("-inf")), mag


def score_err(got, want, mag) -> tuple[bool, float]:
    """(ok, max err/bound): -inf patterns identical, finite scores within RTOL*|want| + ATOL*mag."""
    if got.isnan().any() or not torch.equal(got == float("-inf"), want == float("-inf")):
        return False, float("inf")
    fin = want > float("-inf")
    if not fin.any():
        return True, 0.0
    err = (got[fin].double() - want[fin].double()).abs()
    ratio = (err / (RTOL * want[fin].double().abs() + ATOL * mag[fin] + 1e-30)).max().item()
    return ratio <= 1.0, ratio


def topk_ok(got, score, mag) -> tuple[bool, float]:
    """(ok, fraction of rows identical to top_entries): rows that differ may only swap entries tied
    (within tolerance) at the k-th value."""
    k = CFG["topk"]
    want = top_entries(score, k)
    if got.shape != want.shape:
        return False, 0.0
    same = (got == want).all(-1)
    tol = RTOL * score.abs().nan_to_num(posinf=0, neginf=0) + ATOL * mag.float()
    for s in torch.nonzero(~same).flatten().tolist():
        g, w_ = got[s], want[s]
        if (g == -1).sum() != (w_ == -1).sum():
            return False, same.float().mean().item()
        gs, ws = g[g >= 0], w_[w_ >= 0]
        kth = score[s, ws].min()
        if not (score[s, gs] >= kth - tol[s, gs]).all():
            return False, same.float().mean().item()
        if not torch.isin(ws[score[s, ws] > kth + tol[s, ws]], gs).all():
            return False, same.float().mean().item()
    return True, same.float().mean().item()


def overlap(a, b) -> float:
    """Mean fraction of selected entries shared by two [S, k] pick sets (-1 ignored)."""
    fr = []
    for x, y in zip(a, b):
        x, y = x[x >= 0], y[y >= 0]
        fr.append(torch.isin(x, y).float().mean().item() if x.numel() else 1.0)
    return sum(fr) / len(fr)


def check_case(c) -> dict:
    """Kernel vs fp32 twin on every row (in chunks), dense and (if any) pool, scores and top-k."""
    S, T, bs = c["S"], c["T"], CFG["block_size"]
    out = {"ok": True}
    dense = ix.mqa_index_scores(c["q"], c["kp"], c["ks"], c["w"], c["vis"])
    topd = ix.mqa_index_topk(c["q"], c["kp"], c["ks"], c["w"], c["vis"], CFG["topk"])
    pool = topp = None
    if c["blocks"] is not None:
        pool = ix.mqa_index_scores_pool(c["q"], c["kp"], c["ks"], c["w"], c["vis"], c["blocks"], bs)
        topp = ix.mqa_index_topk(c["q"], c["kp"], c["ks"], c["w"], c["vis"], CFG["topk"], c["blocks"], bs)
        ent = ix.pool_entry_ids(c["blocks"], bs)
    chunk = max(1, min(S, int(2**29 // (T * CFG["H"] * 4 + 1))))
    errs = {"dense": 0.0, "pool": 0.0}
    exact = {"dense": [], "pool": []}
    for r0 in range(0, S, chunk):
        rows = slice(r0, min(S, r0 + chunk))
        score, mag = twin_rows(c, rows)
        ok, e = score_err(dense[rows], score, mag)
        out["ok"] &= ok
        errs["dense"] = max(errs["dense"], e)
        ok, fr = topk_ok(topd[rows], score, mag)
        out["ok"] &= ok
        exact["dense"].append(fr)
        if pool is not None:
            er = ent[rows]
            valid = (er >= 0) & (er < T)
            idx = torch.where(valid, er, 0)
            ok, e = score_err(pool[rows], torch.where(valid, score.gather(1, idx), float("-inf")), mag.gather(1, idx))
            out["ok"] &= ok
            errs["pool"] = max(errs["pool"], e)
            pscore = score.masked_fill(~c["mask"][rows], float("-inf"))
            ok, fr = topk_ok(topp[rows], pscore, mag)
            out["ok"] &= ok
            exact["pool"].append(fr)
        del score, mag
    out["dense_err_over_bound"] = errs["dense"]
    out["dense_topk_rows_exact"] = statistics.mean(exact["dense"])
    naive = naive_topk(c)
    out["naive_bf16_overlap_dense"] = overlap(naive, topd) if c["blocks"] is None else overlap(naive, topp)
    if pool is not None:
        out["pool_err_over_bound"] = errs["pool"]
        out["pool_topk_rows_exact"] = statistics.mean(exact["pool"])
    return out


# ------------------------------------------------------------------------------------------------
# bytes and flops


def bytes_dense(c) -> int:
    S, H, d, T = c["S"], CFG["H"], CFG["d"], c["T"]
    seen = min(T, int(c["vis"].max().item()))
    return seen * (d // 2 + d // 32) + S * T * 4 + S * H * (d * c["q"].element_size() + 4) + S * 4


def bytes_pool(c) -> int:
    S, H, d, T, bs = c["S"], CFG["H"], CFG["d"], c["T"], CFG["block_size"]
    ent = ix.pool_entry_ids(c["blocks"], bs)
    read = int(((ent >= 0) & (ent < T) & (ent < c["vis"].view(-1, 1))).sum().item())
    E = ent.shape[1]
    return read * (d // 2 + d // 32) + S * E * 4 + c["blocks"].numel() * 4 + S * H * (d * 2 + 4) + S * 4


def flops_dense(c) -> float:
    return 2.0 * CFG["H"] * CFG["d"] * float(torch.minimum(c["vis"], torch.tensor(c["T"], device=DEV)).sum())


def flops_pool(c) -> float:
    ent = ix.pool_entry_ids(c["blocks"], CFG["block_size"])
    n = float(((ent >= 0) & (ent < c["T"]) & (ent < c["vis"].view(-1, 1))).sum())
    return 2.0 * CFG["H"] * CFG["d"] * n


# ------------------------------------------------------------------------------------------------
# the run


def row(part, ctx, c, variant, us, nbytes=None, flops=None, check="", **extra):
    r = dict(part=part, context=ctx, T=c["T"], S=c["S"], variant=variant, us=us, check=check, **extra)
    if nbytes is not None and us:
        r["bytes"] = nbytes
        r["GBps"] = nbytes / (us * 1e-6) / 1e9
        r["pct_4p3TBps"] = 100 * nbytes / (us * 1e-6) / HBM_BPS
    if flops is not None and us:
        r["TFLOPs"] = flops / (us * 1e-6) / 1e12
    return r


def sweep_configs(S: int):
    if ARGS.smoke:
        return [{"mode": "scaled", "block_t": 64, "block_s": 1 if S == 1 else 4, "num_warps": 4}]
    if S == 1:
        tiles = [(64, 1, 4), (128, 1, 4), (128, 1, 8), (256, 1, 8)]
    else:
        tiles = [(64, 4, 4), (128, 4, 8), (64, 2, 4)]
    out = [{"mode": m, "block_t": t, "block_s": b, "num_warps": nw} for m in ("scaled", "bf16") for (t, b, nw) in tiles]
    # one wave of programs / many ungrouped programs (the default is 4 waves, key tiles grouped)
    out += [{"mode": "scaled", "block_t": 64, "block_s": 1 if S == 1 else 4, "num_warps": 4, "programs": p}
            for p in (132, 64 * 132)]
    if S > 1:  # a program a query tile over every key tile it sees, or key tiles first (the launch's choice by S)
        out += [{"mode": "scaled", "block_t": t, "block_s": b, "num_warps": nw, "queries_stationary": qs}
                for qs in (False, True) for (t, b, nw) in [(64, 4, 4), (64, 2, 4), (128, 4, 8)]]
    return out


def sweep_pool_configs():
    if ARGS.smoke:
        return [{"mode": "scaled", "block_t": 64, "num_warps": 4}]
    return [{"mode": m, "block_t": t, "num_warps": nw} for m in ("scaled", "bf16") for (t, nw) in
            [(64, 4), (128, 4), (128, 8)]]


SWEEP_BUDGET_S = 170  # stop sweeping past this much wall time (the whole run must stay under 4 minutes)
T_START = time.time()


def run_sweep(part, ctx, c, rows, failures):
    """Time tile/mode variants of the kernels; each is first checked against the default kernel's scores
    (checked against the twin before) within the same tolerance."""
    q, kp, ks, w, vis = ix._prep(c["q"], c["kp"], c["ks"], c["w"], c["vis"])
    ref = ix.mqa_index_scores(c["q"], c["kp"], c["ks"], c["w"], c["vis"])
    keys = dequantize_mxfp4(c["kp"], c["ks"])
    mag = (c["q"].double().abs() * c["w"].double().abs().unsqueeze(-1)).sum(1) @ keys.double().abs().T
    del keys
    for cfg in sweep_configs(c["S"]):
        name = "sweep dense " + " ".join(f"{k}={v}" for k, v in cfg.items())
        if time.time() - T_START > SWEEP_BUDGET_S:
            rows.append(row(part, ctx, c, name, None, check="skipped: time budget", **cfg))
            continue
        out = torch.empty_like(ref)
        try:
            fn = functools.partial(ix._launch_dense, q, kp, ks, w, vis, out, **cfg)
            fn()
            sync()
            ok, _ = score_err(out, ref, 2 * mag)
            us = time_us(fn)
            rows.append(row(part, ctx, c, name, us, bytes_dense(c), flops_dense(c), "ok" if ok else "FAIL", **cfg))
            if not ok:
                failures.append(name)
        except Exception as ex:  # noqa: BLE001 -- a config the compiler rejects is a finding, not a crash
            rows.append(row(part, ctx, c, name, None, check=f"ERROR {type(ex).__name__}: {str(ex)[:200]}", **cfg))
    if c["blocks"] is None:
        return
    bs = CFG["block_size"]
    ref = ix.mqa_index_scores_pool(c["q"], c["kp"], c["ks"], c["w"], c["vis"], c["blocks"], bs)
    blk = c["blocks"].contiguous()
    ent = ix.pool_entry_ids(blk, bs)
    mag = mag.gather(1, torch.where((ent >= 0) & (ent < c["T"]), ent, 0))
    for cfg in sweep_pool_configs():
        name = "sweep pool " + " ".join(f"{k}={v}" for k, v in cfg.items())
        if time.time() - T_START > SWEEP_BUDGET_S:
            rows.append(row(part, ctx, c, name, None, check="skipped: time budget", **cfg))
            continue
        out = torch.empty_like(ref)
        try:
            fn = functools.partial(ix._launch_pool, q, kp, ks, w, vis, blk, bs, out, **cfg)
            fn()
            sync()
            ok, _ = score_err(out, ref, 2 * mag)
            us = time_us(fn)
            rows.append(row(part, ctx, c, name, us, bytes_pool(c), flops_pool(c), "ok" if ok else "FAIL", **cfg))
            if not ok:
                failures.append(name)
        except Exception as ex:  # noqa: BLE001
            rows.append(row(part, ctx, c, name, None, check=f"ERROR {type(ex).__name__}: {str(ex)[:200]}", **cfg))


SELECT_SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)] if DEV == "cuda" else [(256, 4)]


def torch_topk(score: torch.Tensor, k: int, blocks: torch.Tensor | None = None, bs: int = 8) -> torch.Tensor:
    """The previous selection: torch.topk over the scores (pool layout or entries), then the pool -> entry
    mapping, -1 for -inf picks, sort (ties by torch.topk's order: equal to the kernel as index sets only)."""
    T = score.shape[-1]
    top = score.topk(min(k, T), dim=-1)
    ids = top.indices if blocks is None else ix.pool_positions_to_entries(top.indices, blocks, bs)
    return torch.where(top.values > float("-inf"), ids, -1).sort(dim=-1).values


def time_case(part: str, ctx: int, c: dict, mark: str, rows: list) -> None:
    """The naive path, the dense and pool kernels, with and without top-k, and the decode graphs.
    "+topk(kernel)" is mqa_index_topk (scores, then dsv4::topk_select[_pool]); "+topk(torch)" the scores
    followed by torch.topk + mapping + sort; "select(...)" the selection alone on precomputed scores (dense: also
    the reference's stable sort, the exact torch route)."""
    bs, k = CFG["block_size"], CFG["topk"]
    a = (c["q"], c["kp"], c["ks"], c["w"], c["vis"])
    blk = c["blocks"]
    decode = c["S"] == 1
    rows.append(row(part, ctx, c, "naive", time_us(lambda: naive_topk(c)), check="ref"))
    rows.append(row(part, ctx, c, "dense", time_us(lambda: ix.mqa_index_scores(*a)), bytes_dense(c), flops_dense(c),
                    mark))
    dense_torch = lambda: torch_topk(ix.mqa_index_scores(*a), k)
    dense_kernel = lambda: ix.mqa_index_topk(*a, k)
    rows.append(row(part, ctx, c, "dense+topk(torch)", time_us(dense_torch), check=mark))
    rows.append(row(part, ctx, c, "dense+topk(kernel)", time_us(dense_kernel), check=mark))
    if decode and blk is None:
        rows.append(row(part, ctx, c, "dense+topk(torch)+graph", graph_us(dense_torch), check=mark))
        rows.append(row(part, ctx, c, "dense+topk(kernel)+graph", graph_us(dense_kernel), check=mark))
    if blk is None:  # the selection alone, the exact routes beside torch.topk's
        score = ix.mqa_index_scores(*a)
        want = tk.topk_select(score, k)
        rows.append(row(part, ctx, c, "select(torch)", time_us(lambda: torch_topk(score, k)), check=mark))
        rows.append(row(part, ctx, c, "select(kernel)", time_us(lambda: tk.topk_select(score, k)), check=mark))
        same = torch.equal(top_entries(score, k), want)
        rows.append(row(part, ctx, c, "select(stable sort)", time_us(lambda: top_entries(score, k)),
                        check="ok" if same else "FAIL"))
    if blk is not None:
        rows.append(row(part, ctx, c, "pool", time_us(lambda: ix.mqa_index_scores_pool(*a, blk, bs)), bytes_pool(c),
                        flops_pool(c), mark))
        pool_torch = lambda: torch_topk(ix.mqa_index_scores_pool(*a, blk, bs), k, blk, bs)
        pool_kernel = lambda: ix.mqa_index_topk(*a, k, blk, bs)
        rows.append(row(part, ctx, c, "pool+topk(torch)", time_us(pool_torch), check=mark))
        rows.append(row(part, ctx, c, "pool+topk(kernel)", time_us(pool_kernel), check=mark))
        if decode:
            rows.append(row(part, ctx, c, "pool+topk(torch)+graph", graph_us(pool_torch), check=mark))
            rows.append(row(part, ctx, c, "pool+topk(kernel)+graph", graph_us(pool_kernel), check=mark))
            score = ix.mqa_index_scores_pool(*a, blk, bs)
            rows.append(row(part, ctx, c, "select(torch)", time_us(lambda: torch_topk(score, k, blk, bs)),
                            check=mark))
            rows.append(row(part, ctx, c, "select(kernel)", time_us(lambda: tk.topk_select_pool(score, blk, bs, k)),
                            check=mark))
            want = tk.topk_select_pool(score, blk, bs, k)
            for block, warps in SELECT_SWEEP:  # chunk size and warps of the select kernel
                sel = functools.partial(tk._launch, score, min(k, score.shape[1]), False, blk, bs, block=block,
                                        num_warps=warps)  # one pass over each row, `block` columns a step
                try:
                    same = torch.equal(sel(), want)
                    rows.append(row(part, ctx, c, f"select(kernel) block={block} warps={warps}", time_us(sel),
                                    check="ok" if same else "FAIL", block=block, num_warps=warps))
                except Exception as ex:  # noqa: BLE001
                    rows.append(row(part, ctx, c, f"select(kernel) block={block} warps={warps}", None,
                                    check=f"ERROR {type(ex).__name__}: {str(ex)[:200]}"))


def main():
    t_start = T_START
    info = {
        "command": " ".join([sys.executable] + sys.argv),
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": getattr(ix.triton, "__version__", None),
        "config": CFG,
        "bf16_mode": ix.BF16_MODE,
    }
    rate = copy_rate()
    info["copy_rate_Bps"] = rate
    rows, checks, failures = [], [], []
    for part, ratio, pooled in (("decoder", 1, True), ("encoder", 2, False)):
        for ctx in CFG["contexts"]:
            T = ctx // ratio
            for S in (1, CFG["prefill"]):
                c = make_case(T, S, pooled, seed=ctx + S + ratio)
                try:
                    chk = check_case(c)
                    chk.update(part=part, context=ctx, T=T, S=S)
                    checks.append(chk)
                    mark = "ok" if chk["ok"] else "FAIL"
                    if not chk["ok"]:
                        failures.append(f"{part} ctx={ctx} S={S}")
                    time_case(part, ctx, c, mark, rows)
                    if not ARGS.no_sweep and ctx == max(CFG["contexts"]) and part == "decoder":
                        run_sweep(part, ctx, c, rows, failures)
                except Exception as ex:  # noqa: BLE001 -- report it and go on to the other sizes
                    msg = f"ERROR {type(ex).__name__}: {str(ex)[:300]}"
                    rows.append(row(part, ctx, c, "case", None, check=msg))
                    failures.append(f"{part} ctx={ctx} S={S}: {msg}")
                del c
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    info["bf16_mode_after"] = ix.BF16_MODE  # differs from bf16_mode if dot_scaled failed to compile
    info["peak_gpu_bytes"] = torch.cuda.max_memory_allocated() if DEV == "cuda" else None
    info["seconds"] = time.time() - t_start
    info["failures"] = failures

    result = {"info": info, "checks": checks, "rows": rows}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "indexer-smoke" if ARGS.smoke else "indexer"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    plot(rows, out_dir / f"{stem}.png")

    # the table, last
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  commit {info['git_commit']}")
    if rate:
        print(f"device copy rate measured here: {rate / 1e12:.2f} TB/s (read+write); reference 4.3 TB/s")
    print(f"peak GPU memory {(info['peak_gpu_bytes'] or 0) / 1e9:.1f} GB; {info['seconds']:.0f} s; "
          f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} sizes ok")
    for c in checks:
        line = (f"  check {c['part']:7s} ctx={c['context']:>7d} S={c['S']:>3d}: {'ok' if c['ok'] else 'FAIL'}"
                f"  dense err/bound {c['dense_err_over_bound']:.2g} top-k rows exact {c['dense_topk_rows_exact']:.3f}")
        if "pool_err_over_bound" in c:
            line += f"  pool err/bound {c['pool_err_over_bound']:.2g} rows exact {c['pool_topk_rows_exact']:.3f}"
        line += f"  naive-bf16 overlap {c['naive_bf16_overlap_dense']:.3f}"
        print(line)
    hdr = f"{'part':7s} {'ctx':>7s} {'T':>7s} {'S':>3s} {'variant':58s} {'us':>9s} {'GB/s':>7s} {'%4.3T':>6s} {'TF/s':>6s} check"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        us = f"{r['us']:9.1f}" if r["us"] is not None else f"{'-':>9s}"
        gb = f"{r['GBps']:7.0f}" if "GBps" in r else f"{'':7s}"
        pct = f"{r['pct_4p3TBps']:6.1f}" if "pct_4p3TBps" in r else f"{'':6s}"
        tf = f"{r['TFLOPs']:6.1f}" if "TFLOPs" in r else f"{'':6s}"
        print(f"{r['part']:7s} {r['context']:7d} {r['T']:7d} {r['S']:3d} {r['variant'][:58]:58s} {us} {gb} {pct} {tf} "
              f"{r['check'][:60]}")
    print(f"JSON: {out_dir / (stem + '.json')}")
    if failures:
        print("FAILURES: " + "; ".join(failures))
    if info["peak_gpu_bytes"] and info["peak_gpu_bytes"] > MAX_GPU_BYTES:
        print(f"WARNING: peak GPU memory {info['peak_gpu_bytes'] / 1e9:.1f} GB is over the 40 GB budget")
    return 1 if failures else 0


def plot(rows, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    panels = [("decoder", 1), ("decoder", CFG["prefill"]), ("encoder", 1), ("encoder", CFG["prefill"])]
    for ax, (part, S) in zip(axes, panels):
        for variant in ("naive", "dense", "dense+topk(torch)", "dense+topk(kernel)", "pool", "pool+topk(torch)",
                        "pool+topk(kernel)", "dense+topk(torch)+graph", "dense+topk(kernel)+graph",
                        "pool+topk(torch)+graph", "pool+topk(kernel)+graph"):
            pts = [(r["context"], r["us"]) for r in rows
                   if r["part"] == part and r["S"] == S and r["variant"] == variant and r["us"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("us per call")
        ax.set_title(f"{part}, S={S}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
