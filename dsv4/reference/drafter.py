"""DSpark: the block drafter of DeepSeek-V4.1-Flash, stored under `mtp.{k}.*`.

Given the accepted prefix (positions 0..S-1) and the token just sampled after it, the drafter proposes
`dspark_block_size` tokens at positions S..S+block-1 in one pass:

    main_x  = main_norm(main_proj(concat_t mean_streams(input of target layer t)))     # [B, S, D]
    block   = [next_token, noise, ..., noise]                                           # [B, block]
    h       = embed(block) repeated into hc streams; pre = one-hot on stream 0
    per stage k: single-pass mHC block whose attention lets every block query see the window of
                 the main context (this stage's `wkv` applied to main_x, last `sliding_window`
                 positions) and every block position (the block attends bidirectionally)
    x       = collapse(h, pre); logits = head(norm(x))                                  # shared head
    Markov head, one position at a time: logits[i] += markov_head(token[i]); token[i+1] = sample
    confidence = confidence_head(concat(x, markov embeddings))

Speculative decoding itself (verify, accept) is the engine's business; this module defines the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import Dsv4Config, LayerRole
from dsv4.reference.attention import Attention, sparse_attention
from dsv4.reference.linear import Linear, RMSNorm
from dsv4.reference.rope import apply_rope


@dataclass
class DraftContext:
    """The main model's side of the drafter attention: main_x [B, S, D] at positions [S]."""

    main_x: torch.Tensor
    positions: torch.Tensor


class DraftAttention(Attention):
    """Window-only attention of a block over the main context's last window plus the whole block."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: DraftContext, cache=None) -> torch.Tensor:
        B, blk, _ = x.shape
        window = context.positions[-self.window :]
        main_x = context.main_x[:, -self.window :]
        cos, sin = self.rotary.cos_sin(positions)
        cos, sin = cos[None], sin[None]
        wcos, wsin = self.rotary.cos_sin(window)
        q = apply_rope(self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        main_kv = self._window_quant(apply_rope(self.kv_norm(self.wkv(main_x)), wcos[None], wsin[None]))
        block_kv = self._window_quant(apply_rope(self.kv_norm(self.wkv(x)), cos, sin))
        kv = torch.cat((main_kv, block_kv), dim=1)
        allowed = torch.ones(B, blk, kv.shape[1], dtype=torch.bool, device=x.device)
        o = apply_rope(sparse_attention(q, kv, allowed, self.attn_sink, self.head_dim**-0.5), cos, sin, inverse=True)
        return self._output(o)


class MarkovHead(nn.Module):
    """A low-rank bigram bias: logits bias [B, V] and embedding [B, rank] of the previous draft token."""

    def __init__(self, config: Dsv4Config, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.dspark_markov_rank, dtype=dtype)
        self.head = nn.Linear(config.dspark_markov_rank, config.vocab_size, bias=False, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.head.weight.requires_grad_(False)

    def forward(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(token)
        return F.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    def __init__(self, config: Dsv4Config, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(config.hidden_size + config.dspark_markov_rank, 1, fp32=True, dtype=dtype)

    def forward(self, x: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat((x, markov), dim=-1)).squeeze(-1)


def draft_stage(config: Dsv4Config, stage: int, dtype: torch.dtype) -> nn.Module:
    """Stage `stage` of the drafter: a V4.1 block with DraftAttention and the drafter's own MoE size,
    plus `main_proj`/`main_norm` on the first stage and `norm`/heads on the last."""
    from dsv4.reference.model import Block

    class DraftBlock(Block):
        attention_cls = DraftAttention

    role = LayerRole(config.num_hidden_layers + stage, 0, None, False, None, False, False, None, False, False)
    block = DraftBlock(config, role, dtype, config.dspark_n_routed_experts, config.dspark_num_experts_per_tok)
    D = config.hidden_size
    if stage == 0:
        fmt = "fp8" if config.quantization_config else "dense"
        n_targets = len(config.dspark_target_layer_ids)
        block.main_proj = Linear(D * n_targets, D, fmt, config.weight_block_size or (128, 128), config.act_block_size, dtype=dtype)
        block.main_norm = RMSNorm(D, config.rms_norm_eps)
    if stage == config.num_nextn_predict_layers - 1:
        block.norm = RMSNorm(D, config.rms_norm_eps)
        block.markov_head = MarkovHead(config, dtype)
        block.confidence_head = ConfidenceHead(config, dtype)
    return block
