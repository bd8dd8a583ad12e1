"""V4.1's window row write (`dsv4::window_write`: kv_norm, RoPE and FP8 in one kernel) beside what the compiled
decode step ran before it: the norm and the rotation as torch.compile fuses them, then `dsv4::quant_write`.

    python bench/window_write.py          # H100 / H200: bytes checked, then the table; seconds
    python bench/window_write.py --smoke  # small rows on the CPU under the Triton interpreter

Cases: --rows tokens (a batch-1 step writes one row a layer; the bounded replay 128) of V4.1's 512-wide rows (64
rotated, FP8 blocks of 32), bf16, into a store of 8 slots x 256 rows. Timing: `common.time_calls` over rotating
input sets, "graph" replayed from a CUDA graph as the decode step runs them. The check: the store's bytes after
each path are the twin's (they may differ by one FP8 code where the mean square's summation order flips a bf16
rounding: counted in `codes_off`). JSON: $OUT/window_write.json if OUT is set, else bench/results/ (-smoke with
--smoke). The table is printed last.
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 128], help="tokens a call writes")
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")


ARGS = common.parse_args(__doc__, add_arguments)

import torch

from dsv4.fast.kernels.quant import quant_write
from dsv4.fast.kernels.window_write import window_rows, window_write, window_write_twin
from dsv4.fast.model import compile_options
from dsv4.reference.rope import Rotary

SLOTS, SLOT_ROWS, BLOCK, EPS = 8, 256, 32, 1e-6


def inputs(rows: int, width: int, rope: int, seed: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(rows, width, generator=g).bfloat16()
    weight = (1 + torch.randn(width, generator=g) / 4).bfloat16()
    cos, sin = Rotary(rope, 10000.0, None).cos_sin(torch.randint(0, 1 << 16, (rows,), generator=g))
    places = torch.randperm(SLOTS * SLOT_ROWS, generator=g)[:rows]
    return tuple(t.to(device) for t in (kv, weight, cos, sin, places // SLOT_ROWS, places % SLOT_ROWS))


def store(width: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(SLOTS, SLOT_ROWS, width, dtype=torch.uint8, device=device),
            torch.zeros(SLOTS, SLOT_ROWS, width // BLOCK, dtype=torch.uint8, device=device))


def main() -> None:
    started = time.time()
    device = common.bench_device(ARGS.smoke)
    cuda = device == "cuda"
    width, rope = (64, 16) if ARGS.smoke else (512, 64)
    reps = 2 if ARGS.smoke else ARGS.reps
    # what the step compiled before: inductor's norm and rotation kernels, with the decode step's options (its casts
    # rounded as eager's; the interpreter's CPU runs it eagerly)
    compiled = (torch.compile(window_rows, dynamic=False, options=compile_options("inductor", deterministic=True))
                if cuda else window_rows)
    results, checks = [], {}
    for rows in ARGS.rows:
        sets = [inputs(rows, width, rope, seed, device) for seed in range(2 if ARGS.smoke else 8)]
        data, scale = store(width, device)
        paths = {"fused": lambda s, d=data, c=scale: window_write(*s[:2], EPS, *s[2:4], d, c, *s[4:], BLOCK),
                 "before": lambda s, d=data, c=scale: quant_write(compiled(*s[:2], EPS, *s[2:4]), d, c, *s[4:], "fp8",
                                                                  BLOCK)}
        want = store(width, device)
        window_write_twin(*sets[0][:2], EPS, *sets[0][2:4], *want, *sets[0][4:], BLOCK)
        row = {"case": f"{rows}x{width}", "rows": rows, "width": width}
        for name, path in paths.items():
            data.zero_(), scale.zero_()
            path(sets[0])
            off = ((data.view(torch.int8).short() - want[0].view(torch.int8).short()).abs() > 1).sum().item()
            checks[f"{name} {rows}"] = {"ok": torch.equal(scale, want[1]) and off == 0,
                                        "codes_off": (data != want[0]).sum().item()}
            for mode in common.modes(device):
                row[f"{mode}_{name}_us"] = common.time_calls([lambda s=s, p=path: p(s) for s in sets], reps,
                                                             graph=mode == "graph", cuda=cuda)
        results.append(row)
    meta, path = common.write_timed_result("window_write", device, ARGS.smoke, started, reps, checks, results)
    common.print_summary(meta["gpu"], checks, path, meta["wall_s"], key="")
    columns = [("case", "case", "")] + [(f"{mode} {name} us", f"{mode}_{name}_us", ".2f")
                                        for mode in common.modes(device) for name in ("fused", "before")]
    print()
    common.print_table(columns, results)
    common.exit_if_failed(checks)


if __name__ == "__main__":
    main()
