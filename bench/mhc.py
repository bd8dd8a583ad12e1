"""Fused mHC (dsv4::mhc_pre, dsv4::mhc_post) against the eager twin, at V4.1 width (D = 5120, hc = 4).

    python bench/mhc.py            # H200: correctness on CUDA, then timings; < 2 minutes
    python bench/mhc.py --sweep    # also times a few tile configs of mhc_pre per size (and its finish's at N <= 8),
                                   # and V4.1's decode pair (two kernels, or mhc_post_partial at 2 / 4 / 8 warps)
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

import sys
import time

import common


def add_arguments(p):
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="token counts N")
    p.add_argument("--reps", type=int, default=60, help="timed samples per case (median)")
    p.add_argument("--sweep", action="store_true", help="also time a few mhc_pre tile configs")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4.fast.kernels import mhc as K

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


def decode_pair_forms(s) -> dict:
    """V4.1's attention-site post and FFN-site partial pass at decode sizes (the same fn for both sites): its two
    kernels (mhc_post_finish, then mhc_pre_partial) and mhc_post_partial's one at 2, 4 and 8 warps (its default:
    `post_partial_warps`), each a call -> (h', x, the next site's workspace)."""
    args = (s["f"], s["h"], K.mhc_pre_partial(s["h"], s["fn"], s["pre_prev"])[1], s["scale"], s["base"], s["fn"])
    eps = (1e-20, 1e-6, 20)

    def pieces():
        out, pre = K.mhc_post_finish(*args[:5], *eps)
        return (out, *K.mhc_pre_partial(out, args[5], pre))

    return {"finish + partial": pieces, **{
        f"post_partial {w} warps": lambda w=w: K.mhc_post_partial_triton(*args, *eps, cfg={"num_warps": w})
        for w in (2, 4, 8)}}


def check_decode_pair(s, forms: dict) -> float:
    """The worst of each decode-pair form's (`decode_pair_forms(s)`) h' and x against the twins (as the GPU tests
    check them), in bf16 ulps: <= 1 passes."""
    ws = K.mhc_pre_partial_twin(s["h"], s["fn"], s["pre_prev"])[1]
    rout, rpre = K.mhc_post_finish_twin(s["f"], s["h"], ws, s["scale"], s["base"], 1e-20, 1e-6, 20)
    worst = 0.0
    for form in forms.values():
        out, x, _ = form()
        rx = K.mhc_pre_twin(out, s["fn"], s["scale"], s["base"], rpre, 1e-20, 1e-6, 20)[0]  # from its own h'
        worst = max(worst, bf16_tol_ratio(out, rout), bf16_tol_ratio(x, rx))
    return worst


# ------------------------------------------------------------------------------------------------


def main():
    device = common.bench_device(ARGS.smoke)
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
            common.time_fused_vs_baseline(row, calls, reps, device, "twin", fused_bytes, eager_bytes)
            results.append(row)
            # as it goes, so a run cut short by a time limit still shows what it timed
            print(f"N={N} {case}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k.endswith("_us")), flush=True)

        if ARGS.sweep and N <= K.POST_PARTIAL_MAX_N:
            forms = [decode_pair_forms(s) for s in sets]
            checks[N]["decode_pair.tol"] = check_decode_pair(sets[0], forms[0])
            checks[N]["ok"] = checks[N]["ok"] and checks[N]["decode_pair.tol"] <= 1.0
            for name in forms[0]:
                t = common.time_calls([f[name] for f in forms], max(10, reps // 3), cuda=device == "cuda")
                sweep.append({"N": N, "case": "decode pair", "form": name, "us": t})
                print(f"sweep N={N} decode pair {name}: {t:.2f} us", flush=True)

        if ARGS.sweep:
            target = 2 * (torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1)
            # target: the D split's program count, so also how many partials the finish kernel sums (80 at one
            # token by default, its loads a large part of its 8 us in the decode step)
            configs = [{"BN": bn, "BD": bd, "target": max(1, int(target * tm)), "num_warps": nw, "num_stages": ns}
                       for bn in (16, 64, 128) for bd in (64, 128) for tm in (0.25, 0.5, 1, 3)
                       for nw, ns in ((4, 3), (8, 3))
                       if not (bn == 16 and N > 1024) and not (bn == 128 and N < 256)]
            if N <= 8:  # the finish kernel at decode sizes: splits it sums a step, its warps (the pre tile default)
                configs += [{"BN": 16, "BD": 64, "target": max(1, int(target * tm)), "num_warps": 4, "num_stages": 4,
                             "SB": sb, "finish_warps": fw}
                            for tm in (0.25, 0.5, 1) for sb in (8, 32, 128) for fw in (1, 4)]
            for v41 in (True, False):
                for cfg in configs:
                    calls = []
                    for s in sets:
                        cp, eps = (s["pre_prev"], 1e-20) if v41 else (None, 1e-6)
                        calls.append(lambda s=s, cp=cp, eps=eps, cfg=cfg: K.mhc_pre_triton(
                            s["h"], s["fn"], s["scale"], s["base"], cp, eps, 1e-6, 20, cfg=cfg))
                    try:
                        t = common.time_calls(calls, max(10, reps // 3), cuda=device == "cuda")
                    except Exception as e:  # noqa: BLE001 -- a tile that does not compile or fit: record it, go on
                        t = float("nan")
                        print(f"sweep N={N} {cfg}: {type(e).__name__}", file=sys.stderr)
                    sweep.append({"N": N, "case": "pre_v41" if v41 else "pre_v4", **cfg, "us": t})
                    print(f"sweep N={N} {sweep[-1]['case']} {cfg}: {t:.2f} us", flush=True)

    meta, path = common.write_timed_result("mhc", device, ARGS.smoke, t_start, reps, checks, results, sweep=sweep,
                                           shape={"D": D, "hc": hc, "M": M, "dtype": "bfloat16", "sinkhorn_iters": 20})
    shape = f"D={D} hc={hc}"
    common.save_figure(path.with_suffix(".png"), lambda fig, axes: common.plot_fused_vs_baseline(
        axes, results, device, "twin", ("pre_v41", "pre_v4", "post"), f"mHC, {shape}", 1.5))

    pairs = [r for r in sweep if r["case"] == "decode pair"]
    if pairs:
        print("\nV4.1's decode pair (attention-site post + FFN-site partial pass), us per call")
        common.print_table([("N", "N", "d"), ("form", "form", ""), ("us", "us", ".2f")], pairs)
    if sweep:
        print("\nsweep (mhc_pre tiles, us per call; best per N and case marked *)")
        for N in sizes:
            for case in ("pre_v41", "pre_v4"):
                rows = [r for r in sweep if r["N"] == N and r["case"] == case and r["us"] == r["us"]]
                best = min(rows, key=lambda r: r["us"]) if rows else None
                common.print_table([("", lambda r, best=best: "*" if r is best else "", ""), ("N", "N", "d"),
                                    ("case", "case", ""), ("BN", "BN", "d"), ("BD", "BD", "d"),
                                    ("target", "target", "d"), ("warps", "num_warps", "d"),
                                    ("stages", "num_stages", "d"), ("SB", "SB", "d"),
                                    ("finish warps", "finish_warps", "d"), ("us", "us", ".2f")], rows)
    common.print_summary(meta["gpu"], checks, path, meta["wall_s"])
    common.print_fused_vs_baseline(results, device, "twin")
    common.exit_if_failed(checks)


if __name__ == "__main__":
    main()
