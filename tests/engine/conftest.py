"""Engine test set-up: the tiny models loaded once, and a chunked forward through any cache."""

from __future__ import annotations

from contextlib import contextmanager
from itertools import pairwise

import pytest
import torch

from dsv4.engine.layout import cache_layout
from dsv4.reference.model import load_model
from dsv4.reference.moe import Gate


@pytest.fixture(scope="session")
def v41(tiny_v41_dir):
    """The tiny V4.1 model in fp32 with the official precision steps (packed KV is exact)."""
    return load_model(str(tiny_v41_dir), torch.float32, quant_sim=True, progress=False)


@pytest.fixture(scope="session")
def v4_bf16(tiny_v4_dir):
    """The tiny V4 model in bf16 (V4's packed entries keep the RoPE dims in bf16)."""
    return load_model(str(tiny_v4_dir), torch.bfloat16, quant_sim=True, progress=False)


@torch.inference_mode()
def forward_chunks(model, ids: list[int], cache, bounds: list[int], commit=None) -> torch.Tensor:
    """Logits [1, bounds[-1] - bounds[0], V] of ids[bounds[0]:bounds[-1]] through `cache`, one forward
    per chunk [bounds[i], bounds[i + 1]); `commit(end)` after each, as the engine does."""
    out = []
    for start, end in pairwise(bounds):
        out.append(model(torch.tensor([ids[start:end]]), cache=cache, start_pos=start))
        if commit is not None:
            commit(end)
    return torch.cat(out, dim=1)


@torch.inference_mode()
def greedy_decode(model, ids: list[int], cache, logits: torch.Tensor, steps: int, commit=None):
    """Continue `ids` (whose last logits are `logits` [1, V]) by `steps` greedy tokens through
    `cache`; returns the tokens and their logits [1, steps, V]."""
    ids, tokens, out = list(ids), [], []
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        ids.append(tokens[-1])
        step = forward_chunks(model, ids, cache, [len(ids) - 1, len(ids)], commit)
        out.append(step)
        logits = step[:, -1]
    return tokens, torch.cat(out, dim=1)


def blocks_budget(model, n_blocks: int, block_size: int) -> int:
    """Bytes holding exactly n_blocks pool blocks of the model's packed layout."""
    return n_blocks * cache_layout(model.config, "packed", model.embed.weight.dtype).bytes_per_block(block_size)


@contextmanager
def routing_margins(model):
    """While active, each routed gate call's margins [N]: a token's k-th best biased expert score over its (k+1)-th,
    relative to the k-th (hashed gates route by token id and are left out). Where a margin is within float32
    rounding, a pass that sums in another order (a chunk boundary, a cache) may route that token to the other
    expert: a discrete jump in the logits, not rounding."""
    margins = []

    def record(gate, inputs, _out):
        top = (gate.scores(inputs[0]) + gate.bias).topk(gate.topk + 1, dim=-1).values  # [N, k + 1], descending
        margins.append((top[:, -2] - top[:, -1]) / top[:, -2].abs())

    gates = [m for m in model.modules() if isinstance(m, Gate) and hasattr(m, "bias") and m.topk < m.weight.shape[0]]
    hooks = [g.register_forward_hook(record) for g in gates]
    try:
        yield margins
    finally:
        for h in hooks:
            h.remove()
