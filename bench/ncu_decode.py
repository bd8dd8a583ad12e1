"""Why do the batch-1 decode kernels stream below the copy rate? Nsight Compute's counters for the layer's largest
launches at V4.1 widths, each on weights cold in the L2 (as the step's 40 layers leave them): the MoE gather's up
and down kernels (`dsv4::moe_gather_slots`, six routed experts and the shared one's FP8 rows), the FP8 GEMVs of
wq_b + the indexer's wq_b and of wo_b at one row, and the gate GEMM with its routing.

    ncu --clock-control none --kernel-name regex:'_gather|_fp8_gemv|_gate_gemm' --launch-skip 10 --launch-count 10 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats python bench/ncu_decode.py --rounds 2   # GPU: ncu reads the counters
    python bench/ncu_decode.py                                   # GPU: the launches alone (a run to check)

What it answers: the share of cycles a scheduler issues, the warps eligible a cycle, and what the others wait on
(long scoreboard: a global or L1TEX load; wait / short scoreboard: fixed-latency or shared-memory dependencies;
math pipe throttle; barrier; not selected) at the occupancy the registers allow. A kernel held by its issue slots
issues most cycles; one held by its loads' latency waits on the long scoreboard with few warps eligible.
Each kernel runs --rounds times on --sets weight sets in turn (more bytes than the L2 holds); skip the first
round's launches (warm-up: Triton's compiles) with ncu's --launch-skip (5 launches a weight set). Prints nothing
but a line a round; ncu writes the report.
Measured (session 60, H100, `dev/ncu-decode-{sections,raw}-a7b0da2-h100-s60.txt`; BENCHMARKS "Session 60"): the
gather loops issue in 58-62% of cycles at 8-10 programs an SM, their warps waiting on their copies (long scoreboard,
half of the stall); the down kernel's grid 1.70 waves (SMs active 85% of the launch); the FP8 GEMVs' SMs active 82%,
wo_b at 2.4 warps a scheduler; the gate's routing alone on one SM for half of its launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (the repository root on sys.path: `dsv4` importable uninstalled)
import torch  # noqa: E402

from dsv4.fast.kernels import moe_experts as M  # noqa: E402
from dsv4.fast.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from dsv4.fast.kernels.moe_routing import gate_route  # noqa: E402
from dsv4.quant import quantize_fp8  # noqa: E402

E, D, I, TOPK, LIMIT = 384, 5120, 2304, 6, 10.0  # V4.1-Flash's MoE
BLOCK = (32, 32)  # V4.1's FP8 blocks
GEMVS = {"wq_b+idx": (64 * 512 + 32 * 128, 1280), "wo_b": (5120, 8 * 1024)}  # (rows, K) at V4.1 widths


def fp8_weight(rows: int, cols: int, g: torch.Generator, dev) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(torch.randn(rows, cols, generator=g, device=dev) / cols**0.5, BLOCK)


def expert_set(g: torch.Generator, dev) -> dict:
    """E experts' MXFP4 w13 / w2 (codes left as allocated: only the six the ids pick are read, and any byte is two
    codes) and the shared expert's FP8 rows."""
    u8 = {"device": dev, "dtype": torch.uint8}
    w = {"w13": torch.empty(E, 2 * I, D // 2, **u8), "w2": torch.empty(E, D, I // 2, **u8),  # any byte is 2 codes
         "s13": torch.randint(118, 123, (E, 2 * I, D // 32), generator=g, **u8),  # e8m0: not 0xFF (NaN)
         "s2": torch.randint(118, 123, (E, D, I // 32), generator=g, **u8)}
    for name, rows, cols in (("sh13", 2 * I, D), ("sh2", D, I)):
        w[name + "_rows"] = M.fp8_rows(*fp8_weight(rows, cols, g, dev), BLOCK)
        w[name] = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)  # the dense copy: unread with FP8 rows
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", type=int, default=2, help="expert weight sets in turn (each 6 of 384 experts' tables)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a check of the calls under the Triton interpreter")
    args = p.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, D, generator=g, device=dev).bfloat16()
    planes = M.activation_planes(x)
    experts = [expert_set(g, dev) for _ in range(args.sets)]
    ids = [torch.randperm(E, generator=g, device=dev)[:TOPK][None] for _ in range(args.sets)]
    wts = torch.full((1, TOPK), 0.25, device=dev)
    gemvs = {name: [fp8_weight(n, k, g, dev) for _ in range(args.sets)] for name, (n, k) in GEMVS.items()}
    gemv_x = {name: torch.randn(1, k, generator=g, device=dev).bfloat16() for name, (_, k) in GEMVS.items()}
    gate = [torch.randn(E, D, generator=g, device=dev).bfloat16() for _ in range(args.sets)]
    bias = torch.zeros(E, device=dev)
    for r in range(args.rounds):
        for s in range(args.sets):
            w = experts[s]
            M.moe_gather_slots(x, planes, ids[s], wts, w["w13"], w["s13"], w["w2"], w["s2"], w["sh13"], w["sh2"],
                               LIMIT, *w["sh13_rows"], *w["sh2_rows"])
            for name in GEMVS:
                fp8_gemv(gemv_x[name], *gemvs[name][s], *BLOCK, torch.bfloat16, 1)
            gate_route(x, gate[s], bias, None, TOPK, 1.0, 1.5, True, "sqrtsoftplus")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"round {r} done")


if __name__ == "__main__":
    main()
