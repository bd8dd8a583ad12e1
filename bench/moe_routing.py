"""Fused MoE routing (dsv4::route_topk, dsv4::gate_route) against the unfused torch sequence, V4.1 shapes.

    python bench/moe_routing.py          # H200: correctness on CUDA, then timings; < 2 minutes
    python bench/moe_routing.py --sweep  # also times gate_route's split-K and the routing kernel's warps (N <= 16),
                                         # and at N = 1 the step's fused gate, plain and normed, over its tiles
    python bench/moe_routing.py --smoke  # tiny sizes on the CPU under the Triton interpreter

V4.1: E = 384 experts, top-6, sqrtsoftplus, bias, normalized, scale 1.5, D = 5120; N = 1, 16, 32, 64,
128, 256 tokens.
- route: route_topk(logits) against route(router_scores(logits / temp), bias, ...) (about ten launches).
- gate:  gate_route(x, W) against F.linear(x.float(), W.float()) + the same twin (Gate.forward's sequence).
- gate normed (N = 1, the decode step's): gate_route_normed(x, x's squares by d step, the norm weight, W) against
  the three launches it replaced: rms_norm (compiled: one inductor kernel), gate_route, activation_planes
  (compiled), the count given to both (the step's, whose GEMM's last program routes).
Timing: CUDA events; each sample runs R calls on R rotating input sets (the gate weight is cold across
layers), reported per call; the median of --reps samples after warmup. "graph": the R calls captured in
a CUDA graph and replayed (device time, how decode runs); "eager": plain Python calls. Bytes: the fewest
each must move (logits or x and W read once, weights and ids written once).
JSON goes to $OUT/moe_routing.json if OUT is set, else bench/results/moe_routing.json
(moe_routing-smoke.json with --smoke); a PNG beside it when matplotlib imports. The table is printed last.
"""

from __future__ import annotations

import itertools
import sys
import time

import common


def add_arguments(p):
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="token counts N")
    p.add_argument("--reps", type=int, default=60, help="timed samples per case (median)")
    p.add_argument("--sweep", action="store_true", help="also time gate_route tile configs at N <= 16")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4.fast.kernels import moe_routing as R
from dsv4.fast.kernels.mhc import squares_by_step
from dsv4.fast.kernels.moe_experts import activation_planes
from dsv4.reference.linear import rms_norm
from dsv4.reference.moe import router_scores

TOPK, TEMP, SCALE, FUNC = 6, 1.0, 1.5, "sqrtsoftplus"


def make_set(N, E, D, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, D, generator=g, device=device).bfloat16()
    W = (torch.randn(E, D, generator=g, device=device) / D**0.5 * 2).bfloat16()
    bias = torch.randn(E, generator=g, device=device) * 0.05
    logits = torch.nn.functional.linear(x.float(), W.float())
    return {"x": x, "W": W, "bias": bias, "logits": logits, "squares": squares_by_step(x)}


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


def gate_sweep(N, sets, reps, device) -> list[dict]:
    """gate_route at one small N over the GEMM's K splits (each a partial the routing kernel sums), its expert
    block, and the routing kernel's warps: what the decode step's 10 us of routing a layer is made of."""
    rows = []
    for split in (5, 10, 20, 40):
        for BE in (16, 64):
            for warps in (1, 2, 4):
                cfg = {"split": split, "BE": BE, "route": {"num_warps": warps}}
                calls = [lambda s=s, cfg=cfg: R.gate_route_triton(s["x"], s["W"], s["bias"], None, TOPK, TEMP, SCALE,
                                                                    True, FUNC, cfg=cfg) for s in sets]
                try:
                    t = common.time_calls(calls, max(10, reps // 3), cuda=device == "cuda")
                except Exception as e:  # noqa: BLE001 -- a config that does not compile or fit: record it, go on
                    t = float("nan")
                    print(f"sweep N={N} {cfg}: {type(e).__name__}", file=sys.stderr)
                rows.append({"N": N, "split": split, "BE": BE, "route_warps": warps, "us": t})
    return rows


def fused_gate_sweep(sets, D, reps, device) -> list[dict]:
    """The decode step's gate at one row (its last program routes), plain and normed (gate_route_normed's path), over
    the GEMM's K step, K splits and expert block: where the normalization in its K loop costs least."""
    nw = torch.ones(D, dtype=torch.bfloat16, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    rows = []
    for (BK, split), BE, normed in itertools.product([(128, 10), (256, 10), (512, 10), (256, 20), (128, 40),
                                                      (128, 20)], (16, 32), (False, True)):
        cfg = {"BK": BK, "split": split, "BE": BE}
        calls = [lambda s=s, cfg=cfg, n=normed: R.gate_route_triton(
            s["x"], s["W"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC, count, cfg,
            (s["squares"], nw, 1e-6) if n else None) for s in sets]
        try:
            t = common.time_calls(calls, max(10, reps // 3), cuda=device == "cuda")
        except Exception as e:  # noqa: BLE001 -- a config that does not compile or fit: record it, go on
            t = float("nan")
            print(f"fused sweep {cfg} normed={normed}: {type(e).__name__}", file=sys.stderr)
        rows.append({"normed": normed, **cfg, "us": t})
    return rows


def normed_gate_calls(sets: list[dict], D: int, device: str):
    """calls(fused) for the "gate normed" case: gate_route_normed on each set, or the step's three launches before
    it (a compiled norm, gate_route, compiled planes)."""
    nw = (1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(D))).bfloat16().to(device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    norm = torch.compile(lambda x: rms_norm(x, nw, 1e-6))
    planes = torch.compile(activation_planes)

    def apart(s):
        xn = norm(s["x"])
        return *R.gate_route(xn, s["W"], s["bias"], None, TOPK, TEMP, SCALE, True, FUNC, count), xn, planes(xn)

    def normed(s):
        return R.gate_route_normed(s["x"], s["squares"], nw, 1e-6, s["W"], s["bias"], None, TOPK, TEMP, SCALE, True,
                                   FUNC, count)

    return lambda fused: [lambda s=s: (normed if fused else apart)(s) for s in sets]


def main():
    device = common.bench_device(ARGS.smoke)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the twin's fp32 GEMM stays fp32
    E, D = (384, 64) if ARGS.smoke else (384, 5120)
    sizes = ARGS.sizes or ([1, 16] if ARGS.smoke else [1, 16, 32, 64, 128, 256])
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()

    results, checks, sweep, fused_sweep = [], {}, [], []
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
        if N == 1 and device == "cuda":
            cases["gate normed"] = (normed_gate_calls(sets, D, device), w_bytes + x_bytes + o_bytes)
        for case, (calls, nbytes) in cases.items():
            row = {"case": case, "N": N, "E": E, "D": D, "topk": TOPK, "rotating_sets": nsets, "bytes": nbytes}
            common.time_fused_vs_baseline(row, calls, reps, device, "torch", nbytes)
            results.append(row)
        if ARGS.sweep and N <= 16:
            sweep += gate_sweep(N, sets, reps, device)
        if ARGS.sweep and N == 1 and device == "cuda":
            fused_sweep = fused_gate_sweep(sets, D, reps, device)

    shape = {"E": E, "D": D, "topk": TOPK, "score_func": FUNC, "temp": TEMP, "scale": SCALE, "bias": True}
    meta, path = common.write_timed_result("moe_routing", device, ARGS.smoke, t_start, reps, checks, results,
                                           shape=shape, sweep=sweep, fused_sweep=fused_sweep)
    common.save_figure(path.with_suffix(".png"), lambda fig, axes: common.plot_fused_vs_baseline(
        axes, results, device, "torch", ("route", "gate"), f"MoE routing, E={E} k={TOPK}", 1.3))

    if sweep:
        print("\nsweep (gate_route at small N, us per call in a graph)")
        common.print_table([("N", "N", "d"), ("split", "split", "d"), ("BE", "BE", "d"),
                            ("route warps", "route_warps", "d"), ("us", "us", ".2f")], sweep)
    if fused_sweep:
        print("\nfused sweep (the gate at one row, its last program routing, plain and normed; us per call in a graph)")
        common.print_table([("normed", "normed", ""), ("BK", "BK", "d"), ("split", "split", "d"), ("BE", "BE", "d"),
                            ("us", "us", ".2f")], fused_sweep)
    common.print_summary(meta["gpu"], checks, path, meta["wall_s"])
    common.print_fused_vs_baseline(results, device, "torch")
    common.exit_if_failed(checks)


if __name__ == "__main__":
    main()
