"""Can the decode step's latency-bound chains run beside its weight-streaming GEMVs? Two streams of one CUDA graph
against one stream, at V4.1 widths, batch 1.

    python bench/overlap.py               # H200: checks, then the table
    python bench/overlap.py --chain 1 2   # top-k selects in the chain (default 1 2 4)
    python bench/overlap.py --smoke       # tiny sizes on the CPU under the Triton interpreter (one stream there)

Why: in the batch-1 step an indexer layer's selection (pool scores, block selection, two top-k stages: ~35 us in
session 38's profile) runs after the GEMV that streams wq_b with the indexer's wq_b (47 MB of FP8, ~15 us), and
reads almost no bytes; the memory sits idle while it runs. Only the indexer's 4096 rows of that GEMV feed the
selection, so with them first the rest of the GEMV (and the query's and KV's norms, RoPE and cache writes) could
run beside it on a second stream. This bench measures what such an overlap can buy before the step is restructured:
- A: `dsv4::fp8_gemv` at wq_b + indexer wq_b's shape (36864 x 1280, 32 x 32 blocks), one row, over --sets weight
  sets in turn (so the weights come from memory, as they do across layers);
- B: --chain calls of `dsv4::topk_select` (top-512 of a 16384-column row: two stages, as an 8K pool row),
  one after another on one stream.
Each case is one CUDA graph replayed (`common.time_calls`): A alone, B alone, A then B on one stream, and B on a
second stream forked from the first (an event each way) while A runs on the first, that stream at the default
priority and at a higher one ("B urgent": B's programs first where both kernels wait for an SM). "saved" is
serial minus the better two-stream case; "ideal" is max(A, B). The two-stream outputs are checked equal to the
one-stream ones first.

A second way to the same end, on one stream: while B runs, the L2 fetches the weights A reads next. "B then A"
against "L2, B, A", where a launch before B asks the L2 for the first --prefetch-mb of A's weights
(`prefetch.global.L2::evict_last` a 128-byte line, nothing waiting on it, so its programs end at once), and "A
hot" (A's time with its weights already in the L2: A twice on one set, less A once) for the best that can come of
it. "L2 saved" is "B then A" minus "L2, B, A". On the CPU the prefetch launches nothing.
JSON: $OUT/overlap.json if OUT is set, else bench/results/overlap.json (overlap-smoke.json with --smoke).
"""

from __future__ import annotations

import time

import common


def add_arguments(p):
    p.add_argument("--chain", type=int, nargs="*", default=[1, 2, 4], help="top-k selects in chain B")
    p.add_argument("--sets", type=int, default=4, help="weight sets A rotates over (4 x 47 MB: more than the L2)")
    p.add_argument("--reps", type=int, default=30, help="timed samples per case (median)")
    p.add_argument("--prefetch-mb", type=float, default=40.0,
                   help="of A's weights, the MB asked of the L2 ahead of B (the H100's and H200's L2: 50 MB)")


ARGS = common.parse_args(__doc__, add_arguments)

import torch
import triton
import triton.language as tl
from full_width import full_width_config

from dsv4.fast.kernels.fp8_gemv import fp8_gemv
from dsv4.fast.kernels.topk import topk_select
from dsv4.quant import quantize_fp8


def shapes(smoke: bool) -> dict:
    """A's weight rows, K and FP8 blocks; B's row width and k."""
    if smoke:
        return {"N": 256, "K": 128, "block": (32, 32), "cols": 256, "k": 32}
    c = full_width_config("v41", 1)
    return {"N": c.num_attention_heads * c.head_dim + c.index_n_heads * c.index_head_dim, "K": c.q_lora_rank,
            "block": tuple(c.weight_block_size), "cols": 16384, "k": c.index_topk}


def make_inputs(s: dict, sets: int, chain: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    weights = [quantize_fp8(torch.randn(s["N"], s["K"], generator=g), s["block"]) for _ in range(sets)]
    return {"x": torch.randn(1, s["K"], generator=g).to(torch.bfloat16).to(device),
            "weights": [(w.to(device), sc.to(device)) for w, sc in weights],
            "scores": [torch.randn(1, s["cols"], generator=g).to(device) for _ in range(chain)]}


def gemv(inputs: dict, i: int, s: dict) -> torch.Tensor:
    w, sc = inputs["weights"][i]
    return fp8_gemv(inputs["x"], w, sc, *s["block"], torch.bfloat16)


def selects(inputs: dict, s: dict) -> list[torch.Tensor]:
    return [topk_select(row, s["k"]) for row in inputs["scores"]]


@triton.jit
def _l2_prefetch_kernel(ptr, n_lines, LINES: tl.constexpr):
    """Asks the L2 for LINES 128-byte lines a program from the bytes at ptr: no register waits for them, so the
    program ends while they arrive."""
    line = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), n_lines - 1)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptr + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int) -> None:
    """The first `nbytes` of t's storage asked of the L2 (CUDA only: no launch elsewhere)."""
    if not t.is_cuda:
        return
    n_lines, LINES = max(1, min(nbytes, t.nbytes) // 128), 512
    _l2_prefetch_kernel[(triton.cdiv(n_lines, LINES),)](t.view(torch.uint8), n_lines, LINES=LINES, num_warps=4)


def b_then_a(inputs: dict, i: int, s: dict, prefetch_bytes: int = 0):
    """B then A with weight set i, A's first `prefetch_bytes` of weights asked of the L2 before B."""
    if prefetch_bytes:
        l2_prefetch(inputs["weights"][i][0], prefetch_bytes)
    return selects(inputs, s), gemv(inputs, i, s)


def two_streams(a, b, side):
    """b on `side`, forked from the current stream and joined back, while a runs on the current stream; without a
    side stream (or CUDA), a then b on the current one."""
    if side is None:
        return a(), b()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_b = b()
    out_a = a()
    torch.cuda.current_stream().wait_stream(side)
    return out_a, out_b


def cases(inputs: dict, s: dict, side, urgent) -> dict:
    """Each case as a list of calls, one a weight set (the timed unit is their mean). `urgent`: a side stream of
    higher priority, so B's programs go first wherever both kernels wait for an SM."""
    sets = range(len(inputs["weights"]))
    return {
        "A alone": [lambda i=i: gemv(inputs, i, s) for i in sets],
        "B alone": [lambda: selects(inputs, s) for _ in sets],
        **{name: [lambda i=i, st=st: both(inputs, i, s, st) for i in sets]
           for name, st in (("A then B", None), ("two streams", side), ("B urgent", urgent))},
        "B then A": [lambda i=i: b_then_a(inputs, i, s) for i in sets],
        "L2, B, A": [lambda i=i: b_then_a(inputs, i, s, int(ARGS.prefetch_mb * 2**20)) for i in sets],
        "A twice": [lambda i=i: (gemv(inputs, i, s), gemv(inputs, i, s)) for i in sets],
    }


def both(inputs: dict, i: int, s: dict, side):
    """A with weight set i and B, through `two_streams`."""
    return two_streams(lambda: gemv(inputs, i, s), lambda: selects(inputs, s), side)


def same_outputs(inputs: dict, s: dict, side) -> bool:
    """The two-stream calls give what the one-stream calls give, bit for bit."""
    one, two = both(inputs, 0, s, None), both(inputs, 0, s, side)
    if side is not None:
        torch.cuda.synchronize()
    return torch.equal(one[0], two[0]) and all(torch.equal(a, b) for a, b in zip(one[1], two[1]))


def main() -> None:
    started = time.perf_counter()
    device = common.bench_device(ARGS.smoke)
    cuda = device == "cuda"
    s = shapes(ARGS.smoke)
    side = torch.cuda.Stream() if cuda else None
    urgent = torch.cuda.Stream(priority=-1) if cuda else None
    reps = 2 if ARGS.smoke else ARGS.reps
    rows = []
    for chain in ARGS.chain:
        inputs = make_inputs(s, 1 if ARGS.smoke else ARGS.sets, chain, device)
        row = {"chain": chain, "ok": same_outputs(inputs, s, side)}
        for name, fns in cases(inputs, s, side, urgent).items():
            row[name] = common.time_calls(fns, reps, graph=cuda, cuda=cuda)
        row["ideal"] = max(row["A alone"], row["B alone"])
        row["saved"] = row["A then B"] - min(row["two streams"], row["B urgent"])
        row["A hot"] = row["A twice"] - row["A alone"]
        row["L2 saved"] = row["B then A"] - row["L2, B, A"]
        rows.append(row)
    result = {**common.metadata(device), "shapes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
              "sets": ARGS.sets, "reps": reps, "prefetch_mb": ARGS.prefetch_mb, "wall_s": time.perf_counter() - started,
              "rows": rows}
    print(f"json: {common.write_result('overlap', ARGS.smoke, result)}")
    common.print_table([("chain", "chain", "d"), ("ok", "ok", ""), ("A us", "A alone", ".1f"),
                        ("B us", "B alone", ".1f"), ("A then B", "A then B", ".1f"),
                        ("two streams", "two streams", ".1f"), ("B urgent", "B urgent", ".1f"), ("ideal", "ideal", ".1f"),
                        ("saved", "saved", ".1f"), ("B then A", "B then A", ".1f"), ("L2, B, A", "L2, B, A", ".1f"),
                        ("A hot", "A hot", ".1f"), ("L2 saved", "L2 saved", ".1f")],
                       rows)
    if not all(r["ok"] for r in rows):
        raise SystemExit("overlap: two streams changed an output")


if __name__ == "__main__":
    main()
