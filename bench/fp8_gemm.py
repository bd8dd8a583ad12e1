"""Block-scaled FP8 GEMM (dsv4::fp8_block_gemm, fp8_linear) against torch baselines, DeepSeek-V4/V4.1 shapes.

    python bench/fp8_gemm.py          # H200: correctness against the twin, a config sweep, timings; < 3 min
    python bench/fp8_gemm.py --smoke  # tiny sizes on the CPU under the Triton interpreter

Shapes (N x K, weight blocks): V4.1 wq_a 1280x5120, wq_b 32768x1280, wkv 512x5120, wo_b 5120x8192, shared-expert
w1 2304x5120 with 32x32 blocks; V4 1024x4096 with 128x128 blocks; activation rows M in {1, 16, 128, 512, 2048}.
Variants, bf16 activations and output:
- naive:      dequantize the FP8 weight to bf16 on every call, then a bf16 matmul
- bf16:       the weight pre-dequantized to bf16, one bf16 matmul (the bf16 roofline: 2 bytes per weight)
- scaled_mm:  torch._scaled_mm on the same e4m3 bytes with a row-wise (else per-tensor) scale; informational only,
              its numerics differ (no per-block scales)
- gemm:       dsv4::fp8_block_gemm on pre-quantized activations (1 byte per weight + scales)
- linear:     fp8_linear = dsv4::fp8_quant of the bf16 activations + dsv4::fp8_block_gemm
Each case is first checked against the twin (dequantize with dsv4.quant, fp32 matmul): |y - twin| <= 2^-10 *
sum|a||w| + 2^-8 |twin|. Timing: every call gets its own copy of the weight (enough copies to pass --rotate-mb,
far beyond L2, so the weight streams from HBM as in a model), a CUDA graph of one call per copy, replayed after
warm-up; CUDA events; the median of --reps replays, divided by the copies. GB/s counts weight + scale bytes plus
activation and output bytes; TFLOP/s = 2 M N K / t. Before the cases a sweep of kernel configs (tile, K per loop step,
split-K, stages, warps) runs on wo_b and wq_b at every M and on a few other cases, each config checked against the
twin with the same bound (in the JSON; --no-sweep skips it). The kernels of the sweep and the cases are compiled first
by --jobs worker processes into Triton's cache, so the sweep's time goes to timing.
JSON goes to $OUT/fp8_gemm.json if OUT is set, else bench/results/fp8_gemm.json (fp8_gemm-smoke.json with --smoke).
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
import time

import common


def add_arguments(p):
    p.add_argument("--ms", type=int, nargs="*", default=None, help="activation rows M")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays first")
    p.add_argument("--rotate-mb", type=float, default=256.0, help="weight copies per graph until this many MB")
    p.add_argument("--max-copies", type=int, default=64)
    p.add_argument("--no-sweep", action="store_true", help="skip the kernel config sweep")
    p.add_argument("--peak-gbs", type=float, default=4300.0, help="copy bandwidth to compare with (GB/s)")
    p.add_argument("--jobs", type=int, default=14, help="processes compiling the kernels before the timings")


ARGS = common.parse_args(__doc__, add_arguments)

import torch
import torch.nn.functional as F

from dsv4.fast.kernels import fp8_gemm as G
from dsv4.quant import dequantize_fp8, quantize_fp8

SHAPES = [  # (name, N, K, block)
    ("v41_wq_a", 1280, 5120, (32, 32)),
    ("v41_wq_b", 32768, 1280, (32, 32)),
    ("v41_wkv", 512, 5120, (32, 32)),
    ("v41_wo_b", 5120, 8192, (32, 32)),
    ("v41_shared_w1", 2304, 5120, (32, 32)),
    ("v4_1024x4096", 1024, 4096, (128, 128)),
]
SMOKE_SHAPES = [("smoke_32", 160, 256, (32, 32)), ("smoke_128", 160, 256, (128, 128))]
VARIANTS = ("naive", "bf16", "scaled_mm", "gemm", "linear")


class Problem:
    """One weight (copies of it) and one activation batch."""

    def __init__(self, name, N, K, block, M, device, copies, seed=0):
        self.name, self.N, self.K, self.block, self.M = name, N, K, tuple(block), M
        gen = torch.Generator(device=device).manual_seed(seed)
        w = torch.randn(N, K, device=device, generator=gen) * 0.02
        self.w_q, self.w_s = quantize_fp8(w, self.block)
        del w
        self.x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
        self.a_q, self.a_s = quantize_fp8(self.x, (self.block[1],))
        self.copies = copies
        self.wq_copies = [self.w_q] + [self.w_q.clone() for _ in range(copies - 1)]
        self.ws_copies = [self.w_s] + [self.w_s.clone() for _ in range(copies - 1)]
        self._bf16 = None
        self._rowwise = None

    def fp8_weight_bytes(self) -> int:
        return self.w_q.numel() + self.w_s.numel()

    def io_bytes(self, variant: str) -> int:
        """Bytes a call must move at least: weight (+scales), activations (+scales), output."""
        M, N, K = self.M, self.N, self.K
        out = 2 * M * N
        if variant == "bf16":
            return 2 * N * K + 2 * M * K + out
        if variant == "linear":
            return self.fp8_weight_bytes() + 2 * M * K + out
        return self.fp8_weight_bytes() + M * K + self.a_s.numel() + out

    def bf16_copies(self):
        if self._bf16 is None:
            self._bf16 = [dequantize_fp8(q, s, self.block).to(torch.bfloat16) for q, s in zip(self.wq_copies, self.ws_copies)]
        return self._bf16

    def call(self, variant: str, i: int = 0, config=None):
        wq, ws = self.wq_copies[i], self.ws_copies[i]
        bn, bk = self.block
        if variant == "naive":
            return F.linear(self.x, dequantize_fp8(wq, ws, self.block).to(torch.bfloat16))
        if variant == "bf16":
            return F.linear(self.x, self.bf16_copies()[i])
        if variant == "scaled_mm":
            return self.scaled_mm(wq)
        if variant == "gemm":
            if config is not None:
                return G.fp8_gemm(self.a_q, self.a_s, wq, ws, bn, bk, torch.bfloat16, config)
            return G.fp8_block_gemm(self.a_q, self.a_s, wq, ws, bn, bk, torch.bfloat16)
        if variant == "linear":
            return G.fp8_linear(self.x, wq, ws, self.block, bk)
        raise ValueError(variant)

    def scaled_mm(self, wq):
        """torch._scaled_mm on the raw e4m3 bytes: row-wise fp32 scales of 1 if supported, else per-tensor."""
        one_a = torch.ones(self.M, 1, device=wq.device)
        one_b = torch.ones(1, self.N, device=wq.device)
        if self._rowwise is None:
            try:
                torch._scaled_mm(self.a_q, wq.t(), one_a, one_b, out_dtype=torch.bfloat16)
                self._rowwise = True
            except Exception:  # noqa: BLE001 -- row-wise scales unsupported
                self._rowwise = False
        if self._rowwise:
            return torch._scaled_mm(self.a_q, wq.t(), one_a, one_b, out_dtype=torch.bfloat16)
        one = torch.ones((), device=wq.device)
        return torch._scaled_mm(self.a_q, wq.t(), one, one, out_dtype=torch.bfloat16)


def twin_and_tol(p: Problem):
    """The twin (fp64) and the bound 2^-10 sum|a||w| + 2^-8 |twin|."""
    twin = G.fp8_block_gemm_reference(p.a_q, p.a_s, p.w_q, p.w_s, *p.block, torch.float32).double()
    a = dequantize_fp8(p.a_q, p.a_s, (p.block[1],)).abs().double()
    w = dequantize_fp8(p.w_q, p.w_s, p.block).abs().double()
    return twin, 2.0**-10 * (a @ w.T) + 2.0**-8 * twin.abs() + 1e-30


def check(p: Problem) -> dict:
    """gemm and linear against the twin, within twin_and_tol's bound."""
    twin, tol = twin_and_tol(p)
    out = {}
    for variant in ("gemm", "linear"):
        y = p.call(variant).double()
        err = (y - twin).abs()
        out[variant] = {"ok": bool((err <= tol).all()), "max_err_over_tol": float((err / tol).max()),
                        "max_abs_err": float(err.max()), "max_abs_twin": float(twin.abs().max())}
    return out


def time_variant(p: Problem, variant: str, reps: int, warmup: int, config=None) -> float | None:
    """Median microseconds per call; None when the variant does not run. Eager launches if the graph fails."""
    calls = [lambda i=i: p.call(variant, i, config) for i in range(p.copies)]
    try:
        for c in calls[:2]:
            c()
    except Exception as e:  # noqa: BLE001 -- e.g. _scaled_mm not supported for this shape
        print(f"  {p.name} M={p.M} {variant}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None
    cuda = p.x.is_cuda
    try:
        return common.time_calls(calls, reps, cuda=cuda, warmup=warmup)
    except Exception as e:
        if not cuda:
            raise
        print(f"  {p.name} M={p.M} {variant}: no CUDA graph ({type(e).__name__}); timing eager launches")
        return common.time_calls(calls, reps, graph=False, cuda=cuda, warmup=warmup)


SWEEP_CASES = [(s, M) for s in ("v41_wo_b", "v41_wq_b") for M in (1, 16, 128, 512, 2048)] + [
    ("v41_wq_a", 1), ("v4_1024x4096", 1), ("v4_1024x4096", 512)]


def sweep_configs(M: int, N: int, K: int, kb: int):
    """Tiles x K per loop step x pipeline depth x split-K around the defaults. Tiles whose accumulator (plus the
    partial product) would not fit the registers are left out; the split (a run-time argument) targets a number of
    programs rather than a fixed count."""
    if M <= 16:
        tiles, stage_opts, targets = [(64, 16, 4), (128, 16, 4), (128, 16, 8)], {32: (8, 16), 128: (4, 8)}, (264, 528, 1056)
        min_steps = 2
    elif M <= 128:
        tiles, stage_opts, targets = [(128, 32, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8)], {32: (3, 5), 128: (3, 5)}, (132, 264)
        min_steps = 4
    else:
        tiles, stage_opts, targets = [(128, 128, 8), (64, 128, 4), (128, 64, 4)], {32: (3, 4), 64: (3, 4), 128: (3, 4)}, (1, 132)
        min_steps = 4
    out = []
    for (bn, bm, warps), step_k in itertools.product(tiles, stage_opts):
        if step_k < kb:
            continue
        tiles_n = -(-N // bn) * -(-M // bm)
        steps = -(-K // step_k)
        for stages, target in itertools.product(stage_opts[step_k], targets):
            split = max(1, min(-(-target // tiles_n), steps // min_steps))
            cfg = G.GemmConfig(bn=bn, bm=bm, split=split, step_k=step_k, num_warps=warps, num_stages=stages)
            if cfg not in out:
                out.append(cfg)
    return out


def _compile_one(task):
    """Worker: run one config once on a problem of the task's shape, so Triton compiles (and caches) the kernel."""
    name, N, K, block, M, cfg = task
    try:
        p = Problem(name, N, K, block, M, "cuda", 1)
        p.call("gemm", 0, cfg)
        if cfg is None:
            p.call("linear")
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 -- reported, and the config is then timed (or fails) in the main process
        return f"{name} M={M} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def precompile(tasks, jobs: int) -> None:
    """Compile every (shape, M, config) in `jobs` spawned processes; Triton's on-disk cache hands the kernels to
    this process."""
    t = time.time()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        errors = [e for e in pool.imap_unordered(_compile_one, tasks, chunksize=2) if e]
    for e in errors:
        print("  compile:", e)
    print(f"compiled {len(tasks)} (shape, M, config) tasks in {time.time() - t:.0f} s with {jobs} processes")


def main() -> int:
    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not ARGS.smoke and device == "cpu":
        print("no CUDA device: run with --smoke for the interpreter sizes")
        return 2
    shapes = SMOKE_SHAPES if ARGS.smoke else SHAPES
    ms = ARGS.ms or ([1, 8] if ARGS.smoke else [1, 16, 128, 512, 2048])
    reps = 2 if ARGS.smoke else ARGS.reps
    warmup = 0 if ARGS.smoke else ARGS.warmup
    meta = common.metadata(device)
    gpu = meta["gpu"]

    result = {
        **meta,
        "cuda": torch.version.cuda,
        "peak_gbs": ARGS.peak_gbs,
        "smoke": ARGS.smoke,
        "sweep": [],
        "cases": [],
    }
    variants = [v for v in VARIANTS if not (ARGS.smoke and v == "scaled_mm")]

    def copies_for(N, K):
        if ARGS.smoke:
            return 1
        return max(2, min(ARGS.max_copies, int(ARGS.rotate_mb * 2**20 // (2 * N * K)) + 1))

    by_name = {s[0]: s for s in SHAPES}
    sweep = not ARGS.no_sweep and not ARGS.smoke
    if device == "cuda" and ARGS.jobs > 1:
        tasks = [(*s, M, None) for s in shapes for M in ms]
        if sweep:
            for shape_name, M in SWEEP_CASES:
                name, N, K, block = by_name[shape_name]
                tasks += [(name, N, K, block, M, c) for c in sweep_configs(M, N, K, min(block[1], 128))]
        precompile(tasks, ARGS.jobs)
    if sweep:
        for shape_name, M in SWEEP_CASES:
            name, N, K, block = by_name[shape_name]
            p = Problem(name, N, K, block, M, device, copies_for(N, K))
            twin, tol = twin_and_tol(p)
            kb = min(block[1], 128)
            default = G.pick_config(M, N, K, kb, torch.device(device))
            bf16_us = time_variant(p, "bf16", max(5, reps // 4), 1)
            p._bf16 = None
            rows = []
            for cfg in [default, *sweep_configs(M, N, K, kb)]:
                y = p.call("gemm", 0, cfg).double()
                ratio = float(((y - twin).abs() / tol).max())
                us = time_variant(p, "gemm", max(5, reps // 4), 1, cfg)
                rows.append({"config": vars(cfg), "us": us, "default": cfg is default, "ok": ratio <= 1,
                             "max_err_over_tol": ratio})
            best = min((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
            print(f"sweep {name} M={M}: bf16 {bf16_us:.2f} us, default {rows[0]['us']:.2f} us, best {best['us']:.2f} us "
                  f"{best['config']}; all within the bound: {all(r['ok'] for r in rows)}")
            result["sweep"].append({"shape": name, "M": M, "bf16_us": bf16_us, "rows": rows, "best": best})
            del p, twin, tol
            torch.cuda.empty_cache()

    for name, N, K, block in shapes:
        for M in ms:
            p = Problem(name, N, K, block, M, device, copies_for(N, K))
            chk = check(p)
            case = {"shape": name, "N": N, "K": K, "block": list(block), "M": M, "copies": p.copies,
                    "fp8_weight_bytes": p.fp8_weight_bytes(), "bf16_weight_bytes": 2 * N * K, "check": chk,
                    "config": vars(G.pick_config(M, N, K, min(block[1], 128), torch.device(device))), "variants": {}}
            for v in variants:
                us = time_variant(p, v, reps, warmup)
                if us is None:
                    case["variants"][v] = None
                    continue
                gbs = p.io_bytes(v) / (us * 1e-6) / 1e9
                case["variants"][v] = {"us": us, "bytes": p.io_bytes(v), "gbs": gbs,
                                       "frac_peak": gbs / ARGS.peak_gbs, "tflops": 2 * M * N * K / (us * 1e-6) / 1e12}
            result["cases"].append(case)
            del p
            if device == "cuda":
                torch.cuda.empty_cache()

    result["wall_s"] = time.time() - t_start
    path = common.write_result("fp8_gemm", ARGS.smoke, result)

    print(f"\n{gpu}; torch {meta['torch']}, triton {meta['triton']}; us per call (GB/s, % of {ARGS.peak_gbs:.0f})")

    def cell(v):
        def get(c):
            r = c["variants"][v]
            return None if r is None else f"{r['us']:.2f} ({r['gbs']:.0f},{100 * r['frac_peak']:.0f}%)"
        return (v, get, "")

    common.print_table([("shape", "shape", ""), ("M", "M", "d"),
                        ("check", lambda c: "ok" if all(x["ok"] for x in c["check"].values()) else "FAIL", ""),
                        *(cell(v) for v in variants)], result["cases"])
    print(f"{time.time() - t_start:.0f} s; json: {path}")
    ok = all(all(x["ok"] for x in c["check"].values()) for c in result["cases"])
    return 0 if ok and all(r["ok"] for sw in result["sweep"] for r in sw["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
