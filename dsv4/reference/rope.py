"""Rotary position embedding: interleaved pairs on the trailing channels of a head, optional YaRN.

Window-only layers rotate at `rope_theta` without YaRN; every layer with compressed KV (its queries, its
window KV, its compressed entries and its indexer) rotates at `compress_rope_theta` with YaRN frequency
blending. Neither applies YaRN's attention factor (mscale): the official reference does not.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Per-pair angular frequencies [dim // 2], fp32, YaRN-blended when `yarn` is given."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not yarn:
        return freqs
    original, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def corrected_dim(rotations: float) -> float:
        # the pair whose wavelength completes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corrected_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(corrected_dim(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


class Rotary:
    """One layer's RoPE settings; `cos_sin(positions)` gives fp32 tables for any position tensor.

    Frequencies are recomputed per call (dim / 2 values): the reference keeps no buffers, so a model
    built on the meta device needs nothing but its checkpoint tensors.
    """

    def __init__(self, dim: int, theta: float, yarn: dict | None):
        self.dim, self.theta, self.yarn = dim, theta, yarn

    def frequencies(self, device: torch.device) -> torch.Tensor:
        return rope_inv_freq(self.dim, self.theta, self.yarn).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float().unsqueeze(-1) * self.frequencies(positions.device)  # [..., dim // 2]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x as (even, odd) pairs, in fp32.

    x: [B, S, ..., D]; cos, sin: [B or 1, S, R/2]; broadcast over any head dims between S and D.
    `inverse` rotates by the negative angle (removes the query position from the attention output).
    """
    rd = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))  # [..., R/2, 2]: (even, odd)
    # (even cos - odd sin, odd cos + even sin): the roundings of a stack of the two, which torch.compile on a GPU
    # stored as a buffer of its own and concatenated in a second kernel (dev/inductor-output-code-*-s32.log.gz)
    sign = torch.arange(2, device=x.device) * 2.0 - 1.0  # (-1, 1), made on the device (a CUDA graph may capture this)
    rotated = (pairs * cos.unsqueeze(-1) + pairs.flip(-1) * sign * sin.unsqueeze(-1)).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)
