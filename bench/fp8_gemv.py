"""The weight-only FP8 GEMV (dsv4::fp8_gemv) against cuBLAS on the bf16 copies the fast model reads today, at
V4.1's attention projections and decode batch sizes: does one byte a weight beat two?

    python bench/fp8_gemv.py          # H200: exactness, then timings; ~1-2 minutes
    python bench/fp8_gemv.py --arch v4   # V4-Flash's widths and 128 x 128 blocks (fp8_gemv-v4.json)
    python bench/fp8_gemv.py --rows 1 2  # only the decode step's batch-1 and 2 rows (their tile sweeps)
    python bench/fp8_gemv.py --smoke  # small shapes on the CPU under the Triton interpreter
    python bench/fp8_gemv.py --replot bench/results/fp8_gemv.json   # the PNG again, from the JSON

Cases: the decode step's FP8 GEMVs at V4.1 widths and blocks (32 x 32; --arch v4: V4's, 128 x 128), M = 1, 2, 4, 8, 16
activation rows: wq_b and the indexer's wq_b concatenated (one weight, as the fast model reads the query latent's
linears), wo_a (8 groups, each its own 4096 columns of x), wo_b, and wq_a with wkv (x's linears in a layer without an
indexer). "fused" is the FP8 GEMV (its default tiles), "cublas" the fast model's bf16 path on the weight dequantized
to bf16 (exactly): F.linear, or for wo_a its einsum (a batched GEMM). Bytes: the weight as each reads it (FP8 +
scales, or bf16), the activations and the output. Timing: CUDA events, the median of --reps samples of R calls on R
rotating weight sets (past L2), per call; "graph": replayed from a CUDA graph, as the decode step runs them; at M = 1
and 2 also a sweep of tiles (graph_sweep_us), and for the one-group cases the GEMV with its RMSNorm in the kernel
(`graph_normed_us`, the step's form for wq_b, which sums x's squares before its K loop) and the same sweep so
(`graph_normed_sweep_us`), and with x's sum of squares handed on (`squares_by_step`, 80 partial sums at V4.1's width;
`graph_squared_us`: the step's form for wq_a + wkv, whose x the FFN post before made; its output's bits against the
summing form's in the checks, `squared_bits_equal`, which may differ in a last bit); and the default tile and the
sweep with the weight steps as bulk tensor copies (TMA: `graph_tma_us`, `graph_tma_sweep_us`, `graph_tma_normed_us`;
their bits against the pointer loads' in the checks). Exactness: within the fp32 summation-order bound of the twin
(tests/fast/test_fp8_gemv_kernel.py's). JSON to $OUT/fp8_gemv.json if OUT is set, else bench/results/fp8_gemv.json
(fp8_gemv-smoke.json with --smoke), and a PNG beside it. The table is printed last.
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a result file")
    p.add_argument("--arch", choices=("v41", "v4"), default="v41", help="whose widths and FP8 blocks")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="activation rows M to run")


ARGS = common.parse_args(__doc__, add_arguments)

import torch
import torch.nn.functional as F
from full_width import full_width_config

from dsv4.fast.kernels.fp8_gemv import _fp8_gemv_triton, fp8_gemv, fp8_gemv_reference
from dsv4.fast.kernels.mhc import squares_by_step
from dsv4.quant import dequantize_fp8, quantize_fp8

SMOKE_SHAPES = {"small": (96, 256, 1), "grouped": (64, 128, 2)}
# tiles for tuning the defaults. At one row a program's bytes in flight are about BN x BK x (stages - 1): the
# GEMVs with fewer weight rows (wo_b's 5120) streamed slower at 128-wide K steps, so wider steps are in the sweep
SWEEP = [{"BN": bn, "BK": bk, "stages": st, "num_warps": nw}
         for bn, bk, st, nw in [(8, 128, 4, 2), (8, 128, 6, 2), (8, 256, 4, 2), (8, 256, 6, 2), (8, 512, 4, 2),
                                (8, 512, 6, 2), (16, 128, 4, 2), (16, 128, 4, 4), (16, 256, 4, 2), (16, 256, 4, 4),
                                (16, 512, 4, 4), (32, 128, 3, 4), (32, 128, 4, 4), (32, 256, 3, 4),
                                (4, 256, 4, 2), (4, 512, 4, 2)]]


def decode_gemvs(arch: str) -> tuple[dict, tuple[int, int]]:
    """The decode step's FP8 GEMVs at the full-width config's widths, (N, K, groups) by name, and its FP8 blocks."""
    c = full_width_config(arch, 1)
    heads = c.num_attention_heads * c.head_dim
    return ({"wq_b+idx": (heads + c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1),
             "wo_a": (c.o_groups * c.o_lora_rank, heads // c.o_groups, c.o_groups),
             "wo_b": (c.hidden_size, c.o_groups * c.o_lora_rank, 1),
             "wq_a+wkv": (c.q_lora_rank + c.head_dim, c.hidden_size, 1)}, tuple(c.weight_block_size))


def make_set(N, K, block, device, seed):
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_fp8(torch.randn(N, K, generator=g), block)
    return w.to(device), s.to(device), dequantize_fp8(w, s, block).to(torch.bfloat16).to(device)


def bf16_path(x, wb, groups):
    """The fast model's GEMM on the bf16 copy: F.linear, per group an einsum as Attention._output's for wo_a."""
    if groups == 1:
        return F.linear(x, wb)
    M, (N, K) = x.shape[0], wb.shape
    return torch.einsum("mgk,gnk->mgn", x.view(M, groups, K), wb.view(groups, N // groups, K)).reshape(M, N)


def tile_sweep(x, sets, block, G, norm, reps, tma: bool = False) -> dict:
    """us a call of each SWEEP tile over the rotating weight sets, in a CUDA graph; with the in-kernel RMSNorm
    where norm is given (a program's prologue is paid once a program: the tile sets how many pay it); tma: the
    weight steps as bulk tensor copies (`_tma_tiles`)."""
    return {"BN{BN}_BK{BK}_st{stages}_w{num_warps}".format(**c): common.time_calls(
        [lambda w=w, s=s, c=c: _fp8_gemv_triton(x, w, s, *block, torch.bfloat16, G, {**c, "tma": tma}, norm, 1e-6)
         for w, s, _ in sets], reps) for c in SWEEP}


plot = common.plot_by_case("FP8 GEMV vs cuBLAS bf16", "cublas")


def main():
    if ARGS.replot:
        return common.replot(ARGS.replot, plot)
    device = common.bench_device(ARGS.smoke)
    shapes, block = (SMOKE_SHAPES, (32, 32)) if ARGS.smoke else decode_gemvs(ARGS.arch)
    ms = (1, 2) if ARGS.smoke else ARGS.rows
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()
    results, checks = [], {}
    for name, (N, K, G) in shapes.items():
        fp8_bytes = N * K + -(-N // block[0]) * -(-K // block[1])
        nsets = 2 if ARGS.smoke else max(2, min(8, -(-256 * 2**20 // fp8_bytes)))
        sets = [make_set(N, K, block, device, 31 * N + K + i) for i in range(nsets)]
        for M in ms:
            x = torch.randn(M, G * K, device=device).to(torch.bfloat16)
            w, s, wb = sets[0]
            y = fp8_gemv(x, w, s, *block, torch.bfloat16, G).float()
            twin = fp8_gemv_reference(x, w, s, *block, torch.float32, G)
            bound = 1e-5 * bf16_path(x.abs().float(), wb.abs().float(), G) + twin.abs() * 2.0**-8
            case = f"{name} M={M}"
            checks[case] = {"ok": bool(((y - twin).abs() <= bound + 1e-30).all()),
                            "max_abs_diff": float((y - twin).abs().max())}

            def calls(fast, x=x, sets=sets, G=G):
                if fast:
                    return [lambda w=w, s=s: fp8_gemv(x, w, s, *block, torch.bfloat16, G) for w, s, _ in sets]
                return [lambda wb=wb: bf16_path(x, wb, G) for _, _, wb in sets]

            io = 2 * M * (G * K + N)
            row = {"case": name, "N": M, "out_features": N, "in_features": K, "groups": G, "rotating_sets": nsets,
                   "fp8_bytes": fp8_bytes + io, "bf16_bytes": 2 * N * K + io}
            common.time_fused_vs_baseline(row, calls, reps, device, "cublas", fp8_bytes + io, 2 * N * K + io)
            if device == "cuda" and M in (1, 2):  # tiles, for tuning the defaults (graph mode)
                row["graph_sweep_us"] = tile_sweep(x, sets, block, G, None, reps)
                # the same tiles with the weights through the copy engine, and its bits at the default tile
                checks[case]["tma_bits_equal"] = bool(torch.equal(
                    _fp8_gemv_triton(x, w, s, *block, torch.bfloat16, G, {"tma": True}),
                    _fp8_gemv_triton(x, w, s, *block, torch.bfloat16, G)))
                checks[case]["ok"] &= checks[case]["tma_bits_equal"]
                row["graph_tma_us"] = common.time_calls(
                    [lambda w=w, s=s, x=x: _fp8_gemv_triton(x, w, s, *block, torch.bfloat16, G, {"tma": True})
                     for w, s, _ in sets], reps)
                row["graph_tma_sweep_us"] = tile_sweep(x, sets, block, G, None, reps, tma=True)
                if G == 1:  # the RMSNorm's prologue: every program sums x's squares before its K loop
                    norm = torch.rand(K, device=device).to(torch.bfloat16)
                    row["graph_normed_us"] = common.time_calls(
                        [lambda w=w, s=s, x=x, norm=norm: fp8_gemv(x, w, s, *block, torch.bfloat16, 1, norm, 1e-6)
                         for w, s, _ in sets], reps)
                    row["graph_normed_sweep_us"] = tile_sweep(x, sets, block, G, norm, reps)
                    squares = squares_by_step(x)  # as the mHC post hands them on: a sum a d step
                    checks[case]["squared_bits_equal"] = bool(torch.equal(
                        fp8_gemv(x, w, s, *block, torch.bfloat16, 1, norm, 1e-6, squares=squares),
                        fp8_gemv(x, w, s, *block, torch.bfloat16, 1, norm, 1e-6)))
                    row["graph_squared_us"] = common.time_calls(
                        [lambda w=w, s=s, x=x, norm=norm, sq=squares: fp8_gemv(x, w, s, *block, torch.bfloat16, 1,
                                                                               norm, 1e-6, squares=sq)
                         for w, s, _ in sets], reps)
                    row["graph_tma_normed_us"] = common.time_calls(
                        [lambda w=w, s=s, x=x, norm=norm: _fp8_gemv_triton(x, w, s, *block, torch.bfloat16, 1,
                                                                           {"tma": True}, norm, 1e-6)
                         for w, s, _ in sets], reps)
            results.append(row)

    name = "fp8_gemv" if ARGS.arch == "v41" else f"fp8_gemv-{ARGS.arch}"
    common.finish_fused_vs_baseline(name, device, ARGS.smoke, t_start, reps, checks, results, "cublas", plot,
                                    arch=ARGS.arch, block=list(block))


if __name__ == "__main__":
    main()
