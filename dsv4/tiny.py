"""Tiny random DeepSeek-V4-Flash / V4.1-Flash checkpoints in the real on-disk layout.

A tiny checkpoint is what a released one is, at toy size: `config.json` with the released field names
(V4: flat, `model_type: deepseek_v4`; V4.1: composite, `text_config` + top-level `quantization_config`),
sharded safetensors with `model.safetensors.index.json`, FP8 e4m3 weights with ue8m0 block scales,
MXFP4 routed experts packed two per byte into int8, BF16 / F32 / I64 tensors where the release has them,
a byte-level `tokenizer.json` and, for V4.1, the Engram layout file.

Tensor names, shapes and storage are read off a meta-device `Dsv4Model` built from the same config, so
a tiny checkpoint fits the model by construction. Values are random but deterministic in the seed.

`dequantized=True` writes the twin: the same config without `quantization_config`, and every quantized
linear weight replaced by its exact dequantization, stored as F32 (an FP8 value times a power-of-two
scale is not always representable in BF16). The Engram tables stay FP8: the model stores them that way
whatever the checkpoint's quantization.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dsv4.checkpoint import _slots, dequantized_tensors
from dsv4.config import Dsv4Config
from dsv4.quant import quantize_fp8, quantize_mxfp4
from dsv4.reference.linear import FP4_BLOCK, Linear, RMSNorm
from dsv4.reference.model import Dsv4Model
from dsv4.released import V4_FLASH, V41_FLASH

ARCHS = ("v4-flash", "v41-flash")
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")  # ids 0, 1, 2
# Small enough that every tiny checkpoint spans several shards, so sharded loading is always exercised.
MAX_SHARD_BYTES = 1 << 20
# bump when the tiny model's shape or contents change, so a stale cached copy is not reused
TINY_FORMAT_VERSION = 3
EMBEDDED_DEFAULT_NAME = f"tiny-v41-flash-v{TINY_FORMAT_VERSION}-seed0"

# Fields both tiny models share (V4.1 nests them under text_config).
_TEXT_FIELDS = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 16,
    # 16, not 4: with few indexer heads, exact-zero score ties are common (all heads' relu at 0, or all
    # head weights negative), and implementations may break ties differently (dsv4: lower index first)
    "index_n_heads": 16,
    "index_topk": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # max_position_embeddings = factor * original, so YaRN's implied factor matches the explicit one
    "max_position_embeddings": 4096,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 0,  # V4: no drafter tensors; V4.1 overrides it with a DSpark drafter
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
_YARN = {"factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}


# ----------------------------------------------------------------------------- tokenizer
def byte_level_tokenizer(vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` filling exactly `vocab_size` ids.

    Ids 0..2 are DeepSeek's BOS, EOS and pad; then the 256 byte symbols (in code-point order); then
    merges of a space or a letter with a letter, most frequent English letters first, until full.
    Every id the model can see is a token, so the Engram token map covers the whole vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins, one per byte
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *symbols))}
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pairs = [("Ġ", b) for b in letters] + [(a, b) for a in letters for b in letters]  # "Ġ" is a space
    merges = pairs[: vocab_size - len(vocab)]
    if len(vocab) + len(merges) != vocab_size:
        raise ValueError(f"byte_level_tokenizer: cannot fill {vocab_size} ids")
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _tokenizer_config(max_length: int) -> dict:
    bos, eos, pad = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }


# ----------------------------------------------------------------------------- config.json
def tiny_config_dict(arch: str, tokenizer) -> dict:
    """The quantized tiny model's config.json, laid out as the release of `arch` lays it out."""
    if arch == "v4-flash":
        return _v4_config()
    if arch == "v41-flash":
        return _v41_config(tokenizer)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def _v4_config() -> dict:
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **_TEXT_FIELDS,
        "num_hidden_layers": 4,
        # SWA, CSA, HCA, CSA, then the MTP layer's entry, as the 44-entry release ends
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_hash_layers": 1,
        "index_head_dim": 128,
        "rope_scaling": {"type": "yarn", **_YARN},
        "rms_norm_eps": 1e-6,
        "expert_dtype": "fp4",
        "quantization_config": copy.deepcopy(V4_FLASH["quantization_config"]),
        "torch_dtype": "bfloat16",
    }


def _v41_config(tokenizer) -> dict:
    from dsv4.reference.engram import compressed_token_map, engram_primes

    engram = {
        "engram_layer_ids": [1, 3],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_vocab_size": 1000,
        "engram_pad_id": 2,
    }
    # the table sizes and the compressed vocabulary are facts of the hashing and of the tokenizer
    primes = engram_primes(
        len(engram["engram_layer_ids"]),
        engram["engram_vocab_size"],
        engram["engram_max_ngram_size"],
        engram["engram_n_heads"],
    )
    engram["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    engram["engram_compressed_vocab_size"] = compressed_token_map(tokenizer)[1]
    text = {
        **_TEXT_FIELDS,
        "num_hidden_layers": 8,
        # two window layers, a ratio-2 encoder group, a ratio-1 decoder group, then the drafter's entries
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [2, 5],
        "index_source_layer_ids": [2, 5, 7],
        "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        # 128, not 64: the indexer head must be wider than its RoPE part (qk_rope_head_dim)
        "index_head_dim": 128,
        "rope_scaling": {"rope_type": "yarn", **_YARN},
        "rms_norm_eps": 1e-20,
        **engram,
        # a two-stage DSpark drafter (mtp.0, mtp.1) reading the inputs of the last two layers
        "num_nextn_predict_layers": 2,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 511,
        "dspark_target_layer_ids": [6, 7],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        # outside the vocabulary: a random model must never emit a token the model rejects as an image
        "image_token_id": text["vocab_size"],
        "quantization_config": copy.deepcopy(V41_FLASH["quantization_config"]),
        "torch_dtype": "bfloat16",
    }


def _with_overrides(raw: dict, overrides: dict) -> dict:
    """config.json with fields replaced wherever the layout puts them (V4.1: most in text_config)."""
    out = copy.deepcopy(raw)
    for key, value in overrides.items():
        (out["text_config"] if key in out.get("text_config", {}) else out)[key] = value
    return out


def _without_quantization(raw: dict) -> dict:
    """The twin's config: no quantization_config and no expert_dtype, wherever the layout puts them."""
    drop = ("quantization_config", "expert_dtype")
    out = {k: v for k, v in raw.items() if k not in drop}
    if "text_config" in out:
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k not in drop}
    return out


# ----------------------------------------------------------------------------- tensors
def _normal(gen: torch.Generator, shape, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=gen.device) * std + mean


def _dense_value(module: nn.Module, attr: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """fp32 values at scales where every activation stays O(1) through the tiny model."""
    if isinstance(module, RMSNorm) or attr in ("q_weight", "k_weight"):  # multiplicative gains
        return _normal(gen, shape, 0.1, 1.0)
    if attr.startswith("hc_"):  # mHC: the projections small, the bases and scales larger
        return _normal(gen, shape, 0.1 if attr.endswith("_fn") else 0.5)
    if attr == "attn_sink":
        return _normal(gen, shape, 1.0)
    if attr in ("bias", "bias_vl", "ape"):
        return _normal(gen, shape, 0.1)
    if attr == "weight" and len(shape) == 2:  # dense projections, the embedding, the router
        return _normal(gen, shape, shape[-1] ** -0.5)
    raise ValueError(f"no value rule for {type(module).__name__}.{attr} {list(shape)}")


def _quantized(module: nn.Module, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) as the release stores them: an FP8 linear in 2-D blocks, an MXFP4 linear packed
    into int8, or an Engram table's FP8 rows with one scale per SCALE_BLOCK values."""
    from dsv4.reference.engram import SCALE_BLOCK, EngramEmbedding

    if isinstance(module, EngramEmbedding):
        rows = _normal(gen, (module.num_embeddings, module.embedding_dim), module.embedding_dim**-0.5)
        return quantize_fp8(rows, (SCALE_BLOCK,))
    w = _normal(gen, (module.out_features, module.in_features), module.in_features**-0.5)
    if module.fmt == "fp8":
        return quantize_fp8(w, module.block)
    packed, scale = quantize_mxfp4(w, FP4_BLOCK)
    return packed.view(torch.int8), scale


def _is_quantized(module: nn.Module) -> bool:
    from dsv4.reference.engram import EngramEmbedding

    return isinstance(module, EngramEmbedding) or (isinstance(module, Linear) and module.fmt != "dense")


def _slot_tensors(name: str, module: nn.Module, attr: str, slot: torch.Tensor, gen) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one model slot (a quantized weight brings its scale along)."""
    if _is_quantized(module):
        if attr == "scale":  # written with its weight
            return {}
        weight, scale = _quantized(module, gen)
        return {name: weight, name.removesuffix("weight") + "scale": scale}
    if attr == "tid2eid":  # hash routing: k distinct experts per token id
        ranks = torch.rand(slot.shape[0], module.weight.shape[0], generator=gen, device=gen.device).argsort(dim=-1)
        return {name: ranks[:, : slot.shape[1]].contiguous()}
    # the model computes norms in fp32, but the release stores them in BF16
    dtype = torch.bfloat16 if isinstance(module, RMSNorm) else slot.dtype
    return {name: _dense_value(module, attr, slot.shape, gen).to(dtype)}


def iter_random_tensors(model: Dsv4Model, gen: torch.Generator):
    """(name, tensor) for every tensor `model` (a meta-device model) loads, in checkpoint storage, drawn
    from `gen` and made on its device (a CUDA generator makes them on the GPU, one at a time)."""
    for name, (module, attr, slot, _) in _slots(model).items():
        yield from _slot_tensors(name, module, attr, slot, gen).items()


def random_tensors(model: Dsv4Model, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor `model` (a meta-device model) loads, with deterministic random values.

    The slots are the loader's own list, so the checkpoint holds exactly what loading expects.
    """
    return dict(iter_random_tensors(model, torch.Generator().manual_seed(seed)))


# ----------------------------------------------------------------------------- writing
def write_sharded_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """Consecutive tensors packed into shards of at most max_shard_bytes (one tensor may exceed it),
    plus `model.safetensors.index.json`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def make_tiny_checkpoint(arch: str, out_dir: str | os.PathLike, seed: int = 0, dequantized: bool = False,
                         overrides: dict | None = None) -> Path:
    """Write a tiny random checkpoint of `arch` ("v4-flash" or "v41-flash") into out_dir; returns it.

    The quantized checkpoint and its `dequantized` twin of the same seed hold the same weights.
    `overrides` replaces config.json fields (e.g. the released engram_head_dim of 256, which the host
    Engram tables' packed rows assume).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(_TEXT_FIELDS["vocab_size"])
    raw = _with_overrides(tiny_config_dict(arch, tokenizer), overrides or {})
    config = Dsv4Config.from_dict(raw)
    with torch.device("meta"):
        model = Dsv4Model(config)
    tensors = random_tensors(model, seed)
    if dequantized:
        tensors = dequantized_tensors(model, tensors)
        raw = _without_quantization(raw)
    write_sharded_safetensors(tensors, out, MAX_SHARD_BYTES)
    _write_json(out / "config.json", raw)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config.max_position_embeddings))
    if config.is_v41 and config.engram_layer_ids:
        from dsv4.reference.engram import LAYOUT_FILENAME, compressed_token_map, load_or_create_layout

        load_or_create_layout(out / LAYOUT_FILENAME, config, compressed_token_map(tokenizer)[0])
    return out


def embedded_default_dir() -> Path:
    """The V4.1 tiny model (seed 0) under the cache ($DSV4_CACHE, else ~/.cache/dsv4), made on first use.

    It is written to a temporary directory beside its final place and renamed there, so a concurrent
    caller never sees half a checkpoint; when two callers race, the first rename wins.
    """
    root = Path(os.environ.get("DSV4_CACHE") or Path.home() / ".cache" / "dsv4").expanduser()
    final = root / EMBEDDED_DEFAULT_NAME
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{EMBEDDED_DEFAULT_NAME}-"))
    try:
        make_tiny_checkpoint("v41-flash", tmp, seed=0)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
