"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator.

Sampling uses the Gumbel-max form (argmax of p / Exponential(1)), equivalent to drawing from p but
free of the host synchronization `torch.multinomial` needs.
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits: [B, V] -> token ids [B]. temperature 0 is greedy; top_k 0 and top_p 1 disable the filters."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p; the first token always stays
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)
