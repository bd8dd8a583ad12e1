"""The lightning indexer: picks, per query, the `index_topk` compressed entries it attends to.

score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t]), masked to entries visible at the query
(t < (p_s + 1) // ratio), then top-k; picks that are not selectable come back as -1.

V4: every CSA layer compresses its own index keys (a ratio-4 overlapping compressor at index_head_dim);
under quant_sim q and keys are Hadamard-rotated and FP4-simulated.
V4.1: keys come from the KV source's latent (`wk` + `k_norm`, no rotation), FP4-simulated; the
candidate source layer keeps the best `candidate_topk_blocks` blocks of `candidate_block_size`
entries (a block scores its best entry; the block of the newest visible entry is always kept) and
later index layers rescore only inside that pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import Dsv4Config
from dsv4.quant import fake_quant_mxfp4
from dsv4.reference.compressor import Compressor
from dsv4.reference.linear import Linear, RMSNorm
from dsv4.reference.rope import Rotary, apply_rope

FP4_BLOCK = 32


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two), in fp32."""
    d = x.shape[-1]
    y = x.float()
    h = 1
    while h < d:
        y = y.unflatten(-1, (-1, 2, h))
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return (y * d**-0.5).to(x.dtype)


def select_candidate_blocks(score: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of V4.1's two-level top-k.

    score: [B, S, T] with unreachable entries at -inf; visible: [S] entries each query can see.
    Returns a bool mask [B, S, T] of the entries inside the kept blocks.
    """
    blocks = candidate_block_scores(score, visible, block)
    values, indices = stable_topk(blocks, min(topk_blocks, blocks.shape[-1]))
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :score.shape[-1]]


def candidate_block_scores(score: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    """What level one ranks: each block's best entry score [B, S, ceil(T / block)], the newest block at +inf."""
    T = score.shape[-1]
    blocks = F.pad(score, (0, -T % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    # the newest block is only partly filled, so it could lose to an older full block: pin it
    newest = ((visible - 1) // block).view(1, -1, 1)
    return blocks.masked_fill(torch.arange(blocks.shape[-1], device=score.device) == newest, float("inf"))


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties going to the lower index.

    relu makes exact-zero scores common, and torch.topk breaks such ties by implementation detail,
    so the selection would depend on how many entries the tensor happens to hold (a chunked prefill
    and a full pass would disagree). A stable sort makes the semantics one function.
    """
    values, indices = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, max_bytes: int = 1 << 30) -> torch.Tensor:
    """score[b, s, t] = sum_h weights[b, s, h] * relu(q[b, s, h] . keys[b, t]), fp32.

    q: [B, S, H, d]; keys: [B, T, d]; weights: [B, S, H] (already scaled). The per-head products
    [B, S, H, T] are formed for as many queries at a time as fit `max_bytes` (a long prefill chunk over a
    long context would need tens of GB at once); each score is the same sum either way.
    """
    B, S, H, _ = q.shape
    keys = keys.to(q.dtype)
    step = max(1, max_bytes // max(1, B * H * keys.shape[1] * q.element_size()))
    out = []
    for a in range(0, S, step):
        dots = torch.einsum("bshd,btd->bsht", q[:, a : a + step], keys)
        out.append((dots.relu() * weights[:, a : a + step].unsqueeze(-1)).sum(2).float())
    return torch.cat(out, dim=1) if len(out) != 1 else out[0]


def top_entries(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries per row in position order; picks with score -inf (unreachable) become -1."""
    values, indices = stable_topk(score, min(k, score.shape[-1]))
    return torch.where(values > float("-inf"), indices, -1).sort(dim=-1).values


def picks_mask(picks: torch.Tensor, width: int) -> torch.Tensor:
    """Picked columns [..., k] (-1 = none) -> bool [..., width], True where picked."""
    mask = torch.zeros(*picks.shape[:-1], width + 1, dtype=torch.bool, device=picks.device)
    return mask.scatter_(-1, torch.where(picks < 0, width, picks), True)[..., :width]  # -1 lands past the end


class Indexer(nn.Module):
    def __init__(self, config: Dsv4Config, owns_keys: bool, dtype: torch.dtype):
        super().__init__()
        self.is_v41 = config.is_v41
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.weights_scale = self.head_dim**-0.5 * self.n_heads**-0.5  # on weights_proj's output (the head weights)
        self.topk = config.index_topk
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.quant_sim = True
        self.score_bytes = 1 << 30  # the fp32 scores a forward forms at once (see forward)
        fmt = "fp8" if config.quantization_config else "dense"
        block, act = config.weight_block_size or (128, 128), config.act_block_size
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fmt, block, act, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype=dtype)
        if owns_keys and self.is_v41:
            self.wk = Linear(config.head_dim, self.head_dim, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        elif owns_keys:
            self.compressor = Compressor(config, 4, self.head_dim, dtype)

    def _fp4(self, t: torch.Tensor) -> torch.Tensor:
        if not self.quant_sim:
            return t
        return self._fake_mxfp4(t if self.is_v41 else hadamard(t))

    def _fake_mxfp4(self, t: torch.Tensor) -> torch.Tensor:
        return fake_quant_mxfp4(t, FP4_BLOCK)

    def keys(
        self,
        x: torch.Tensor,
        first_pos: int,
        latent: torch.Tensor,
        first: int,
        rotary: Rotary,
        ratio: int,
        state: dict | None,
    ) -> tuple[torch.Tensor, dict | None]:
        """Index keys [B, G, index_head_dim] of the groups completed by this chunk, rotated at their
        positions. V4.1 derives them from the KV source's latent (groups first..first+G-1); V4 runs
        its own compressor over x, with its own carry state (returned)."""
        if self.is_v41:
            k = self.k_norm(self.wk(latent))
        else:
            k, first, state = self.compressor(x, first_pos, state)
        cos, sin = rotary.cos_sin((first + torch.arange(k.shape[1], device=k.device)) * ratio)
        return self._key_codes(k, cos, sin), state

    def _key_codes(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Keys [B, G, di] rotated by their tables cos / sin [G, R/2], then FP4-simulated as the queries are."""
        return self._fp4(apply_rope(k, cos[None], sin[None]))

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        ratio: int,
        candidates: torch.Tensor | None = None,
        select_candidates: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns top-k entry ids [B, S, k] (-1 = none) and, for the candidate source, the pool mask.

        x: [B, S, D]; qr: [B, S, q_lora_rank]; keys: [B, T, index_head_dim]; positions: [S].
        candidates: [B, S, T] pool from the candidate source, for a layer that rescores inside it.
        The fp32 scores are formed for as many queries at a time as fit `score_bytes` (a long chunk over a long
        context, 8192 queries over 1M entries, would need 32 GB at once); every query's picks are its own.
        """
        cos, sin = rotary.cos_sin(positions)
        q, w = self._queries(x, qr, cos[None], sin[None])
        visible = (positions + 1) // ratio  # [S]
        B, S, T = q.shape[0], q.shape[1], keys.shape[1]
        step = max(1, self.score_bytes // max(1, 4 * B * T))
        picks, pools = [], []
        for a in range(0, max(S, 1), step):
            rows = slice(a, a + step)
            if candidates is not None:
                picks.append(self._top_in_pool(q[:, rows], keys, w[:, rows], visible[rows], candidates[:, rows]))
                continue
            score = self._scores(q[:, rows], keys, w[:, rows], visible[rows])  # [B, rows, T]
            if select_candidates:
                pools.append(self._candidate_blocks(score, visible[rows]))
            picks.append(self._top(score))
        return torch.cat(picks, dim=1), torch.cat(pools, dim=1) if select_candidates else None

    def _queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The rotated, FP4-simulated queries [B, S, Hi, di] and the scaled head weights [B, S, Hi] of x [B, S, D]
        and its query latent qr [B, S, q_lora_rank]."""
        return self._query_heads(self.wq_b(qr), self.weights_proj(x), cos, sin)

    def _query_heads(self, q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """wq_b's output [B, S, Hi * di] and weights_proj's [B, S, Hi] -> as `_queries` returns them."""
        q = self._fp4(apply_rope(q.unflatten(-1, (self.n_heads, self.head_dim)), cos, sin))
        return q, w * self.weights_scale

    # the steps a kernel implementation replaces (dsv4.fast.model.FastIndexer)
    def _scores(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Scores [B, S, T] fp32 of q [B, S, Hi, di] against keys [B, T, di], -inf where t >= visible [S]."""
        reachable = torch.arange(keys.shape[1], device=q.device) < visible.unsqueeze(-1)  # [S, T]
        return index_scores(q, keys, w).masked_fill(~reachable, float("-inf"))

    def _candidate_blocks(self, score: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        return select_candidate_blocks(score, visible, self.candidate_topk_blocks, self.candidate_block_size)

    def _top(self, score: torch.Tensor) -> torch.Tensor:
        return top_entries(score, self.topk)

    def _top_in_pool(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor,
                     pool: torch.Tensor) -> torch.Tensor:
        """A candidate consumer's picks [B, S, k]: the top-k of its scores inside the source's pool (what
        `_candidate_blocks` returned: here a [B, S, T] mask)."""
        return self._top(self._scores(q, keys, w, visible).masked_fill(~pool, float("-inf")))
