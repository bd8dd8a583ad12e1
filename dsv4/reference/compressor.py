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


class Compressor(nn.Module):
    def __init__(self, config: Dsv4Config, ratio: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = not config.is_v41 and ratio == 4
        coff = 2 if self.overlap else 1
        D = config.hidden_size
        # above ratio 1 the projections feed an fp32 softmax pooling, so they run in fp32
        self.wkv = Linear(D, coff * head_dim, fp32=ratio > 1, dtype=dtype)
        if ratio > 1:
            self.wgate = Linear(D, coff * head_dim, fp32=True, dtype=dtype)
        if not config.is_v41:
            self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32), False)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] from position 0 -> latents [B, S // ratio, head_dim] of the complete groups."""
        B, S, _ = x.shape
        r, d = self.ratio, self.head_dim
        if r == 1:
            return self.norm(self.wkv(x))
        G = S // r
        kv = self.wkv(x[:, : G * r]).unflatten(1, (G, r))  # [B, G, r, coff * d] fp32
        score = self.wgate(x[:, : G * r]).unflatten(1, (G, r))
        if hasattr(self, "ape"):
            score = score + self.ape
        if self.overlap:
            kv, score = _overlap(kv, d, 0.0), _overlap(score, d, float("-inf"))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # [B, G, d]
        return self.norm(pooled.to(x.dtype))


def _overlap(t: torch.Tensor, d: int, pad: float) -> torch.Tensor:
    """[B, G, r, 2d] -> [B, G, 2r, d]: slots 0..r-1 hold group g-1's first halves (pad for g = 0),
    slots r..2r-1 hold group g's second halves."""
    B, G, r, _ = t.shape
    out = t.new_full((B, G, 2 * r, d), pad)
    out[:, :, r:] = t[..., d:]
    out[:, 1:, :r] = t[:, :-1, :, :d]
    return out
