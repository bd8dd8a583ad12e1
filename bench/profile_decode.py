"""Where a fast decode step's time goes: kernels of one step run outside its graph (torch.compile'd with
--compile, as the runner then captures it) under torch.profiler, grouped by name,
beside the CUDA-graph step time and the roofline's bytes, on full-width layers (bench/full_width.py).

    python bench/profile_decode.py --arch v41 --layers 4 --context 8192 --batch 1
    python bench/profile_decode.py --arch v4 --layers 2 --context 8192 --compile --prefill-chunk 8192
    python bench/profile_decode.py --smoke

The kernel table is device time per kernel name summed over the step (the same kernels the graph replays,
without the graph, each kernel alone); `graph_step_ms - kernel_sum_ms` is what the graph still spends between
kernels. `launches` lists the step's kernels in order with the ops that launched them, and on a GPU their starts,
spans and own times in one replay of the step's graph (own: the time each ran after the kernel before it ended; a
PDL kernel's span holds its wait for that one); `by_op` sums both by op (each dsv4 op, cuBLAS, inductor's
kernels, other aten ops).
`by_layer` (`full_width.layer_breakdown`): the launches cut into layers at their mHC posts, each with its kind, time
alone and the bytes it reads, and the step at the released depth with each released layer at its kind's measured
time and bytes (`--layers 6` measures every V4.1 kind, 4 every V4 kind); `by_layer_own` the same from the kernels'
own times in the graph replay (where they line up), the split of the graph's device time; where every kind was
measured, the released depth's step and roofline also as top-level numbers (`released_ms_own`,
`released_roofline_own`, and `_spans` from the spans), which `bench/ab.py` tables.
With --prefill-chunk, a cold prefill's kernels too, where the device sat idle (`full_width.idle_gaps`: the longest
gaps and the host ops that launched the work after them), and its device time by layer module and module-path
method (`SPANS`: CUDA events around each call, so a span includes the spans inside it).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def add_arguments(p):
    p.add_argument("--arch", default="v41", choices=["v41", "v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (the captured and the profiled one)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="also profile a cold prefill of --context tokens in chunks of this many")
    p.add_argument("--slots", type=int, default=0,
                   help="slots the runner holds, each holding the context (at least --batch; bench/runner.py holds 64)")
    p.add_argument("--warm-up", action="store_true",
                   help="start the runner as bench/runner.py and an engine do (Runner.warm_up: the prefill's lengths, "
                        "every decode graph up to the slots, the replay's)")


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from full_width import (  # noqa: E402
    bench_setup,
    build_random_model,
    cold_prefill,
    decode_bytes,
    idle_gaps,
    launches,
    layer_breakdown,
    prefill_chunks,
    print_breakdown,
    profile_step,
    profiler_activities,
    random_ids,
    released_numbers,
)

from dsv4.fast.model import make_fast  # noqa: E402
from dsv4.fast.runner import Runner  # noqa: E402


def kernel_table(prof) -> list[dict]:
    """Device kernels of the profile grouped by name: calls and total microseconds, largest first."""
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            calls[e.name] += 1
    rows = [{"kernel": k[:90], "calls": calls[k], "us": total[k]} for k in total]
    return sorted(rows, key=lambda r: -r["us"])


def replay_times(prof, rows: list[dict]) -> list[str] | None:
    """The step as its CUDA graph replays it (the profiler reports a replayed graph's kernels one by one): each of
    `rows` (`launches`, in order) gets its start, its span in the replay (`replay_us`: a PDL kernel's holds its
    wait for the one before) and its own time (`common.own_times`: what it adds to the step, the by-op sums'
    second column). Where the replay's kernels are not the launches in order nothing is set, and the replay's
    kernel names (in start order) come back for the result, to show where the two differ."""
    device = [(e.name[:90], e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = common.spans_of_run(device, [r["kernel"] for r in rows])  # among the copies of its inputs and logits
    if spans is None:
        return [name for name, *_ in sorted(device, key=lambda k: k[1])]
    for r, (start, end), own in zip(rows, spans, common.own_times(spans)):
        r["start_us"], r["replay_us"], r["own_us"] = start - spans[0][0], end - start, own
    return None


def by_op(rows: list[dict]) -> list[dict]:
    """`launches` grouped by what launched them: each dsv4 op, cuBLAS (aten::mm / bmm), inductor's own kernels, and
    other aten ops (copies, reductions): launches, microseconds and own microseconds (NaN without the device's
    timestamps), largest first."""
    total, own, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for r in rows:
        op = r["ops"].split(" < ")[0]
        if op.startswith("dsv4::"):
            group = op
        elif op in ("aten::mm", "aten::bmm", "aten::addmm"):
            group = "cuBLAS (aten::mm / bmm)"
        elif r["kernel"].startswith("triton_"):
            group = "inductor's kernels"
        else:
            group = op
        total[group] += r["us"]
        own[group] += r.get("own_us", float("nan"))
        calls[group] += 1
    return sorted(({"op": g, "launches": calls[g], "us": total[g], "own_us": own[g]} for g in total),
                  key=lambda r: -r["us"])


# what the prefill's table by module times, per layer: (attribute path from the block, methods; "" = its forward)
# the norms through the blocks' prefill pieces that call them (a span inside a compiled piece would record its
# events in the trace, not on the stream)
SPANS = (("", ("forward", "_attn_input", "_ffn_input")),
         ("attn", ("forward", "_q_kv", "_compress", "_compressed", "_output")),
         ("attn.compressor", ("forward",)), ("attn.indexer", ("forward", "keys", "_queries", "_scores", "_top",
                                                              "_candidate_blocks", "_top_in_pool")),
         ("ffn", ("forward",)), ("engram", ("forward",)))


def module_times(model, run, device) -> dict[str, float]:
    """Milliseconds of one run() in each SPANS method of each layer, "L{i}.{path}.{method}" (CUDA events; the host
    clock off CUDA). The methods are wrapped on the instances for the run and put back after."""
    spans, restore = defaultdict(list), []

    def wrap(obj, name, label):
        fn = getattr(obj, name)
        restore.append((obj, name, fn if name in vars(obj) else None))  # a compiled piece is an instance attribute

        def timed(*args, **kwargs):
            if device.type != "cuda":
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                elapsed = (time.perf_counter() - t) * 1e3
                spans[label].append(lambda: elapsed)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            spans[label].append(lambda: start.elapsed_time(end))
            return out

        setattr(obj, name, timed)

    for i, layer in enumerate(model.layers):
        for path, methods in SPANS:
            try:
                obj = layer.get_submodule(path)
            except AttributeError:
                continue  # no such module in this layer (compressor, indexer, Engram)
            for name in methods:
                if hasattr(obj, name):
                    wrap(obj, name, ".".join(p for p in (f"L{i}", path, name) if p))
    try:
        run()
    finally:
        for obj, name, fn in reversed(restore):
            if fn is None:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {label: sum(ms() for ms in calls) for label, calls in spans.items()}


def profile_prefill(runner, device, context: int) -> dict:
    """A cold prefill of `context` tokens in --prefill-chunk chunks into a fresh slot: wall time (after a
    warm-up run), then the kernels of one more run."""
    ids = random_ids(runner.config, context)

    def run():
        cold_prefill(runner, ids, ARGS.prefill_chunk)

    ms = common.timed(run, device) * 1e3
    with profile(activities=profiler_activities(device)) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = kernel_table(prof)
    return {"ms": ms, "tokens_per_s": context / ms * 1e3, "kernel_sum_ms": sum(r["us"] for r in rows) / 1e3,
            "table": rows[: ARGS.top], "idle": idle_gaps(prof, 20),
            "by_module_ms": module_times(runner.model, run, device)}


def main():
    device, config = bench_setup(ARGS.arch, ARGS.layers, ARGS.smoke)
    context = 128 if ARGS.smoke else ARGS.context
    fast = make_fast(build_random_model(config, device, torch.bfloat16, seed=0))
    B = ARGS.batch
    # the step the runner captures and the step profiled below are one: compiled exactly when --compile
    # --slots and --warm-up set up the runner as bench/runner.py's table does, whose batch-1 step read 56 us more
    runner = Runner(fast, max_seqs=max(B + 1, ARGS.slots), max_len=context + 64, compile=ARGS.compile)
    if ARGS.warm_up:
        runner.warm_up(runner.state.max_seqs)
    ids = random_ids(config, context)
    held = [runner.allocate() for _ in range(max(B, ARGS.slots))]
    prefill_chunks(runner, held[0], ids, 2048)
    for s in held[1:]:
        runner.resume(s, held[0], context)
    slots = held[:B]
    next_ids = random_ids(config, B).to(device)  # distinct rows route to distinct experts, as in a real batch
    runner.decode(slots, next_ids)  # capture
    step_ms = common.timed(lambda: runner.decode(slots, next_ids), device, 10) * 1e3
    prof = profile_step(runner, next_ids, slots)
    rows = kernel_table(prof)
    steps = launches(prof)
    unmatched = None
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as replay:
            runner.decode(slots, next_ids)
            torch.cuda.synchronize()
        unmatched = replay_times(replay, steps)
    prefill = profile_prefill(runner, device, context) if ARGS.prefill_chunk else None
    nbytes = decode_bytes(fast, runner.state, context)
    bw = common.copy_bandwidth(device)
    result = {**common.metadata(str(device)), "arch": ARGS.arch, "layers": ARGS.layers, "context": context, "batch": B, "compiled": ARGS.compile,
              "slots": len(held), "warm_up": ARGS.warm_up,
              "graph_step_ms": step_ms, "kernel_sum_ms": sum(r["us"] for r in rows) / 1e3, "kernels": len(rows),
              "kernel_launches": sum(r["calls"] for r in rows), "bytes_per_step_b1": nbytes,
              "floor_ms_b1": nbytes / bw * 1e3, "table": rows[: ARGS.top], "launches": steps,
              "prefill": prefill}
    if unmatched is not None:
        result["unmatched_replay_kernels"] = unmatched
    result["by_op"] = by_op(result["launches"])
    # batch 1: the bytes a layer reads are counted for one token
    result["by_layer"] = layer_breakdown(fast, runner.state, steps, context, nbytes, bw, ARGS.arch) if B == 1 else None
    timed_rows = [r for r in result["launches"] if "own_us" in r]
    if timed_rows:  # the replay's span on the device = its kernels' own times + the gaps between them
        result["device_span_ms"] = max(r["start_us"] + r["replay_us"] for r in timed_rows) / 1e3
        result["own_sum_ms"] = sum(r["own_us"] for r in timed_rows) / 1e3
        if B == 1:
            result["by_layer_own"] = layer_breakdown(fast, runner.state, steps, context, nbytes, bw, ARGS.arch,
                                                     key="own_us")
    result.update(released_numbers(result))
    path = common.write_result(f"profile-decode-{ARGS.arch}-b{B}{'-compiled' if ARGS.compile else ''}", ARGS.smoke, result)
    print(path)
    print(f"graph step {step_ms:.3f} ms; kernels {result['kernel_sum_ms']:.3f} ms in {result['kernel_launches']} launches; "
          f"floor (B=1 bytes) {result['floor_ms_b1']:.3f} ms")
    for r in rows[: ARGS.top]:
        print(f"{r['us']:9.1f} us {r['calls']:4d}x  {r['kernel']}")
    for name in ("own", "spans"):
        if f"released_ms_{name}" in result:
            print(f"released depth by kind ({name}): {result[f'released_ms_{name}']:.3f} ms a step, "
                  f"{100 * result[f'released_roofline_{name}']:.1f}% of the roofline")
    if "own_sum_ms" in result:
        print(f"graph replay: device span {result['device_span_ms']:.3f} ms, kernels' own time "
              f"{result['own_sum_ms']:.3f} ms, gaps {result['device_span_ms'] - result['own_sum_ms']:.3f} ms")
    elif device.type == "cuda":
        names = {r["kernel"] for r in result["launches"]}
        print(f"own times: the graph replay's {len(unmatched)} kernels did not line up with the {len(steps)} launches; "
              f"not computed (unmatched_replay_kernels in the JSON). Only in the replay: "
              f"{sorted(set(unmatched) - names)[:8]}; only launched: {sorted(names - set(unmatched))[:8]}")
    print_breakdown(result["by_layer"], bw, "kernels alone")
    if result.get("by_layer_own"):
        print_breakdown(result["by_layer_own"], bw, "own times in the graph replay")
    print("the step by the ops that launched its kernels (us alone, own us in the graph replay):")
    for r in result["by_op"]:
        print(f"{r['us']:9.1f} {r['own_us']:9.1f} us {r['launches']:4d}x  {r['op']}")
    print("aten kernels in the step, by the ops that launched them:")
    for r in result["launches"]:
        if r["kernel"].startswith("void at::"):
            print(f"{r['us']:9.1f} us  {r['kernel'][:50]}  <  {r['ops']}")
    if prefill:
        print(f"prefill {context} in chunks of {ARGS.prefill_chunk}: {prefill['ms']:.1f} ms "
              f"({prefill['tokens_per_s']:.0f} tok/s), kernels {prefill['kernel_sum_ms']:.1f} ms")
        for r in prefill["table"]:
            print(f"{r['us']:9.1f} us {r['calls']:4d}x  {r['kernel']}")
        idle = prefill["idle"]
        print(f"prefill: the device idle {idle['idle_us'] / 1e3:.2f} ms in {idle['gaps']} gaps; the longest:")
        for g in idle["longest"]:
            print(f"{g['us']:9.1f} us  after {g['before'][:40]}  before {g['after'][:40]}  <  {g['launched_by'][:110]}")
        print("prefill by module (inclusive):")
        for label, ms in prefill["by_module_ms"].items():
            print(f"{ms:9.3f} ms  {100 * ms / prefill['ms']:5.1f}%  {label}")


main()
