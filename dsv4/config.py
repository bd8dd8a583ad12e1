"""The model configuration: one class for DeepSeek-V4-Flash and DeepSeek-V4.1-Flash.

Field names are the ones of the released `config.json` (for V4.1, of its `text_config`), so a released
file loads with no renaming. `Dsv4Config.from_dict` also accepts the composite V4.1 file, a config
written by transformers' `DeepseekV4Config.save_pretrained`, and dsv4's own saved form. Everything the
model needs to know about a layer (which attention it runs, which layer owns the KV it reads, whether it
indexes, routes by hash or looks up an Engram table) is derived once, in `layer_roles`.

This module imports nothing else from dsv4: the config is a leaf.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

V4 = "deepseek_v4"
V41 = "deepseek_v41"
FAMILIES = (V4, V41)

# Ratios each family knows how to run (V4: window-only, CSA, HCA; V4.1: window-only, ratio-1 decoder,
# ratio-2 encoder).
_KNOWN_RATIOS = {V4: {0, 4, 128}, V41: {0, 1, 2}}
# The activation block of the FP8 simulation when no quantization_config says otherwise: the official
# references quantize activations in 1x128 blocks (V4) and 1x32 blocks (V4.1).
_DEFAULT_ACT_BLOCK = {V4: 128, V41: 32}
_SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_TRANSFORMERS_LAYER_TYPES = {"sliding_attention": 0}


class ConfigError(ValueError):
    """A config.json that cannot describe a model; the message names the field."""


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does, derived from the config.

    - `compress_ratio`: 0 = window only; otherwise the layer also attends to compressed KV.
    - `kv_source`: the layer whose compressed KV this layer reads (itself when it owns a compressor).
    - `owns_compressor`: this layer computes compressed KV (V4: every compressed layer; V4.1: sources).
    - `index_source`: the layer whose top-k selection this layer uses, or None when the layer attends to
      every visible compressed entry (V4 HCA) or has none.
    - `owns_indexer`: this layer scores compressed entries with its own indexer queries.
    - `owns_index_keys`: this layer computes the indexer keys (V4: CSA layers; V4.1: KV sources).
    - `candidate_role`: V4.1 two-level top-k: "source" selects the candidate pool, "consumer" rescores
      inside it, None otherwise.
    - `hash_moe`: the MoE picks experts from the token id (`tid2eid`), V4 layers < num_hash_layers.
    - `engram`: an Engram lookup is added to the residual stream before this layer (V4.1).
    """

    layer_id: int
    compress_ratio: int
    kv_source: int | None
    owns_compressor: bool
    index_source: int | None
    owns_indexer: bool
    owns_index_keys: bool
    candidate_role: str | None
    hash_moe: bool
    engram: bool

    @property
    def attention_kind(self) -> str:
        """"window", "csa" (top-k over compressed KV) or "hca" (all compressed KV)."""
        if self.compress_ratio == 0:
            return "window"
        return "csa" if self.index_source is not None else "hca"


@dataclass
class Dsv4Config:
    """Configuration of a DeepSeek-V4-Flash or DeepSeek-V4.1-Flash text model.

    Args:
        model_family: "deepseek_v4" (V4-Flash) or "deepseek_v41" (V4.1-Flash); taken from the released
            file's `model_type`. It selects the mechanisms that differ between the two (mHC wiring,
            compressor, indexer keys, cache precision).
        vocab_size: number of token ids (embedding and head rows).
        hidden_size: width D of each residual stream.
        num_hidden_layers: backbone layers (drafter layers are not counted).
        num_attention_heads: query heads of the shared-KV MQA.
        num_key_value_heads: must be 1: one latent serves as key and value for every head.
        head_dim: width of each query head and of the KV latent (512 in both released models).
        qk_rope_head_dim: trailing channels of each head that carry interleaved RoPE.
        q_lora_rank: rank of the low-rank query path (`wq_a` -> `q_norm` -> `wq_b`).
        o_groups: head groups of the grouped low-rank output projection (`wo_a`).
        o_lora_rank: per-group rank of `wo_a`.
        n_routed_experts: routed experts per MoE layer.
        n_shared_experts: always-on experts per MoE layer (must be 1).
        num_experts_per_tok: routed experts chosen per token.
        moe_intermediate_size: hidden width of every expert (routed and shared).
        scoring_func: router activation, "sqrtsoftplus" in both released models.
        topk_method: "noaux_tc": a bias steers selection only; weights come from the unbiased scores.
        norm_topk_prob: renormalize the chosen experts' weights to sum to one.
        routed_scaling_factor: factor on the routed weights after normalization.
        swiglu_limit: clamp of the SwiGLU pre-activations (up two-sided, gate from above).
        gate_temp: V4.1 router temperature: logits are divided by it before the score function.
        num_hash_layers: V4: the first layers pick experts from a token-id table (`tid2eid`).
        sliding_window: window of raw KV every layer attends to (128).
        compress_ratios: per layer (drafter entries may follow): 0 = window only, r = one compressed KV
            entry per r tokens.
        rope_theta: RoPE base of window-only layers (no YaRN).
        compress_rope_theta: RoPE base of every layer with compressed KV (with YaRN).
        rope_scaling: YaRN parameters of the compressed layers (`factor`, `original_max_position_embeddings`,
            `beta_fast`, `beta_slow`); no attention-factor (mscale) is applied.
        max_position_embeddings: longest supported context.
        index_n_heads: lightning-indexer query heads.
        index_head_dim: lightning-indexer head width.
        index_topk: compressed entries kept per query.
        kv_source_layer_ids: V4.1: layers owning a compressor; later layers read the last source before
            them. Empty for V4, where every compressed layer owns one.
        index_source_layer_ids: V4.1: layers running their own indexer; the others reuse the last one's
            top-k. Empty for V4, where every ratio-4 layer indexes.
        candidate_source_layer_id: V4.1: the index layer that selects the candidate block pool; later
            index layers rescore inside it. Negative disables the two-level selection.
        candidate_topk_blocks: blocks kept in the candidate pool.
        candidate_block_size: compressed positions per candidate block.
        hc_mult: parallel residual streams of mHC.
        hc_sinkhorn_iters: Sinkhorn iterations projecting the mixing matrix.
        hc_eps: epsilon of the mHC pre weights and Sinkhorn denominators.
        rms_norm_eps: epsilon of every RMSNorm, and of mHC's weightless norm (1e-20 in V4.1, as released).
        engram_layer_ids: V4.1 layers with an Engram lookup.
        engram_num_embeddings: rows of each Engram table.
        engram_max_ngram_size: longest n-gram hashed (2..max).
        engram_vocab_size: the prime search for the bucket sizes starts above `engram_vocab_size - 1`.
        engram_n_heads: hash heads per n-gram size.
        engram_head_dim: width of an Engram table row.
        engram_pad_id: token id whose compressed id fills look-backs past the sequence start.
        engram_compressed_vocab_size: size of the normalized token space; the hash multipliers derive
            from it.
        num_nextn_predict_layers: drafter (MTP / DSpark) stages in the checkpoint.
        dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids, dspark_markov_rank,
        dspark_n_routed_experts, dspark_num_experts_per_tok: the DSpark drafter.
        image_token_id: V4.1 id of image-span tokens (image input is not supported yet).
        quantization_config: storage format of the checkpoint (`weight_block_size`, `scale_fmt`,
            `expert_dtype`); None for a dense (dequantized) checkpoint.
        expert_dtype: V4: storage of routed experts ("fp4"); V4.1 keeps it in quantization_config.
        bos_token_id, eos_token_id, tie_word_embeddings: as in transformers.
    """

    model_family: str = V41
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    num_hash_layers: int = 0
    sliding_window: int = 128
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = field(
        default_factory=lambda: {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    )
    max_position_embeddings: int = 1048576
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[int] = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int | None = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int | None = 129264
    quantization_config: dict | None = field(
        default_factory=lambda: {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        }
    )
    expert_dtype: str | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        self.compress_ratios = [int(r) for r in self.compress_ratios]
        self.validate()

    # ----------------------------------------------------------------------------- derived facts
    @property
    def is_v41(self) -> bool:
        return self.model_family == V41

    @property
    def weight_block_size(self) -> tuple[int, int] | None:
        """Block of the FP8 weight scales, or None for a dense checkpoint."""
        if not self.quantization_config:
            return None
        return tuple(self.quantization_config.get("weight_block_size", (128, 128)))

    @property
    def expert_format(self) -> str:
        """Storage of routed experts: "fp4" (MXFP4), "fp8" or "dense"."""
        if not self.quantization_config:
            return "dense"
        return self.quantization_config.get("expert_dtype") or self.expert_dtype or "fp8"

    @property
    def act_block_size(self) -> int:
        """Block of the simulated FP8 activation quantization at quantized linears."""
        if self.weight_block_size is not None:
            return self.weight_block_size[1]
        return _DEFAULT_ACT_BLOCK[self.model_family]

    @property
    def has_drafter(self) -> bool:
        """V4.1 checkpoints carry a DSpark block drafter under `mtp.*`."""
        return self.is_v41 and self.dspark_block_size > 0 and self.num_nextn_predict_layers > 0

    @property
    def decoder_start(self) -> int | None:
        """V4.1: first decoder layer (after the last KV source); these own only a window and read the
        last source's global KV, so `decoder_replay` may run them over the prompt's last window only."""
        if not self.is_v41 or not self.kv_source_layer_ids:
            return None
        start = self.kv_source_layer_ids[-1] + 1
        return start if start < self.num_hidden_layers else None

    @property
    def compression_ratios(self) -> set[int]:
        """The compress ratios the decoder layers use (0, a layer without a compressor, left out)."""
        return {r for r in self.compress_ratios[: self.num_hidden_layers] if r}

    @property
    def layer_roles(self) -> list[LayerRole]:
        return [self._role(i) for i in range(self.num_hidden_layers)]

    def _role(self, i: int) -> LayerRole:
        ratio = self.compress_ratios[i]
        engram = i in self.engram_layer_ids if self.is_v41 else False
        if self.is_v41:
            kv_source = _last_at_or_before(self.kv_source_layer_ids, i) if ratio else None
            index_source = _last_at_or_before(self.index_source_layer_ids, i) if ratio else None
            cand = self.candidate_source_layer_id
            role = None
            if ratio and i in self.index_source_layer_ids and cand >= 0:
                role = "source" if i == cand else ("consumer" if i > cand else None)
            return LayerRole(
                layer_id=i,
                compress_ratio=ratio,
                kv_source=kv_source,
                owns_compressor=ratio > 0 and i in self.kv_source_layer_ids,
                index_source=index_source,
                owns_indexer=ratio > 0 and i in self.index_source_layer_ids,
                owns_index_keys=ratio > 0 and i in self.kv_source_layer_ids,
                candidate_role=role,
                hash_moe=False,
                engram=engram,
            )
        csa = ratio == 4
        return LayerRole(
            layer_id=i,
            compress_ratio=ratio,
            kv_source=i if ratio else None,
            owns_compressor=ratio > 0,
            index_source=i if csa else None,
            owns_indexer=csa,
            owns_index_keys=csa,
            candidate_role=None,
            hash_moe=i < self.num_hash_layers,
            engram=False,
        )

    # ----------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Reject configs that cannot describe a model, naming the offending field."""
        if self.model_family not in FAMILIES:
            raise ConfigError(f"model_family must be one of {FAMILIES}, got {self.model_family!r}")
        self._validate_types()
        positive = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads head_dim q_lora_rank o_groups "
            "o_lora_rank n_routed_experts num_experts_per_tok moe_intermediate_size sliding_window "
            "index_n_heads index_head_dim index_topk hc_mult hc_sinkhorn_iters"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        _check(self.num_key_value_heads == 1, "num_key_value_heads", "must be 1 (shared-KV MQA)")
        _check(self.n_shared_experts == 1, "n_shared_experts", "must be 1")
        _check(
            0 < self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0,
            "qk_rope_head_dim",
            f"must be even and below head_dim={self.head_dim}",
        )
        _check(
            self.index_head_dim > self.qk_rope_head_dim,
            "index_head_dim",
            f"must exceed qk_rope_head_dim={self.qk_rope_head_dim}",
        )
        _check(
            self.num_attention_heads % self.o_groups == 0,
            "o_groups",
            f"must divide num_attention_heads={self.num_attention_heads}",
        )
        _check(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            f"exceeds n_routed_experts={self.n_routed_experts}",
        )
        _check(self.scoring_func in _SCORING_FUNCS, "scoring_func", f"must be one of {_SCORING_FUNCS}")
        _check(self.rms_norm_eps >= 0 and math.isfinite(self.rms_norm_eps), "rms_norm_eps", "must be >= 0")
        _check(self.gate_temp > 0, "gate_temp", "must be > 0")
        n = self.num_hidden_layers
        _check(
            len(self.compress_ratios) >= n,
            "compress_ratios",
            f"has {len(self.compress_ratios)} entries for num_hidden_layers={n}",
        )
        bad = sorted({r for r in self.compress_ratios[:n]} - _KNOWN_RATIOS[self.model_family])
        _check(not bad, "compress_ratios", f"values {bad} are not used by {self.model_family}")
        _check(
            0 <= self.num_hash_layers <= n and (self.num_hash_layers == 0 or not self.is_v41),
            "num_hash_layers",
            "must be between 0 and num_hidden_layers (0 for V4.1)",
        )
        if self.quantization_config:
            block = self.quantization_config.get("weight_block_size", (128, 128))
            _check(
                isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block),
                "quantization_config.weight_block_size",
                f"must be two positive ints, got {block!r}",
            )
            _check(
                self.expert_format in ("fp4", "fp8"),
                "quantization_config.expert_dtype",
                f"must be 'fp4' or 'fp8', got {self.expert_format!r}",
            )
        if self.is_v41:
            self._validate_v41()
        if self.has_drafter:
            for i in self.dspark_target_layer_ids:
                # the drafter reads a target layer's input, which we take as the previous layer's output:
                # exact unless an Engram lookup sits in between
                _check(0 < i < n and i not in self.engram_layer_ids, "dspark_target_layer_ids",
                       f"layer {i} must be a backbone layer after layer 0 without Engram")
            _check(len(self.dspark_target_layer_ids) > 0, "dspark_target_layer_ids", "the drafter needs target layers")

    def _check_source_list(self, name: str) -> None:
        """A sorted, duplicate-free list of layers that have compressed KV."""
        ids = getattr(self, name)
        _check(ids == sorted(set(ids)), name, "must be sorted and unique")
        for i in ids:
            _check(0 <= i < self.num_hidden_layers and self.compress_ratios[i] > 0, name, f"layer {i} has no compress ratio")

    def _validate_types(self) -> None:
        """Every field holds the kind of value its annotation names (JSON gives no such promise)."""
        kinds = {
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "bool": lambda v: isinstance(v, bool),
            "list[int]": lambda v: isinstance(v, (list, tuple)) and all(kinds["int"](x) for x in v),
        }
        for f in dataclasses.fields(self):
            check = kinds.get(f.type)
            if check is not None and not check(getattr(self, f.name)):
                raise ConfigError(f"config field {f.name}: must be {f.type}, got {getattr(self, f.name)!r}")

    def _validate_v41(self) -> None:
        ratios = self.compress_ratios
        sources, index = self.kv_source_layer_ids, self.index_source_layer_ids
        self._check_source_list("kv_source_layer_ids")
        self._check_source_list("index_source_layer_ids")
        for i in sources:
            _check(i in index, "index_source_layer_ids", f"KV source {i} must also be an index source (it owns the index keys)")
        for i in range(self.num_hidden_layers):
            if not ratios[i]:
                continue
            src, idx = _last_at_or_before(sources, i), _last_at_or_before(index, i)
            _check(src is not None, "kv_source_layer_ids", f"compressed layer {i} has no KV source before it")
            _check(idx is not None, "index_source_layer_ids", f"compressed layer {i} has no index source")
            _check(
                ratios[src] == ratios[i],
                "compress_ratios",
                f"layer {i} (ratio {ratios[i]}) reads source {src} (ratio {ratios[src]})",
            )
            _check(
                _last_at_or_before(sources, idx) == src,
                "index_source_layer_ids",
                f"layer {i} reuses the top-k of layer {idx}, which reads other compressed KV",
            )
        cand = self.candidate_source_layer_id
        if cand >= 0:
            _check(cand in index, "candidate_source_layer_id", f"layer {cand} is not an index source")
            _check(self.candidate_topk_blocks > 0, "candidate_topk_blocks", "must be > 0")
            _check(self.candidate_block_size > 0, "candidate_block_size", "must be > 0")
            for i in index:
                _check(
                    i <= cand or _last_at_or_before(sources, i) == _last_at_or_before(sources, cand),
                    "candidate_source_layer_id",
                    f"index layer {i} rescores inside the pool of layer {cand} but reads other compressed KV",
                )
        _check(
            len(self.engram_layer_ids) == len(self.engram_num_embeddings),
            "engram_num_embeddings",
            f"needs one entry per engram layer {self.engram_layer_ids}",
        )
        for i in self.engram_layer_ids:
            _check(0 <= i < self.num_hidden_layers, "engram_layer_ids", f"layer {i} is outside the model")
        if self.engram_layer_ids:
            _check(self.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
            for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
                _check(getattr(self, name) > 0, name, "must be > 0")

    # ----------------------------------------------------------------------------- (de)serialization
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Dsv4Config":
        """Read any supported config dict: released V4 / V4.1, transformers-saved V4, or dsv4's own."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type == "dsv4":
            d = {k: v for k, v in raw.items() if k != "model_type"}
        elif model_type == V41:
            d = _from_v41_composite(raw)
        elif model_type in (V4, None) and "layer_types" in raw:
            d = _from_transformers_v4(raw)
        elif model_type == V4:
            d = dict(raw, model_family=V4)
            d.setdefault("kv_source_layer_ids", [])
            d.setdefault("index_source_layer_ids", [])
            d.setdefault("candidate_source_layer_id", -1)
            d.setdefault("engram_layer_ids", [])
            d.setdefault("engram_num_embeddings", [])
            d.setdefault("rms_norm_eps", 1e-6)
            d.setdefault("num_hash_layers", 3)
        else:
            raise ConfigError(f"model_type must be 'deepseek_v4', 'deepseek_v41' or 'dsv4', got {model_type!r}")
        d.setdefault("quantization_config", None)  # no quantization_config: a dense checkpoint
        if d["model_family"] == V4:  # V4.1-only settings a V4 file may lack
            for key, value in (("image_token_id", None), ("dspark_block_size", 0), ("dspark_noise_token_id", None)):
                d.setdefault(key, value)
            d.setdefault("dspark_target_layer_ids", [])
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            if k in kwargs and not isinstance(kwargs[k], (list, tuple)):
                raise ConfigError(f"{k} must be a list, got {type(kwargs[k]).__name__}")
        try:
            return cls(**kwargs)
        except TypeError as e:  # a wrongly typed value reached arithmetic in validation
            raise ConfigError(f"malformed config: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Dsv4Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """dsv4's own saved form: the released field names plus `model_type: "dsv4"`."""
        return {"model_type": "dsv4", **dataclasses.asdict(self)}

    def replace(self, **changes: Any) -> "Dsv4Config":
        return dataclasses.replace(self, **changes)


def _check(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"config field {name}: {problem}")


def _last_at_or_before(ids: list[int], i: int) -> int | None:
    before = [s for s in ids if s <= i]
    return before[-1] if before else None


def _from_v41_composite(raw: dict) -> dict:
    """The released V4.1 file nests the text model under `text_config` next to vision settings."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config field text_config: missing in a deepseek_v41 config")
    d = dict(text, model_family=V41)
    if "engram_pad_token_id" in d:  # the released file's name for engram_pad_id
        d.setdefault("engram_pad_id", d["engram_pad_token_id"])
    for key in ("quantization_config", "image_token_id", "bos_token_id", "eos_token_id"):
        if key in raw and key not in d:
            d[key] = raw[key]
    d.setdefault("num_hash_layers", 0)
    return d


def _from_transformers_v4(raw: dict) -> dict:
    """transformers' DeepseekV4Config names layers by type and nests RoPE parameters by rope kind."""
    rates = raw.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    to_ratio = {**_TRANSFORMERS_LAYER_TYPES, **rates}
    try:
        ratios = [int(to_ratio[t]) for t in raw["layer_types"]]
    except KeyError as e:
        raise ConfigError(f"config field layer_types: unknown layer type {e}") from None
    mlp = raw.get("mlp_layer_types") or []
    n_hash = sum(1 for t in mlp if t == "hash_moe")
    if mlp[:n_hash] != ["hash_moe"] * n_hash:
        raise ConfigError("config field mlp_layer_types: hash_moe layers must come first")
    rope = raw.get("rope_parameters") or {}
    main, compress = rope.get("main", {}), rope.get("compress", {})
    d = dict(raw, model_family=V4, compress_ratios=ratios, num_hash_layers=n_hash)
    d["qk_rope_head_dim"] = int(raw["head_dim"] * (raw.get("partial_rotary_factor") or 0.125))
    d["rope_theta"] = main.get("rope_theta", raw.get("rope_theta", 10000.0))
    d["compress_rope_theta"] = compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))
    if compress.get("rope_type") == "yarn":
        if compress.get("attention_factor", 1.0) != 1.0:
            raise ConfigError("config field rope_parameters.compress.attention_factor: only 1.0 is supported")
        d["rope_scaling"] = {
            "type": "yarn",
            **{k: compress[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")},
        }
    else:
        d["rope_scaling"] = None
    for k in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings"):
        d[k] = []
    d["candidate_source_layer_id"] = -1
    return d
