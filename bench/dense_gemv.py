"""The dense GEMV (dsv4::dense_gemv) against cuBLAS, at the attention's dense linears on x in a decode step: does
one launch beat cuBLAS's split K and its reduce? (The fast model runs cuBLAS there until this says so.)

    python bench/dense_gemv.py          # H200: exactness, then timings; about a minute
    python bench/dense_gemv.py --smoke  # small shapes on the CPU under the Triton interpreter
    python bench/dense_gemv.py --replot bench/results/dense_gemv.json   # the PNG again, from the JSON

Cases, V4.1-Flash widths (the full-width config): "x bf16", an index layer's bf16 linears on x as the fast model
concatenates them (wq_a, wkv, the indexer's weights_proj; bf16 output, against F.linear), and "x fp32", a CSA
layer's compressors' (its compressor's wkv and wgate, its indexer's; fp32 output, against the fast model's
`mm_fp32_out`), at M = 1, 2, 4 rows, and at one row a sweep of tiles (graph_sweep_us). Bytes: the weight, the
activations and the output. Timing: CUDA events, the median of --reps samples of R calls on R rotating weight
sets (past L2), per call; "graph": replayed from a CUDA graph, as the decode step runs them. Exactness: within the
fp32 summation-order bound of the twin (tests/fast/test_dense_gemv_kernel.py's). JSON to $OUT/dense_gemv.json if
OUT is set, else bench/results/dense_gemv.json (dense_gemv-smoke.json with --smoke), and a PNG beside it. The table
is printed last.
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a result file")


ARGS = common.parse_args(__doc__, add_arguments)

import torch
import torch.nn.functional as F
from full_width import full_width_config

from dsv4.fast.kernels.dense_gemv import _dense_gemv_triton, dense_gemv, dense_gemv_reference
from dsv4.fast.model import mm_fp32_out

SMOKE_SHAPES = {"x bf16": (96, 256, torch.bfloat16), "x fp32": (80, 192, torch.float32)}
# tiles at one row, for choosing the defaults: a program's bytes in flight are about BN x BK x 2 x (stages - 1)
SWEEP = [{"BN": bn, "BK": bk, "stages": st, "num_warps": nw}
         for bn, bk, st, nw in [(2, 256, 4, 2), (4, 128, 4, 2), (4, 256, 4, 2), (4, 256, 6, 2), (4, 512, 3, 2),
                                (8, 128, 4, 2), (8, 256, 4, 2), (8, 256, 4, 4), (16, 128, 3, 4), (16, 256, 3, 4)]]


def decode_gemvs() -> dict[str, tuple[int, int, torch.dtype]]:
    """(N, K, output dtype) by case at the full-width V4.1 config: the index layer's bf16 part on x, and a CSA
    layer's compressors (coff = 2 at ratio 4: wkv and wgate of 2 x head_dim rows, the indexer's of 2 x its own)."""
    c = full_width_config("v41", 1)
    bf16_rows = c.q_lora_rank + c.head_dim + c.index_n_heads
    fp32_rows = 2 * (2 * c.head_dim) + 2 * (2 * c.index_head_dim)
    return {"x bf16": (bf16_rows, c.hidden_size, torch.bfloat16), "x fp32": (fp32_rows, c.hidden_size, torch.float32)}


plot = common.plot_by_case("dense GEMV vs cuBLAS", "cublas")


def cublas(x, w, out_dtype):
    """The fast model's path without the GEMV: F.linear, or mm_fp32_out for fp32 output (the CPU: in fp32)."""
    if out_dtype == torch.float32:
        return mm_fp32_out(x, w) if x.is_cuda else F.linear(x.float(), w.float())
    return F.linear(x, w)


def main():
    if ARGS.replot:
        return common.replot(ARGS.replot, plot)
    device = common.bench_device(ARGS.smoke)
    shapes = SMOKE_SHAPES if ARGS.smoke else decode_gemvs()
    ms = (1, 2) if ARGS.smoke else (1, 2, 4)
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()
    results, checks = [], {}
    for name, (N, K, out_dtype) in shapes.items():
        nsets = 2 if ARGS.smoke else max(2, min(8, -(-256 * 2**20 // (2 * N * K))))
        g = torch.Generator().manual_seed(N + K)
        sets = [torch.randn(N, K, generator=g).to(torch.bfloat16).to(device) for _ in range(nsets)]
        for M in ms:
            x = torch.randn(M, K, device=device).to(torch.bfloat16)
            y = dense_gemv(x, sets[0], out_dtype).float()
            twin = dense_gemv_reference(x, sets[0], torch.float32)
            bound = 1e-5 * (x.abs().float() @ sets[0].abs().float().T) + twin.abs() * 2.0**-8
            case = f"{name} M={M}"
            checks[case] = {"ok": bool(((y - twin).abs() <= bound + 1e-30).all()),
                            "max_abs_diff": float((y - twin).abs().max())}

            def calls(fast, x=x, out_dtype=out_dtype, sets=sets):
                fn = dense_gemv if fast else cublas
                return [lambda w=w: fn(x, w, out_dtype) for w in sets]

            nbytes = 2 * N * K + 2 * M * K + M * N * (4 if out_dtype == torch.float32 else 2)
            row = {"case": name, "N": M, "out_features": N, "in_features": K, "out_dtype": str(out_dtype),
                   "rotating_sets": nsets, "bytes": nbytes}
            common.time_fused_vs_baseline(row, calls, reps, device, "cublas", nbytes, nbytes)
            if device == "cuda" and M == 1:  # tiles, for choosing the defaults (graph mode)
                row["graph_sweep_us"] = {
                    "BN{BN}_BK{BK}_st{stages}_w{num_warps}".format(**c): common.time_calls(
                        [lambda w=w, c=c, x=x, out_dtype=out_dtype: _dense_gemv_triton(x, w, out_dtype, c)
                         for w in sets], reps)
                    for c in SWEEP}
            results.append(row)

    common.finish_fused_vs_baseline("dense_gemv", device, ARGS.smoke, t_start, reps, checks, results, "cublas", plot)


if __name__ == "__main__":
    main()
