"""The radix top-k select (dsv4::topk_select, dsv4::topk_select_pool) against its torch twins, at the row lengths
the indexer selects over in decode and prefill.

    python bench/topk.py          # H200: exactness on CUDA, then timings; ~1 minute
    python bench/topk.py --smoke  # short rows on the CPU under the Triton interpreter

Cases (k = 512): dense rows of T columns (`top_entries`: a stable sort), S = 1 and 4 rows (decode: one or a few
sequences) and S = 64 (a prefill chunk's queries); pool rows of T columns in 8-entry blocks of a 4x larger cache
(`twin_topk_select_pool`). Rows longer than RESIDENT_MAX go through stages (`first_stage_chunk`). Scores are
Gaussian, a tenth of the later two thirds -inf (unreachable entries), so ties and -1s occur as in the indexer.
Timing: CUDA events, the median of --reps samples of R calls on R rotating score sets, per call; "graph": the calls
replayed from a CUDA graph, as decode runs them. Bytes: the scores read once (and the block table), the ids
written once. Exactness: the kernel's ids equal the twin's in every row. JSON to $OUT/topk.json if OUT is set, else
bench/results/topk.json (topk-smoke.json with --smoke). The table is printed last.
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4.fast.kernels import topk as tk
from dsv4.reference.indexer import top_entries

K, POOL_BLOCK = 512, 8
CASES = [("dense", 1, 2048), ("dense", 1, 16384), ("dense", 4, 16384), ("dense", 1, 65536), ("dense", 1, 262144),
         ("dense", 64, 16384), ("pool", 1, 16384), ("pool", 4, 16384), ("pool", 1, 65536)]
SMOKE_CASES = [("dense", 1, 300), ("dense", 3, 700), ("pool", 2, 320)]


def make_set(kind: str, S: int, T: int, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(S, T, generator=g, device=device)
    cut = T // 3
    gone = torch.rand(S, T - cut, generator=g, device=device) < 0.1
    x[:, cut:] = x[:, cut:].masked_fill(gone, float("-inf"))
    s = {"scores": x}
    if kind == "pool":
        nb = T // POOL_BLOCK
        s["blocks"] = torch.stack([torch.randperm(4 * nb, generator=g, device=device)[:nb] for _ in range(S)]).int()
    return s


def select(kind: str, k: int, fast: bool):
    if kind == "pool":
        f = tk.topk_select_pool if fast else tk.twin_topk_select_pool
        return lambda s: f(s["scores"], s["blocks"], POOL_BLOCK, k)
    f = tk.topk_select if fast else top_entries
    return lambda s: f(s["scores"], k)


def main():
    device = common.bench_device(ARGS.smoke)
    cases, k = (SMOKE_CASES, 16) if ARGS.smoke else (CASES, K)
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()
    results, checks = [], {}
    for kind, S, T in cases:
        name = f"{kind} {S}x{T}"
        nbytes = S * T * 4 + S * min(k, T) * 8 + (S * (T // POOL_BLOCK) * 4 if kind == "pool" else 0)
        nsets = 2 if ARGS.smoke else max(2, min(32, -(-64 * 2**20 // nbytes)))
        sets = [make_set(kind, S, T, device, 7919 * T + 31 * S + i) for i in range(nsets)]
        got, want = select(kind, k, True)(sets[0]), select(kind, k, False)(sets[0])
        checks[name] = {"ok": bool(torch.equal(got.cpu(), want.cpu())),
                        "stages": tk.first_stage_chunk(T, min(k, T), POOL_BLOCK if kind == "pool" else 1,
                                                       S if kind == "dense" else None) is not None}

        def calls(fast, kind=kind, sets=sets):
            f = select(kind, k, fast)
            return [lambda s=s: f(s) for s in sets]

        row = {"case": name, "N": T, "rows": S, "k": k, "rotating_sets": nsets, "bytes": nbytes}
        common.time_fused_vs_baseline(row, calls, reps, device, "torch", nbytes)
        results.append(row)

    meta, path = common.write_timed_result("topk", device, ARGS.smoke, t_start, reps, checks, results)
    common.print_summary(meta["gpu"], checks, path, meta["wall_s"], key="")
    common.print_fused_vs_baseline(results, device, "torch")
    common.exit_if_failed(checks)


if __name__ == "__main__":
    main()
