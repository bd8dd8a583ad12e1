"""Shared-KV multi-query attention over a sliding window plus compressed KV.

One 512-wide latent per position is both key and value for all heads. Every query attends, in one
softmax with a per-head sink logit (denominator only), to
- the window: its own position and the `sliding_window - 1` before it, and
- on compressed layers, compressed entries: the indexer's top-k (CSA), or every visible entry (HCA).
RoPE covers the trailing `qk_rope_head_dim` channels; because values carry the keys' rotation, the
output is rotated back by the query position before the grouped low-rank output projection
(`wo_a` per head group, then `wo_b`).

Which layer computes the compressed KV, the index keys and the top-k a layer uses is in its
`LayerRole`; what one layer computes for later ones travels in `SharedKV`, made per forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4.config import Dsv4Config, LayerRole
from dsv4.quant import fake_quant_fp8, fake_quant_nvfp4
from dsv4.reference.compressor import Compressor
from dsv4.reference.indexer import Indexer, picks_mask
from dsv4.reference.linear import Linear, RMSNorm
from dsv4.reference.rope import Rotary, apply_rope

V4_WINDOW_FP8_BLOCK = 64  # V4's window (and compressed) rows: FP8 in blocks of 64 on the channels RoPE leaves alone


def head_rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's query heads q [..., Dh] each divided by its root mean square, weightless, in fp32, cast back."""
    qf = q.float()
    return (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)).to(q.dtype)


def round_unrotated(kv: torch.Tensor, rope_dim: int, block: int, fake_fp8=fake_quant_fp8) -> torch.Tensor:
    """V4's rows [..., D] with the D - rope_dim channels RoPE leaves alone through an FP8 round trip (`fake_fp8`, 1 x
    block blocks), the rotated ones as they are."""
    return torch.cat((fake_fp8(kv[..., :-rope_dim], block), kv[..., -rope_dim:]), dim=-1)


@dataclass
class SharedKV:
    """Per-query selections index layers hand to later layers within one forward pass.

    The compressed KV and index keys themselves live in the cache (see dsv4/reference/cache.py).
    """

    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, k], -1 = none
    candidates: torch.Tensor | None = None  # the candidate source's pool: [B, S, G] bool (the fast one: block ids)
    # a source's compressed KV read from the cache once per forward: up to 20 layers read one source
    compressed: dict[int, torch.Tensor] = field(default_factory=dict)

    def read_compressed(self, cache, source: int) -> torch.Tensor | None:
        if source not in self.compressed:
            view = cache.compressed(source)
            if view is None:
                return None
            self.compressed[source] = view
        return self.compressed[source]

    def keep_queries(self, keep: slice) -> None:
        """Keep only some query rows of the per-query selections (V4.1 decoder replay)."""
        self.topk = {layer: idx[:, keep] for layer, idx in self.topk.items()}
        if self.candidates is not None:
            self.candidates = self.candidates[:, keep]


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of q [B, S, H, D] over kv [B, T, D] where allowed [B, S, T], with a sink.

    Logits and the softmax are fp32; probabilities are rounded to kv's dtype before P @ V, as in the
    official kernel. Output [B, S, H, D] in q's dtype.
    """
    kvf = kv.float()
    logits = torch.einsum("bshd,btd->bsht", q.float(), kvf) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    sink = sink.float().view(1, 1, -1)
    peak = torch.maximum(logits.amax(-1), sink)  # [B, S, H]
    p = torch.exp(logits - peak.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sink - peak)
    out = torch.einsum("bsht,btd->bshd", p.to(kv.dtype).float(), kvf) / denom.unsqueeze(-1)
    return out.to(q.dtype)


class Attention(nn.Module):
    def __init__(self, config: Dsv4Config, role: LayerRole, dtype: torch.dtype):
        super().__init__()
        self.role = role
        self.is_v41 = config.is_v41
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rope_dim, self.window = config.qk_rope_head_dim, config.sliding_window
        self.o_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.eps = config.rms_norm_eps
        self.quant_sim = True
        D, H, Dh = config.hidden_size, self.n_heads, self.head_dim
        fmt = "fp8" if config.quantization_config else "dense"
        block, act = config.weight_block_size or (128, 128), config.act_block_size
        self.wq_a = Linear(D, config.q_lora_rank, fmt, block, act, dtype=dtype)
        self.q_norm = RMSNorm(config.q_lora_rank, self.eps)
        self.wq_b = Linear(config.q_lora_rank, H * Dh, fmt, block, act, dtype=dtype)
        self.wkv = Linear(D, Dh, fmt, block, act, dtype=dtype)
        self.kv_norm = RMSNorm(Dh, self.eps)
        # wo_a is stored FP8 but the official reference runs it dequantized, without activation rounding
        self.wo_a = Linear(H * Dh // self.o_groups, self.o_groups * self.o_lora_rank, fmt, block, dtype=dtype)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, D, fmt, block, act, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), False)
        if role.compress_ratio:
            self.rotary = Rotary(self.rope_dim, config.compress_rope_theta, config.rope_scaling)
        else:
            self.rotary = Rotary(self.rope_dim, config.rope_theta, None)
        if role.owns_compressor:
            self.compressor = Compressor(config, role.compress_ratio, Dh, dtype)
        if role.owns_indexer:
            self.indexer = Indexer(config, role.owns_index_keys, dtype)

    # ------------------------------------------------------------------ precision steps (quant_sim)
    def _fake_fp8(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return fake_quant_fp8(x, block)

    def _fake_nvfp4(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return fake_quant_nvfp4(x, block)

    def _window_quant(self, kv: torch.Tensor) -> torch.Tensor:
        """V4: FP8 (block 64) on the non-RoPE dims; V4.1: FP8 (block 32) over all 512 dims."""
        if not self.quant_sim:
            return kv
        if self.is_v41:
            return self._fake_fp8(kv, 32)
        return round_unrotated(kv, self.rope_dim, V4_WINDOW_FP8_BLOCK, self._fake_fp8)

    def _compressed_quant(self, kv: torch.Tensor) -> torch.Tensor:
        """V4: as the window; V4.1: e2m1 with an e4m3 scale per 16, after RoPE."""
        if self.quant_sim and self.is_v41:
            return self._fake_nvfp4(kv, 16)
        return self._window_quant(kv)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, positions: torch.Tensor, shared: SharedKV, cache) -> torch.Tensor:
        """x: [B, S, D] at consecutive positions [S], the cache filled up to positions[0] -> [B, S, D]."""
        B, S, _ = x.shape
        layer = self.role.layer_id
        cos, sin = self.rotary.cos_sin(positions)
        cos, sin = cos[None], sin[None]
        q, qr, kv = self._q_kv(x, cos, sin)

        past, past_pos = cache.window(layer)
        cache.append_window(layer, kv, positions)
        key_pos = positions
        if past is not None:
            kv, key_pos = torch.cat((past.to(kv.dtype), kv), dim=1), torch.cat((past_pos, positions))
        distance = positions.unsqueeze(1) - key_pos.unsqueeze(0)  # [S, P + S]
        allowed = ((distance >= 0) & (distance < self.window)).expand(B, -1, -1)
        if self.role.compress_ratio:
            comp = self._compressed(x, qr, positions, shared, cache)
            kv = torch.cat((kv, comp.to(kv.dtype)), dim=1)
            visible = self._visible_compressed(positions, shared, comp.shape[1]).expand(B, S, -1)
            allowed = torch.cat((allowed, visible), dim=-1)

        o = sparse_attention(q, kv, allowed, self.attn_sink, self.head_dim**-0.5)
        return self._output(apply_rope(o, cos, sin, inverse=True))

    def _q_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries [B, S, H, Dh], the query latent [B, S, q_lora_rank] and the window-quantized,
        rotated KV rows [B, S, Dh]."""
        qr = self.q_norm(self.wq_a(x))
        return self._query_heads(self.wq_b(qr), cos, sin), qr, self._window_rows(self.wkv(x), cos, sin)

    def _query_heads(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """wq_b's output [B, S, H * Dh] -> the rotated query heads [B, S, H, Dh]."""
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        if not self.is_v41:  # V4 only: weightless RMS norm per query head
            q = head_rms_norm(q, self.eps)
        return apply_rope(q, cos, sin)

    def _window_rows(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """wkv's output [B, S, Dh] -> the normalized, rotated, window-quantized KV rows [B, S, Dh]."""
        return self._window_quant(apply_rope(self.kv_norm(kv), cos, sin))

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: o [B, S, H, Dh] -> [B, S, D]."""
        B, S = o.shape[:2]
        o = o.reshape(B, S, self.o_groups, -1)  # consecutive heads form a group
        wo_a = self.wo_a.dequantized_weight().to(o.dtype).view(self.o_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))

    def _compressed(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, shared: SharedKV, cache
    ) -> torch.Tensor:
        """The compressed KV this layer reads [B, G, Dh], after this layer's compressor and indexer ran over the chunk
        (the indexer's top-k goes to `shared`, for this layer and those that read it)."""
        role, r = self.role, self.role.compress_ratio
        B = x.shape[0]
        if role.owns_compressor:
            self._compress(x, cache)
            shared.compressed.pop(role.layer_id, None)  # grown: read again
        comp = shared.read_compressed(cache, role.kv_source)
        if comp is None:
            comp = x.new_zeros(B, 0, self.head_dim)
        if role.owns_indexer:
            keys = cache.index_keys(role.kv_source if self.is_v41 else role.layer_id)
            if keys is None:
                keys = x.new_zeros(B, 0, self.indexer.head_dim)
            idx, pool = self.indexer(
                x,
                qr,
                keys,
                positions,
                self.rotary,
                r,
                candidates=shared.candidates if role.candidate_role == "consumer" else None,
                select_candidates=role.candidate_role == "source",
            )
            if pool is not None:
                shared.candidates = pool
            shared.topk[role.layer_id] = idx
        return comp

    def _visible_compressed(self, positions: torch.Tensor, shared: SharedKV, G: int) -> torch.Tensor:
        """Which of the G compressed entries each query sees: every visible one (HCA) [S, G], or the index source's
        picks (CSA) [B, S, G]."""
        if self.role.index_source is None:
            visible = (positions + 1) // self.role.compress_ratio  # [S]
            return torch.arange(G, device=positions.device) < visible.unsqueeze(-1)
        return picks_mask(shared.topk[self.role.index_source], G)

    def _compress(self, x: torch.Tensor, cache) -> None:
        """Run this layer's compressor (and index-key owner) over the chunk; append what completes."""
        role, r, layer = self.role, self.role.compress_ratio, self.role.layer_id
        first_pos = cache.length - x.shape[1]  # the chunk's positions end where the cache's tokens end
        latent, first, state = self.compressor(x, first_pos, cache.state(f"{layer}.compressor"))
        cache.set_state(f"{layer}.compressor", state)
        if role.owns_index_keys:
            key = f"{layer}.indexer.compressor"
            keys, key_state = self.indexer.keys(x, first_pos, latent, first, self.rotary, r, cache.state(key))
            if key_state is not None:
                cache.set_state(key, key_state)
            if keys.shape[1]:
                cache.append_index_keys(layer, keys)
        if latent.shape[1]:
            cos, sin = self.rotary.cos_sin((first + torch.arange(latent.shape[1], device=x.device)) * r)
            cache.append_compressed(layer, self._compressed_quant(apply_rope(latent, cos[None], sin[None])))
