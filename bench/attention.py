"""Sparse latent-MQA decode over FP4 vs FP8 vs bf16 global KV (dsv4::sparse_attn_fp4 / _fp8 / _bf16), V4.1 shapes.

    python bench/attention.py          # H200: correctness against the twin, a config sweep, timings; < 4 minutes
    python bench/attention.py --smoke  # tiny sizes on the CPU under the Triton interpreter

Decode (one query row per sequence), H = 64 heads, D = 512, RoPE 64, for batch 1 and 8 (sequences side by side in
one pooled store; each row's indices point into its own sequence's rows):
- csa2: the 128-slot window plus the indexer's top-512 of --csa-store global entries per sequence (V4.1 CSA2);
  the timed calls rotate over --rotate index sets, so the 512 rows come from a store far larger than L2.
- all-C: the window plus every global entry of a context C (C / --ratio entries), the HCA-like case, for
  C = 8K, 64K, 512K: the list grows from L2-resident to HBM-bound.
With --shard-heads (default 16, a tensor-parallel shard of the 64 heads), the largest all-C case again at that
head count: fewer heads, less matrix work per KV byte.
Formats: window FP8 (528 B/slot) for fp4 and fp8; global FP4 (288 B/entry) vs FP8 (528 B) vs bf16 (1024 B, and a
bf16 window). Bytes = KV rows read x bytes per row (q, o, index lists and split partials not counted).
Each case is first checked against the twin (dequantize with dsv4.quant, gather, reference sparse_attention,
inverse RoPE): |o - twin| <= 2e-2 max|twin| + 1e-2 |twin|. Timing: CUDA graph of --rotate calls, replayed, CUDA
events; the median of --reps replays, per call. Before the cases, each format runs a few kernel configs on the
largest all-C case at batch 1 and keeps the fastest (the sweep is in the JSON); the csa2 case at batch 1 also runs
the head-block configs of DECODE_SWEEP (FP4; `decode_sweep` in the JSON).
JSON goes to $OUT/attention.json if OUT is set, else bench/results/attention.json (attention-smoke.json with
--smoke); a PNG beside it when matplotlib imports. The table is printed last.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import common


def add_arguments(p):
    p.add_argument("--batches", type=int, nargs="*", default=None, help="sequences per decode step")
    p.add_argument("--contexts", type=int, nargs="*", default=None, help="contexts C of the all-entries case")
    p.add_argument("--ratio", type=int, default=2, help="compression ratio of the all-entries case (V4.1 encoder: 2)")
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--csa-store", type=int, default=65536, help="global entries per sequence the top-k is drawn from")
    p.add_argument("--rotate", type=int, default=8, help="calls per graph, each on its own index set (csa2)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--no-sweep", action="store_true", help="use the default kernel config")
    p.add_argument("--peak-gbs", type=float, default=4300.0, help="copy bandwidth to compare with (GB/s)")
    p.add_argument("--shard-heads", type=int, nargs="*", default=None,
                   help="extra head counts (a tensor-parallel shard of the 64) for the largest all-C case; [] for none")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4.fast.kernels import attention as A
from dsv4.fast.kernels.quant import fp8_quant, nvfp4_quant

FORMATS = ("fp4", "fp8", "bf16")
SWEEP = [  # (block_h, block_n, num_warps, num_stages); the first is the default
    A.Config(),
    A.Config(block_h=64, block_n=32, num_warps=8, num_stages=3),
    A.Config(block_h=64, block_n=64, num_warps=8, num_stages=2),
    A.Config(block_h=32, block_n=32, num_warps=8, num_stages=3),
]
# the batch-1 decode case (csa2, FP4) at 16 heads a program, by warps and stages: in 4 warps (the default) its tile
# took 255 registers and a 64-byte stack for sm_90, in 8 warps 218 and none (Triton 3.8 offline)
DECODE_SWEEP = [A.Config(block_h=16, num_warps=w, num_stages=st) for w, st in ((4, 3), (8, 3), (8, 2), (4, 2))]


def ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


class Problem:
    """One decode step: B query rows, a pooled window store and global store per format, index lists."""

    def __init__(self, name: str, B: int, H: int, D: int, R: int, W: int, G: int, k: int | None, rotate: int,
                 device: str, seed: int = 0):
        self.name, self.B, self.H, self.D, self.G = name, B, H, D, G
        gen = torch.Generator(device=device).manual_seed(seed)
        self.q = torch.randn(B, H, D, device=device, generator=gen).to(torch.bfloat16)
        self.sink = torch.randn(H, device=device, generator=gen)
        ang = torch.rand(B, R // 2, device=device, generator=gen) * 1000
        self.cos, self.sin = ang.cos(), ang.sin()
        self.scale = D**-0.5
        win_x = torch.randn(B * W, D, device=device, generator=gen).to(torch.bfloat16)
        glob_x = torch.empty(B * G, D, device=device, dtype=torch.bfloat16)
        for i in range(0, B * G, 1 << 18):  # chunks keep the fp32 temporaries small
            n = min(1 << 18, B * G - i)
            glob_x[i : i + n] = torch.randn(n, D, device=device, generator=gen)
        base = torch.arange(B, device=device, dtype=torch.int32)[:, None]
        self.win_idx = base * W + torch.arange(W, device=device, dtype=torch.int32)
        if k is None:  # every entry
            self.glob_idx = [base * G + torch.arange(G, device=device, dtype=torch.int32)]
        else:
            self.glob_idx = []
            for _ in range(rotate):
                pick = torch.rand(B, G, device=device, generator=gen).topk(k, dim=1).indices.sort(dim=1).values
                self.glob_idx.append((base * G + pick).to(torch.int32))
        win8 = A.KV(A.FP8, *fp8_quant(win_x, 32))
        self.stores = {
            "fp4": (win8, A.KV(A.FP4, *nvfp4_quant(glob_x, 16))),
            "fp8": (win8, A.KV(A.FP8, *fp8_quant(glob_x, 32))),
            "bf16": (A.KV(A.BF16, win_x), A.KV(A.BF16, glob_x)),
        }

    def args(self, fmt: str, i: int = 0):
        win, glob = self.stores[fmt]
        idx = self.glob_idx[i % len(self.glob_idx)]
        return self.q, win, self.win_idx, glob, idx, self.sink, self.scale, self.cos, self.sin

    def kv_bytes(self, fmt: str) -> int:
        win, glob = self.stores[fmt]
        n_win = int((self.win_idx >= 0).sum())
        n_glob = int((self.glob_idx[0] >= 0).sum())
        return n_win * win.row_bytes() + n_glob * glob.row_bytes()

    def call_op(self, fmt: str, i: int = 0) -> torch.Tensor:
        """Through the registered custom op (dispatch, default config)."""
        q, win, win_idx, glob, glob_idx, sink, scale, cos, sin = self.args(fmt, i)
        if fmt == "bf16":
            return A.sparse_attn_bf16(q, win.data, win_idx, glob.data, glob_idx, sink, scale, cos, sin)
        op = A.sparse_attn_fp4 if fmt == "fp4" else A.sparse_attn_fp8
        return op(q, win.data, win.scale, win_idx, glob.data, glob.scale, glob_idx, sink, scale, cos, sin)


def check(p: Problem, fmt: str) -> dict:
    o = p.call_op(fmt)
    ref = A.sparse_attn_reference(*p.args(fmt))
    err = (o.float() - ref.float()).abs()
    bound = 2e-2 * ref.float().abs().max() + 1e-2 * ref.float().abs()
    rel = ((o.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
    return {"ok": bool((err <= bound).all()) and bool(torch.isfinite(o).all()), "max_abs_err": err.max().item(),
            "max_abs_ref": ref.float().abs().max().item(), "rel_l2_err": rel}


def time_call(p: Problem, fmt: str, cfg: A.Config, reps: int) -> float:
    """Microseconds per call: a CUDA graph of one call per index set, replayed; median over reps."""
    n = len(p.glob_idx) if p.glob_idx else 1
    fns = [lambda i=i: A.sparse_attn(*p.args(fmt, i), config=cfg) for i in range(n)]
    return common.time_calls(fns, reps, cuda=p.q.is_cuda, warmup=1)


def main() -> int:
    t_start = time.time()
    smoke = ARGS.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        print("needs CUDA (or --smoke)")
        return 2
    if smoke:
        H, D, R, W, topk, store = 4, 64, 16, 16, 32, 256
        batches, contexts, ratio, reps, rotate = ARGS.batches or [1, 2], ARGS.contexts or [256, 1024], ARGS.ratio, 1, 2
        sweep = [A.INTERPRETER_CONFIG]
    else:
        H, D, R, W, topk, store = 64, 512, 64, ARGS.window, ARGS.topk, ARGS.csa_store
        batches, contexts, ratio = ARGS.batches or [1, 8], ARGS.contexts or [8192, 65536, 524288], ARGS.ratio
        reps, rotate = ARGS.reps, ARGS.rotate
        sweep = SWEEP[:1] if ARGS.no_sweep else SWEEP
    meta = common.metadata(device)
    gpu = meta["gpu"]
    print(f"device: {gpu}; H={H} D={D} RoPE={R} window={W} top-k={topk} ratio={ratio}", flush=True)

    # ---- config sweep on the largest all-entries case, batch 1
    best: dict[str, A.Config] = {}
    sweep_rows = []
    p = Problem(f"all-{max(contexts)}", 1, H, D, R, W, max(contexts) // ratio, None, 1, device)
    for fmt in FORMATS:
        times = {}
        for cfg in sweep:
            try:
                t = time_call(p, fmt, cfg, max(3, reps // 4))
                times[cfg] = t
                sweep_rows.append({"format": fmt, "config": vars(cfg), "us": t})
            except Exception as e:  # noqa: BLE001 -- a config that does not compile or fit
                sweep_rows.append({"format": fmt, "config": vars(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
        best[fmt] = min(times, key=times.get) if times else sweep[0]
        shown = ", ".join(f"({c.block_h},{c.block_n},{c.num_warps},{c.num_stages}) {t:.0f}us" for c, t in times.items())
        print(f"sweep {fmt}: {shown}", flush=True)
    del p
    decode_sweep = []
    if not smoke:
        p = Problem("csa2", 1, H, D, R, W, store, topk, rotate, device)
        for cfg in DECODE_SWEEP:
            decode_sweep.append({"config": vars(cfg), "us": time_call(p, "fp4", cfg, reps)})
        print("decode sweep (csa2, batch 1, fp4; block_h, warps, stages): " + ", ".join(
            f"({r['config']['block_h']},{r['config']['num_warps']},{r['config']['num_stages']}) {r['us']:.1f}us"
            for r in decode_sweep), flush=True)
        del p

    # ---- cases
    cases = []
    specs = [("csa2", H, b, store, topk) for b in batches]
    specs += [(f"all-{ctx(c)}", H, b, c // ratio, None) for c in contexts for b in batches]
    shard = ARGS.shard_heads if ARGS.shard_heads is not None else ([] if smoke else [16])
    specs += [(f"all-{ctx(max(contexts))}", h, b, max(contexts) // ratio, None) for h in shard for b in batches]
    all_ok = True
    for name, h, B, G, k in specs:
        p = Problem(name, B, h, D, R, W, G, k, rotate if k else 1, device, seed=len(cases) + 1)
        row = {"case": name, "heads": h, "batch": B, "global_entries_per_seq": G, "selected_per_seq": k or G,
               "formats": {}}
        for fmt in FORMATS:
            cfg = best[fmt] if h == H else dataclasses.replace(best[fmt], block_h=0)
            chk = check(p, fmt)
            all_ok &= chk["ok"]
            us = time_call(p, fmt, cfg, reps)
            nbytes = p.kv_bytes(fmt)
            row["formats"][fmt] = {**chk, "us": us, "kv_bytes": nbytes, "gbs": nbytes / us / 1e3,
                                   "pct_peak": nbytes / us / 1e3 / ARGS.peak_gbs * 100, "config": vars(cfg)}
        f4, f8 = row["formats"]["fp4"], row["formats"]["fp8"]
        row["fp4_speedup_over_fp8"] = f8["us"] / f4["us"]
        row["fp4_bytes_saved_vs_fp8"] = 1 - f4["kv_bytes"] / f8["kv_bytes"]
        g4, g8 = p.stores["fp4"][1].row_bytes(), p.stores["fp8"][1].row_bytes()
        row["global_row_bytes"] = {"fp4": g4, "fp8": g8, "bf16": p.stores["bf16"][1].row_bytes()}
        cases.append(row)
        print(f"{name:>8} H={h} B={B}: " + "  ".join(f"{f} {row['formats'][f]['us']:.1f}us{'' if row['formats'][f]['ok'] else ' WRONG'}"
                                                for f in FORMATS), flush=True)
        del p
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- outputs
    result = {
        **meta,
        "shape": {"H": H, "D": D, "rope": R, "window": W, "topk": topk, "csa_store": store, "ratio": ratio},
        "peak_gbs": ARGS.peak_gbs, "sweep": sweep_rows, "decode_sweep": decode_sweep, "cases": cases,
        "all_correct": all_ok,
        "wall_s": time.time() - t_start,
        "goals": {"fp4_speedup_over_fp8": 1.45, "fp4_bytes_saved_vs_fp8": 0.44},
    }
    path = common.write_result("attention", smoke, result)
    common.save_figure(path.with_suffix(".png"), lambda fig, axes: plot(cases, fig, axes, gpu))

    print(f"\nus per decode step, KV GB/s, % of {ARGS.peak_gbs:.0f} GB/s; rows/seq: window + selected global rows")
    columns = [("case", "case", ""), ("H", "heads", "d"), ("B", "batch", "d"),
               ("rows/seq", lambda c: W + c["selected_per_seq"], "d")]
    for f in FORMATS:
        columns += [(f"{f} us", lambda c, f=f: c["formats"][f]["us"], ".1f"),
                    ("GB/s", lambda c, f=f: c["formats"][f]["gbs"], ".0f"),
                    ("%pk", lambda c, f=f: c["formats"][f]["pct_peak"], ".0f")]
    columns += [("fp4/fp8 speed", "fp4_speedup_over_fp8", ".2f"), ("bytes saved", "fp4_bytes_saved_vs_fp8", ".0%"),
                ("ok", lambda c: "yes" if all(c["formats"][f]["ok"] for f in FORMATS) else "NO", "")]
    common.print_table(columns, cases)
    g = cases[0]["global_row_bytes"]
    print(f"bytes per global entry: fp4 {g['fp4']}, fp8 {g['fp8']}, bf16 {g['bf16']} ({1 - g['fp4'] / g['fp8']:.1%} fewer "
          f"for fp4; 'bytes saved' above includes the FP8 window)")
    print(f"goals: fp4/fp8 speed >= 1.45x, bytes saved >= 44%; all correct: {all_ok}; "
          f"{time.time() - t_start:.0f} s; json: {path}")
    return 0 if all_ok else 1


def plot(cases, fig, axes, gpu: str) -> None:
    for B in sorted({c["batch"] for c in cases}):
        rows = [c for c in cases if c["case"].startswith("all-") and c["batch"] == B and c["heads"] == cases[0]["heads"]]
        xs = [c["global_entries_per_seq"] for c in rows]
        for fmt, style in zip(FORMATS, ("o-", "s--", "^:")):
            axes[0].plot(xs, [c["formats"][fmt]["us"] for c in rows], style, label=f"{fmt} B={B}")
            axes[1].plot(xs, [c["formats"][fmt]["gbs"] for c in rows], style, label=f"{fmt} B={B}")
    for ax, ylabel in zip(axes, ("us per decode step", "KV GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global entries per sequence (all read)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].axhline(ARGS.peak_gbs, color="gray", lw=0.8)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"dsv4 sparse attention decode, H=64 D=512: FP4 vs FP8 vs bf16 global KV ({gpu})", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())
