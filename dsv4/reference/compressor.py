"""Token compression: `compress_ratio` consecutive tokens pool into one KV latent.

Pooling is a per-channel softmax over the group's gate scores, in fp32. V4 adds a learned per-slot
position bias (`ape`) and, at ratio 4, overlaps groups: entry g pools the previous group's tokens
through the first half of the projections and its own tokens through the second half, so every
entry sees 2 * ratio tokens. V4.1 pools without bias or overlap, and its ratio-1 compressor (the
decoder's global KV) is a plain projection.

The latent comes out RMS-normalized and before RoPE: entry g belongs to position g * ratio, and the
caller rotates and quantizes it (the V4.1 indexer keys need the unrotated latent).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import Dsv4Config
from dsv4.reference.linear import Linear, RMSNorm


def overlaps(config: Dsv4Config, ratio: int) -> bool:
    """Whether a compressor of this ratio pools overlapping groups (V4 at ratio 4)."""
    return not config.is_v41 and ratio == 4


class Compressor(nn.Module):
    def __init__(self, config: Dsv4Config, ratio: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = overlaps(config, ratio)
        coff = 2 if self.overlap else 1
        D = config.hidden_size
        # above ratio 1 the projections feed an fp32 softmax pooling, so they run in fp32
        self.wkv = Linear(D, coff * head_dim, fp32=ratio > 1, dtype=dtype)
        if ratio > 1:
            self.wgate = Linear(D, coff * head_dim, fp32=True, dtype=dtype)
        if not config.is_v41:
            self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32), False)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, first_pos: int, state: dict | None) -> tuple[torch.Tensor, int, dict]:
        """Compress the tokens x [B, S, D] at positions first_pos..first_pos+S-1, continuing `state`.

        Returns the latents of the groups completed by this chunk [B, G, head_dim], the index of the
        first of them, and the new state. Positions below `state["next"]` were consumed already and
        are skipped (a prefix-cache replay). The state holds the raw fp32 projections of the
        unfinished group's tokens and, when groups overlap, those of the last finished group.
        `first_pos` is a host int (the caller knows where its chunk starts; reading a position tensor
        back would stall the host on a GPU).
        """
        r, d = self.ratio, self.head_dim
        start = first_pos if state is None else state["next"]
        if first_pos > start:
            raise ValueError(f"compressor expects position {start}, got {first_pos}")
        x = x[:, start - first_pos :]
        end = start + x.shape[1]
        if state is None and start % r:
            raise ValueError(f"a compressor without carry state must start on a group boundary, got {start}")
        if r == 1:
            return self.norm(self.wkv(x)), start, {"next": end}
        new_pos = torch.arange(start, end, device=x.device)
        kv, score = self.wkv(x), self.wgate(x)  # [B, S', coff * d] fp32
        if hasattr(self, "ape"):
            score = score + self.ape[new_pos % r]
        if state is not None and state["kv"].shape[1]:
            kv, score = torch.cat((state["kv"], kv), dim=1), torch.cat((state["score"], score), dim=1)
        first = (end - kv.shape[1]) // r  # the tail always starts on a group boundary
        G = kv.shape[1] // r
        groups_kv, groups_score = kv[:, : G * r].unflatten(1, (G, r)), score[:, : G * r].unflatten(1, (G, r))
        prev = (state or {}).get("prev")
        # clone: a view would keep the whole chunk's projections alive in the cache
        new_state = {"next": end, "kv": kv[:, G * r :].clone(), "score": score[:, G * r :].clone()}
        if self.overlap:
            new_state["prev"] = (groups_kv[:, -1], groups_score[:, -1]) if G else prev
            groups_kv = _overlap(groups_kv, d, 0.0, None if prev is None else prev[0])
            groups_score = _overlap(groups_score, d, float("-inf"), None if prev is None else prev[1])
        pooled = (groups_kv * groups_score.softmax(dim=2)).sum(dim=2)  # [B, G, d]
        return self.norm(pooled.to(x.dtype)), first, new_state


def _overlap(t: torch.Tensor, d: int, pad: float, prev: torch.Tensor | None) -> torch.Tensor:
    """[B, G, r, 2d] -> [B, G, 2r, d]: slots 0..r-1 hold group g-1's first halves (`prev` [B, r, 2d]
    for g = 0, else pad), slots r..2r-1 hold group g's second halves."""
    B, G, r, _ = t.shape
    out = t.new_full((B, G, 2 * r, d), pad)
    out[:, :, r:] = t[..., d:]
    out[:, 1:, :r] = t[:, :-1, :, :d]
    if prev is not None and G:
        out[:, 0, :r] = prev[..., :d]
    return out
