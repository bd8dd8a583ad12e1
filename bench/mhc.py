"""Fused mHC (dsv4::mhc_pre, dsv4::mhc_post) against the eager twin, at V4.1 width (D = 5120, hc = 4).

    python bench/mhc.py            # H200: correctness on CUDA, then timings; < 2 minutes
    python bench/mhc.py --sweep    # also times a few tile configs of mhc_pre per size
    python bench/mhc.py --smoke    # tiny sizes on the CPU under the Triton interpreter (proves the script runs)

Cases, for N = 1, 8, 64, 512, 4096 tokens (bf16 streams h [N, 4, 5120], fn [24, 20480] fp32):
- pre_v41: mhc_pre with collapse_pre given (V4.1 single pass, norm_eps 1e-20): h is read once.
- pre_v4:  mhc_pre collapsing with its own pre (V4): h is read twice (the weights need the whole row).
- post:    mhc_post (expand), against hc_expand.
Timing: CUDA events; each sample runs R calls on R rotating input sets (so weights and small inputs come
from memory, not L2, as they would across layers), reported per call; the median of --reps samples after
warmup. "graph": the R calls captured in a CUDA graph and replayed (device time, no launch gaps, how
decode runs); "eager": plain Python calls (includes launch overhead). Bytes are the fewest each version
must move: eager reads h twice (project, collapse), fused once (pre_v41), fn once, x written once.
JSON goes to $OUT/mhc.json if OUT is set, else bench/results/mhc.json (mhc-smoke.json with --smoke);
a PNG beside it when matplotlib imports. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="token counts N")
    p.add_argument("--reps", type=int, default=60, help="timed samples per case (median)")
    p.add_argument("--sweep", action="store_true", help="also time a few mhc_pre tile configs")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch

from dsv4.fast.kernels import mhc as K


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ------------------------------------------------------------------------------------------------
# Timing


def time_calls(fns, reps: int, graph: bool, device: str) -> float:
    """Median over `reps` samples of (time to run every fn in `fns` once) / len(fns), in microseconds."""
    for f in fns:  # warmup (compiles, allocator)
        f()
    if device != "cuda":
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            for f in fns:
                f()
            samples.append((time.perf_counter() - t) * 1e6 / len(fns))
        return statistics.median(samples)
    torch.cuda.synchronize()
    run = lambda: [f() for f in fns]
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm the graph pool's allocations
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------------
# Inputs and checks


def make_set(N, hc, D, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    M = (2 + hc) * hc
    h = torch.randn(N, hc, D, generator=g, device=device).bfloat16()
    fn = torch.randn(M, hc * D, generator=g, device=device) / (hc * D) ** 0.5 * 4
    scale = torch.rand(3, generator=g, device=device) + 0.5
    base = torch.randn(M, generator=g, device=device) * 0.5
    pre_prev = torch.rand(N, hc, generator=g, device=device) + 0.1
    f = torch.randn(N, D, generator=g, device=device).bfloat16()
    return {"h": h, "fn": fn, "scale": scale, "base": base, "pre_prev": pre_prev, "f": f}


def bf16_tol_ratio(out, ref) -> float:
    """max |out - ref| / (1 bf16 ulp of ref + 1e-5 max|ref|): <= 1 passes (the tests' bf16 tolerance)."""
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-126))) - 7)
    return ((out.float() - ref.float()).abs() / (ulp + 1e-5 * ref.float().abs().max())).max().item()


def check(s) -> dict:
    """Fused vs twin on the device: x within 1 bf16 ulp (+1e-5 max|x|), pre/post/comb within 1e-5 relative."""
    worst = {}
    for mode, cp, eps in (("pre_v41", s["pre_prev"], 1e-20), ("pre_v4", None, 1e-6)):
        out = K.mhc_pre(s["h"], s["fn"], s["scale"], s["base"], cp, eps, 1e-6, 20)
        ref = K.mhc_pre_twin(s["h"], s["fn"], s["scale"], s["base"], cp, eps, 1e-6, 20)
        worst[f"{mode}.x_tol"] = bf16_tol_ratio(out[0], ref[0])
        for name, a, b in zip(("pre", "post", "comb"), out[1:], ref[1:]):
            err = (a.double() - b.double()).abs() / (b.double().abs() + b.double().abs().max())
            worst[f"{mode}.{name}_rel"] = err.max().item()
    comb = K.mhc_pre(s["h"], s["fn"], s["scale"], s["base"], None, 1e-6, 1e-6, 20)[3]
    post = torch.rand_like(comb[..., 0]) * 2
    out = K.mhc_post(s["f"], s["h"], post, comb)
    ref = K.mhc_post_twin(s["f"], s["h"], post, comb)
    worst["post.h_tol"] = bf16_tol_ratio(out, ref)
    ok = all(v <= 1.0 for k, v in worst.items() if k.endswith("tol")) and all(
        v <= 1e-5 for k, v in worst.items() if k.endswith("rel"))
    return {"ok": ok, **worst}


# ------------------------------------------------------------------------------------------------


def main():
    device = "cpu" if ARGS.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/mhc.py needs CUDA (or --smoke)")
    hc, D = 4, (64 if ARGS.smoke else 5120)
    sizes = ARGS.sizes or ([1, 5] if ARGS.smoke else [1, 8, 64, 512, 4096])
    reps = 3 if ARGS.smoke else ARGS.reps
    M = (2 + hc) * hc
    t_start = time.time()

    results, checks, sweep = [], {}, []
    for N in sizes:
        elt = 2
        h_bytes, fn_bytes, x_bytes = N * hc * D * elt, M * hc * D * 4, N * D * elt
        small = N * (hc + 2 * hc + hc * hc) * 4
        # rotating input sets: enough that one sample's inputs overflow L2 (weights are cold across layers)
        per_set = h_bytes + fn_bytes + N * D * elt
        R = 2 if ARGS.smoke else max(2, min(64, -(-256 * 2**20 // per_set)))
        sets = [make_set(N, hc, D, device, 1000 * N + i) for i in range(R)]
        checks[N] = check(sets[0])

        def pre_calls(fused, v41, sets=sets):
            calls = []
            for s in sets:
                cp, eps = (s["pre_prev"], 1e-20) if v41 else (None, 1e-6)
                fn = K.mhc_pre if fused else K.mhc_pre_twin
                calls.append(lambda s=s, cp=cp, eps=eps, fn=fn: fn(s["h"], s["fn"], s["scale"], s["base"], cp, eps,
                                                                   1e-6, 20))
            return calls

        post_in = [(s["f"], s["h"], torch.rand(N, hc, device=device) * 2,
                    torch.softmax(torch.randn(N, hc, hc, device=device), dim=-2)) for s in sets]

        def post_calls(fused, post_in=post_in):
            fn = K.mhc_post if fused else K.mhc_post_twin
            return [lambda a=a, fn=fn: fn(*a) for a in post_in]

        cases = {
            "pre_v41": (lambda fused: pre_calls(fused, True), h_bytes + fn_bytes + x_bytes + small,
                        2 * h_bytes + fn_bytes + x_bytes + small),
            "pre_v4": (lambda fused: pre_calls(fused, False), 2 * h_bytes + fn_bytes + x_bytes + small,
                       2 * h_bytes + fn_bytes + x_bytes + small),
            "post": (post_calls, x_bytes + 2 * h_bytes + small, x_bytes + 2 * h_bytes + small),
        }
        for case, (calls, fused_bytes, eager_bytes) in cases.items():
            row = {"case": case, "N": N, "D": D, "hc": hc, "rotating_sets": R,
                   "bytes_fused": fused_bytes, "bytes_eager": eager_bytes}
            for mode in (["eager"] if device == "cpu" else ["graph", "eager"]):
                # eager: launch overhead dominates and L2 hardly matters; 4 sets keep the host time short
                n_sets = R if mode == "graph" else min(R, 4)
                tf = time_calls(calls(True)[:n_sets], reps, mode == "graph", device)
                te = time_calls(calls(False)[:n_sets], reps, mode == "graph", device)
                row[f"{mode}_fused_us"], row[f"{mode}_twin_us"] = tf, te
                row[f"{mode}_speedup"] = te / tf
                row[f"{mode}_fused_GBps"] = fused_bytes / tf / 1e3
                row[f"{mode}_twin_GBps"] = eager_bytes / te / 1e3
            results.append(row)

        if ARGS.sweep:
            target = 2 * (torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1)
            configs = [{"BN": bn, "BD": bd, "target": target * tm, "num_warps": nw, "num_stages": ns}
                       for bn in (16, 64, 128) for bd in (64, 128) for tm in (1, 3) for nw, ns in ((4, 3), (8, 3))
                       if not (bn == 16 and N > 1024) and not (bn == 128 and N < 256)]
            for v41 in (True, False):
                for cfg in configs:
                    calls = []
                    for s in sets:
                        cp, eps = (s["pre_prev"], 1e-20) if v41 else (None, 1e-6)
                        calls.append(lambda s=s, cp=cp, eps=eps, cfg=cfg: K.mhc_pre_triton(
                            s["h"], s["fn"], s["scale"], s["base"], cp, eps, 1e-6, 20, cfg=cfg))
                    try:
                        t = time_calls(calls, max(10, reps // 3), device == "cuda", device)
                    except Exception as e:  # noqa: BLE001 -- a tile that does not compile or fit: record it, go on
                        t = float("nan")
                        print(f"sweep N={N} {cfg}: {type(e).__name__}", file=sys.stderr)
                    sweep.append({"N": N, "case": "pre_v41" if v41 else "pre_v4", **cfg, "us": t})

    meta = {
        "bench": "mhc",
        "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {"D": D, "hc": hc, "M": M, "dtype": "bfloat16", "sinkhorn_iters": 20},
        "timing": "CUDA events, median of reps samples; each sample = R calls on rotating inputs, per call",
        "reps": reps,
        "wall_s": round(time.time() - t_start, 1),
        "checks": checks,
        "results": results,
        "sweep": sweep,
    }
    name = "mhc-smoke" if ARGS.smoke else "mhc"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))
    plot(results, out_dir / f"{name}.png", device)

    if sweep:
        print("\nsweep (mhc_pre tiles, us per call; best per N and case marked *)")
        for N in sizes:
            for case in ("pre_v41", "pre_v4"):
                rows = [r for r in sweep if r["N"] == N and r["case"] == case and r["us"] == r["us"]]
                best = min(rows, key=lambda r: r["us"]) if rows else None
                for r in rows:
                    mark = "*" if r is best else " "
                    print(f"{mark} N={N:5d} {case:8s} BN={r['BN']:3d} BD={r['BD']:3d} target={r['target']:4d} "
                          f"warps={r['num_warps']} stages={r['num_stages']}  {r['us']:9.2f}")
    print(f"\ncorrectness on {meta['gpu']}: " + ", ".join(f"N={N} {'ok' if c['ok'] else 'FAIL'}" for N, c in checks.items()))
    mode = "eager" if device == "cpu" else "graph"
    print(f"results: {out_dir / (name + '.json')}  ({meta['wall_s']} s)")
    print(f"\n{'case':8s} {'N':>5s} | {mode} fused us  twin us  speedup  fused GB/s  twin GB/s" +
          ("" if device == "cpu" else " | eager fused us  twin us  speedup"))
    for r in results:
        line = (f"{r['case']:8s} {r['N']:5d} | {r[mode + '_fused_us']:14.2f} {r[mode + '_twin_us']:8.2f} "
                f"{r[mode + '_speedup']:7.2f}x {r[mode + '_fused_GBps']:10.1f} {r[mode + '_twin_GBps']:10.1f}")
        if device == "cuda":
            line += f" | {r['eager_fused_us']:14.2f} {r['eager_twin_us']:8.2f} {r['eager_speedup']:7.2f}x"
        print(line)
    if not all(c["ok"] for c in checks.values()):
        print("CORRECTNESS FAILED: " + json.dumps(checks))
        sys.exit(1)


def plot(results, path, device):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mode = "eager" if device == "cpu" else "graph"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for case in ("pre_v41", "pre_v4", "post"):
        rows = [r for r in results if r["case"] == case]
        Ns = [r["N"] for r in rows]
        (line,) = axes[0].plot(Ns, [r[f"{mode}_fused_us"] for r in rows], "o-", label=f"{case} fused")
        axes[0].plot(Ns, [r[f"{mode}_twin_us"] for r in rows], "x--", color=line.get_color(), label=f"{case} twin")
        axes[1].plot(Ns, [r[f"{mode}_speedup"] for r in rows], "o-", label=case)
    shape = f"D={results[0]['D']} hc={results[0]['hc']}" if results else ""
    axes[0].set(xscale="log", yscale="log", xlabel="tokens N", ylabel=f"us per call ({mode})", title=f"mHC, {shape}")
    axes[1].set(xscale="log", xlabel="tokens N", ylabel="speedup over eager twin", title="fused / twin")
    axes[1].axhline(1.5, color="gray", ls=":")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
