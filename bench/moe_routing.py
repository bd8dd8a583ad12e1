"""Fused MoE routing (dsv4::route_topk, dsv4::gate_route) against the unfused torch sequence, V4.1 shapes.

    python bench/moe_routing.py          # H200: correctness on CUDA, then timings; < 2 minutes
    python bench/moe_routing.py --smoke  # tiny sizes on the CPU under the Triton interpreter

V4.1: E = 384 experts, top-6, sqrtsoftplus, bias, normalized, scale 1.5, D = 5120; N = 1, 16, 32, 64,
128, 256 tokens.
- route: route_topk(logits) against route(router_scores(logits / temp), bias, ...) (about ten launches).
- gate:  gate_route(x, W) against F.linear(x.float(), W.float()) + the same twin (Gate.forward's sequence).
Timing: CUDA events; each sample runs R calls on R rotating input sets (the gate weight is cold across
layers), reported per call; the median of --reps samples after warmup. "graph": the R calls captured in
a CUDA graph and replayed (device time, how decode runs); "eager": plain Python calls. Bytes: the fewest
each must move (logits or x and W read once, weights and ids written once).
JSON goes to $OUT/moe_routing.json if OUT is set, else bench/results/moe_routing.json
(moe_routing-smoke.json with --smoke); a PNG beside it when matplotlib imports. The table is printed last.
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
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch

from dsv4.fast.kernels import moe_routing as R
from dsv4.reference.moe import router_scores

TOPK, TEMP, SCALE, FUNC = 6, 1.0, 1.5, "sqrtsoftplus"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
            run()
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


def make_set(N, E, D, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, D, generator=g, device=device).bfloat16()
    W = (torch.randn(E, D, generator=g, device=device) / D**0.5 * 2).bfloat16()
    bias = torch.randn(E, generator=g, device=device) * 0.05
    logits = torch.nn.functional.linear(x.float(), W.float())
    return {"x": x, "W": W, "bias": bias, "logits": logits}


def compare(out, ref, sel, rel) -> tuple[int, float, int]:
    """(rows with different id sets, worst relative weight error over the other rows, rows skipped as
    near-ties: top-7 biased scores closer than 1e-5)."""
    w, ids = (t.cpu() for t in out)
    rw, rids = (t.cpu() for t in ref)
    top = sel.cpu().topk(TOPK + 1, dim=-1).values
    tie = (top[:, :-1] - top[:, 1:]).min(dim=-1).values < 1e-5
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    bad = int((~same & ~tie).sum())
    keep = same & ~tie
    wb = w.gather(-1, ids.sort(-1).indices)[keep].double()
    rb = rw.gather(-1, rids.sort(-1).indices)[keep].double()
    err = ((wb - rb).abs() / rb.abs()).max().item() if keep.any() else 0.0
    return bad, err, int(tie.sum())


def check(s) -> dict:
    sel = router_scores(s["logits"] / TEMP, FUNC) + s["bias"]
    out = R.route_topk(s["logits"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC)
    ref = R.route_topk_twin(s["logits"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC)
    r_bad, r_err, r_tie = compare(out, ref, sel, 1e-6)
    out = R.gate_route(s["x"], s["W"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC)
    ref = R.gate_route_twin(s["x"], s["W"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC)
    g_bad, g_err, g_tie = compare(out, ref, sel, 5e-6)
    ok = r_bad == 0 and r_err <= 1e-6 and g_bad == 0 and g_err <= 5e-6
    return {"ok": ok, "route_bad_rows": r_bad, "route_w_rel": r_err, "route_tie_rows": r_tie,
            "gate_bad_rows": g_bad, "gate_w_rel": g_err, "gate_tie_rows": g_tie}


def main():
    device = "cpu" if ARGS.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/moe_routing.py needs CUDA (or --smoke)")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the twin's fp32 GEMM stays fp32
    E, D = (384, 64) if ARGS.smoke else (384, 5120)
    sizes = ARGS.sizes or ([1, 16] if ARGS.smoke else [1, 16, 32, 64, 128, 256])
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()

    results, checks = [], {}
    for N in sizes:
        w_bytes, x_bytes, l_bytes, o_bytes = E * D * 2, N * D * 2, N * E * 4, N * TOPK * 12
        per_set = w_bytes + x_bytes + l_bytes
        nsets = 2 if ARGS.smoke else max(2, min(64, -(-256 * 2**20 // per_set)))
        sets = [make_set(N, E, D, device, 7919 * N + i) for i in range(nsets)]
        checks[N] = check(sets[0])

        def route_calls(fused, sets=sets):
            f = R.route_topk if fused else R.route_topk_twin
            return [lambda s=s: f(s["logits"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC) for s in sets]

        def gate_calls(fused, sets=sets):
            f = R.gate_route if fused else R.gate_route_twin
            return [lambda s=s: f(s["x"], s["W"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC) for s in sets]

        cases = {"route": (route_calls, l_bytes + E * 4 + o_bytes), "gate": (gate_calls, w_bytes + x_bytes + o_bytes)}
        for case, (calls, nbytes) in cases.items():
            row = {"case": case, "N": N, "E": E, "D": D, "topk": TOPK, "rotating_sets": nsets, "bytes": nbytes}
            for mode in (["eager"] if device == "cpu" else ["graph", "eager"]):
                n_sets = nsets if mode == "graph" else min(nsets, 4)
                tf = time_calls(calls(True)[:n_sets], reps, mode == "graph", device)
                tt = time_calls(calls(False)[:n_sets], reps, mode == "graph", device)
                row[f"{mode}_fused_us"], row[f"{mode}_torch_us"] = tf, tt
                row[f"{mode}_speedup"] = tt / tf
                row[f"{mode}_fused_GBps"] = nbytes / tf / 1e3
            results.append(row)

    meta = {
        "bench": "moe_routing",
        "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {"E": E, "D": D, "topk": TOPK, "score_func": FUNC, "temp": TEMP, "scale": SCALE, "bias": True},
        "timing": "CUDA events, median of reps samples; each sample = R calls on rotating inputs, per call",
        "reps": reps,
        "wall_s": round(time.time() - t_start, 1),
        "checks": checks,
        "results": results,
    }
    name = "moe_routing-smoke" if ARGS.smoke else "moe_routing"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))
    plot(results, out_dir / f"{name}.png", device)

    print(f"\ncorrectness on {meta['gpu']}: " + ", ".join(f"N={N} {'ok' if c['ok'] else 'FAIL'}" for N, c in checks.items()))
    print(f"results: {out_dir / (name + '.json')}  ({meta['wall_s']} s)")
    mode = "eager" if device == "cpu" else "graph"
    print(f"\n{'case':6s} {'N':>4s} | {mode} fused us  torch us  speedup  fused GB/s" +
          ("" if device == "cpu" else " | eager fused us  torch us  speedup"))
    for r in results:
        line = (f"{r['case']:6s} {r['N']:4d} | {r[mode + '_fused_us']:14.2f} {r[mode + '_torch_us']:9.2f} "
                f"{r[mode + '_speedup']:7.2f}x {r[mode + '_fused_GBps']:10.1f}")
        if device == "cuda":
            line += f" | {r['eager_fused_us']:14.2f} {r['eager_torch_us']:9.2f} {r['eager_speedup']:7.2f}x"
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
    for case in ("route", "gate"):
        rows = [r for r in results if r["case"] == case]
        Ns = [r["N"] for r in rows]
        (line,) = axes[0].plot(Ns, [r[f"{mode}_fused_us"] for r in rows], "o-", label=f"{case} fused")
        axes[0].plot(Ns, [r[f"{mode}_torch_us"] for r in rows], "x--", color=line.get_color(), label=f"{case} torch")
        axes[1].plot(Ns, [r[f"{mode}_speedup"] for r in rows], "o-", label=case)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens N", ylabel=f"us per call ({mode})",
                title=f"MoE routing, E={results[0]['E'] if results else ''} k={TOPK}")
    axes[1].set(xscale="log", xlabel="tokens N", ylabel="speedup over torch", title="fused / torch")
    axes[1].axhline(1.3, color="gray", ls=":")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
