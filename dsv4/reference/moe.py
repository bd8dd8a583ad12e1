"""Mixture of experts: a router picks `num_experts_per_tok` SwiGLU experts per token, plus one shared.

Router (fp32): s = sqrtsoftplus(x W^T / gate_temp). Experts are chosen by top-k of s + bias (the bias
steers selection only) or, on V4 hash layers, read from the token-id table `tid2eid`; weights are the
chosen unbiased scores, normalized to sum to one and scaled by `routed_scaling_factor`.
Expert: clamp(up, +-limit), clamp(gate, max=limit), silu(gate) * up, times the routing weight before
`w2`, as in the official reference (the weight then meets w2's activation rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import Dsv4Config, LayerRole
from dsv4.reference.linear import Linear


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def route(
    scores: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None, topk: int, normalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice from router scores [N, E] (fp32): ids from top-k of scores + bias, or the hash
    table's ids `hashed` [N, k]; weights are the unbiased scores, normalized and scaled."""
    idx = hashed if hashed is not None else (scores + bias).topk(topk, dim=-1).indices
    w = scores.gather(-1, idx)
    if normalize and topk > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


class Gate(nn.Module):
    def __init__(self, config: Dsv4Config, role: LayerRole, n_experts: int, topk: int, dtype: torch.dtype):
        super().__init__()
        self.topk, self.scoring_func = topk, config.scoring_func
        self.temp, self.scale = config.gate_temp, config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, config.hidden_size, dtype=dtype), False)
        if role.hash_moe:
            self.register_buffer("tid2eid", torch.empty(config.vocab_size, topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), False)
        if config.is_v41:  # routing bias of image-span tokens; loaded, unused until image input exists
            self.bias_vl = nn.Parameter(torch.empty(n_experts, dtype=torch.float32), False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> the router scores [N, E] fp32 (before the bias, which steers selection only)."""
        return router_scores(F.linear(x.float(), self.weight.float()) / self.temp, self.scoring_func)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D], input_ids: [N] -> weights [N, k] fp32, expert ids [N, k]."""
        hashed = self.tid2eid[input_ids] if hasattr(self, "tid2eid") else None
        bias = getattr(self, "bias", None)
        return route(self.scores(x), bias, hashed, self.topk, self.norm_topk_prob, self.scale)


class Expert(nn.Module):
    def __init__(self, config: Dsv4Config, fmt: str, dtype: torch.dtype):
        super().__init__()
        D, inter = config.hidden_size, config.moe_intermediate_size
        block, act = config.weight_block_size or (128, 128), config.act_block_size
        self.w1 = Linear(D, inter, fmt, block, act, dtype=dtype)
        self.w2 = Linear(inter, D, fmt, block, act, dtype=dtype)
        self.w3 = Linear(D, inter, fmt, block, act, dtype=dtype)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = h * weight
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: Dsv4Config, role: LayerRole, dtype: torch.dtype, n_experts=None, topk=None):
        super().__init__()
        E, k = n_experts or config.n_routed_experts, topk or config.num_experts_per_tok
        self.gate = Gate(config, role, E, k, dtype)
        expert_fmt = config.expert_format
        shared_fmt = "fp8" if config.quantization_config else "dense"
        self.experts = nn.ModuleList(Expert(config, expert_fmt, dtype) for _ in range(E))
        self.shared_experts = Expert(config, shared_fmt, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D], input_ids: [B, S] -> [B, S, D]; routed outputs summed in fp32."""
        flat = x.flatten(0, 1)
        weights, idx = self.gate(flat, input_ids.flatten())
        y = torch.zeros_like(flat, dtype=torch.float32)
        for e in idx.unique().tolist():
            token, slot = torch.where(idx == e)
            y.index_add_(0, token, self.experts[e](flat[token], weights[token, slot, None]).float())
        y = y + self.shared_experts(flat).float()
        return y.to(x.dtype).view_as(x)
