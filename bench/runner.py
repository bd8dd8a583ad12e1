"""The fast runner on full-width layers: decode and prefill tokens/s, the HBM roofline, and fast vs
reference vs transformers, side by side in one run.

Models: `bench/full_width.py` (real dimensions, random weights in the released formats, the first
`--layers` layers of a role-covering selection). Per architecture:
- fast decode (CUDA graphs) at batch 1/8/64 over a `--context`-token prefix in every slot (one prefill,
  copied slot to slot), and prefill tokens/s at `--context` (module path, `--chunk`-token chunks);
- the roofline of a batch-1 decode step: bytes the step must read (weights as the fast model holds them,
  the experts a token actually touches, the KV rows it attends to and the index keys it scores) over
  the device copy bandwidth measured in the same run; per layer (the head GEMM timed alone, the rest of
  the step averaged over the layers) and extrapolated to the released depth; and by layer kind (one step
  profiled, its kernels cut into layers and scaled to the graph step; each released layer at its kind's time and
  bytes: `--layers 6` measures every V4.1 kind, V4's 4 every V4 kind);
- the reference model (same seed, same weights) at `--ref-context` tokens, where its dense masks fit;
- V4 only: transformers' eager `DeepseekV4ForCausalLM` on the same weights.

    python bench/runner.py --arch v41 --layers 4 --context 8192
    python bench/runner.py --arch v4 --layers 2 --context 8192 --transformers
    python bench/runner.py --smoke          # tiny widths on CPU, to check the script
    python bench/runner.py --replot bench/results/runner-v41.json   # the PNG again, from the JSON
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def add_arguments(p):
    p.add_argument("--arch", default="v41", choices=["v41", "v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--ref-context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--transformers", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a result file")


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch  # noqa: E402

from full_width import (  # noqa: E402
    bench_setup,
    build_random_model,
    cold_prefill,
    decode_bytes,
    decode_rows,
    fill_in_chunks,
    fill_slots,
    launches,
    layer_breakdown,
    print_breakdown,
    profile_step,
    random_ids,
    released_depth,
)

from dsv4.fast.model import make_fast  # noqa: E402
from dsv4.fast.runner import Runner  # noqa: E402
from dsv4.reference.cache import DenseCache  # noqa: E402

PREFILL_REPS = 3  # prefills timed (after an untimed one), for fast and transformers alike: one is a single sample


def fast_prefill(runner, device, context: int) -> dict:
    ids = random_ids(runner.config, context)
    s = common.timed(lambda: cold_prefill(runner, ids, ARGS.chunk), device, PREFILL_REPS)
    return {"seconds": s, "tokens_per_s": context / s}


def fast_results(config, device, context: int, ref_context: int, batches: list[int]) -> dict:
    """Decode, prefill and the batch-1 roofline of the fast model (freed on return)."""
    fast = make_fast(build_random_model(config, device, torch.bfloat16, seed=0))
    steps = len(batches) * (ARGS.steps // 2 + 2)  # the tokens every batch size adds
    runner = Runner(fast, max_seqs=max(batches), max_len=context + steps)
    runner.warm_up(max(batches))  # as an engine starts: the prefills below run its symbolic-length graphs
    bw = common.copy_bandwidth(device)
    nbytes = decode_bytes(fast, runner.state, context)
    rows = decode_rows(runner, common.timer(device), context, batches, ARGS.chunk, ARGS.steps // 2)
    out = {"fast_decode": rows, "fast_prefill": fast_prefill(runner, device, context)}
    out["roofline"] = {"bytes_per_step": nbytes, "copy_bandwidth_Bps": bw, "floor_ms": nbytes / bw * 1e3,
                       "fraction_at_batch1": (nbytes / bw) / (rows[batches[0]]["step_ms"] * 1e-3)}
    out["whole_model"] = extrapolate(fast, rows[batches[0]]["step_ms"], nbytes, bw, device, config)
    if batches[0] == 1:
        out["released_by_kind"] = extrapolate_by_kind(runner, rows[1]["step_ms"], nbytes, bw, context)
    if not ARGS.no_reference:
        out["fast_at_ref_context"] = {"decode": decode_rows(runner, common.timer(device), ref_context, [1], ARGS.chunk,
                                                          ARGS.steps // 2)[1],
                                      "prefill": fast_prefill(runner, device, ref_context)}
    return out


def extrapolate(fast, step_ms: float, nbytes: int, bw: float, device, config) -> dict:
    """The batch-1 step per layer and for the released depth: the part outside the layers (final norm and
    head GEMM, the bulk of it) timed alone, the rest averaged over the measured layers, which is as
    representative of the released model as their roles are (bytes likewise)."""
    x = torch.randn(1, config.hidden_size, device=device, dtype=torch.bfloat16)
    head_ms = common.time_calls([lambda: fast.logits(x)], 20, cuda=device.type == "cuda") / 1e3
    head_bytes = fast.head.weight.nbytes + fast.embed.weight[0].nbytes
    n, full = len(fast.layers), released_depth(ARGS.arch)
    layer_ms, layer_bytes = (step_ms - head_ms) / n, (nbytes - head_bytes) / n
    step_full, bytes_full = head_ms + full * layer_ms, head_bytes + full * layer_bytes
    return {"head_ms": head_ms, "head_bytes": head_bytes, "layer_ms": layer_ms, "layer_bytes": layer_bytes,
            "layer_fraction": layer_bytes / bw / (layer_ms * 1e-3), "layers": full, "step_ms": step_full,
            "tokens_per_s": 1e3 / step_full, "bytes_per_step": bytes_full,
            "fraction_at_batch1": bytes_full / bw / (step_full * 1e-3)}


def extrapolate_by_kind(runner, step_ms: float, nbytes: int, bw: float, context: int) -> dict | None:
    """The batch-1 step by layer and at the released depth by layer kind (`full_width.layer_breakdown`): one step of
    a fresh slot profiled outside its graph, its kernels' times scaled to the graph step `step_ms`."""
    slots = fill_slots(runner, context, 1, ARGS.chunk)
    prof = profile_step(runner, random_ids(runner.config, 1).to(runner.state.device), slots)
    runner.release(slots[0])
    return layer_breakdown(runner.model, runner.state, launches(prof), context, nbytes, bw, ARGS.arch, step_ms)


def reference_rows(model, device, context: int) -> dict:
    """Reference decode (batch 1) and prefill at `context`: chunked so its dense masks fit."""
    ids = random_ids(model.config, (1, context), device=device)
    cache = DenseCache(model.config.sliding_window)

    def prefill():
        nonlocal cache
        cache = DenseCache(model.config.sliding_window)
        for a in range(0, context, 256):
            model.hidden_states(ids[:, a : a + 256], cache=cache, start_pos=a)

    with torch.inference_mode():
        pre = common.timed(prefill, device)
        pos = [context]

        def step():
            model.logits(model.hidden_states(ids[:, :1], cache=cache, start_pos=pos[0]))
            pos[0] += 1

        dec = common.timed(step, device, 3)
    return {"prefill_tokens_per_s": context / pre, "decode_step_ms": dec * 1e3, "decode_tokens_per_s": 1 / dec}


def transformers_rows(hf, device, context: int, config) -> dict:
    """transformers eager, bf16 weights; under bf16 autocast, because its mHC streams come out of the
    collapse in fp32 and meet bf16 projections (a dtype error otherwise). Its prefill makes the last position's
    logits alone (`logits_to_keep=1`, as `generate` asks), like fast's `ModelRunner.prefill`: the head over all
    8K positions is some 9 TFLOP more that neither generate nor fast computes.

    Where the prompt in one forward runs out of memory (its eager attention's [heads, S, S'] fp32 logits: 20 GiB
    each at 8K, past an H100 beside transformers' 58 GB), the prefill row is that error and the decode steps run
    on a cache filled in chunks (halved until one fits; `decode_cache_chunk`): the cache, and so the step, are
    the one-forward fill's (its continuation matches to fp32 rounding on the tiny widths)."""
    from transformers import DynamicCache

    ids = random_ids(config, (1, context), device=device)
    out = {}
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
        cache = [None]

        def prefill(chunk: int = context):
            cache[0] = DynamicCache(config=hf.config)
            for a in range(0, context, chunk):
                hf(input_ids=ids[:, a : a + chunk], past_key_values=cache[0], use_cache=True, logits_to_keep=1)

        try:
            out["prefill_tokens_per_s"] = context / common.timed(prefill, device, PREFILL_REPS)
        except torch.OutOfMemoryError as e:
            out["prefill_error"] = out_of_memory(e, context)
            out["decode_cache_chunk"] = fill_in_chunks(prefill, context, torch.cuda.empty_cache)
        nxt = ids[:, :1]

        def step():
            hf(input_ids=nxt, past_key_values=cache[0], use_cache=True)

        dec = common.timed(step, device, 5)
    return {**out, "decode_step_ms": dec * 1e3, "decode_tokens_per_s": 1 / dec}


def out_of_memory(e: torch.OutOfMemoryError, context: int) -> str:
    """The error's line for the result (the allocator's cache emptied for what runs next)."""
    torch.cuda.empty_cache()
    return f"transformers eager ran out of memory at {context} tokens: {str(e).splitlines()[0]}"


def transformers_or_oom(hf, device, context: int, config) -> dict:
    """`transformers_rows`, or what ran out of memory (the run goes on with what it has measured)."""
    try:
        return transformers_rows(hf, device, context, config)
    except torch.OutOfMemoryError as e:
        return {"error": out_of_memory(e, context)}


def plot(result: dict, path) -> None:
    """Decode step time per batch size against the batch-1 roofline floor; tokens/s of every measured path."""
    rows = {int(b): r for b, r in result["fast_decode"].items()}  # JSON keys come back as strings

    def draw(fig, axes):
        axes[0].plot(list(rows), [r["step_ms"] for r in rows.values()], "o-", label="fast (CUDA graphs)")
        axes[0].axhline(result["roofline"]["floor_ms"], color="gray", ls="--", label="batch-1 roofline floor")
        axes[0].set_xscale("log", base=2)
        axes[0].set(xlabel="decode batch", ylabel="ms per step", ylim=(0, None), title="decode step")
        axes[0].legend()
        paths = {"fast": (rows[min(rows)]["tokens_per_s"], result["fast_prefill"]["tokens_per_s"])}
        if "decode_tokens_per_s" in result.get("transformers", {}):
            t = result["transformers"]
            prefill = t.get("prefill_tokens_per_s", float("nan"))  # none: its one-forward prefill ran out of memory
            paths["transformers eager"] = (t["decode_tokens_per_s"], prefill)
        series = {label: [p[k] for p in paths.values()]
                  for label, k in (("batch-1 decode", 0), (f"prefill {result['context'] // 1024}K", 1))}
        common.grouped_log_bars(axes[1], list(paths), series)
        axes[1].set(ylabel="tokens/s", title=f"at {result['context'] // 1024}K context")
        fig.suptitle(f"{result['arch']} layers {result['layers']}, full width, {result['gpu']}, commit {result['commit']}")

    common.save_figure(path, draw)


def print_fast(result: dict) -> None:
    """The fast model's lines: decode, prefill, roofline and the per-layer extrapolation."""
    print(f"{ARGS.arch} {len(result['layers'])} layers {result['layers']}, context {result['context']}")
    for B, r in result["fast_decode"].items():
        print(f"fast decode B={B:3d}: {r['step_ms']:.3f} ms/step, {r['tokens_per_s']:.0f} tok/s")
    print(f"fast prefill {result['context']}: {result['fast_prefill']['tokens_per_s']:.0f} tok/s")
    rf = result["roofline"]
    print(f"roofline B=1: {rf['bytes_per_step'] / 1e6:.1f} MB/step at {rf['copy_bandwidth_Bps'] / 1e12:.2f} TB/s = "
          f"{rf['floor_ms']:.3f} ms; measured fraction {rf['fraction_at_batch1']:.2%}")
    wm = result["whole_model"]
    print(f"per layer: {wm['layer_ms']:.3f} ms for {wm['layer_bytes'] / 1e6:.1f} MB ({wm['layer_fraction']:.2%} of the "
          f"copy rate); head {wm['head_ms']:.3f} ms; {wm['layers']} layers: {wm['step_ms']:.2f} ms/step, "
          f"{wm['tokens_per_s']:.0f} tok/s, roofline {wm['fraction_at_batch1']:.2%}", flush=True)
    print_breakdown(result.get("released_by_kind"), rf["copy_bandwidth_Bps"], "kernels scaled to the graph step")


def free_device_memory(device) -> int:
    """Bytes the process still holds on the device once the finished part's objects are gone: its compiled graphs
    (dynamo's caches keep the modules they traced) and reference cycles collected, the allocator's cache emptied,
    so transformers' eager 8K prefill (two [heads, 8K, 10K] fp32 tensors, 20 GiB each) meets an empty card."""
    if device.type != "cuda":
        return 0
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def main():
    if ARGS.replot:
        return common.replot(ARGS.replot, plot)
    device, config = bench_setup(ARGS.arch, ARGS.layers, ARGS.smoke)
    context = 128 if ARGS.smoke else ARGS.context
    ref_context = 32 if ARGS.smoke else ARGS.ref_context
    batches = [int(b) for b in ARGS.batches.split(",")]
    result = {**common.metadata(str(device)), "arch": ARGS.arch, "layers": [role.layer_id for role in config.layer_roles],
              "context": context, "chunk": ARGS.chunk}
    t0 = time.time()

    def save(*keys):  # each part's lines and the JSON once it is measured: a run cut short keeps what it timed
        for key in keys:
            print(key, result[key], flush=True)
        result["wall_s"] = time.time() - t0
        return common.write_result(f"runner-{ARGS.arch}", ARGS.smoke, result)

    result.update(fast_results(config, device, context, ref_context, batches))
    print_fast(result)
    save(*(["fast_at_ref_context"] if not ARGS.no_reference else []))
    result["held_after"] = {"fast": free_device_memory(device)}
    if not ARGS.no_reference:
        ref = build_random_model(config, device, torch.bfloat16, seed=0)
        ref.set_quant_sim(True, activations=False)
        result["reference"] = reference_rows(ref, device, ref_context)
        del ref
        save("reference")
        result["held_after"]["reference"] = free_device_memory(device)
    if ARGS.transformers:
        from full_width import transformers_model

        save("held_after")
        hf = transformers_model(build_random_model(config, device, torch.bfloat16, seed=0))
        # the short context first: its eager attention's [heads, S, S] logits fit where the long one's may not
        for key, length in (("transformers_at_ref_context", ref_context), ("transformers", context)):
            result[key] = transformers_or_oom(hf, device, length, config)
            save(key)
    path = save()
    plot(result, path.with_suffix(".png"))
    print(path)

main()
