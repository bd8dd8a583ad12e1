"""Time to first token of a long prompt whose prefix is cached, three ways, on full-width layers
(bench/full_width.py) through the fast runner, side by side in one run:

- cold: the whole prompt prefilled (chunks of `--chunk` tokens);
- hit, SWA bounded replay: a slot restored from the cached prefix's slot (compressed KV, index keys and
  compressor carries copied), its windows rebuilt by recomputing the prefix's last `sliding_window` tokens in
  the forward of the first chunk of new tokens (`Runner.resume` with ids, as the engine schedules a hit), then
  the rest prefilled;
- hit, replay step: the same restore, the windows rebuilt by the runner's replay step alone (`Runner.resume`
  without ids: the decode step over the window's positions, a CUDA graph), then the new tokens prefilled;
- hit, replay off: the cached slot continued where it stopped (its windows were kept), then the new tokens.

Each time ends when the first token's logits are on the device (synchronized). The prompt is
`--prefix` cached tokens plus `--suffix` new ones (a multi-turn agent's next turn).

    python bench/ttft.py --arch v41 --layers 4 --prefix 98304 --suffix 512
    python bench/ttft.py --smoke
    python bench/ttft.py --replot bench/results/ttft-v41.json   # the PNG again, from the JSON
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def add_arguments(p):
    p.add_argument("--arch", default="v41", choices=["v41", "v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefix", default="8192,32768,98304", help="cached prefix lengths (multiples of 128)")
    p.add_argument("--suffix", type=int, default=512)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a result file")


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch
from full_width import bench_setup, build_random_model, prefill_chunks, random_ids

from dsv4.fast.model import make_fast
from dsv4.fast.runner import Runner


def measure(runner, device, prefix: int, suffix: int, reps: int) -> dict:
    """Seconds to the first token: cold, hit with bounded replay (in the first chunk's forward, or as the replay
    step), hit with replay off (median of reps)."""
    sync = common.synchronizer(device)
    g = torch.Generator().manual_seed(prefix)
    ids = random_ids(runner.config, prefix + suffix, g)

    def clock(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def in_new_slot(fn):  # seconds of fn(slot) in a newly allocated slot, released after
        slot = runner.allocate()
        seconds = clock(lambda: fn(slot))
        runner.release(slot)
        return seconds

    def replay_hit(slot, cached):  # the replay leads the first chunk's forward, as in the engine
        runner.resume(slot, cached, prefix, ids[prefix : prefix + ARGS.chunk])
        if ids.numel() > prefix + ARGS.chunk:
            prefill_chunks(runner, slot, ids[prefix + ARGS.chunk :], ARGS.chunk)

    def replay_step_hit(slot, cached):  # the replay on its own, then the new tokens
        runner.resume(slot, cached, prefix)
        prefill_chunks(runner, slot, ids[prefix:], ARGS.chunk)

    times = {"cold": [], "hit_replay": [], "hit_replay_step": [], "hit_no_replay": []}
    for _ in range(reps):
        cached = runner.allocate()
        prefill_chunks(runner, cached, ids[:prefix], ARGS.chunk)  # the previous turn, left in its slot
        times["cold"].append(in_new_slot(lambda slot: prefill_chunks(runner, slot, ids, ARGS.chunk)))
        times["hit_replay"].append(in_new_slot(lambda slot, cached=cached: replay_hit(slot, cached)))
        times["hit_replay_step"].append(in_new_slot(lambda slot, cached=cached: replay_step_hit(slot, cached)))
        times["hit_no_replay"].append(clock(lambda cached=cached: prefill_chunks(runner, cached, ids[prefix:], ARGS.chunk)))
        runner.release(cached)
    out = {k: statistics.median(v) for k, v in times.items()}
    for hit in ("hit_replay", "hit_replay_step", "hit_no_replay"):  # -> replay_vs_cold, replay_step_vs_cold, ...
        out[f"{hit.removeprefix('hit_')}_vs_cold"] = 1 - out[hit] / out["cold"]
    return out


def plot(result: dict, path: Path) -> None:
    """Seconds to the first token per cached prefix length (log scale), and the hit's saving over cold."""
    prefixes = list(result["rows"])
    rows = [result["rows"][p] for p in prefixes]

    def draw(fig, axes):
        series = {name: [r[key] for r in rows] for key, name in (
            ("cold", "cold prefill"), ("hit_replay", "hit, bounded replay"), ("hit_replay_step", "hit, replay step"),
            ("hit_no_replay", "hit, replay off"))}
        common.grouped_log_bars(axes[0], [f"{int(p) // 1024}K" for p in prefixes], series)
        axes[0].set(xlabel="cached prefix (tokens)", ylabel="time to first token (s)")
        axes[1].plot([int(p) // 1024 for p in prefixes], [100 * r["replay_vs_cold"] for r in rows], "o-",
                     label="hit, bounded replay")
        if "replay_step_vs_cold" in rows[0]:  # results before the replay step lack it
            axes[1].plot([int(p) // 1024 for p in prefixes], [100 * r["replay_step_vs_cold"] for r in rows], "^-",
                         label="hit, replay step")
        axes[1].plot([int(p) // 1024 for p in prefixes], [100 * r["no_replay_vs_cold"] for r in rows], "s-",
                     label="hit, replay off")
        axes[1].axhline(70, color="gray", ls="--", label="goal: 70% lower")
        axes[1].set(xlabel="cached prefix (K tokens)", ylabel="lower than cold (%)", ylim=(0, 100))
        axes[1].legend()
        fig.suptitle(f"{result['arch']} {result['layers']} full-width layers, {result['suffix']} new tokens, {result['gpu']}")

    common.save_figure(path, draw)


def main():
    if ARGS.replot:
        return common.replot(ARGS.replot, plot)
    device, config = bench_setup(ARGS.arch, ARGS.layers, ARGS.smoke)
    prefixes = [256] if ARGS.smoke else [int(p) for p in ARGS.prefix.split(",")]
    suffix = 32 if ARGS.smoke else ARGS.suffix
    fast = make_fast(build_random_model(config, device, torch.bfloat16, seed=0))
    runner = Runner(fast, max_seqs=2, max_len=max(prefixes) + suffix)
    result = {**common.metadata(str(device)), "arch": ARGS.arch, "layers": ARGS.layers, "suffix": suffix,
              "chunk": ARGS.chunk, "rows": {}}
    measure(runner, device, prefixes[0], suffix, 1)  # warm-up: the kernels compile for the shapes a run meets
    for prefix in prefixes:
        result["rows"][prefix] = measure(runner, device, prefix, suffix, ARGS.reps)
    path = common.write_result(f"ttft-{ARGS.arch}", ARGS.smoke, result)
    plot(result, path.with_suffix(".png"))
    print(path)
    print(f"{'prefix':>8} {'cold s':>9} {'hit+replay s':>13} {'replay step s':>14} {'hit, no replay s':>17} "
          f"{'replay vs cold':>15}")
    for prefix, r in result["rows"].items():
        print(f"{prefix:8d} {r['cold']:9.3f} {r['hit_replay']:13.4f} {r['hit_replay_step']:14.4f} "
              f"{r['hit_no_replay']:17.4f} {-r['replay_vs_cold']:+15.1%}")


main()
