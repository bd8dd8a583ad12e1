"""Engram tables in host memory inside the model: the decode step of a full-width V4.1 cut with an Engram layer,
its tables on the GPU vs in pinned host memory with the rows prefetched on a side stream (what
`LLM(engram_tables="host")` does), side by side on the same weights and tokens.

Layers: released 0, 1 (window attention and the first Engram lookup), 2, 20, 21, 24 (the runner bench's roles), at
full width. Layer 0 comes before the first Engram layer as in the released model: the prefetch, started at the step's
entry, has the embedding, the hash and one layer ahead of it to hide behind. (Until 28f77e3 the cut began at layer 1,
with nothing ahead of the lookup.)
Each Engram table has `--engram-vocab` hash buckets per head (24 heads: 3 n-gram sizes x 8), about 24x that many
rows (the released tables: 16M buckets, 384M rows, 98 GB each). Per batch size: the CUDA-graph decode step with
device tables and with host tables, what the host tables add (host step - device step), the prefetch's gather alone
for that many tokens (in a CUDA graph), and the share of the lookup hidden, 1 - added / gather alone (an upper bound:
the device step's own gather, from device memory, is subtracted with it). The logits of both steps are compared (same
rows, same bits).
And a cold prefill of `--context` tokens in `--chunk`-token forwards both ways: each forward's entry starts the
rows' gather on the side stream, its Engram layer waits for them.

    python bench/engram_decode.py                   # 700K buckets: 16.8M rows, 4.4 GB per table
    python bench/engram_decode.py --smoke           # tiny widths on CPU, to check the script
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def add_arguments(p):
    p.add_argument("--engram-vocab", type=int, default=700_000, help="hash buckets per head of each table")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunk", type=int, default=2048)


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch  # noqa: E402

from full_width import (  # noqa: E402
    SMOKE_WIDTHS,
    build_random_model,
    cold_prefill,
    decode_rows,
    full_width_config,
    random_ids,
)

from dsv4.fast.engram_prefetch import keep_engram_on_host  # noqa: E402
from dsv4.fast.model import make_fast  # noqa: E402
from dsv4.fast.runner import Runner  # noqa: E402

LAYERS = [0, 1, 2, 20, 21, 24]


def steps(fast, device, context: int, batches: list[int], logits: dict) -> tuple[dict, float]:
    """Decode rows per batch size, and the seconds of a cold prefill of `context` tokens."""
    runner = Runner(fast, max_seqs=max(batches), max_len=context + len(batches) * (ARGS.steps + 2))
    rows = decode_rows(runner, common.timer(device), context, batches, ARGS.chunk, ARGS.steps, logits)
    ids = random_ids(fast.config, context, torch.Generator().manual_seed(2))
    prefill_s = common.timed(lambda r=runner: cold_prefill(r, ids, ARGS.chunk), device, 3)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, prefill_s


def gather_alone(fast, device, B: int) -> float:
    """Seconds of the prefetch's gather for B tokens (start, then wait), replayed from a CUDA graph as the step runs
    it: device time (timed from the host, the launches would be most of a few-token gather)."""
    pre, config = fast.engram_prefetch, fast.config
    heads = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    rows = [layer.engram.embed.num_embeddings for layer in fast.layers if layer.role.engram]
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randint(0, n, (B, 1, heads), generator=g) for n in rows], 2).to(device)  # [B, 1, L, C]

    def lookup():
        pre.start(ids)
        pre.wait(0)

    cuda = device.type == "cuda"
    return common.time_calls([lookup], 50, graph=cuda, cuda=cuda) * 1e-6


def main():
    device = torch.device("cpu" if ARGS.smoke else "cuda")
    vocab = 1000 if ARGS.smoke else ARGS.engram_vocab
    config = full_width_config("v41", layers=LAYERS, overrides=SMOKE_WIDTHS if ARGS.smoke else None,
                               engram_vocab_size=vocab)
    context = 128 if ARGS.smoke else ARGS.context
    batches = [int(b) for b in ARGS.batches.split(",")]
    t0 = time.time()
    fast = make_fast(build_random_model(config, device, torch.bfloat16, seed=0))
    on_device, on_host = {}, {}
    device_rows, device_prefill = steps(fast, device, context, batches, on_device)
    tables = keep_engram_on_host(fast)  # the device tables go; views of pinned host tables take their names
    make_fast(fast)  # attaches the prefetcher
    host_rows, host_prefill = steps(fast, device, context, batches, on_host)
    result = {**common.metadata(str(device)), "layers": LAYERS, "context": context,
              "engram_rows": config.engram_num_embeddings, "table_mode": [t.mode for t in tables],
              "thp_kb": [t.thp_kb for t in tables], "gather_programs": fast.engram_prefetch._programs,
              "prefill": {"chunk": ARGS.chunk, "device_tables_s": device_prefill, "host_tables_s": host_prefill},
              "rows": {}}
    for B in batches:
        lookup = gather_alone(fast, device, B)
        dev_ms, host_ms = device_rows[B]["step_ms"], host_rows[B]["step_ms"]
        diff = (on_host[B] - on_device[B]).abs().max().item()
        result["rows"][B] = {"device_step_ms": dev_ms, "host_step_ms": host_ms, "added_ms": host_ms - dev_ms,
                             "gather_alone_ms": lookup * 1e3, "hidden": 1 - (host_ms - dev_ms) / (lookup * 1e3),
                             "logits_max_abs_diff": diff,
                             "argmax_equal": bool(torch.equal(on_host[B].argmax(-1), on_device[B].argmax(-1)))}
    result["wall_s"] = time.time() - t0
    path = common.write_result("engram-decode", ARGS.smoke, result)
    print(path)
    print(f"tables {result['table_mode']}, {config.engram_num_embeddings} rows, gather programs "
          f"{result['gather_programs']}; cold prefill of {context} tokens: device tables {device_prefill:.3f} s, "
          f"host tables {host_prefill:.3f} s")
    common.print_table(
        [("batch", "batch", "d"), ("device step ms", "device_step_ms", ".3f"), ("host step ms", "host_step_ms", ".3f"),
         ("added ms", "added_ms", ".3f"), ("gather alone ms", "gather_alone_ms", ".3f"), ("hidden", "hidden", ".1%"),
         ("logits diff", "logits_max_abs_diff", ".3g"), ("argmax equal", "argmax_equal", "")],
        [{"batch": B, **r} for B, r in result["rows"].items()])


main()
