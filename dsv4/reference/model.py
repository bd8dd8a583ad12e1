"""The DeepSeek-V4 / V4.1 text model: embed, expand into mHC streams, blocks, collapse, head.

Module and parameter names equal the official checkpoint keys (`embed`, `layers.{i}.attn.wq_a`,
`layers.{i}.ffn.experts.{e}.w1`, `layers.{i}.hc_attn_fn`, `head`, ...), so official checkpoints load
without renaming. Every mechanism lives in its own file; this one wires them:

    h = embed(ids) repeated into hc_mult streams                       # [B, S, hc, D]
    per layer: [V4.1 Engram] -> mHC(attn_norm -> attention) -> mHC(ffn_norm -> MoE)
    logits = head(norm(collapse(h)))                                   # fp32

`quant_sim` (on by default) reproduces the official reference's precision steps (FP8 activations at
quantized linears, FP8/FP4 KV and indexer simulation); off, the model computes in full precision as
transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import Dsv4Config, LayerRole
from dsv4.reference.attention import Attention, SharedKV
from dsv4.reference.cache import DenseCache
from dsv4.reference.linear import RMSNorm
from dsv4.reference.mhc import hc_collapse, hc_expand, hc_head_pre, hc_project, hc_split_sinkhorn, one_hot_pre
from dsv4.reference.moe import MoE


class Block(nn.Module):
    attention_cls = Attention  # subclasses swap mechanisms (the drafter's stages, dsv4.fast)
    moe_cls = MoE

    def __init__(self, config: Dsv4Config, role: LayerRole, dtype: torch.dtype, n_experts=None, topk=None):
        super().__init__()
        self.config, self.role = config, role
        D, hc = config.hidden_size, config.hc_mult
        mix = (2 + hc) * hc
        if role.engram:
            from dsv4.reference.engram import Engram

            self.engram = Engram(config, role.layer_id, dtype)
        self.attn = self.attention_cls(config, role, dtype)
        self.ffn = self.moe_cls(config, role, dtype, n_experts, topk)
        self.attn_norm = RMSNorm(D, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, config.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, hc * D), False))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix), False))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3), False))

    def mixes(self, h: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        m = hc_project(h, getattr(self, f"hc_{site}_fn"), c.rms_norm_eps)
        base, scale = getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale")
        return hc_split_sinkhorn(m, scale, base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps)

    def forward(
        self,
        h: torch.Tensor,
        pre: torch.Tensor | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        shared,
        cache=None,
        hash_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [B, S, hc, D]. `pre` is V4.1's carried collapse weights (None for V4); returns the new
        streams and the weights the next site collapses with. `shared` is what the attention reads
        from earlier layers (a SharedKV; a drafter stage's context)."""
        if self.role.engram:
            h = self.engram(h, hash_ids)
        single_pass = self.config.is_v41
        attn_pre, post, comb = self.mixes(h, "attn")
        x = hc_collapse(h, pre if single_pass else attn_pre)
        h = hc_expand(self.attn(self.attn_norm(x), positions, shared, cache), h, post, comb)
        ffn_pre, post, comb = self.mixes(h, "ffn")
        x = hc_collapse(h, attn_pre if single_pass else ffn_pre)
        h = hc_expand(self.ffn(self.ffn_norm(x), input_ids), h, post, comb)
        return h, ffn_pre


class Dsv4Model(nn.Module):
    block_cls = Block

    def __init__(self, config: Dsv4Config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        D, hc = config.hidden_size, config.hc_mult
        self.embed = nn.Embedding(config.vocab_size, D, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.block_cls(config, role, dtype) for role in config.layer_roles)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.head = nn.Linear(D, config.vocab_size, bias=False, dtype=dtype)
        self.head.weight.requires_grad_(False)
        if not config.is_v41:
            self.hc_head_fn = nn.Parameter(torch.empty(hc, hc * D), False)
            self.hc_head_base = nn.Parameter(torch.empty(hc), False)
            self.hc_head_scale = nn.Parameter(torch.empty(1), False)
        if config.has_drafter:
            from dsv4.reference.drafter import draft_stage

            self.mtp = nn.ModuleList(draft_stage(config, k, dtype) for k in range(config.num_nextn_predict_layers))
        self.engram_hasher = None  # set by the loader for V4.1 models with Engram layers
        self.decoder_replay = False

    @property
    def quant_sim(self) -> bool:
        """Whether the official reference's precision steps are on."""
        return self.layers[0].attn.quant_sim

    def set_quant_sim(self, on: bool, activations: bool | None = None) -> None:
        """Switch the official reference's precision steps on or off in every submodule.

        `activations` (default: `on`) sets the FP8 activation rounding of the linears separately from
        the KV-cache and indexer formats; the fast model stores the packed formats but runs its linears
        on unrounded activations, i.e. `set_quant_sim(True, activations=False)`.
        """
        from dsv4.reference.linear import Linear

        for m in self.modules():
            if m is not self and hasattr(m, "quant_sim"):
                m.quant_sim = on if activations is None or not isinstance(m, Linear) else activations

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        layer_hook=None,
        decoder_replay: bool | None = None,
        cache: DenseCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        """Final collapsed hidden state [B, S', D] (before the final norm) of tokens at positions
        start_pos..start_pos+S-1, continuing `cache` (filled up to start_pos; a fresh one if None).

        With V4.1's `decoder_replay` on (prefill from position 0 only), the decoder layers (after the
        last KV source) run only over the last `sliding_window` positions, reading the global KV the
        encoder built over the whole prompt (DeepSeek's "decoder SWA bounded replay"); their windows
        then start at that cut, and S' is the window. Off (the default), every layer runs over every
        token: the exact causal model.
        """
        c = self.config
        self._check_prompt(input_ids)
        replay = self.decoder_replay if decoder_replay is None else decoder_replay
        if replay and start_pos:
            raise ValueError("decoder_replay applies to a prefill from position 0")
        cache = DenseCache(c.sliding_window) if cache is None else cache
        S = input_ids.shape[1]
        positions = torch.arange(start_pos, start_pos + S, device=input_ids.device)
        history = cache.write_tokens(start_pos, input_ids)
        hash_ids = self.engram_hash_ids(history, start_pos) if c.is_v41 and c.engram_layer_ids else None
        h = self.embed(input_ids).unsqueeze(2).repeat(1, 1, c.hc_mult, 1)  # [B, S, hc, D]
        pre = one_hot_pre(h) if c.is_v41 else None
        shared = SharedKV()
        for layer in self.layers:
            i = layer.role.layer_id
            if replay and i == c.decoder_start and S > c.sliding_window:
                keep = slice(S - c.sliding_window, S)
                h, pre, input_ids, positions = h[:, keep], pre[:, keep], input_ids[:, keep], positions[keep]
                shared.keep_queries(keep)
                hash_ids = hash_ids[:, keep] if hash_ids is not None else None
            ids = hash_ids[:, :, c.engram_layer_ids.index(i)] if layer.role.engram else None
            h, pre = layer(h, pre, input_ids, positions, shared, cache, ids)
            if layer_hook is not None:
                layer_hook(i, h)
        if c.is_v41:
            return hc_collapse(h, pre)
        head_pre = hc_head_pre(h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.rms_norm_eps, c.hc_eps)
        return hc_collapse(h, head_pre)

    def engram_hash_ids(self, history: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Engram rows of positions start_pos.. of history [B, T] -> [B, T - start_pos, n_layers, (N-1)*H], at the
        forward's entry (where the fast model starts fetching them)."""
        return self.engram_hasher.hash_ids(history, start_pos)

    @torch.no_grad()
    def draft(
        self, input_ids: torch.Tensor, next_token: torch.Tensor, temperature: float = 0.0, generator=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DSpark draft after the prefix input_ids [B, S] and the token sampled after it [B].

        Returns the block's tokens [B, block + 1] (next_token first), its logits [B, block, V] fp32
        (Markov bias included) and confidences [B, block]. See dsv4/reference/drafter.py.
        """
        from dsv4.reference.drafter import DraftContext
        from dsv4.sampling import sample

        c = self.config
        if not c.has_drafter:
            raise ValueError("this model has no DSpark drafter (mtp.*) layers")
        targets = {t - 1: t for t in c.dspark_target_layer_ids}  # a layer's input is the previous layer's output
        inputs: dict[int, torch.Tensor] = {}

        def keep_target_inputs(layer_id: int, h: torch.Tensor) -> None:
            if layer_id in targets:
                inputs[targets[layer_id]] = h.mean(dim=2)

        self.hidden_states(input_ids, keep_target_inputs, decoder_replay=False)
        first, last = self.mtp[0], self.mtp[-1]
        main = torch.cat([inputs[t] for t in c.dspark_target_layer_ids], dim=-1)
        S, blk = input_ids.shape[1], c.dspark_block_size
        context = DraftContext(first.main_norm(first.main_proj(main)), torch.arange(S, device=input_ids.device))
        block = next_token.new_full((input_ids.shape[0], blk), c.dspark_noise_token_id)
        block[:, 0] = next_token
        positions = torch.arange(S, S + blk, device=input_ids.device)
        h = self.embed(block).unsqueeze(2).repeat(1, 1, c.hc_mult, 1)
        pre = one_hot_pre(h)
        for stage in self.mtp:
            h, pre = stage(h, pre, block, positions, context, None)
        x = hc_collapse(h, pre)
        logits = F.linear(last.norm(x).float(), self.head.weight.float())  # [B, blk, V]
        tokens, markov = [next_token], []
        for i in range(blk):
            bias, embedding = last.markov_head(tokens[-1])
            logits[:, i] += bias
            markov.append(embedding)
            tokens.append(sample(logits[:, i], temperature, generator=generator))
        confidence = last.confidence_head(x, torch.stack(markov, dim=1).to(x.dtype))
        return torch.stack(tokens, dim=1), logits, confidence

    def _check_prompt(self, input_ids: torch.Tensor) -> None:
        self.check_token_ids(input_ids)

    def check_token_ids(self, input_ids: torch.Tensor, values: bool = True) -> None:
        """A ValueError for ids the model cannot embed: not integers, and with `values`, outside the vocabulary
        or V4.1's image token (image input is not supported yet). The values are read: on the GPU that waits
        for them, so a caller that must not wait checks the dtype alone."""
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {input_ids.dtype}")
        if not values:
            return
        image = self.config.image_token_id if self.config.is_v41 else None
        if image is not None and bool((input_ids == image).any()):
            raise ValueError(f"the token ids contain image tokens (id {image}); image input is not supported yet")
        outside = input_ids[(input_ids < 0) | (input_ids >= self.config.vocab_size)]
        if outside.numel():
            raise ValueError(f"token id {int(outside[0])} is outside the vocabulary of {self.config.vocab_size}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final norm's output, as the official head computes them."""
        return F.linear(self.norm(hidden).float(), self.head.weight.float())

    def forward(self, input_ids: torch.Tensor, cache: DenseCache | None = None, start_pos: int = 0) -> torch.Tensor:
        """input_ids: [B, S] at positions start_pos.. (continuing `cache`) -> logits [B, S, vocab_size] fp32."""
        return self.logits(self.hidden_states(input_ids, cache=cache, start_pos=start_pos))


def load_model(
    path_or_repo: str,
    dtype: torch.dtype = torch.bfloat16,
    quant_sim: bool = True,
    progress: bool = True,
    decoder_replay: bool = False,
) -> Dsv4Model:
    """Build on the meta device, then memory-map and assign the checkpoint (nothing allocated twice)."""
    from dsv4.checkpoint import load_into, resolve_model_dir

    model_dir = resolve_model_dir(path_or_repo)
    config = Dsv4Config.from_json(model_dir)
    with torch.device("meta"):
        model = Dsv4Model(config, dtype)
    model.load_report = load_into(model, model_dir, progress=progress, skip=() if config.has_drafter else ("mtp.",))
    if config.is_v41 and config.engram_layer_ids:
        model.engram_hasher = engram_hasher(model_dir, config)
    model.set_quant_sim(quant_sim)
    model.decoder_replay = decoder_replay
    model.model_dir = model_dir
    return model.eval()


def engram_hasher(model_dir, config: Dsv4Config):
    """The n-gram hasher of V4.1's Engram layers: token map from the checkpoint's tokenizer, hash
    layout frozen in `engram_layout.json` beside the checkpoint (or in the user cache when the
    checkpoint directory is read-only)."""
    import hashlib
    import os
    from pathlib import Path

    from tokenizers import Tokenizer

    from dsv4.reference.engram import LAYOUT_FILENAME, EngramHasher, compressed_token_map, load_or_create_layout

    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.exists():
        raise FileNotFoundError(f"{model_dir} has Engram layers but no tokenizer.json to build their token map")
    token_map, _ = compressed_token_map(Tokenizer.from_file(str(tokenizer_file)))
    layout_path = model_dir / LAYOUT_FILENAME
    if not layout_path.exists() and not os.access(model_dir, os.W_OK):
        key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
        layout_path = Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4")) / key / LAYOUT_FILENAME
        layout_path.parent.mkdir(parents=True, exist_ok=True)
    return EngramHasher(load_or_create_layout(layout_path, config, token_map), token_map)


def bounded_replay_state(model: Dsv4Model, prefix_ids: torch.Tensor) -> DenseCache:
    """The state a prefix-cache hit of `prefix_ids` [B, H] defines under SWA bounded replay.

    The prefix-cacheable state (compressed KV, index keys, compressor carries, tokens) is the cold
    run's; the sliding windows are rebuilt by recomputing only the last `sliding_window` positions
    [H - W, H), whose own windows therefore start at H - W. The replay reads but never rewrites the
    cached compressed KV (the compressors have consumed those positions already). Hits shorter than
    the window are not replayed: callers treat them as misses.
    """
    W = model.config.sliding_window
    H = prefix_ids.shape[1]
    if H < W:
        raise ValueError(f"a bounded replay needs a hit of at least {W} tokens, got {H}")
    cache = DenseCache(W)
    model.hidden_states(prefix_ids, cache=cache)
    cache.reset_windows()
    model.hidden_states(prefix_ids[:, H - W :], cache=cache, start_pos=H - W)
    return cache
