"""Routed MXFP4 experts + shared expert (dsv4::moe_mxfp4_with_shared) against a naive torch MoE, V4.1 shapes.

    python bench/moe_experts.py          # H200: correctness on CUDA, then timings; < 3 minutes, ~8 GB
    python bench/moe_experts.py --smoke  # tiny sizes on the CPU under the Triton interpreter

V4.1: E = 384 experts, top-6, D = 5120, I = 2304, swiglu limit 10, one shared expert (dense bf16, its values FP8
in 32 x 32 blocks);
N = 1, 8, 16, 64, 256 tokens. Weights random (uint8 codes, e8m0 scales 2^-9 .. 2^-5), one layer's worth.
- naive:   for each selected expert: dequantize its w1/w3/w2 (dsv4.quant) to bf16, bf16 matmuls, SwiGLU,
           index_add in fp32; plus the shared expert (what a straightforward implementation does; host syncs).
- gather (N <= 256), gather_tc (N <= 16: every program scans the batch's ids), grouped: the kernel's paths (forced).
- slots (N <= GATHER_MAX_N): dsv4::moe_gather_slots, the gather kernels as the batch-1 decode step calls them (the
           activation planes made, and the slots summed, by the step's compiled code: not timed here); slots_fp8
           (N = 1) the same with the shared expert's FP8 rows, as the fast model passes them at one token (its
           bytes: the FP8 codes and a scale a row and 32 in place of the bf16 copy).
Bytes: the expert weights the call must touch at least: each distinct selected expert's w13 + w2 at 4.25
bits/weight (e2m1 + one e8m0 per 32) and the shared expert's bf16 weights (3 * I * D * 2 bytes); GB/s is
those bytes over the time, and `roofline` their fraction of 4.3 TB/s (the batch-1 memory ceiling).
Timing: CUDA events; each sample runs the calls on R rotating id/x sets (different experts each: cold
weights), reported per call; median of --reps samples after warmup. "graph": the calls captured in one CUDA
graph and replayed (how decode runs); "eager": plain Python calls (naive: eager only).
JSON goes to $OUT/moe_experts.json if OUT is set, else bench/results/moe_experts.json (moe_experts-smoke.json
with --smoke). The table is printed last.
"""

from __future__ import annotations

import itertools
import statistics
import time

import common


def add_arguments(p):
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="token counts N")
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")
    p.add_argument("--sets", type=int, default=8, help="rotating id/x sets per sample")


ARGS = common.parse_args(__doc__, add_arguments)

import torch
import torch.nn.functional as F
import triton

from dsv4.fast.kernels import moe_experts as M
from dsv4.quant import dequantize_fp8, dequantize_mxfp4, quantize_fp8

PEAK_BPS = 4.3e12
LIMIT = 10.0
SHARED_BLOCK = (32, 32)


def time_calls(fns, reps: int, graph: bool, device: str) -> float:
    """common.time_calls with this bench's two warm-up runs."""
    return common.time_calls(fns, reps, graph=graph, cuda=device == "cuda", warmup=2)


# ------------------------------------------------------------------------------------------------ cases


def make_weights(E, D, I, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    u8 = {"generator": g, "device": device, "dtype": torch.uint8}
    W = {
        "w13": torch.randint(0, 256, (E, 2 * I, D // 2), **u8),
        "s13": torch.randint(118, 123, (E, 2 * I, D // 32), **u8),
        "w2": torch.randint(0, 256, (E, D, I // 2), **u8),
        "s2": torch.randint(118, 123, (E, D, I // 32), **u8),
    }
    # the shared expert as V4.1 stores it (FP8 in 32 x 32 blocks) and its exact bf16 copy, as the fast model holds both
    for name, rows, cols in (("sh13", 2 * I, D), ("sh2", D, I)):
        q, e = quantize_fp8(torch.randn(rows, cols, generator=g, device=device) / cols**0.5, SHARED_BLOCK)
        W[name] = dequantize_fp8(q, e, SHARED_BLOCK).bfloat16()
        W[name + "_rows"] = M.fp8_rows(q, e, SHARED_BLOCK)
    return W


def make_set(N, E, D, k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, D, generator=g, device=device).bfloat16()
    ids = torch.rand(N, E, generator=g, device=device).topk(k, dim=-1).indices
    wts = torch.rand(N, k, generator=g, device=device)
    wts = wts / wts.sum(-1, keepdim=True) * 1.5
    return {"x": x, "ids": ids, "wts": wts, "planes": M.activation_planes(x)}


def naive(W, s, limit=LIMIT):
    """The straightforward implementation: per selected expert, dequantize to bf16, bf16 matmuls."""
    x, ids, wts = s["x"], s["ids"], s["wts"]
    I = W["w2"].shape[-1] * 2
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def expert(xs, w13, w2, rw):
        gu = F.linear(xs, w13).float()
        g, u = gu[:, :I].clamp(max=limit), gu[:, I:].clamp(-limit, limit)
        h = F.silu(g) * u
        if rw is not None:
            h = h * rw
        return F.linear(h.to(xs.dtype), w2).float()

    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        w13 = dequantize_mxfp4(W["w13"][e], W["s13"][e].view(torch.float8_e8m0fnu)).bfloat16()
        w2 = dequantize_mxfp4(W["w2"][e], W["s2"][e].view(torch.float8_e8m0fnu)).bfloat16()
        y.index_add_(0, tok, expert(x[tok], w13, w2, wts[tok, slot, None]))
    return y + expert(x, W["sh13"], W["sh2"], None)


PATHS = ("gather", "gather_tc", "grouped")


def applies(path: str, N: int) -> bool:
    """gather_tc scans every token-slot in each program (decode sizes); the gather path reads each token's experts
    on its own, seconds a call at prefill sizes."""
    return N <= {"gather_tc": 16, "gather": 256}.get(path, N)


def kernel(W, s, path):
    return M.moe_mxfp4_with_shared(s["x"], s["ids"], s["wts"], W["w13"], W["s13"], W["w2"], W["s2"],
                                   W["sh13"], W["sh2"], LIMIT, path)


def slots(W, s, fp8: bool = False):
    """The batch-1 decode step's call: the slots' outputs of moe_gather_slots on the set's activation planes;
    `fp8`: with the shared expert's FP8 rows, as the step passes them at one token."""
    stored = (*W["sh13_rows"], *W["sh2_rows"]) if fp8 else ()
    return M.moe_gather_slots(s["x"], s["planes"], s["ids"], s["wts"], W["w13"], W["s13"], W["w2"], W["s2"],
                              W["sh13"], W["sh2"], LIMIT, *stored)


# the tile sweeps (graph mode, for tuning): the configs each path is timed at, keyed by their values
# the last four are untimed since session 40's 16-byte copies (a thread holds a scale group's four words): 32 up or
# down rows (the down loop at 32 rows: 34 sm_90 instructions a word against 38.5 at 16, 158 registers at 2 warps),
# and the default tiles one pipeline stage deeper or in 4 warps (the one-token default is 2)
GATHER_SWEEP = [{"BI": BI, "BD": BD, "BK": BK}
                for BI, BD, BK in [(4, 16, 512), (8, 8, 256), (4, 4, 512), (16, 16, 256), (8, 16, 256), (32, 16, 256),
                                   (16, 32, 256)]]
GATHER_SWEEP += [{"BI": 16, "BD": 16, "BK": 256, "gather_stages": 3}, {"BI": 16, "BD": 16, "BK": 256, "gather_warps": 4}]
# more bytes in flight a program (session 41): at one token the up grid is 7 x 144 programs, under one wave, so only a
# deeper pipeline or a longer K step puts more of the expert bytes in flight (all compile without spills, Triton 3.6)
GATHER_SWEEP += [{"BI": 16, "BD": 16, "BK": 256, "gather_stages": 4}, {"BI": 16, "BD": 16, "BK": 512}]
# the one-token default since session 42 is 512-wide K steps in both kernels; at 512 the down loop waits on 4 of its
# loads a step (sm_90 SASS, Triton 3.6 and 3.8), at 256 on none: 512 up with 256 down, and 512 three stages deep
GATHER_SWEEP += [{"BI": 16, "BD": 16, "BK": 512, "BKD": 256}, {"BI": 16, "BD": 16, "BK": 512, "gather_stages": 3}]
# gather_tc: 4 warps ran 1.7x slower than 2 at 8 tokens (session 30); the spills 2 warps seemed to have then were an
# open-int compile's: as launched (V4.1 widths) 2 / 4 warps take 150 / 138 registers, none spilled
GATHER_TC_SWEEP = [{"BM": BM, "BN": BN, "BKG": BKG, "warps": w}
                   for BM, BN, BKG, w in [(16, 32, 128, 2), (16, 32, 128, 4), (16, 64, 64, 4)]]
# 64 x 64 tiles (a prefill chunk's, grouped_block_m at 8K tokens): 8 warps ran 3.3x slower than 4 at 8192 tokens
# (session 30); as launched 4 warps spill nothing (bench/registers.py, the spills once seen were an open-int compile's)
GROUPED_SWEEP = [{"BM": BM, "BN": BN, "BKG": BKG, "warps": w}
                 for BM, BN, BKG, w in [(16, 64, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 64, 64, 8),
                                        (64, 128, 64, 8), (16, 128, 128, 4)]]
# the down kernel's own output tile (the default, 128, twice the up tile: one accumulator to the up kernel's two, so
# each activation tile it loads serves twice the MMAs; the entries above take it) against the up kernel's and less
GROUPED_SWEEP += [{"BM": 64, "BN": 64, "BND": 64, "BKG": 64, "warps": 4}, {"BM": 64, "BN": 64, "BND": 32, "BKG": 64,
                                                                            "warps": 4}]
KEY_NAMES = {"BKG": "BK", "warps": "w", "gather_stages": "st", "gather_warps": "w"}


def tile_sweep(W, sets, path: str, configs: list[dict], reps: int, device: str) -> dict[str, float]:
    """Microseconds per call of `path` at each config (a CUDA graph over the sets), keyed like BI16_BD16_BK256; the
    gather path at one token as the batch-1 decode step runs it (the slots from the planes, the shared expert's FP8
    rows)."""
    times = {}
    for cfg in configs:
        if path == "gather" and sets[0]["x"].shape[0] == 1:
            calls = [lambda s=s, c=cfg: M._gather(s["x"], s["planes"], s["ids"], s["wts"], W["w13"], W["s13"],
                                                  W["w2"], W["s2"], W["sh13"], W["sh2"], LIMIT, True,
                                                  {**M._cfg(s["x"], 1, "gather"), **c},
                                                  (*W["sh13_rows"], *W["sh2_rows"])) for s in sets]
        else:
            calls = [lambda s=s, c=cfg: M.moe_triton(s["x"], s["ids"], s["wts"], W["w13"], W["s13"], W["w2"],
                                                     W["s2"], LIMIT, W["sh13"], W["sh2"], path, c) for s in sets]
        name = "_".join(f"{KEY_NAMES.get(k, k)}{v}" for k, v in cfg.items())
        try:
            times[name] = time_calls(calls, reps, True, device)
        except triton.runtime.errors.OutOfResources as e:  # a tile the card cannot hold: the sweep goes on
            times[name] = None
            print(f"{name}: {str(e).splitlines()[0]}", flush=True)
        else:
            print(f"{name}: {times[name]:.1f} us", flush=True)
    return times


def check(W, s) -> dict:
    ref = M.moe_experts_twin(s["x"], s["ids"], s["wts"], W["w13"], W["s13"], W["w2"], W["s2"], LIMIT,
                             W["sh13"], W["sh2"])
    scale = ref.abs().max().clamp(min=1e-30)
    out = {}
    ok = True
    paths = [p for p in PATHS if applies(p, s["x"].shape[0])]
    runs = [(p, kernel(W, s, p)) for p in paths]
    if s["x"].shape[0] <= M.GATHER_MAX_N:
        runs.append(("slots", slots(W, s).sum(dim=1)))
    if s["x"].shape[0] == 1:
        runs.append(("slots_fp8", slots(W, s, fp8=True).sum(dim=1)))
    for name, y in runs + [("naive", naive(W, s))]:
        err = (y - ref).abs() / scale
        out[f"{name}_max_rel"] = err.max().item()
        out[f"{name}_median_rel"] = err.median().item()
        if name != "naive":  # naive's shared expert is a bf16 GEMM (different rounding): informational
            ok = ok and out[f"{name}_max_rel"] <= 2**-7 and out[f"{name}_median_rel"] <= 1e-4
    out["ok"] = ok
    return out


def main():
    device = common.bench_device(ARGS.smoke)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    E, D, I, k = (8, 64, 64, 2) if ARGS.smoke else (384, 5120, 2304, 6)
    sizes = ARGS.sizes or ([1, 4] if ARGS.smoke else [1, 8, 16, 64, 256])
    reps = 2 if ARGS.smoke else ARGS.reps
    nsets = 2 if ARGS.smoke else ARGS.sets
    t_start = time.time()

    W = make_weights(E, D, I, device)
    expert_bytes = 3 * I * D * 4.25 / 8
    shared_bytes = 3 * I * D * 2
    fp8_shared_bytes = 3 * I * D * (1 + 1 / 32)  # e4m3 codes, a scale a row and 32 (`fp8_rows`)
    results, checks = [], {}
    for N in sizes:
        sets = [make_set(N, E, D, k, device, 7919 * N + i) for i in range(nsets)]
        checks[N] = check(W, sets[0])
        uniq = statistics.mean(s["ids"].unique().numel() for s in sets)
        nbytes = uniq * expert_bytes + shared_bytes
        row = {"N": N, "E": E, "D": D, "I": I, "topk": k, "rotating_sets": nsets, "distinct_experts": uniq,
               "weight_bytes": nbytes, "routed_weight_bytes": uniq * expert_bytes, "shared_weight_bytes": shared_bytes}
        naive_sets = sets[: max(1, min(nsets, 2 if N >= 64 else nsets))]
        row["eager_naive_us"] = time_calls([lambda s=s: naive(W, s) for s in naive_sets],
                                           max(3, reps // 5) if N >= 64 else reps, False, device)
        for path in [p for p in PATHS if applies(p, N)]:
            calls = [lambda s=s, p=path: kernel(W, s, p) for s in sets]
            for mode in common.modes(device):
                t = time_calls(calls, reps, mode == "graph", device)
                row[f"{mode}_{path}_us"] = t
                row[f"{mode}_{path}_GBps"] = nbytes / t / 1e3
                row[f"{mode}_{path}_roofline"] = nbytes / t / 1e-6 / PEAK_BPS
                row[f"{mode}_{path}_speedup_vs_naive"] = row["eager_naive_us"] / t
        variants = [("slots", False, nbytes)] if N <= M.GATHER_MAX_N else []
        variants += [("slots_fp8", True, nbytes - shared_bytes + fp8_shared_bytes)] if N == 1 else []
        for (name, fp8, touched), mode in itertools.product(variants, common.modes(device)):
            t = time_calls([lambda s=s, f=fp8: slots(W, s, f) for s in sets], reps, mode == "graph", device)
            row[f"{mode}_{name}_us"] = t
            row[f"{mode}_{name}_GBps"] = touched / t / 1e3
            row[f"{mode}_{name}_roofline"] = touched / t / 1e-6 / PEAK_BPS
        if device == "cuda" and N <= 16:
            row["gather_sweep"] = tile_sweep(W, sets, "gather", GATHER_SWEEP, reps, device)
        if device == "cuda" and 2 < N <= 16:
            row["gather_tc_sweep"] = tile_sweep(W, sets, "gather_tc", GATHER_TC_SWEEP, reps, device)
        if device == "cuda" and N >= 64:
            row["grouped_sweep"] = tile_sweep(W, sets, "grouped", GROUPED_SWEEP, reps, device)
        results.append(row)
        print(f"N={N}: " + ", ".join(f"{kk}={v:.4g}" if isinstance(v, float) else f"{kk}={v}"
                                     for kk, v in row.items() if kk.endswith(("_us", "roofline", "sweep"))),
              flush=True)

    shape = {"E": E, "D": D, "I": I, "topk": k, "limit": LIMIT, "shared": "dense bf16 (slots_fp8: FP8 rows)",
             "shared_block": list(SHARED_BLOCK), "expert_bits_per_weight": 4.25}
    meta, path = common.write_timed_result("moe_experts", device, ARGS.smoke, t_start, reps, checks, results,
                                           shape=shape, peak_bytes_per_s=PEAK_BPS)

    common.print_summary(meta["gpu"], checks, path, meta["wall_s"])
    mode = common.modes(device)[0]
    print(f"\ntimes: {mode} (naive: eager); MB: weight bytes the call must touch; roof: fraction of "
          f"{PEAK_BPS / 1e12} TB/s")
    common.print_table([("N", "N", "d"), ("experts", "distinct_experts", ".1f"),
                        ("MB", lambda r: r["weight_bytes"] / 1e6, ".1f"), ("naive us", "eager_naive_us", ".1f"),
                        ("gather us", f"{mode}_gather_us", ".1f"), ("GB/s", f"{mode}_gather_GBps", ".0f"),
                        ("roof", f"{mode}_gather_roofline", ".2f"), ("slots us", f"{mode}_slots_us", ".1f"),
                        ("roof", f"{mode}_slots_roofline", ".2f"), ("fp8 shared us", f"{mode}_slots_fp8_us", ".1f"),
                        ("tc us", f"{mode}_gather_tc_us", ".1f"),
                        ("roof", f"{mode}_gather_tc_roofline", ".2f"), ("grouped us", f"{mode}_grouped_us", ".1f"),
                        ("GB/s", f"{mode}_grouped_GBps", ".0f"), ("roof", f"{mode}_grouped_roofline", ".2f")],
                       results)


if __name__ == "__main__":
    main()
