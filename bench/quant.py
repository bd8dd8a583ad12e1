"""The cache quantization kernel (dsv4::fp8_quant, mxfp4_quant, nvfp4_quant) at its tiles side by side: the tiles
`quant_config` picks (default), the prefill tiles every input had before it (4096 values, 4 warps a program), and
a decode entry's blocks in one 4-warp program.

    python bench/quant.py          # H200: exactness on CUDA, then timings; seconds
    python bench/quant.py --smoke  # small rows on the CPU under the Triton interpreter

Cases (bf16 rows, V4.1 widths): one token's cache writes, as a batch-1 decode step makes them (a 512-wide window
entry in FP8, a compressed entry in NVFP4, a 128-wide index key in MXFP4), the same for 32 tokens, and a
4096-token prefill chunk (where the default is the prefill tile). Timing: CUDA events, the median of --reps
samples of R calls on R rotating input sets, per call; "graph": replayed from a CUDA graph, as decode runs them.
Exactness: every tile gives dsv4.quant's bytes. JSON to $OUT/quant.json if OUT is set, else
bench/results/quant.json (quant-smoke.json with --smoke). The table is printed last.
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4 import quant as ref
from dsv4.fast.kernels import quant, triton

# format: (reference codec, block)
FORMATS = {"fp8": (lambda x, b: ref.quantize_fp8(x, (b,)), 32), "nvfp4": (ref.quantize_nvfp4, 16),
           "mxfp4": (ref.quantize_mxfp4, 32)}
# (format, rows, width): each format at one token, at 32 tokens and at a prefill chunk
CASES = [(f, rows, 128 if f == "mxfp4" else 512) for rows in (1, 32, 4096) for f in FORMATS]
SMOKE_CASES = [("fp8", 1, 64), ("nvfp4", 1, 64), ("mxfp4", 3, 64)]


def tiles(rows: int, cols: int, block: int) -> dict[str, dict | None]:
    """The tile configurations timed: name -> quant_config overrides (None: its own choice); one 4-warp program
    only where the blocks fit the prefill tile's 4096 values."""
    prefill = quant.quant_config(4096, 4096, block)
    out = {"default": None, "prefill": {"ROWS": prefill["ROWS"], "num_warps": prefill["num_warps"]}}
    n_blocks = rows * cols // block
    if n_blocks <= prefill["ROWS"]:
        out["one_program_4w"] = {"ROWS": triton.next_power_of_2(n_blocks), "num_warps": 4}
    return out


TILES = ("default", "prefill", "one_program_4w")


def main():
    device = common.bench_device(ARGS.smoke)
    reps = 3 if ARGS.smoke else ARGS.reps
    t_start = time.time()
    results, checks = [], {}
    for fmt, rows, cols in SMOKE_CASES if ARGS.smoke else CASES:
        (reference, block), code = FORMATS[fmt], quant.FORMAT_CODES[fmt]
        name = f"{fmt} {rows}x{cols}"
        nbytes = rows * cols * 2 + rows * cols * (1 if fmt == "fp8" else 0.5) + rows * cols // block
        nsets = 2 if ARGS.smoke else max(2, min(32, int(64 * 2**20 // nbytes)))
        g = torch.Generator(device=device).manual_seed(rows * cols)
        sets = [torch.randn(rows, cols, generator=g, device=device).bfloat16() for _ in range(nsets)]  # [rows, cols]
        want = [t.view(torch.uint8) for t in reference(sets[0], block)]
        row = {"case": name, "format": fmt, "rows": rows, "cols": cols, "rotating_sets": nsets, "bytes": nbytes}
        checks[name] = {"ok": True}
        for tile, cfg in tiles(rows, cols, block).items():
            got = quant._launch(sets[0], block, code, cfg)
            checks[name]["ok"] &= all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
            row[f"{tile}_cfg"] = quant.quant_config(rows, cols, block, cfg)
            for mode in common.modes(device):
                fns = [lambda x=x, b=block, c=code, cfg=cfg: quant._launch(x, b, c, cfg) for x in sets]
                row[f"{mode}_{tile}_us"] = common.time_calls(fns, reps, graph=mode == "graph", cuda=device == "cuda")
        results.append(row)

    meta, path = common.write_timed_result("quant", device, ARGS.smoke, t_start, reps, checks, results)
    common.print_summary(meta["gpu"], checks, path, meta["wall_s"], key="")
    columns = [("case", "case", "")]
    for mode in common.modes(device):
        columns += [(f"{mode} {tile} us", f"{mode}_{tile}_us", ".2f") for tile in TILES]
    print()
    common.print_table(columns, results)
    common.exit_if_failed(checks)


if __name__ == "__main__":
    main()
