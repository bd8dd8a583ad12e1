"""Manifold-constrained hyper-connections (mHC): the residual stream is `hc_mult` parallel copies.

Each sub-layer site (attention, FFN) derives three coefficient sets from the streams themselves:
`pre` collapses the streams into the sub-layer input, `post` spreads the sub-layer output back over the
streams, and `comb` (projected towards a doubly stochastic matrix by Sinkhorn) mixes the old streams
into the new ones. All coefficients are computed in fp32.

V4 uses each site's `pre` at that site, and collapses before the head with separate `hc_head_*`
parameters. V4.1 ("single-pass mHC") collapses each site with the previous site's `pre` (the first with
a one-hot on stream 0) and the head with the last FFN site's `pre`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hc_project(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Dynamic mixes: fn applied to the weightless-RMS-normalized, flattened streams.

    h: [B, S, hc, D]; fn: [M, hc * D] -> [B, S, M] fp32.
    """
    x = h.flatten(2).float()  # [B, S, hc * D]
    rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(x, fn.float()) * rsqrt


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split [B, S, (2 + hc) * hc] mixes into pre [B, S, hc], post [B, S, hc] and comb [B, S, hc, hc].

    comb[j, k] weighs old stream j in new stream k: a row softmax, then alternating column and row
    normalizations ending on a column one, so each new stream is a convex mix of the old ones.
    """
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sum_k pre_k * h_k in fp32: [B, S, hc, D] x [B, S, hc] -> [B, S, D] in h's dtype."""
    return (pre.unsqueeze(-1) * h.float()).sum(dim=2).to(h.dtype)


def hc_expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams h'_k = post_k * f + sum_j comb[j, k] * residual_j, mixed in fp32.

    f: [B, S, D]; residual: [B, S, hc, D]; post: [B, S, hc]; comb: [B, S, hc, hc] -> [B, S, hc, D].
    """
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, residual.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(f.dtype)


def hc_head_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float, eps: float):
    """V4's final collapse weights: sigmoid(mixes * scale + base) + eps, [B, S, hc]."""
    return torch.sigmoid(hc_project(h, fn, norm_eps) * scale.float() + base.float()) + eps


def one_hot_pre(h: torch.Tensor) -> torch.Tensor:
    """V4.1's first collapse: all weight on stream 0. h: [B, S, hc, D] -> [B, S, hc] fp32."""
    pre = h.new_zeros(h.shape[:3], dtype=torch.float32)
    pre[..., 0] = 1.0
    return pre
