"""transformers integration: `Dsv4Config`, `Dsv4ForCausalLM`, and their Auto-class registration.

`Dsv4ForCausalLM.from_pretrained` reads official DeepSeek-V4-Flash and V4.1-Flash directories,
directories written by transformers' DeepseekV4 `save_pretrained`, and its own saved form, locally or
from the Hugging Face hub. `save_pretrained` writes the official tensor names with `model_type: "dsv4"`,
which `AutoModelForCausalLM.from_pretrained` maps back to `Dsv4ForCausalLM` once `dsv4` is imported.
This is the only module of the package that imports transformers.

The model has no KV cache here: every generation step recomputes the whole sequence. The reference
implementation defines the semantics, `impl="fast"` computes it with the kernels of `dsv4.fast`; the
engine (`dsv4.LLM`) is the way to serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from dsv4.checkpoint import to_device
from dsv4.config import Dsv4Config as ModelConfig
from dsv4.engine.llm import IMPLS, default_device
from dsv4.reference.model import Dsv4Model, load_model


class Dsv4Config(PretrainedConfig):
    """The model config as a transformers `PretrainedConfig`: the fields of `dsv4.Dsv4Config` (the
    released config.json names), validated by it, plus transformers' generic settings."""

    model_type = "dsv4"

    def __init__(self, **kwargs):
        import dataclasses

        names = {f.name for f in dataclasses.fields(ModelConfig)}
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        model_config = ModelConfig(**fields) if fields else ModelConfig()
        for name, value in dataclasses.asdict(model_config).items():
            setattr(self, name, value)
        kwargs.setdefault("bos_token_id", model_config.bos_token_id)
        kwargs.setdefault("eos_token_id", model_config.eos_token_id)
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        import dataclasses

        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> "Dsv4Config":
        import dataclasses

        return cls(**dataclasses.asdict(config))


class Dsv4ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = Dsv4Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: Dsv4Config, model: Dsv4Model | None = None, impl: str = "reference"):
        super().__init__(config)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "fast" and model is None:
            raise ValueError("impl='fast' needs loaded weights: use Dsv4ForCausalLM.from_pretrained(..., impl='fast')")
        self.impl = impl
        self.model = model if model is not None else Dsv4Model(config.model_config, config.dtype or torch.bfloat16)
        self.generation_config.use_cache = False

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *args,
        impl: str = "reference",
        torch_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype | str | None = None,
        quant_sim: bool = True,
        decoder_replay: bool = False,
        device: torch.device | str | None = None,
        progress: bool = True,
        **kwargs,
    ) -> "Dsv4ForCausalLM":
        """Load an official V4 / V4.1 directory, a transformers-saved DeepseekV4 one, or our own.

        `quant_sim=False` computes in full precision (as transformers does); `decoder_replay=True` runs
        V4.1's decoder layers over the prompt's last window only, so logits cover those positions.
        `impl="fast"` runs the kernels (`dsv4.fast.model.make_fast`; MXFP4 experts, i.e. official-format
        checkpoints): quant_sim then keeps the packed KV and indexer formats but not the FP8 rounding of
        activations, and the model is placed on `device` at load (default: the GPU when there is one),
        where its re-laid-out weights stay; on a GPU its forward's cache-free pieces run compiled
        (`FastModel.compile_prefill`, as the fast runner's prefill does).
        """
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        dtype = _as_dtype(dtype or torch_dtype) or torch.bfloat16
        model = load_model(str(path_or_repo_id), dtype, quant_sim, progress, decoder_replay)
        model = to_device(model, device or default_device(impl))
        if impl == "fast":
            from dsv4.fast.model import make_fast

            model = make_fast(model, packed_kv=quant_sim)
            if model.embed.weight.is_cuda:
                model.compile_prefill()
        config = Dsv4Config.from_model_config(model.config)
        config.dtype = dtype
        return cls(config, model=model, impl=impl).eval()

    def save_pretrained(self, save_directory: str | Path, max_shard_bytes: int = 4 << 30, **kwargs) -> None:
        """Write config.json (`model_type: "dsv4"`) and sharded safetensors with the official names."""
        from safetensors.torch import save_file

        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {**self.model.config.to_dict(), "architectures": ["Dsv4ForCausalLM"]}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shards, current, size = [], {}, 0
        for name, tensor in self.model.state_dict().items():
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name], size = tensor.contiguous(), size + nbytes
        shards.append(current)
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.head

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs):
        # no cache: each step sees the whole sequence
        return {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask")}

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> CausalLMOutputWithPast:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported by the reference model; pass equal-length prompts")
        if self.impl == "fast":  # the fast module path runs one sequence at a time
            return CausalLMOutputWithPast(logits=torch.cat([self.model(row[None]) for row in input_ids]))
        return CausalLMOutputWithPast(logits=self.model(input_ids))


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def register() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` resolve `model_type: "dsv4"`; safe to call twice."""
    AutoConfig.register("dsv4", Dsv4Config, exist_ok=True)
    AutoModelForCausalLM.register(Dsv4Config, Dsv4ForCausalLM, exist_ok=True)
