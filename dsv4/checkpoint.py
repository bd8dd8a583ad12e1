"""Loading checkpoints: sharded safetensors, memory-mapped and assigned into a meta-device model.

Accepted layouts:
- official DeepSeek names (`embed.weight`, `layers.{i}.attn.wq_a.weight` + `.scale`, FP4 experts as
  packed int8 with e8m0 scales), one file or shards listed in `model.safetensors.index.json`;
- the names transformers' `save_pretrained` writes for DeepseekV4, mapped by `TRANSFORMERS_RENAMES`.

Each shard file is memory-mapped once and every tensor is a view into it, assigned to the model in
place of its meta parameter: nothing is allocated twice (a dtype conversion, e.g. a bf16 checkpoint
into an fp32 model, is the only copy; `to_device` copies, on the host only, the tensors off a 64-byte
boundary, so that CPU GEMMs round the same whatever the file offsets). Only safetensors are read;
nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# Tensors the text model does not use (yet): skipped by name, and counted in the report. The drafter
# (`mtp.`) is skipped only where the model has none (V4's MTP stages).
SKIPPED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")

# transformers' DeepseekV4 `save_pretrained` keeps a `model.` prefix and a few of its own leaf names;
# the attention kv_norm comes out as `attn.norm` (compressor norms are named `norm` in both schemes).
TRANSFORMERS_RENAMES = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^model\.layers\.(\d+)\.attn\.norm\.weight$"), r"layers.\1.attn.kv_norm.weight"),
    (re.compile(r"^model\."), ""),
)

NAN_CHECK_CHUNK = 1 << 26  # elements per step of the loader's NaN check (64 MB of temporaries per e4m3 step)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PACKED_BYTES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensors."""


@dataclass
class LoadReport:
    loaded: int = 0
    skipped: list[str] = field(default_factory=list)
    shards: int = 0


def official_name(name: str) -> str:
    """Map a transformers-saved DeepseekV4 tensor name to the official one (identity otherwise)."""
    for pattern, repl in TRANSFORMERS_RENAMES:
        name, n = pattern.subn(repl, name)
        if n and pattern.pattern != r"^model\.":
            return name
    return name


def resolve_model_dir(path_or_repo: str | os.PathLike) -> Path:
    """A local directory, or a Hugging Face repo id fetched with huggingface-hub (HF_HUB_OFFLINE applies)."""
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    text = str(path_or_repo)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"model directory {text!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
        return Path(snapshot_download(repo_id=text, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, no network: one line that says which
        raise FileNotFoundError(f"cannot get model {text!r} from the Hugging Face hub: {e}".splitlines()[0]) from None


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing[:5]}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise CheckpointError(f"{model_dir} holds only pickle checkpoints; dsv4 loads safetensors only")
        raise CheckpointError(f"no .safetensors files in {model_dir}")
    return files


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file as views into a private memory map of it."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    size = path.stat().st_size
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = data[base + start : base + end]
        if (base + start) % max(dtype.itemsize, 1):  # misaligned for a view: copy this one tensor
            raw = raw.clone()
        out[name] = raw.view(dtype).view(info["shape"])
    return out


def _has_nan(tensor: torch.Tensor, chunk: int = NAN_CHECK_CHUNK) -> bool:
    """Any NaN (e4m3: the code with all exponent and mantissa bits set), checked a chunk of elements at a
    time: a whole-tensor check would make table-sized temporaries (two 98 GB ones for an Engram table)."""
    flat = tensor.reshape(-1)
    if tensor.dtype == torch.float8_e4m3fn:
        bits = flat.view(torch.uint8)
        return any(bool(((bits[i : i + chunk] & 0x7F) == 0x7F).any()) for i in range(0, bits.numel(), chunk))
    return any(bool(flat[i : i + chunk].isnan().any()) for i in range(0, flat.numel(), chunk))


def _fit(name: str, tensor: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Check one tensor against the model's slot and convert where the conversion is exact in intent."""
    if tuple(tensor.shape) != tuple(expected.shape):
        raise CheckpointError(f"{name}: shape {list(tensor.shape)}, expected {list(expected.shape)}")
    want, got = expected.dtype, tensor.dtype
    if want == torch.int8 and got in _PACKED_BYTES:  # packed FP4 pairs, however the writer typed the bytes
        return tensor.view(torch.int8)
    if want in (torch.int64, torch.int32) and not got.is_floating_point and got != torch.bool:
        return tensor.to(want)
    if want.is_floating_point and want.itemsize > 1 and got.is_floating_point and got.itemsize > 1:
        if _has_nan(tensor):
            raise CheckpointError(f"{name}: contains NaN")
        return tensor if got == want else tensor.to(want)
    if want == got:
        if want == torch.float8_e4m3fn and _has_nan(tensor):
            raise CheckpointError(f"{name}: contains NaN")
        return tensor
    raise CheckpointError(f"{name}: dtype {got}, expected {want}")


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor, bool]]:
    """Every persistent parameter and buffer: name -> (owner module, attribute, current tensor, is_param)."""
    slots = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in module._parameters.items():
            if p is not None:
                slots[prefix + attr] = (module, attr, p, True)
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                slots[prefix + attr] = (module, attr, b, False)
    return slots


def load_into(model: nn.Module, model_dir: Path, progress: bool = True, skip: tuple[str, ...] = ()) -> LoadReport:
    """Assign every checkpoint tensor into `model` (built on the meta device), checking all of them.

    Raises CheckpointError listing missing, unexpected, misshapen and mistyped tensors by name.
    """
    from tqdm import tqdm

    slots = _slots(model)
    report, problems, seen = LoadReport(), [], set()
    files = shard_files(model_dir)
    for path in tqdm(files, desc="Loading shards", unit="shard", disable=not progress or len(files) < 2):
        for raw_name, tensor in mmap_safetensors(path).items():
            name = official_name(raw_name)
            if name.startswith(SKIPPED_PREFIXES + tuple(skip)):
                report.skipped.append(name)
                continue
            if name not in slots:
                problems.append(f"unexpected tensor {name}")
                continue
            module, attr, expected, is_param = slots[name]
            try:
                value = _fit(name, tensor, expected)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            if is_param:
                module._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[attr] = value
            seen.add(name)
        report.shards += 1
    problems += [f"missing tensor {n}" for n in slots if n not in seen]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
        raise CheckpointError(f"checkpoint {model_dir} does not fit the model: {shown}")
    report.loaded = len(seen)
    return report


HOST_ALIGNMENT = 64  # bytes: torch's CPU allocator alignment, the widest SIMD load the CPU GEMMs issue


def to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to(device)`; on the host, every tensor the memory map left off a 64-byte boundary is then
    copied into torch's aligned memory. CPU GEMMs peel an unaligned operand's head and so round with
    the file offset: one checkpoint saved twice gave logits 1 ulp apart. Tensors shared by several
    modules stay shared."""
    model = model.to(device)
    if torch.device(device).type != "cpu":
        return model
    copies: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                if t is None or t.data_ptr() % HOST_ALIGNMENT == 0:
                    continue
                if id(t) not in copies:
                    data = t.detach().clone()
                    copies[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                store[attr] = copies[id(t)]
    return model


# ----------------------------------------------------------------------------- writing for transformers
# The inverse of TRANSFORMERS_RENAMES: official names -> the names transformers' DeepseekV4
# `save_pretrained` writes (and its `from_pretrained` reads back). The LM head lives outside the base
# model, so it alone keeps its name; everything else gains the `model.` prefix.
_OFFICIAL_TO_TRANSFORMERS = (
    (re.compile(r"^embed\.weight$"), "model.embed_tokens.weight"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"model.hc_head.hc_\1"),
    (re.compile(r"^layers\.(\d+)\.attn\.kv_norm\.weight$"), r"model.layers.\1.attn.norm.weight"),
    (re.compile(r"^head\.weight$"), "head.weight"),
)


def transformers_name(official: str) -> str:
    """Map an official tensor name to the one transformers' DeepseekV4 checkpoints use."""
    for pattern, repl in _OFFICIAL_TO_TRANSFORMERS:
        name, n = pattern.subn(repl, official)
        if n:
            return name
    return f"model.{official}"


def dequantized_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official tensors with every FP8 / FP4 linear weight replaced by its exact dequantization (fp32)
    and its `.scale` dropped; everything else is passed through.

    `model` is the (meta-device) model the tensors belong to: each weight is dequantized by a shallow
    copy of its own module holding the stored tensors, so the values are exactly the ones the model
    computes with.
    """
    import copy

    out = dict(tensors)
    for name, module in model.named_modules():
        if getattr(module, "fmt", "dense") == "dense" or not hasattr(module, "dequantized_weight"):
            continue
        stored = copy.copy(module)
        stored._parameters = {"weight": out.pop(f"{name}.weight"), "scale": out.pop(f"{name}.scale")}
        out[f"{name}.weight"] = stored.dequantized_weight().float()
    return out


def _transformers_v4_config(config) -> dict:
    """DeepseekV4Config fields of a V4 `Dsv4Config`: layer and MLP types per layer, RoPE by rope kind."""
    kinds = {"window": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    roles = config.layer_roles
    rotary = config.qk_rope_head_dim / config.head_dim
    compress = {"rope_type": "default"}
    if config.rope_scaling:
        yarn = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        # transformers derives YaRN's attention factor (mscale) unless told; the model applies none
        compress = {"rope_type": "yarn", **{k: config.rope_scaling[k] for k in yarn}, "attention_factor": 1.0}
    copied = (
        "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim q_lora_rank num_experts_per_tok n_routed_experts n_shared_experts scoring_func norm_topk_prob "
        "routed_scaling_factor max_position_embeddings rope_theta compress_rope_theta hc_mult hc_sinkhorn_iters "
        "hc_eps swiglu_limit sliding_window o_groups o_lora_rank index_n_heads index_head_dim index_topk "
        "num_nextn_predict_layers rms_norm_eps bos_token_id eos_token_id tie_word_embeddings"
    ).split()
    return {
        **{k: getattr(config, k) for k in copied},
        "architectures": ["DeepseekV4ForCausalLM"],
        "layer_types": [kinds[role.attention_kind] for role in roles],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe" if role.hash_moe else "moe" for role in roles],
        "partial_rotary_factor": rotary,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": rotary},
            "compress": {**compress, "rope_theta": config.compress_rope_theta, "partial_rotary_factor": rotary},
        },
    }


def to_transformers_dir(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a dequantized copy of a V4 checkpoint that transformers' `DeepseekV4ForCausalLM` loads.

    The config becomes `DeepseekV4Config` fields (written as JSON: dsv4 imports transformers only in
    dsv4.hf); quantized weights become their exact fp32 dequantization and every name its transformers
    form (`transformers_name`); tensors the text model skips are left out. Everything goes into one
    `model.safetensors`: this is for test- and debug-sized checkpoints.
    """
    from safetensors.torch import save_file

    from dsv4.config import Dsv4Config
    from dsv4.reference.model import Dsv4Model

    model_dir, out = resolve_model_dir(model_dir), Path(out_dir)
    config = Dsv4Config.from_json(model_dir)
    if config.is_v41:
        raise ValueError(f"{model_dir} is a DeepSeek-V4.1 checkpoint; transformers' DeepseekV4 runs V4 only")
    with torch.device("meta"):
        model = Dsv4Model(config)
    tensors = {}
    for path in shard_files(model_dir):
        tensors.update({official_name(k): v for k, v in mmap_safetensors(path).items()})
    kept = {k: v for k, v in tensors.items() if not k.startswith(SKIPPED_PREFIXES + ("mtp.",))}
    dense = dequantized_tensors(model, kept)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {"model_type": "deepseek_v4", **_transformers_v4_config(config)}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file({transformers_name(k): v.contiguous() for k, v in dense.items()}, str(out / "model.safetensors"))
    return out
