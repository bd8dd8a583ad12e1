"""The fast engine (`LLM(impl="fast")`) on full-width layers under an agentic multi-turn workload, three ways
side by side in one run: prefix caching with SWA bounded replay (the default), prefix caching with replay off,
and no prefix caching.

The workload: `--sessions` agents share a `--system`-token system prompt; each starts with its own
`--task`-token request and runs `--turns` turns. A turn generates `--gen` tokens (greedy, end-of-sequence
ignored), then the agent's next prompt is the whole conversation so far plus a `--tool`-token tool result: the
shape of a coding agent's loop. All sessions' turn t are submitted together (continuous batching), each under
its session id, so a session's next turn can resume its retained slot.

Per turn and variant: the turn's wall time, time to first token (median and max over the sessions: arrival at
submission to the first sampled token), decode tokens/s over the turn (every session's tokens after its first, over
the longest such span: it includes steps shared with other sessions' prefill chunks), the decode step time once
every session is decoding (from the last first token to the last finish, over that session's steps: no prefill
runs then), and the share of prompt tokens served from the cache. Per variant: the time to build the engine (its
decode graphs are captured then). Random weights in the released formats (`bench/full_width.py`); one model serves the three
engines (each engine builds its own slots over it).

    python bench/engine.py --arch v41 --layers 4 --variants replay   # H200, one engine: ~175 s at 7a97190, 136 s
                                                                     # of it the build (decode compiled, captured)
    python bench/engine.py --arch v41 --layers 4                     # the three engines, one after another
    python bench/engine.py --smoke                                   # tiny widths on the CPU: the plumbing
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

VARIANTS = {  # key: (name, enable_prefix_caching, swa_bounded_replay)
    "replay": ("prefix cache + bounded replay", True, True),
    "no-replay": ("prefix cache, replay off", True, False),
    "no-cache": ("no prefix cache", False, True),
}


def add_arguments(p):
    p.add_argument("--arch", default="v41", choices=["v41", "v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=4096, help="shared system prompt tokens")
    p.add_argument("--task", type=int, default=512, help="each session's first request tokens")
    p.add_argument("--tool", type=int, default=1024, help="tool-result tokens appended per turn")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per turn")
    p.add_argument("--kv-gb", type=float, default=40.0, help="KV memory of each engine (GB)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch
from full_width import bench_setup, build_random_model, random_ids

from dsv4.engine.llm import LLM
from dsv4.engine.request import SamplingParams
from dsv4.fast.model import make_fast


def workload(config, sizes: dict, seed: int = 0) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    """(system prompt, each session's task, each session's tool result per turn): random token ids."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: random_ids(config, n, g).tolist()
    system = draw(sizes["system"])
    tasks = [draw(sizes["task"]) for _ in range(sizes["sessions"])]
    tools = [[draw(sizes["tool"]) for _ in range(sizes["turns"])] for _ in range(sizes["sessions"])]
    return system, tasks, tools


def run_sessions(llm: LLM, sizes: dict, work, sync, label: str = "turn") -> list[dict]:
    """The turns of every session, batched per turn -> one row of metrics per turn."""
    system, tasks, tools = work
    params = SamplingParams(max_tokens=sizes["gen"], ignore_eos=True)
    conversations = [system + task for task in tasks]
    ids = [f"agent-{i}" for i in range(len(tasks))]
    rows = []
    for turn in range(sizes["turns"]):
        sync()
        start = time.perf_counter()
        outs = llm.generate(conversations, params, session_ids=ids)
        sync()
        wall = time.perf_counter() - start
        ttft = [o.metrics.time_to_first_token for o in outs]
        decode = [o.metrics.finished_time - o.metrics.first_token_time for o in outs]
        prompt_tokens = sum(len(c) for c in conversations)
        all_decoding = (max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs))
        rows.append({
            "turn": turn, "prompt_tokens": prompt_tokens, "wall_s": wall,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "decode_tokens_per_s": len(outs) * (sizes["gen"] - 1) / max(decode),
            "decode_step_ms": all_decoding / (sizes["gen"] - 1) * 1e3,
            "cached_share": sum(o.num_cached_tokens for o in outs) / prompt_tokens,
        })
        print(f"  {label} {turn}: {wall:.2f} s, TTFT median {rows[-1]['ttft_median_s']:.3f} s", flush=True)
        conversations = [c + o.outputs[0].token_ids + tool[turn]
                         for c, o, tool in zip(conversations, outs, tools)]
    for session in ids:
        llm.end_session(session)
    return rows


def plot(result: dict, path: Path) -> None:
    """Time to first token (median over the sessions) and the turn's wall time, per turn and variant."""

    def draw(fig, axes):
        for name, turns in result["variants"].items():
            x = [r["turn"] + 1 for r in turns]
            axes[0].plot(x, [r["ttft_median_s"] for r in turns], "o-", label=name)
            axes[1].plot(x, [r["wall_s"] for r in turns], "o-", label=name)
        axes[0].set(xlabel="turn", ylabel="time to first token, median (s)", yscale="log")
        axes[1].set(xlabel="turn", ylabel="turn wall time (s)")
        axes[0].legend()
        fig.suptitle(f"{result['arch']} {result['layers']} full-width layers, {result['sessions']} agents, "
                     f"{result['gpu']}")

    common.save_figure(path, draw)


def main():
    device, config = bench_setup(ARGS.arch, ARGS.layers, ARGS.smoke)
    sizes = ({"sessions": 2, "turns": 2, "system": 192, "task": 16, "tool": 16, "gen": 4} if ARGS.smoke else
             {k: getattr(ARGS, k) for k in ("sessions", "turns", "system", "task", "tool", "gen")})
    if sizes["gen"] < 2:
        sys.exit("--gen must be at least 2: the decode rates are over the tokens after the first")
    longest = sizes["system"] + sizes["task"] + sizes["turns"] * (sizes["tool"] + sizes["gen"])
    dtype = torch.float32 if ARGS.smoke else torch.bfloat16
    fast = make_fast(build_random_model(config, device, dtype, seed=0))
    sync = common.synchronizer(device)
    work = workload(config, sizes)
    kv = int((0.05 if ARGS.smoke else ARGS.kv_gb) * 2**30)
    result = {**common.metadata(str(device)), "arch": ARGS.arch, "layers": ARGS.layers, **sizes,
              "kv_bytes": kv, "build_s": {}, "variants": {}}
    t0 = time.time()
    for key in ARGS.variants.split(","):
        if key not in VARIANTS:
            sys.exit(f"--variants: {key!r} is not one of {','.join(VARIANTS)}")
        name, caching, replay = VARIANTS[key]
        print(f"{name}: building the engine", flush=True)
        t = time.perf_counter()
        llm = LLM(fast, impl="fast", device=device, max_model_len=longest, kv_cache_memory=kv,
                  enable_prefix_caching=caching, swa_bounded_replay=replay,
                  max_num_batched_tokens=64 if ARGS.smoke else 8192, max_num_seqs=sizes["sessions"])
        result["build_s"][name] = time.perf_counter() - t
        print(f"{name}: built in {result['build_s'][name]:.1f} s; warm-up turn", flush=True)
        # warm-up on other prompts (no prefix of the measured ones gets cached): kernels compile (prefill shapes)
        run_sessions(llm, {**sizes, "turns": 1}, workload(config, sizes, seed=1), sync, "warm-up")
        result["variants"][name] = run_sessions(llm, sizes, work, sync)
        del llm  # its slots go before the next engine allocates its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.time() - t0
    path = common.write_result(f"engine-{ARGS.arch}", ARGS.smoke, result)
    plot(result, path.with_suffix(".png"))
    print(path)
    rows = [{"variant": name, **row} for name, turns in result["variants"].items() for row in turns]
    common.print_table([("variant", "variant", "s"), ("turn", "turn", "d"), ("prompt tok", "prompt_tokens", "d"),
                        ("cached", "cached_share", ".0%"), ("TTFT med s", "ttft_median_s", ".3f"),
                        ("TTFT max s", "ttft_max_s", ".3f"), ("decode tok/s", "decode_tokens_per_s", ".0f"),
                        ("step ms", "decode_step_ms", ".2f"),
                        ("turn s", "wall_s", ".2f")], rows)


main()
