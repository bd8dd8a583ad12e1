"""Engram row lookup from host memory: a naive synchronous gather against the side-stream UVA prefetch.

    python bench/engram.py          # H200: < 3 minutes, ~8.5 GB of pinned host memory per table mode
    python bench/engram.py --smoke  # tiny table on the CPU (Triton interpreter), checks the plumbing
    python bench/engram.py --modes auto --programs 8 16 32   # gather grid caps side by side, same tables

Two synthetic tables of --rows rows x 264 B (default 16M rows = 4.2 GB each; the real ones are 384M,
98 GB) stand for V4.1's Engram layers 1 and 14; each token reads 24 random rows per layer. Token counts:
decode steps of 1..64 tokens and a 2048-token prefill chunk. Per table memory mode (--modes: "auto"
takes THP + cudaHostRegister where the OS allows, "pinned" is cudaHostAlloc with 4 KB pages):
  sync_us:      the naive lookup: ids to the host, index_select of fp8 rows and scales, dequantize on the
                CPU, blocking copy of the bf16 rows to the GPU (EngramEmbedding.forward on a host table);
  sync_raw_us:  the same without the CPU dequant: index_select of the 264 B records, blocking copy;
  lookup_us:    EngramPrefetcher.start + wait for both layers, nothing else on the GPU (CUDA events on
                the main stream: the side stream's gather kernel, which reads pinned host memory over
                PCIe and dequantizes both layers in one launch, plus the cross-stream waits);
  compute_us:   the stand-in for what runs on the main stream before Engram layer 1 reads its rows (the
                embedding, layer 0 and layer 1's attention): a bf16 matmul chain sized to one measured
                full-width V4.1 layer, --compute-us 368 for decode (runner-v41.json, 9bc21f3: 0.368 ms per
                layer at batch 1) and --prefill-compute-us 15400 for the chunk (same run: 4 layers prefill
                8K in 2048-token chunks at 33.2K tokens/s, 15.4 ms per layer per chunk);
  overlap_us:   start(); compute; wait(0); wait(1); on the main stream;
  hidden:       1 - (overlap_us - compute_us) / lookup_us (1.0: the lookup costs nothing);
  start_host_us: host time spent in start() (it must not wait for the GPU); step_host_us: start() and
                the two wait() calls.
  Each of lookup/compute/overlap is timed twice: with a spin kernel queued on the main stream first, so
  the host enqueues the step while the GPU is busy and the events see only the GPU's cost (an engine
  whose host runs ahead of the GPU, or a CUDA graph: the plain columns), and on an idle GPU, where the
  host's launch time of start() and of the compute delays the step (a fully synchronous engine: the
  *_idle columns). host_breakdown_us: host time of start()'s pieces at one token.
Medians over --reps samples, rotating 8 id sets. Rows are checked against the twin first.
JSON goes to $OUT/engram.json if OUT is set, else bench/results/engram.json (engram-smoke.json with
--smoke). The table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny table on CPU under TRITON_INTERPRET=1")
    p.add_argument("--rows", type=int, default=16 << 20, help="rows per synthetic table")
    p.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts per step")
    p.add_argument("--modes", nargs="*", default=["auto", "pinned"], help="table memory modes")
    p.add_argument("--compute-us", type=float, default=368.0, help="stand-in compute for decode steps")
    p.add_argument("--prefill-compute-us", type=float, default=15400.0, help="stand-in compute, >= 512 tokens")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--programs", type=int, nargs="*", default=None,
                   help="gather grid caps, one run each on the same tables (default: the prefetch's own)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import warnings

import torch
from common import bench_device, git_commit  # $DSV4_COMMIT wins over a stale .git

from dsv4.fast.engram_prefetch import EngramPrefetcher, HostEngramTable, thp_setting
from dsv4.fast.kernels.engram import engram_gather_twin

L, C = 2, 24
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # interpreter int64 wrap


def fill(table: HostEngramTable, seed: int) -> None:
    """Random e4m3 bytes without NaN codes, scales around 2^0; a 64 MB block repeated (fast)."""
    g = torch.Generator().manual_seed(seed)
    block_rows = min(table.rows, 1 << 18)
    block = torch.randint(0, 256, (block_rows, 264), generator=g, dtype=torch.uint8)
    block[:, :256][(block[:, :256] & 0x7F) == 0x7F] = 0
    block[:, 256:] = torch.randint(117, 137, (block_rows, 8), generator=g, dtype=torch.uint8)
    for lo in range(0, table.rows, block_rows):
        hi = min(lo + block_rows, table.rows)
        table.data[lo:hi].copy_(block[: hi - lo])


def naive_sync(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return engram_gather_twin(table, ids)  # ids.cpu() -> index_select -> CPU dequant -> .to(device)


def raw_sync(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, ids.reshape(-1).cpu()).to(ids.device)


def same_bits(a, b) -> bool:
    """Bitwise equal (torch.equal would let -0.0 pass for +0.0); the tables hold no NaN codes."""
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def median(xs):
    return statistics.median(xs)


def time_host(fn, reps, cuda):
    fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e6)
    return median(out)


AHEAD_CYCLES = 3_000_000  # ~1.5 ms of spinning: the host enqueues the timed work while the GPU is busy


def time_events(fn, reps, ahead=False):
    """Median device time of fn() on the current stream (events around it), and host time of fn().

    ahead=False: the GPU is idle when fn starts, so the host's launch time of fn counts in full (a
    synchronous engine at the start of a step). ahead=True: a spin kernel queued first keeps the GPU
    busy while the host enqueues fn, so the events measure only what fn costs the GPU (an engine whose
    host runs ahead, or a CUDA graph)."""
    fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead:
            torch.cuda._sleep(AHEAD_CYCLES)
        a.record()
        t = time.perf_counter()
        fn(i)
        host.append((time.perf_counter() - t) * 1e6)
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b) * 1e3)
    return median(dev), median(host)


def host_breakdown(pre, ids, n=300):
    """Median host us of start()'s pieces (one token step), to see where the time goes."""
    main = torch.cuda.current_stream()
    ev = torch.cuda.Event()

    def med(fn):
        fn()
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        return round(median(xs), 2)

    def stream_ctx():
        """Host cost of entering and leaving a stream context, nothing inside."""
        with torch.cuda.stream(pre.stream):
            pass

    fast = pre._fast
    out = {
        "current_stream": med(lambda: torch.cuda.current_stream()),
        "event_record": med(lambda: ev.record(main)),
        "wait_event": med(lambda: pre.stream.wait_event(ev)),
        "wait_stream_(new_event)": med(lambda: pre.stream.wait_stream(main)),
        "stream_context": med(stream_ctx),
        "record_stream": med(lambda: ids.record_stream(pre.stream)),
        "start_direct_launch": med(lambda: pre.start(ids)),
    }
    torch.cuda.set_stream(main)
    pre._fast, pre._compiled = False, [None] * len(pre._compiled)
    out["start_jit_launch"] = med(lambda: pre.start(ids))
    pre._fast = fast
    out["wait_x2"] = med(lambda: (pre.wait(0), pre.wait(1)))
    torch.cuda.synchronize()
    return out


class StandIn:
    """A bf16 matmul chain on the current stream, calibrated to about `target_us`."""

    def __init__(self, tokens, target_us):
        m = max(16, min(tokens, 2048))
        self.x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
        self.n = 1
        self.n = 8
        eight, _ = time_events(lambda i=0: self.run(), 10, ahead=True)
        self.n = max(1, round(target_us / (eight / 8)))

    def run(self):
        y = self.x
        for _ in range(self.n):
            y = y @ self.w
        return y


def bench_mode(mode, tokens_list, reps, device) -> list[dict]:
    """One table memory mode: a run (table info and rows) per gather grid cap of --programs."""
    cuda = device == "cuda"
    t0 = time.time()
    tables = [HostEngramTable(ARGS.rows if cuda else 4096, mode=mode if cuda else "pageable") for _ in range(L)]
    alloc_s = time.time() - t0
    for i, t in enumerate(tables):
        fill(t, i)
    info = {"mode_requested": mode, "mode": tables[0].mode, "thp_anon_huge_kb": tables[0].thp_kb,
            "notes": tables[0].notes, "rows": tables[0].rows, "alloc_s": round(alloc_s, 2),
            "fill_s": round(time.time() - t0 - alloc_s, 2), "table_gb": round(tables[0].nbytes / 1e9, 3)}
    runs = []
    for programs in ARGS.programs or [None]:
        pre = EngramPrefetcher(tables, device, max_tokens=max(tokens_list), programs=programs)
        results, breakdown = measure(pre, tables, tokens_list, reps, device)
        cap = programs or ("min(32, SMs): the prefetch default" if cuda else "4: the host default")
        runs.append({**info, "gather_programs": cap, "host_breakdown_us": breakdown, "results": results})
        pre.buffers = []
    for t in tables:
        t.close()  # unregisters a THP mapping; the memory goes when the tables do (on return)
    return runs


def measure(pre, tables, tokens_list, reps, device) -> tuple[list[dict], dict | None]:
    """Rows per token count, and the host time of start()'s pieces at the first count (CUDA)."""
    cuda = device == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    results, breakdown = [], None
    for n in tokens_list:
        sets = [torch.randint(0, tables[0].rows, (n, 1, L, C), device=device, generator=gen) for _ in range(8)]
        # correctness
        pre.start(sets[0])
        ok = all(same_bits(pre.wait(l), engram_gather_twin(tables[l].data, sets[0][:, :, l])) for l in range(L))
        row = {"tokens": n, "rows_per_step": n * L * C, "bytes_per_step": n * L * C * 264, "ok": ok}

        def sync(i=0, f=naive_sync, sets=sets):
            ids = sets[i % 8]
            return [f(tables[l].data, ids[:, :, l]) for l in range(L)]

        r = min(reps, 5) if n >= 512 else reps
        row["sync_us"] = time_host(sync, r, cuda)
        row["sync_raw_us"] = time_host(lambda: sync(0, raw_sync), r, cuda)
        if not cuda:
            row["lookup_us"] = time_host(lambda ids=sets[1]: pre.start(ids), r, cuda)
            results.append(row)
            continue

        start_host = []

        def lookup(i=0, sets=sets, start_host=start_host):
            t = time.perf_counter()
            pre.start(sets[i % 8])
            start_host.append((time.perf_counter() - t) * 1e6)
            for l in range(L):
                pre.wait(l)

        row["lookup_us"], row["step_host_us"] = time_events(lookup, reps, ahead=True)
        row["start_host_us"] = median(start_host[1:])
        row["lookup_idle_us"], _ = time_events(lookup, reps)
        target = ARGS.prefill_compute_us if n >= 512 else ARGS.compute_us
        comp = StandIn(n, target)
        row["compute_us"], _ = time_events(lambda i=0, comp=comp: comp.run(), reps, ahead=True)
        row["compute_idle_us"], _ = time_events(lambda i=0, comp=comp: comp.run(), reps)

        def overlapped(i=0, sets=sets, comp=comp):
            pre.start(sets[i % 8])
            comp.run()
            for l in range(L):
                pre.wait(l)

        row["overlap_us"], _ = time_events(overlapped, reps, ahead=True)
        row["overlap_idle_us"], _ = time_events(overlapped, reps)
        row["hidden"] = 1 - (row["overlap_us"] - row["compute_us"]) / row["lookup_us"]
        row["hidden_idle"] = 1 - (row["overlap_idle_us"] - row["compute_idle_us"]) / row["lookup_idle_us"]
        row["speedup_vs_sync"] = row["sync_us"] / row["lookup_us"]
        row["speedup_idle_vs_sync"] = row["sync_us"] / row["lookup_idle_us"]
        row["lookup_GBps"] = row["bytes_per_step"] / row["lookup_us"] / 1e3
        if n == tokens_list[0]:
            breakdown = host_breakdown(pre, sets[0])
        results.append(row)
    return results, breakdown


def main():
    device = bench_device(ARGS.smoke)
    tokens = ARGS.tokens or ([1, 4] if ARGS.smoke else [1, 4, 16, 64, 2048])
    reps = 3 if ARGS.smoke else ARGS.reps
    modes = ["pageable"] if ARGS.smoke else ARGS.modes
    t_start = time.time()
    runs = []
    for mode in modes:
        runs += bench_mode(mode, tokens, reps, device)
        gc.collect()
        if runs[-1]["mode"] == "pinned" and mode == "auto" and "pinned" in modes:
            break  # auto fell back to pinned already: nothing new to measure
    meta = {
        "bench": "engram",
        "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "thp_setting": thp_setting(),
        "layers": L, "rows_per_token_per_layer": C, "row_bytes": 264,
        "compute_us_target": {"decode": ARGS.compute_us, "prefill": ARGS.prefill_compute_us},
        "timing": ("median of reps; sync_*: host wall clock incl. sync; lookup/compute/overlap: CUDA events "
                   "with a spin kernel queued first (the host runs ahead: GPU cost only); *_idle: CUDA events "
                   "on an idle GPU (the host's launch time counts)"),
        "reps": reps,
        "goals": {"speedup_vs_sync_fastest": 10, "hidden": 0.9},
        "runs": runs,
    }
    meta["wall_s"] = round(time.time() - t_start, 1)
    name = "engram-smoke" if ARGS.smoke else "engram"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))

    print(f"\nresults: {out_dir / (name + '.json')}  ({meta['wall_s']} s), THP setting {meta['thp_setting']}")
    ok = True
    for run in runs:
        print(f"\ntable mode {run['mode']} (asked {run['mode_requested']}), AnonHugePages {run['thp_anon_huge_kb']} kB, "
              f"{run['rows']} rows = {run['table_gb']} GB, alloc {run['alloc_s']} s, gather programs {run['gather_programs']}")
        print(f"{'tokens':>6s} {'ok':>3s} {'sync us':>9s} {'raw us':>9s} {'lookup us':>9s}" + ("" if device == "cpu" else
              f" {'speedup':>8s} {'GB/s':>6s} {'compute':>8s} {'overlap':>8s} {'hidden':>7s} {'start host us':>13s}"
              f" | idle GPU: {'lookup':>7s} {'speedup':>8s} {'compute':>8s} {'overlap':>8s} {'hidden':>7s}"))
        for r in run["results"]:
            ok &= r["ok"]
            if device == "cpu":
                print(f"{r['tokens']:6d} {'y' if r['ok'] else 'N':>3s} {r['sync_us']:9.1f} {r['sync_raw_us']:9.1f} "
                      f"{r['lookup_us']:9.1f}")
                continue
            print(f"{r['tokens']:6d} {'y' if r['ok'] else 'N':>3s} {r['sync_us']:9.1f} {r['sync_raw_us']:9.1f} "
                  f"{r['lookup_us']:9.1f} {r['speedup_vs_sync']:7.1f}x {r['lookup_GBps']:6.1f} "
                  f"{r['compute_us']:8.1f} {r['overlap_us']:8.1f} {r['hidden']:7.1%} {r['start_host_us']:13.1f}"
                  f" |           {r['lookup_idle_us']:7.1f} {r['speedup_idle_vs_sync']:7.1f}x {r['compute_idle_us']:8.1f} "
                  f"{r['overlap_idle_us']:8.1f} {r['hidden_idle']:7.1%}")
        if run["host_breakdown_us"] is not None:
            print("host us of start()'s pieces:", json.dumps(run["host_breakdown_us"]))
    if not ok:
        print("CORRECTNESS FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
