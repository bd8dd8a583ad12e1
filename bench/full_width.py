"""Full-width DeepSeek-V4.1-Flash / V4-Flash models with random weights and only a few layers, for GPU benchmarks.

    python -m bench.full_width --arch v41 --layers 4 --device cuda   # build on the GPU, print bytes per layer
    python -m bench.full_width --arch v4 --layers 4                  # --device meta (default): shapes only

Library use (from a benchmark):

    from bench.full_width import full_width_config, build_random_model, transformers_model
    config = full_width_config("v41", 4)                # released widths, 4 layers with the interesting roles
    model = build_random_model(config, "cuda")          # dsv4.reference.model.Dsv4Model, weights on the GPU
    hf = transformers_model(build_random_model(full_width_config("v4", 4), "cuda"))   # V4 only

What is built:
- `full_width_config(arch, n_layers)`: every width of the released config (MODEL.md section 2: V4.1-Flash
  hidden 5120, 384 experts x 2304, q_lora 1280, 32 indexer heads, FP8 32x32 blocks; V4-Flash hidden 4096,
  256 experts x 2048, q_lora 1024, 64 indexer heads, FP8 128x128 blocks, 3 hash layers; full vocabulary),
  with `n_layers` layers picked from the released stack so that few layers still hold the distinct roles
  (`full_width_layers`), the per-layer lists (compress_ratios, KV / index / candidate sources, hash layers)
  cut and renumbered to them. No Engram, no drafter (MTP / DSpark): `num_nextn_predict_layers=0`.
- `build_random_model(config, device)`: a meta-device `Dsv4Model` whose every parameter is drawn directly on
  `device` by the generators of the tiny checkpoints (`dsv4.tiny.iter_random_tensors`), in the real storage
  formats (FP8 e4m3 + ue8m0 block scales, MXFP4 experts packed into int8 + e8m0 scales, fp32 mHC / sinks /
  router bias, int64 `tid2eid` hash tables), checked and converted as `dsv4.checkpoint.load_into` would.
  Nothing is written to disk. `dsv4.fast.model.make_fast(model)` then gives the fast model.
- `transformers_model(model)`: transformers' `DeepseekV4ForCausalLM` (eager attention, bf16 by default)
  holding the same weights, dequantized (exact in bf16), named by `dsv4.checkpoint.transformers_name` and
  handed to transformers' own loader in memory. Build it before `make_fast` (which re-lays out the weights).
- `layer_bytes(model)`: parameter bytes per layer by kind, for rooflines.
- `decode_bytes(model, state, context)`, `layer_decode_bytes(...)`: what a batch-1 decode step reads, in all and
  by layer; `role_kind(role)`: a layer's kind of decode work.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `dsv4` and `bench` importable from the device machine's bare tree

import torch

from dsv4.config import Dsv4Config
from dsv4.reference.model import Dsv4Model
from dsv4.released import V4_FLASH, V41_FLASH

ARCHS = ("v41", "v4")

RELEASED = {"v41": V41_FLASH, "v4": V4_FLASH}
# tiny widths with the real layer structure, for the benchmarks' --smoke runs on CPU
SMOKE_WIDTHS = {"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 16,
                "q_lora_rank": 128, "o_lora_rank": 64, "num_attention_heads": 16, "index_n_heads": 8}

# Which released layers a cut model keeps, in order of priority: the first n of these, sorted, are the model.
# Every prefix keeps each chosen layer's role exactly (its KV source, index source and candidate pool are
# chosen before it), so the derived LayerRoles of the cut model are the released ones, renumbered.
# V4.1: 20 decoder KV source (ratio-1 compressor, index keys, candidate-pool source), 21 decoder reader (reads
#   20's global KV and reuses its top-k), 2 encoder KV source (ratio-2 compressor + indexer), 24 candidate
#   consumer (own indexer queries rescored inside 20's pool), 3 encoder reader, 0 window-only, 25 reader of
#   24's top-k; then the rest in order (layer 1 without its Engram).
# V4: 4 CSA (ratio 4 + indexer, routed MoE), 5 HCA (ratio 128), 0 window-only with hash MoE, 2 CSA with hash
#   MoE; then the rest in order.
_PRIORITY = {
    "v41": [20, 21, 2, 24, 3, 0, 25],
    "v4": [4, 5, 0, 2],
}


def _arch(arch: str) -> str:
    a = arch.lower().replace(".", "").replace("-flash", "").replace("-", "")
    if a not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return a


def released_depth(arch: str) -> int:
    """Layers of the released checkpoint (V4.1-Flash 40, V4-Flash 43)."""
    raw = RELEASED[arch]
    return (raw["text_config"] if arch == "v41" else raw)["num_hidden_layers"]


def full_width_layers(arch: str, n_layers: int) -> list[int]:
    """The released layer ids a full-width model of `n_layers` layers is made of (sorted).

    v41, n = 1..7: [20], [20,21], [2,20,21], [2,20,21,24], [2,3,20,21,24], [0,2,3,20,21,24], [0,2,3,20,21,24,25].
    v4,  n = 1..6: [4], [4,5], [0,4,5], [0,2,4,5], [0,1,2,4,5], [0..5]. n = all layers: the released stack.
    """
    arch = _arch(arch)
    total = released_depth(arch)
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total} for {arch}, got {n_layers}")
    head = _PRIORITY[arch]
    order = head + [i for i in range(total) if i not in head]
    return sorted(order[:n_layers])


def full_width_config(
    arch: str, n_layers: int | None = None, overrides: dict | None = None, layers: Sequence[int] | None = None,
    engram_vocab_size: int | None = None,
) -> Dsv4Config:
    """The released config of `arch` ("v41" or "v4") cut to `n_layers` layers (`full_width_layers`), or to the
    released layers `layers` (sorted; any set whose roles the config validation accepts).

    The per-layer lists are cut and renumbered: compress_ratios (drafter entries dropped), V4.1's
    kv_source_layer_ids / index_source_layer_ids / candidate_source_layer_id (-1 when layer 20 is not kept),
    V4's num_hash_layers (the kept layers among the first 3: hash layers stay a prefix). The drafter is
    removed, and so are the Engram lookups unless `engram_vocab_size` is given (V4.1): then the kept layers of
    the released Engram layers (1, 14) keep theirs, with that many hash buckets per head instead of 16M, so each
    table has about 24x `engram_vocab_size` rows (3 n-gram sizes x 8 heads) instead of 384M. `overrides`
    replaces text-config fields afterwards (e.g. tiny widths for CPU tests; the layer structure is unchanged).
    """
    arch = _arch(arch)
    if layers is None:
        if n_layers is None:
            raise ValueError("give n_layers or layers")
        layers = full_width_layers(arch, n_layers)
    layers = sorted(int(i) for i in layers)
    total = released_depth(arch)
    if not layers or len(set(layers)) != len(layers) or not 0 <= layers[0] <= layers[-1] < total:
        raise ValueError(f"layers must be distinct released layer ids in 0..{total - 1}, got {layers}")
    if n_layers is not None and n_layers != len(layers):
        raise ValueError(f"n_layers={n_layers} but {len(layers)} layers given")
    raw = copy.deepcopy(RELEASED[arch])
    text = raw["text_config"] if arch == "v41" else raw
    new_id = {old: new for new, old in enumerate(layers)}
    text["num_hidden_layers"] = len(layers)
    text["compress_ratios"] = [text["compress_ratios"][i] for i in layers]
    text["num_nextn_predict_layers"] = 0
    if arch == "v41":
        for key in ("kv_source_layer_ids", "index_source_layer_ids"):
            text[key] = [new_id[i] for i in text[key] if i in new_id]
        text["candidate_source_layer_id"] = new_id.get(text["candidate_source_layer_id"], -1)
        text["engram_layer_ids"], text["engram_num_embeddings"] = _cut_engram(text, new_id, engram_vocab_size)
        text["dspark_target_layer_ids"] = []
    else:
        if engram_vocab_size is not None:
            raise ValueError("engram_vocab_size: V4 has no Engram layers")
        text["num_hash_layers"] = sum(1 for i in layers if i < text["num_hash_layers"])
    text.update(copy.deepcopy(overrides or {}))
    return Dsv4Config.from_dict(raw)


def _cut_engram(text: dict, new_id: dict[int, int], vocab_size: int | None) -> tuple[list[int], list[int]]:
    """The cut model's Engram layer ids and table rows (none without `vocab_size`); sets the bucket count."""
    if vocab_size is None:
        return [], []
    from dsv4.reference.engram import engram_primes

    kept = [new_id[i] for i in text["engram_layer_ids"] if i in new_id]
    if not kept:
        raise ValueError(f"engram_vocab_size: none of the kept layers {sorted(new_id)} has an Engram lookup "
                         f"(released: {text['engram_layer_ids']})")
    text["engram_vocab_size"] = vocab_size
    primes = engram_primes(len(kept), vocab_size, text["engram_max_ngram_size"], text["engram_n_heads"])
    return kept, [sum(map(sum, layer)) for layer in primes]


# ----------------------------------------------------------------------------------------------- weights
def build_random_model(
    config: Dsv4Config, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Dsv4Model:
    """A `Dsv4Model` of `config` with random weights in the checkpoint's storage formats, made on `device`.

    Built on the meta device; each tensor the loader expects is drawn on `device` by the tiny checkpoints'
    generators (same value rules: dense projections N(0, 1/fan_in), norms N(1, 0.1), FP8 / MXFP4 weights
    quantized from such values, distinct experts per token in `tid2eid`), then checked and converted exactly
    as `dsv4.checkpoint.load_into` does for a checkpoint tensor (`_fit`: shape, dtype, NaN) and assigned.
    One tensor (at most one fp32 expert matrix, or the fp32 embedding) is in flight at a time. Deterministic
    in (seed, device type); on the CPU the values are the tiny checkpoint's (`dsv4.tiny.random_tensors`).
    quant_sim is on, as after `load_model`. `device="meta"` returns the unmaterialized model. With Engram layers
    (`full_width_config(..., engram_vocab_size=...)`) the model gets a hasher over a synthetic token map.
    """
    from torch import nn

    from dsv4.checkpoint import _fit, _slots
    from dsv4.tiny import iter_random_tensors

    with torch.device("meta"):
        model = Dsv4Model(config, dtype)
    device = torch.device(device)
    if device.type == "meta":
        return model.eval()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    slots = _slots(model)
    gen = torch.Generator(device=device).manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for name, tensor in iter_random_tensors(model, gen):
            module, attr, expected, is_param = slots[name]
            value = _fit(name, tensor, expected)
            if is_param:
                module._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[attr] = value
            seen.add(name)
    missing = [n for n in slots if n not in seen]
    if missing:  # the generators cover every slot by construction; this guards a future model change
        raise RuntimeError(f"build_random_model left tensors unset: {missing[:8]}")
    if config.is_v41 and config.engram_layer_ids:
        model.engram_hasher = synthetic_engram_hasher(config).to(device)
    model.set_quant_sim(True)
    return model.eval()


def synthetic_engram_hasher(config: Dsv4Config):
    """The Engram hasher over a synthetic token map, token t -> t mod the compressed vocabulary (the released
    tokenizer, whose map the loader builds, is not at hand; which compressed id a token gets does not change what
    a lookup costs)."""
    from dsv4.reference.engram import EngramHasher, compute_layout

    token_map = [t % config.engram_compressed_vocab_size for t in range(config.vocab_size)]
    return EngramHasher(compute_layout(config, token_map), token_map)


# ----------------------------------------------------------------------------------------------- transformers
class _Deferred:
    """A state-dict value transformers materializes when it loads the parameter (`value[...]`, the way it
    reads a lazy safetensors slice), so one dequantized weight at a time exists besides the models."""

    def __init__(self, make, shape, dtype):
        self._make, self.shape, self.dtype = make, tuple(shape), dtype

    def __getitem__(self, index):
        return self._make()[index]

    def get_shape(self):
        return list(self.shape)


def _dequantized_state(model: Dsv4Model) -> dict[str, _Deferred]:
    """Official name -> deferred value: quantized linears as their exact fp32 dequantization (`.scale`
    dropped), everything else as stored (norms fp32, mHC fp32, dense bf16, tid2eid int64)."""
    from dsv4.checkpoint import _slots

    out = {}
    for name, (module, attr, tensor, _) in _slots(model).items():
        quantized = getattr(module, "fmt", "dense") != "dense" and hasattr(module, "dequantized_weight")
        if quantized and attr == "scale":
            continue
        if quantized:
            rows, cols = module.out_features, module.in_features
            out[name] = _Deferred(module.dequantized_weight, (rows, cols), torch.float32)
        else:
            out[name] = _Deferred(lambda t=tensor: t, tensor.shape, tensor.dtype)
    return out


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def transformers_model(model: Dsv4Model, dtype: torch.dtype = torch.bfloat16):
    """transformers' `DeepseekV4ForCausalLM` (eager attention, `dtype`) holding `model`'s weights (V4 only).

    The config is `dsv4.checkpoint`'s DeepseekV4Config translation (the one `to_transformers_dir` writes);
    the weights go to `from_pretrained(None, config=..., state_dict=...)` under their transformers checkpoint
    names (`transformers_name`), dequantized when transformers asks for each (FP8 and MXFP4 values times
    power-of-two scales are exact in bf16), so transformers' own conversion (expert stacking, renames,
    fp32-kept modules) applies and nothing touches the disk. Loading is synchronous (HF_DEACTIVATE_ASYNC_LOAD)
    to keep one layer's experts in flight. Without `accelerate` transformers loads to the CPU; the model is
    then moved to `model`'s device. Raises if any weight is missing, unexpected or misshapen.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import is_accelerate_available

    from dsv4.checkpoint import _transformers_v4_config, transformers_name

    config = model.config
    if config.is_v41:
        raise ValueError("transformers' DeepseekV4ForCausalLM runs DeepSeek-V4 only, not V4.1")
    device = model.embed.weight.device
    if device.type == "meta":
        raise ValueError("the model has no weights (meta device); build it with build_random_model on a device")
    hf_config = DeepseekV4Config.from_dict({"model_type": "deepseek_v4", **_transformers_v4_config(config)})
    state = {transformers_name(name): value for name, value in _dequantized_state(model).items()}
    kwargs = {"device_map": {"": device}} if is_accelerate_available() and device.type != "cpu" else {}
    with _env("HF_DEACTIVATE_ASYNC_LOAD", "1"):
        hf, info = DeepseekV4ForCausalLM.from_pretrained(
            None,
            config=hf_config,
            state_dict=state,
            dtype=dtype,
            attn_implementation="eager",
            output_loading_info=True,
            **kwargs,
        )
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise RuntimeError(f"transformers did not take every weight: {problems}")
    hf = hf.to(device)
    hf.requires_grad_(False)
    return hf.eval()


# ----------------------------------------------------------------------------------------------- bytes
KINDS = ("attention", "routed_experts", "shared_expert", "gate", "mhc", "norms", "engram")


def _kind(name: str) -> str:
    if name.startswith("attn."):
        return "attention"
    if name.startswith("ffn.experts."):
        return "routed_experts"
    if name.startswith("ffn.shared_experts."):
        return "shared_expert"
    if name.startswith("ffn.gate."):
        return "gate"
    if name.startswith("hc_"):
        return "mhc"
    if name.startswith(("attn_norm.", "ffn_norm.")):
        return "norms"
    if name.startswith("engram."):
        return "engram"
    raise ValueError(f"no byte kind for layer tensor {name}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_bytes(model: Dsv4Model) -> list[dict]:
    """Per layer: bytes of its parameters and persistent buffers by kind (as the model holds them: norms
    in fp32, the rest in checkpoint storage), "total", and "routed_active": the routed-expert bytes one
    token reads (num_experts_per_tok / n_routed_experts of them). Works on a meta-device model."""
    from dsv4.checkpoint import _slots

    rows = []
    for layer in model.layers:
        row = dict.fromkeys(KINDS, 0)
        for name, (_, _, t, _) in _slots(layer).items():
            row[_kind(name)] += _nbytes(t)
        row["total"] = sum(row[k] for k in KINDS)
        c = model.config
        row["routed_active"] = row["routed_experts"] * c.num_experts_per_tok // c.n_routed_experts
        rows.append(row)
    return rows


def top_level_bytes(model: Dsv4Model) -> dict[str, int]:
    """Bytes outside the layers: embed, head, and the final norm plus V4's hc_head."""
    from dsv4.checkpoint import _slots

    out = {"embed": 0, "head": 0, "other": 0}
    for name, (_, _, t, _) in _slots(model).items():
        if name.startswith(("layers.", "mtp.")):
            continue
        key = name.split(".")[0]
        out[key if key in out else "other"] += _nbytes(t)
    return out


def bench_setup(arch: str, layers: int, smoke: bool) -> tuple[torch.device, Dsv4Config]:
    """The device and full-width config a benchmark runs on (--smoke: tiny widths on the CPU)."""
    device = torch.device("cpu" if smoke else "cuda")
    return device, full_width_config(arch, layers, SMOKE_WIDTHS if smoke else None)


def prefill_chunks(runner, slot: int, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill ids [S] into a runner slot `chunk` tokens at a time, as a server feeds a long prompt ->
    the logits of the last token."""
    for a in range(0, ids.numel(), chunk):
        logits = runner.prefill(slot, ids[a : a + chunk])
    return logits


def cold_prefill(runner, ids: torch.Tensor, chunk: int) -> None:
    """A prefill of ids [S] into a fresh slot, released afterwards."""
    slot = runner.allocate()
    prefill_chunks(runner, slot, ids, chunk)
    runner.release(slot)


def fill_in_chunks(prefill, context: int, after_oom=lambda: None, smallest: int = 1024) -> int:
    """prefill(chunk) for chunks of half the context, halved after each out-of-memory error (`after_oom` runs
    first: free the allocator's cache) down to `smallest` -> the chunk that fit."""
    chunk = context // 2
    while True:
        try:
            prefill(chunk)
            return chunk
        except torch.OutOfMemoryError:
            if chunk <= smallest:
                raise
            after_oom()
            chunk //= 2


def fill_slots(runner, context: int, slots: int, chunk: int) -> list[int]:
    """`slots` sequences holding the same `context` random tokens: one prefill, then prefix hits."""
    g = torch.Generator().manual_seed(0)
    ids = random_ids(runner.config, context, g)
    first = runner.allocate()
    prefill_chunks(runner, first, ids, chunk)
    out = [first]
    for _ in range(slots - 1):
        out.append(runner.allocate())
        runner.resume(out[-1], first, context)
    return out


def decode_rows(runner, timed, context: int, batches: list[int], chunk: int, reps: int,
                logits: dict | None = None) -> dict:
    """Decode step time per batch size over `context`-token slots (released afterwards); each size decodes on
    from where the previous one stopped (reps + 2 tokens). The rows' tokens differ, so they route to different
    experts as a real batch does (one token repeated in every row would read one token's experts). `logits`,
    when given, gets each size's first (graph-capturing) step's logits, on the host. `timed(fn, reps)` -> seconds
    per call."""
    slots = fill_slots(runner, context, max(batches), chunk)
    g = torch.Generator().manual_seed(1)
    out = {}
    for B in batches:
        ids = random_ids(runner.config, B, g).to(runner.state.device)
        first = runner.decode(slots[:B], ids)  # capture
        if logits is not None:
            logits[B] = first.float().cpu()
        step = timed(lambda: runner.decode(slots[:B], ids), reps)  # noqa: B023 (called at once)
        out[B] = {"step_ms": step * 1e3, "tokens_per_s": B / step}
    for slot in slots:
        runner.release(slot)
    return out


def random_ids(config: Dsv4Config, shape, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Random prompt token ids: the text ids below V4.1's image-span tokens, which the model rejects."""
    image = config.image_token_id if config.is_v41 else None
    high = min(config.vocab_size, image) if image is not None else config.vocab_size
    return torch.randint(0, high, tuple(shape) if not isinstance(shape, int) else (shape,), generator=generator,
                         device=device)


def decode_bytes(model: Dsv4Model, state, context: int) -> int:
    """Bytes one batch-1 decode step reads: every weight a token touches as the model holds it (routed
    experts: top-k of them; shared expert bf16 copy and attention weights dequantized at load, except those
    the step reads as stored FP8 in their place: `FastAttention.fp8_pairs`, `FastMoE.fp8_pairs`), plus the
    cache rows attended or scored at `context`, at the sizes `state` (a fast SlotState) stores them."""
    return model.head.weight.nbytes + model.embed.weight[0].nbytes + sum(layer_decode_bytes(model, state, context))


def layer_decode_bytes(model: Dsv4Model, state, context: int) -> list[int]:
    """`decode_bytes` of each layer (what the step reads beside the head and its embedding row)."""
    c = model.config
    row = lambda rows: rows.data[0, 0].nbytes + (0 if rows.scale is None else rows.scale[0, 0].nbytes)
    out = []
    for layer, weights in zip(model.layers, layer_bytes(model)):
        total = weights["total"] - weights["routed_experts"] + weights["routed_active"]
        stored = layer.attn.fp8_pairs() + layer.ffn.fp8_pairs()
        total -= sum(w.nbytes - c.weight.nbytes - c.scale.nbytes for w, c in stored)
        role = layer.role
        total += c.sliding_window * row(state.windows[role.layer_id])
        if role.compress_ratio:
            entries = context // role.compress_ratio
            picked = entries if role.index_source is None else min(entries, c.index_topk)
            total += picked * row(state.compressed[role.kv_source])
            if role.owns_indexer:
                keys = state.index_keys[role.kv_source if c.is_v41 else role.layer_id]
                total += entries * row(keys)
        out.append(total)
    return out


def role_kind(role) -> str:
    """`role_label` without the source layers' ids: layers of one kind run the same decode work (the Engram
    lookup aside, which `role_label` does not show either)."""
    return re.sub(r"<-\d+", "<-", role_label(role))


def role_label(role) -> str:
    """A short description of a LayerRole: attention kind and what the layer owns or reads."""
    if role.compress_ratio == 0:
        parts = ["window"]
    else:
        parts = [f"{role.attention_kind} r{role.compress_ratio}"]
        if role.owns_compressor:
            parts.append("kv-src")
        elif role.kv_source is not None and role.kv_source != role.layer_id:
            parts.append(f"kv<-{role.kv_source}")
        if role.owns_indexer:
            parts.append("idx")
        elif role.index_source is not None and role.index_source != role.layer_id:
            parts.append(f"idx<-{role.index_source}")
        if role.candidate_role:
            parts.append(f"cand-{role.candidate_role}")
    if role.hash_moe:
        parts.append("hash-moe")
    return " ".join(parts)


def launches(prof) -> list[dict]:
    """The step's kernels in launch order, each with the ops it was launched under (innermost first): what the
    table's aten kernels (copies, reductions: glue the compiled step left) belong to, and its time run alone (the
    host launches them tens of microseconds apart, so none waits for another)."""
    return [{"kernel": k.name[:90], "us": k.duration, "ops": chain} for chain, k in launching_ops(prof)]


def launching_ops(prof) -> list[tuple[str, object]]:
    """(the ops a kernel was launched under, innermost first and at most 4 deep, joined by " < "; the kernel) for
    every kernel the profiled host launched, in launch order."""
    ops = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.kernels),
                 key=lambda e: e.time_range.start)
    out = []
    for op in ops:
        chain, parent = [], op
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parent.cpu_parent
        out += [(" < ".join(chain), k) for k in op.kernels]
    return out


def idle_gaps(prof, top: int) -> dict:
    """Where the device waited during the profiled run: the `top` longest stretches with no kernel, copy or memset
    running (device events merged in start order), each with the device work before and after it and the host ops
    that launched the one after (innermost first; the n-th launch of a name is its n-th run), and the idle time in
    all. A gap is the host not yet having launched the next work: behind on its own, or back from waiting on the
    device (a pageable copy, a sync)."""
    launched_by = defaultdict(list)  # kernel name -> the launching ops' chains, in launch order
    for chain, k in launching_ops(prof):
        launched_by[k.name].append(chain)
    work = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda w: w[0])
    runs = Counter()
    gaps, busy_until, before = [], None, None
    for start, end, name in work:
        chains, n = launched_by.get(name, []), runs[name]
        runs[name] += 1
        if busy_until is not None and start > busy_until:
            gaps.append({"us": start - busy_until, "before": before[:90], "after": name[:90],
                         "launched_by": chains[n] if n < len(chains) else ""})
        if busy_until is None or end >= busy_until:
            busy_until, before = end, name
    gaps.sort(key=lambda g: -g["us"])
    return {"idle_us": sum(g["us"] for g in gaps), "gaps": len(gaps), "longest": gaps[:top]}


# the kernels that close an mHC site, two a layer (its FFN site's closes it): the plain post, V4.1's post finishing
# the site's coefficients, or the post with the next site's pass (V4.1's) or sums (V4's)
POST_KERNELS = ("_post_kernel", "_post_finish_kernel", "_post_partial_kernel")


def split_by_layer(steps: list[dict], n_layers: int) -> tuple[list[dict], list[list[dict]], list[dict]] | None:
    """`launches` cut into the step's entry, one run of launches a layer and its exit (final collapse, norm, head):
    each layer ends with its second mHC post kernel. The entry is the leading launches of the entry's compiled
    region (uncompiled, its kernels count in the first layer's). None where the posts do not make n_layers runs."""
    region = lambda r: (m.group(1) if (m := re.search(r"Torch-Compiled Region: (\d+)/", r["ops"])) else None)
    first = region(steps[0]) if steps else None
    n_entry = 0
    while first is not None and n_entry < len(steps) and region(steps[n_entry]) == first:
        n_entry += 1
    runs, run, posts = [], [], 0
    for r in steps[n_entry:]:
        run.append(r)
        posts += r["kernel"] in POST_KERNELS
        if posts == 2:
            runs.append(run)
            run, posts = [], 0
    if len(runs) != n_layers or posts:
        return None
    return steps[:n_entry], runs, run


def layer_breakdown(fast, state, steps: list[dict], context: int, nbytes: int, bw: float, arch: str,
                    step_ms: float | None = None, key: str = "us") -> dict | None:
    """A profiled batch-1 step by layer: its launches (`launches`) cut into layers (`split_by_layer`), each layer's
    time and bytes (`layer_rows`), the time outside them, and the step at the released depth by layer kind
    (`released_estimate`); the times are the launches' `key` (the kernels' alone, or with "own_us" their own times
    in the graph replay), or scaled so all of them add up to `step_ms` (the graph step). None where the launches do
    not split into the layers (on the CPU there are no kernels)."""
    split = split_by_layer(steps, len(fast.layers))
    if split is None:
        return None
    entry, runs, leave = split
    scale = 1.0 if step_ms is None else step_ms * 1e3 / sum(r[key] for r in steps)
    layer_bytes = layer_decode_bytes(fast, state, context)
    layers = layer_rows(fast, runs, layer_bytes, full_width_layers(arch, len(fast.layers)), scale, key)
    outside_us = scale * sum(r[key] for r in entry + leave)
    return {"layers": layers, "outside_us": outside_us, "scale": scale,
            "estimate": released_estimate(arch, layers, outside_us, nbytes - sum(layer_bytes), bw)}


def layer_rows(fast, runs: list[list[dict]], layer_bytes: list[int], released: list[int], scale: float = 1.0,
               key: str = "us") -> list[dict]:
    """Each layer's launches (`runs`: `split_by_layer`'s), their times (`key`: alone, or "own_us") times `scale`,
    and the bytes the step reads for it (`layer_decode_bytes`), with its kind (`role_kind`) and released layer id."""
    return [{"layer": i, "released": released[i], "kind": role_kind(layer.role), "launches": len(run),
             "us": scale * sum(r[key] for r in run), "bytes": nbytes}
            for i, (layer, run, nbytes) in enumerate(zip(fast.layers, runs, layer_bytes))]


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records on `device`: CPU ops, and CUDA kernels on a GPU."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_step(runner, ids: torch.Tensor, slots: list[int]):
    """torch.profiler over one decode step of `slots` (`profiler_activities`) run outside its graph, by the runner's
    step function (compiled where the runner compiles), after one step unprofiled."""
    from torch.profiler import profile

    device = runner.state.device
    slot_ids = torch.tensor(slots, device=device)
    with torch.inference_mode():
        runner.step(ids, slot_ids, runner.state)
        with profile(activities=profiler_activities(device)) as prof:
            runner.step(ids, slot_ids, runner.state)
            if device.type == "cuda":
                torch.cuda.synchronize()
    return prof


def print_breakdown(by_layer: dict | None, bw: float, how: str) -> None:
    """`layer_breakdown`'s lines: each layer's kind, time (`how` they were timed), bytes and share of the copy rate
    `bw`, then the step at the released depth by kind."""
    if by_layer is None:
        print("by layer: not measured (batch 1 only, where the launches split into the layers at their mHC posts)")
        return
    print(f"by layer ({how}; entry and exit {by_layer['outside_us']:.1f} us):")
    for r in by_layer["layers"]:
        print(f"  layer {r['layer']} (released {r['released']}, {r['kind']}): {r['us']:7.1f} us, {r['launches']} "
              f"launches, {r['bytes'] / 1e6:.1f} MB: {r['bytes'] / bw / (r['us'] * 1e-6):.2%} of the copy rate")
    est = by_layer["estimate"]
    if "missing_kinds" in est:
        print(f"released depth: not estimated, no layer of kinds {est['missing_kinds']} measured (--layers 6 measures "
              "every V4.1 kind, 4 every V4 kind)")
    else:
        print(f"released depth ({est['layers']} layers by kind, Engram left out): {est['step_ms']:.3f} ms a step for "
              f"{est['bytes'] / 1e9:.2f} GB, floor {est['floor_ms']:.3f} ms: {est['roofline']:.1%} of the roofline",
              flush=True)


def released_estimate(arch: str, layers: list[dict], outside_us: float, outside_bytes: int, bw: float) -> dict:
    """The step at the released depth from the measured layers: each released layer costs the mean time and bytes of
    the measured layers of its kind (`role_kind`), plus the entry and exit (`outside_us`: head included) and the
    head's and embedding row's bytes; its roofline is those bytes at the copy rate over that time. Kinds nothing
    measured are listed instead (`missing_kinds`). Engram lookups are not in the bench's layers."""
    kinds = Counter(role_kind(r) for r in full_width_config(arch, released_depth(arch)).layer_roles)
    measured = defaultdict(list)
    for row in layers:
        measured[row["kind"]].append(row)
    missing = sorted(set(kinds) - set(measured))
    if missing:
        return {"missing_kinds": missing}
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    us = outside_us + sum(n * mean(measured[k], "us") for k, n in kinds.items())
    nbytes = outside_bytes + sum(n * mean(measured[k], "bytes") for k, n in kinds.items())
    return {"layers": sum(kinds.values()), "kinds": dict(kinds), "step_ms": us / 1e3, "bytes": nbytes,
            "floor_ms": nbytes / bw * 1e3, "roofline": nbytes / bw / (us * 1e-6),
            "engram_layers_left_out": RELEASED[arch].get("text_config", {}).get("engram_layer_ids", [])}


def released_numbers(result: dict) -> dict:
    """A profile's released-depth step and roofline (`released_estimate` in its `by_layer_own` and `by_layer`) as
    top-level numbers, so that `bench/ab.py` tables them, where every kind was measured: `_own` by the kernels' own
    times in the graph replay (they sum to the graph step: the figure to quote), `_spans` by their spans (which
    count a PDL kernel's wait for its predecessor)."""
    out = {}
    for name, key in (("own", "by_layer_own"), ("spans", "by_layer")):
        estimate = (result.get(key) or {}).get("estimate", {})
        if "step_ms" in estimate:
            out[f"released_ms_{name}"] = estimate["step_ms"]
            out[f"released_roofline_{name}"] = estimate["roofline"]
    return out


# ----------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="v41")
    p.add_argument("--layers", type=int, default=4, help="number of layers (see full_width_layers)")
    p.add_argument("--device", default="meta", help="where to build the weights; 'meta': shapes only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=0, help="run one reference forward over this many random tokens")
    args = p.parse_args(argv)

    from bench import common

    config = full_width_config(args.arch, args.layers)
    kept = full_width_layers(args.arch, args.layers)
    t0 = time.perf_counter()
    model = build_random_model(config, args.device, seed=args.seed)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    built_s = time.perf_counter() - t0
    c = config
    print(f"{args.arch}: hidden {c.hidden_size}, {c.n_routed_experts} experts x {c.moe_intermediate_size} "
          f"(top-{c.num_experts_per_tok}), q_lora {c.q_lora_rank}, weight blocks {list(c.weight_block_size)}, "
          f"vocab {c.vocab_size}; released layers {kept}")
    if args.device != "meta":
        print(f"built on {args.device} in {built_s:.1f} s")
    rows = layer_bytes(model)
    for row, role, orig in zip(rows, config.layer_roles, kept):
        row.update(layer=role.layer_id, released=orig, role=role_label(role))
    mb = ".1f"
    columns = [("layer", "layer", "d"), ("released", "released", "d"), ("role", "role", ""),
               ("attention MB", lambda r: r["attention"] / 1e6, mb),
               ("routed experts MB", lambda r: r["routed_experts"] / 1e6, mb),
               ("routed active MB", lambda r: r["routed_active"] / 1e6, mb),
               ("shared expert MB", lambda r: r["shared_expert"] / 1e6, mb),
               ("gate MB", lambda r: r["gate"] / 1e6, ".2f"),
               ("mHC MB", lambda r: r["mhc"] / 1e6, ".2f"),
               ("norms MB", lambda r: r["norms"] / 1e6, ".3f"),
               ("total MB", lambda r: r["total"] / 1e6, mb)]
    print()
    common.print_table(columns, rows)
    top = top_level_bytes(model)
    total = sum(r["total"] for r in rows) + sum(top.values())
    print(f"\nembed {top['embed'] / 1e6:.1f} MB, head {top['head'] / 1e6:.1f} MB, other {top['other'] / 1e6:.2f} MB; "
          f"model total {total / 1e9:.2f} GB")
    if args.device != "meta" and torch.device(args.device).type == "cuda":
        print(f"GPU memory allocated: {torch.cuda.memory_allocated() / 1e9:.2f} GB")
    if args.tokens and args.device != "meta":
        ids = random_ids(c, (1, args.tokens), device=args.device)
        if c.is_v41 and c.image_token_id is not None:
            ids[ids == c.image_token_id] = c.eos_token_id
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(ids)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"reference forward over {args.tokens} tokens: {time.perf_counter() - t0:.2f} s, "
              f"logits finite: {bool(logits.isfinite().all())}, |logit| max {logits.abs().max().item():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
