"""V4.1-specific rules of the reference model (dsv4/reference), pinned on small hand-made cases.

Covers MODEL.md §3 (single-pass mHC), §4 (mHC math), §5.3 (CSA2: shared compressed KV, two-level
indexer, precision steps) and COMPONENTS.md §1 and §4.3 / §5.2 (encoder-decoder, decoder replay).

Expected values are written out by hand (the derivations are in the comments) or recomputed inside
the test by a minimal, independent re-implementation of the rule; the function under test never
produces its own expectation. Models are tiny dense fp32 V4.1 configs without Engram, filled with
seeded random weights, so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dsv4.reference.model as model_module
from dsv4.config import Dsv4Config
from dsv4.quant import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    fake_quant_fp8,
    fake_quant_mxfp4,
    fake_quant_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
)
from dsv4.reference.attention import Attention, SharedKV
from dsv4.reference.compressor import Compressor
from dsv4.reference.indexer import Indexer, index_scores, select_candidate_blocks, top_entries
from dsv4.reference.linear import RMSNorm
from dsv4.reference.mhc import one_hot_pre
from dsv4.reference.model import Block, Dsv4Model
from dsv4.reference.rope import Rotary, apply_rope

NEG = float("-inf")
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)

# The tiny V4.1 model: 8 layers, window 8.
#   0, 1      window only
#   2         ratio-2 KV source, index source (owns compressor, indexer, index keys)
#   3, 4      read 2's KV, reuse 2's top-k
#   5         ratio-1 KV source, index source, candidate source
#   6         reads 5's KV, reuses 5's top-k (decoder_start = 6)
#   7         reads 5's KV, own indexer queries, candidate consumer
TINY = dict(
    model_family="deepseek_v41",
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    sliding_window=8,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 5, 7],
    candidate_source_layer_id=5,
    candidate_topk_blocks=2,
    candidate_block_size=4,
    index_n_heads=2,
    index_head_dim=64,
    index_topk=4,
    engram_layer_ids=[],
    engram_num_embeddings=[],
    quantization_config=None,
    rms_norm_eps=1e-20,
    dspark_target_layer_ids=[],
    num_nextn_predict_layers=0,
)
WINDOW = TINY["sliding_window"]
LONG = 14  # a prompt longer than the window


def tiny_config(**changes) -> Dsv4Config:
    return Dsv4Config(**{**TINY, **changes})


def v4_config() -> Dsv4Config:
    return Dsv4Config(
        **{
            **TINY,
            "model_family": "deepseek_v4",
            "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 128],
            "kv_source_layer_ids": [],
            "index_source_layer_ids": [],
            "candidate_source_layer_id": -1,
            "rms_norm_eps": 1e-6,
            "image_token_id": None,
        }
    )


def fill_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights: linears N(0, .05), norms 1 + N(0, .1), hc_* N(0, .3), sinks N(0, 1),
    biases N(0, .1)."""
    g = torch.Generator().manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if id(p) in norm_weights:
                value = 1 + 0.1 * noise
            elif leaf.startswith("hc_"):
                value = 0.3 * noise
            elif leaf == "attn_sink":
                value = noise
            elif leaf in ("bias", "bias_vl"):
                value = 0.1 * noise
            else:
                value = 0.05 * noise
            p.copy_(value.to(p.dtype))
    return model


def build(config: Dsv4Config, seed: int = 0, quant_sim: bool = False) -> Dsv4Model:
    model = fill_(Dsv4Model(config, torch.float32), seed)
    model.set_quant_sim(quant_sim)
    return model.eval()


def prompt(S: int, B: int = 2, seed: int = 1, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny() -> Dsv4Model:
    return build(tiny_config())


def run_with_hooks(model, ids, **kw):
    per_layer = {}
    out = model.hidden_states(ids, layer_hook=lambda i, h: per_layer.__setitem__(i, h.clone()), **kw)
    return out, per_layer


def record_shared(monkeypatch) -> list[SharedKV]:
    """Make every SharedKV the model builds land in the returned list (test-local patch)."""
    made = []

    def factory():
        s = SharedKV()
        made.append(s)
        return s

    monkeypatch.setattr(model_module, "SharedKV", factory)
    return made


def wrap_method(monkeypatch, cls, name, record):
    """Replace cls.name by a wrapper that calls the original and appends (self, args, result)."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        record.append((self, args, result))
        return result

    monkeypatch.setattr(cls, name, wrapper)


# The reference is moving from "a forward pass from position 0" to "a forward pass continuing a
# cache" (Attention/Block take a cache, Compressor/Indexer.keys carry state). These helpers call
# either form, so the rules below are pinned independently of that plumbing.


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def new_cache(window: int, compressed=None, index_keys=None):
    """A fresh cache holding the given per-source compressed KV / index keys."""
    from dsv4.reference.cache import DenseCache

    cache = DenseCache(window)
    for k, v in (compressed or {}).items():
        cache.append_compressed(k, v)
    for k, v in (index_keys or {}).items():
        cache.append_index_keys(k, v)
    return cache


def new_shared(topk=None, candidates=None) -> SharedKV:
    return SharedKV(topk=dict(topk or {}), candidates=candidates)


def call_attention(att, x, positions, shared, cache=None):
    """Attention.forward as the model calls it: the cache's tokens end where the chunk's positions end."""
    cache = cache if cache is not None else new_cache(att.window)
    cache.write_tokens(int(positions[0]), torch.zeros(x.shape[0], positions.shape[0], dtype=torch.long))
    return att(x, positions, shared, cache)


def call_block(forward, layer, h, pre, ids, positions, shared, cache=None, hash_ids=None):
    """forward: Block.forward (possibly the unwrapped original)."""
    return forward(layer, h, pre, ids, positions, shared, cache=cache, hash_ids=hash_ids)


def call_compressor(comp, x):
    return comp(x, 0, None)[0]


def record_blocks(monkeypatch) -> dict:
    """Record each block's output (streams, carried pre) by layer id while the test runs."""
    blocks = {}
    original = Block.forward

    def block_forward(self, h, pre, *args, **kwargs):
        out = original(self, h, pre, *args, **kwargs)
        blocks[self.role.layer_id] = out
        return out

    monkeypatch.setattr(Block, "forward", block_forward)
    return blocks


def record_source_outputs(monkeypatch, model):
    """Record, per KV source, the compressed entries it stores (output of `_compressed_quant`) and
    the index keys it computes (output of `Indexer.keys`)."""
    comp_calls, key_calls = [], []
    wrap_method(monkeypatch, Attention, "_compressed_quant", comp_calls)
    wrap_method(monkeypatch, Indexer, "keys", key_calls)
    attn_layer = {id(layer.attn): layer.role.layer_id for layer in model.layers}
    idx_layer = {id(m.attn.indexer): m.role.layer_id for m in model.layers if hasattr(m.attn, "indexer")}

    def collect():
        compressed = {}
        for att, _, out in comp_calls:
            compressed.setdefault(attn_layer[id(att)], []).append(out)
        keys = {}
        for idx, _, out in key_calls:
            keys.setdefault(idx_layer[id(idx)], []).append(_first(out))
        return compressed, keys

    return collect


# ============================================================================ 1. released layer roles

# columns: layers, ratio, kv_source, owns_compressor, index_source, owns_indexer, owns_index_keys,
# candidate_role (MODEL.md §2.2 and §5.3)
_R = range
RELEASED_ROLES = [
    (_R(0, 2), 0, None, False, None, False, False, None),
    ([2], 2, 2, True, 2, True, True, None),
    (_R(3, 8), 2, 2, False, 2, False, False, None),
    ([8], 2, 8, True, 8, True, True, None),
    (_R(9, 14), 2, 8, False, 8, False, False, None),
    ([14], 2, 14, True, 14, True, True, None),
    (_R(15, 20), 2, 14, False, 14, False, False, None),
    ([20], 1, 20, True, 20, True, True, "source"),
    (_R(21, 24), 1, 20, False, 20, False, False, None),
    ([24], 1, 20, False, 24, True, False, "consumer"),
    (_R(25, 28), 1, 20, False, 24, False, False, None),
    ([28], 1, 20, False, 28, True, False, "consumer"),
    (_R(29, 32), 1, 20, False, 28, False, False, None),
    ([32], 1, 20, False, 32, True, False, "consumer"),
    (_R(33, 36), 1, 20, False, 32, False, False, None),
    ([36], 1, 20, False, 36, True, False, "consumer"),
    (_R(37, 40), 1, 20, False, 36, False, False, None),
]
RELEASED_ROWS = [(i, *row[1:]) for row in RELEASED_ROLES for i in row[0]]
RELEASED_ENGRAM = {1, 14}


def test_released_role_table_covers_every_layer_once():
    assert [row[0] for row in RELEASED_ROWS] == list(range(40))


@pytest.mark.parametrize("layer,ratio,kv,owns_comp,index,owns_idx,owns_keys,cand", RELEASED_ROWS)
def test_released_v41_layer_roles(layer, ratio, kv, owns_comp, index, owns_idx, owns_keys, cand):
    role = Dsv4Config().layer_roles[layer]
    assert role.layer_id == layer
    assert role.compress_ratio == ratio
    assert role.kv_source == kv
    assert role.owns_compressor is owns_comp
    assert role.index_source == index
    assert role.owns_indexer is owns_idx
    assert role.owns_index_keys is owns_keys
    assert role.candidate_role == cand
    assert role.hash_moe is False
    assert role.engram is (layer in RELEASED_ENGRAM)
    assert role.attention_kind == ("window" if ratio == 0 else "csa")


def test_released_v41_derived_facts():
    c = Dsv4Config()
    assert c.is_v41 and c.num_hidden_layers == 40
    assert c.decoder_start == 21
    assert [r.layer_id for r in c.layer_roles if r.engram] == [1, 14]
    assert [r.layer_id for r in c.layer_roles if r.owns_compressor] == [2, 8, 14, 20]
    assert [r.layer_id for r in c.layer_roles if r.owns_indexer] == [2, 8, 14, 20, 24, 28, 32, 36]


def test_candidate_consumers_must_share_the_candidate_source_kv():
    # Candidate source 2 (ratio-2 KV of layer 2) would hand its [B, S, 7] pool to consumers 5 and 7,
    # which score layer 5's 14 entries: the model fails with a shape error at layer 5. The config
    # should say so instead.
    from dsv4.config import ConfigError

    with pytest.raises(ConfigError, match="candidate_source_layer_id"):
        tiny_config(candidate_source_layer_id=2)


# ============================================================================ 2. candidate blocks


def test_candidate_blocks_block_max_and_pinned_newest():
    # T = 8 entries, blocks of 2, keep 2 blocks, all 8 visible.
    # block maxima: b0 = max(.1, .9) = .9, b1 = .3, b2 = .5, b3 = max(0, -.5) = 0 (the lowest)
    # b3 holds the newest visible entry (7 // 2 = 3): pinned; the other slot goes to b0 (.9).
    score = torch.tensor([[[0.1, 0.9, 0.3, 0.2, 0.5, 0.4, 0.0, -0.5]]])
    keep = select_candidate_blocks(score, torch.tensor([8]), topk_blocks=2, block=2)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[[True, True, False, False, False, False, True, True]]]
    # keep 1 block: only the pinned newest one survives, although it scores lowest
    keep = select_candidate_blocks(score, torch.tensor([8]), topk_blocks=1, block=2)
    assert keep.tolist() == [[[False] * 6 + [True, True]]]


def test_candidate_blocks_max_not_mean():
    # b0 = (1.0, -9) has max 1.0 (mean -4); b1 = (.6, .6) has max .6 (mean .6); b2 pinned.
    # A block scores its best entry, so b0 beats b1.
    score = torch.tensor([[[1.0, -9.0, 0.6, 0.6, 0.0, 0.0]]])
    keep = select_candidate_blocks(score, torch.tensor([6]), topk_blocks=2, block=2)
    assert keep.tolist() == [[[True, True, False, False, True, True]]]


def test_candidate_blocks_unreachable_never_kept_and_fewer_than_topk():
    # 5 of 8 entries visible (the caller puts -inf on the rest): blocks of 2 ->
    # b0 = .3, b1 = .8, b2 = max(.7, -inf) = .7 (partly visible, holds the newest entry 4 -> pinned),
    # b3 wholly unreachable. Asking for 4 blocks keeps only the 3 reachable ones; the mask covers
    # whole kept blocks (entry 5 is inside b2), never b3.
    score = torch.tensor([[[0.3, 0.1, 0.2, 0.8, 0.7, NEG, NEG, NEG]]])
    keep = select_candidate_blocks(score, torch.tensor([5]), topk_blocks=4, block=2)
    assert keep.tolist() == [[[True] * 6 + [False, False]]]
    # asking for 2: pinned b2 plus the best other (b1 = .8)
    keep = select_candidate_blocks(score, torch.tensor([5]), topk_blocks=2, block=2)
    assert keep.tolist() == [[[False, False, True, True, True, True, False, False]]]


def test_candidate_blocks_partial_last_block():
    # T = 7, blocks of 4: b0 = entries 0..3, b1 = entries 4..6 (partial). Newest entry 6 is in b1.
    score = torch.tensor([[[5.0, 4.0, 3.0, 2.0, -1.0, -2.0, -3.0]]])
    keep = select_candidate_blocks(score, torch.tensor([7]), topk_blocks=1, block=4)
    assert keep.shape == (1, 1, 7)
    assert keep.tolist() == [[[False] * 4 + [True] * 3]]
    keep = select_candidate_blocks(score, torch.tensor([7]), topk_blocks=5, block=4)
    assert keep.tolist() == [[[True] * 7]]


def test_candidate_blocks_per_row_visibility_and_empty_rows():
    # Three query rows over T = 8 entries, blocks of 2, keep 2 blocks; batch of 2 with the second
    # batch row's scores negated. Row visibility 0, 3 and 8.
    base = torch.tensor([0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.4, 0.5])
    visible = torch.tensor([0, 3, 8])
    reach = torch.arange(8) < visible.unsqueeze(-1)  # [3, 8]
    rows = base.expand(3, 8)
    score = torch.stack((rows, -rows)).masked_fill(~reach, NEG)  # [2, 3, 8]
    keep = select_candidate_blocks(score, visible, topk_blocks=2, block=2)
    F, T = False, True
    # row 0: nothing visible -> nothing kept
    assert keep[:, 0].tolist() == [[F] * 8, [F] * 8]
    # row 1: entries 0..2 visible, newest block b1 (entry 2); b0 the only other reachable block
    assert keep[:, 1].tolist() == [[T, T, T, T, F, F, F, F]] * 2
    # row 2: newest block b3 pinned; other = best block max:
    #   batch 0: b0 = .9, b1 = .3, b2 = .8 -> b0;  batch 1 (negated): b0 = -.1, b1 = -.2, b2 = -.7 -> b0
    assert keep[0, 2].tolist() == [T, T, F, F, F, F, T, T]
    assert keep[1, 2].tolist() == [T, T, F, F, F, F, T, T]


def test_candidate_blocks_no_entries_yet():
    score = torch.full((1, 2, 4), NEG)
    keep = select_candidate_blocks(score, torch.tensor([0, 0]), topk_blocks=3, block=2)
    assert not keep.any()


# ============================================================================ 3. indexer top-k


def _hand_indexer(topk: int) -> tuple[Indexer, float]:
    """An indexer whose q is the input qr (wq_b = identity, q_lora_rank = 2 heads x 64) and whose
    head weights are column 0 of weights_proj (x = e_0), with all precision steps off."""
    config = tiny_config(q_lora_rank=128, index_topk=topk)
    idx = Indexer(config, owns_keys=False, dtype=torch.float32)
    for m in idx.modules():
        m.quant_sim = False
    c = 64**-0.5 * 2**-0.5  # the indexer's own weight scaling head_dim^-1/2 * n_heads^-1/2
    with torch.no_grad():
        idx.wq_b.weight.copy_(torch.eye(128))
        idx.weights_proj.weight.zero_()
        idx.weights_proj.weight[:, 0] = torch.tensor([1.0, -0.5]) / c
    return idx, c


# Two heads, weights w = (1, -0.5); only channels 0, 1 of each head are non-zero (RoPE acts on the
# last 32 channels, which are zero, so it changes nothing).
HAND_KEYS = [(1, 0), (0, 1), (1, 1), (2, -1)]
HAND_Q = [  # per query position s: (head 0, head 1)
    ((1, 0), (0, 1)),
    ((1, 2), (-1, 1)),
    ((0, 1), (1, 0)),
    ((1, -0.5), (0, -10)),
]
# score[s, t] = 1 * relu(q0 . k_t) - 0.5 * relu(q1 . k_t); entry t is visible iff t <= s (ratio 1):
#   s=0: q0.k = (1, 0, 1, 2),   q1.k = (0, 1, 1, -1)     -> (1, -.5, .5, 2)
#   s=1: q0.k = (1, 2, 3, 0),   q1.k = (-1, 1, 0, -3)    -> (1, 1.5, 3, 0)
#   s=2: q0.k = (0, 1, 1, -1),  q1.k = (1, 0, 1, 2)      -> (-.5, 1, .5, -1)
#   s=3: q0.k = (1, -.5, .5, 2.5), q1.k = (0, -10, -10, 10) -> (1, 0, .5, -2.5)
#   (without the ReLU, s=3 would be (1, 4.5, 5.5, -2.5) and pick {1, 2}; with w_1 = +.5 it would
#    be (1, 0, .5, 7.5) and pick {0, 3})
HAND_SCORES = [
    [1.0, -0.5, 0.5, 2.0],
    [1.0, 1.5, 3.0, 0.0],
    [-0.5, 1.0, 0.5, -1.0],
    [1.0, 0.0, 0.5, -2.5],
]
HAND_TOPK = {
    2: [[-1, 0], [0, 1], [1, 2], [0, 2]],
    3: [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [0, 1, 2]],  # s=2 keeps the negative-scored t0
}


def _hand_inputs():
    S, D = 4, 64
    x = torch.zeros(1, S, D)
    x[..., 0] = 1.0
    qr = torch.zeros(1, S, 2, 64)
    for s, heads in enumerate(HAND_Q):
        for h, (a, b) in enumerate(heads):
            qr[0, s, h, 0], qr[0, s, h, 1] = a, b
    keys = torch.zeros(1, len(HAND_KEYS), 64)
    for t, (a, b) in enumerate(HAND_KEYS):
        keys[0, t, 0], keys[0, t, 1] = a, b
    return x, qr.flatten(2), keys


def test_hand_scores_match_the_formula():
    # the literal table above, recomputed from sum_h w_h relu(q_h . k_t)
    w = (1.0, -0.5)
    for s, heads in enumerate(HAND_Q):
        for t in range(4):
            k = HAND_KEYS[t]
            want = sum(wh * max(0.0, q[0] * k[0] + q[1] * k[1]) for wh, q in zip(w, heads))
            assert want == HAND_SCORES[s][t]


def test_index_scores_hand_case():
    _, qr, keys = _hand_inputs()
    weights = torch.tensor([1.0, -0.5]).expand(1, 4, 2)
    got = index_scores(qr.unflatten(-1, (2, 64)), keys, weights)
    assert got.dtype == torch.float32
    assert got.tolist() == [HAND_SCORES]
    # a byte budget below one query's products: one query at a time, the same scores
    assert index_scores(qr.unflatten(-1, (2, 64)), keys, weights, max_bytes=1).tolist() == [HAND_SCORES]


def test_index_scores_in_query_pieces_equal_one_pass():
    """Long chunks over long contexts form the per-head products a few queries at a time: same scores."""
    g = torch.Generator().manual_seed(0)
    q, keys, w = torch.randn(2, 9, 4, 16, generator=g), torch.randn(2, 30, 16, generator=g), torch.rand(2, 9, 4, generator=g)
    whole = index_scores(q, keys, w)
    for budget in (1, 2 * 4 * 30 * 4 * 2, 2 * 4 * 30 * 4 * 5):  # 1, 2 and 5 queries per piece
        assert torch.equal(index_scores(q, keys, w, max_bytes=budget), whole)


@pytest.mark.parametrize("topk", [2, 3])
def test_top_entries_hand_case(topk):
    visible = torch.arange(4).unsqueeze(-1) >= torch.arange(4)  # t <= s
    score = torch.tensor([HAND_SCORES]).masked_fill(~visible, NEG)
    assert top_entries(score, topk).tolist() == [HAND_TOPK[topk]]
    # k above the number of entries: every reachable entry, unreachable ones as -1
    assert top_entries(score, 9).tolist() == [[[-1, -1, -1, 0], [-1, -1, 0, 1], [-1, 0, 1, 2], [0, 1, 2, 3]]]


@pytest.mark.parametrize("topk", [2, 3])
def test_indexer_hand_case(topk):
    idx, _ = _hand_indexer(topk)
    x, qr, keys = _hand_inputs()
    rotary = Rotary(32, 160000.0, None)
    out, pool = idx(x, qr, keys, torch.arange(4), rotary, ratio=1)
    assert pool is None
    assert out.tolist() == [HAND_TOPK[topk]]


def test_indexer_hand_case_candidate_restriction():
    # consumer: entries outside the pool are dropped before top-k. Pool for s=3 = {1, 2} only:
    # scores there (0, .5) -> top-2 = [1, 2]; other rows get an empty pool -> all -1.
    idx, _ = _hand_indexer(2)
    x, qr, keys = _hand_inputs()
    pool = torch.zeros(1, 4, 4, dtype=torch.bool)
    pool[0, 3, 1:3] = True
    out, _ = idx(x, qr, keys, torch.arange(4), Rotary(32, 160000.0, None), 1, candidates=pool)
    assert out.tolist() == [[[-1, -1], [-1, -1], [-1, -1], [1, 2]]]


def test_indexer_hand_case_candidate_source_pool():
    # candidate source with blocks of 2, keep 1 block: each row keeps only its newest block.
    idx, _ = _hand_indexer(2)
    idx.candidate_topk_blocks, idx.candidate_block_size = 1, 2
    x, qr, keys = _hand_inputs()
    out, pool = idx(x, qr, keys, torch.arange(4), Rotary(32, 160000.0, None), 1, select_candidates=True)
    F, T = False, True
    assert pool.tolist() == [[[T, T, F, F], [T, T, F, F], [F, F, T, T], [F, F, T, T]]]
    assert out.tolist() == [HAND_TOPK[2]]  # the source's own top-k is not restricted to its pool


def _forward_capture(model, ids, monkeypatch):
    """Run hidden_states recording the SharedKV, each layer's compressed KV / allowed mask and
    every Compressor call."""
    shared = record_shared(monkeypatch)
    used, visible, compressor_calls = [], [], []
    wrap_method(monkeypatch, Attention, "_compressed", used)
    wrap_method(monkeypatch, Attention, "_visible_compressed", visible)
    wrap_method(monkeypatch, Compressor, "forward", compressor_calls)
    collect = record_source_outputs(monkeypatch, model)
    with torch.no_grad():
        out = model.hidden_states(ids)
    assert len(shared) == 1
    layer_of = {id(layer.attn): layer.role.layer_id for layer in model.layers}
    allowed = {layer_of[id(att)]: mask.expand(*ids.shape, -1) for att, _, mask in visible}
    per_layer = {layer_of[id(att)]: (comp, allowed[layer_of[id(att)]]) for att, _, comp in used}
    owner = {id(m): i for i, layer in enumerate(model.layers) for m in layer.modules() if isinstance(m, Compressor)}
    calls = [owner[id(c)] for c, _, _ in compressor_calls]
    compressed, keys = collect()
    return out, shared[0], per_layer, calls, compressed, keys


def test_indexer_topk_rows_in_the_tiny_model(tiny, monkeypatch):
    ids = prompt(LONG)
    B, S = ids.shape
    _, shared, *_ = _forward_capture(tiny, ids, monkeypatch)
    assert sorted(shared.topk) == [2, 5, 7]
    k = TINY["index_topk"]
    for layer, idx in shared.topk.items():
        ratio = TINY["compress_ratios"][layer]
        assert idx.shape == (B, S, k)
        assert torch.equal(idx, idx.sort(dim=-1).values), f"layer {layer}: indices not sorted"
        for s in range(S):
            visible = (s + 1) // ratio
            for b in range(B):
                row = idx[b, s].tolist()
                picks = [t for t in row if t >= 0]
                assert all(t < visible for t in picks), f"layer {layer} row {s}: pick beyond visibility"
                assert len(set(picks)) == len(picks)
                if layer != 7:  # unrestricted layers fill every slot they can
                    assert row.count(-1) == max(0, k - visible), f"layer {layer} row {s}: {row}"
    # ratio 2: query 0 sees nothing yet, query 1 sees entry 0 only
    assert shared.topk[2][:, 0].tolist() == [[-1] * 4] * B
    assert shared.topk[2][:, 1].tolist() == [[-1, -1, -1, 0]] * B


def test_consumer_picks_lie_in_candidate_pool(tiny, monkeypatch):
    ids = prompt(LONG)
    B, S = ids.shape
    _, shared, *_ = _forward_capture(tiny, ids, monkeypatch)
    pool = shared.candidates
    assert pool is not None and pool.shape == (B, S, S)  # ratio 1: one entry per position
    bs, nb = TINY["candidate_block_size"], TINY["candidate_topk_blocks"]
    for b in range(B):
        for s in range(S):
            kept = pool[b, s].tolist()
            blocks = {t // bs for t, on in enumerate(kept) if on}
            # whole blocks, at most nb of them, never past the newest visible block, newest pinned
            assert kept == [t // bs in blocks for t in range(S)]
            assert len(blocks) <= nb and max(blocks) == s // bs
            picks = [t for t in shared.topk[7][b, s].tolist() if t >= 0]
            assert all(kept[t] for t in picks), f"row {s}: consumer picked outside the pool"
            in_pool_visible = sum(kept[: s + 1])
            assert len(picks) == min(TINY["index_topk"], in_pool_visible)


# ============================================================================ 4. reuse / rescore


def test_only_kv_sources_own_compressors_and_index_keys(tiny):
    for layer in tiny.layers:
        i = layer.role.layer_id
        assert hasattr(layer.attn, "compressor") == (i in TINY["kv_source_layer_ids"]), i
        assert hasattr(layer.attn, "indexer") == (i in TINY["index_source_layer_ids"]), i
        if i in TINY["index_source_layer_ids"]:
            owns_keys = i in TINY["kv_source_layer_ids"]
            assert hasattr(layer.attn.indexer, "wk") == owns_keys
            assert hasattr(layer.attn.indexer, "k_norm") == owns_keys
            assert not hasattr(layer.attn.indexer, "compressor")  # V4.1 keys come from the KV latent
    # ratio 1 is a plain projection: no gate; ratio 2 pools with a gate
    assert not hasattr(tiny.layers[5].attn.compressor, "wgate")
    assert hasattr(tiny.layers[2].attn.compressor, "wgate")


def test_reuse_and_shared_kv_equalities(tiny, monkeypatch):
    ids = prompt(LONG)
    B, S = ids.shape
    _, shared, used, calls, compressed, keys = _forward_capture(tiny, ids, monkeypatch)
    assert calls == [2, 5]  # only the KV sources run a compressor, once each
    assert sorted(compressed) == [2, 5] and sorted(keys) == [2, 5]  # ... and store entries / index keys
    assert all(len(v) == 1 for v in (*compressed.values(), *keys.values()))
    assert compressed[2][0].shape == (B, S // 2, 64) and compressed[5][0].shape == (B, S, 64)
    roles = tiny.config.layer_roles
    for i, (comp, allowed) in sorted(used.items()):
        role = roles[i]
        # exactly the compressed KV its source stored
        assert torch.equal(comp, compressed[role.kv_source][0]), i
        # the allowed set is exactly the index source's top-k, rebuilt by hand
        idx = shared.topk[role.index_source]
        G = comp.shape[1]
        want = torch.zeros(B, S, G, dtype=torch.bool)
        for b in range(B):
            for s in range(S):
                for t in idx[b, s].tolist():
                    if t >= 0:
                        want[b, s, t] = True
        assert torch.equal(allowed, want), i
    assert sorted(used) == [2, 3, 4, 5, 6, 7]
    assert torch.equal(used[3][1], used[2][1]) and torch.equal(used[4][1], used[2][1])
    assert torch.equal(used[6][1], used[5][1])
    assert torch.equal(used[3][0], used[2][0]) and torch.equal(used[7][0], used[5][0])


def _rms(v: list[float], w: list[float]) -> list[float]:
    r = math.sqrt(sum(a * a for a in v) / len(v))
    return [wi * a / r for a, wi in zip(v, w)]


def _hand_compressor(ratio):
    config = tiny_config()
    comp = Compressor(config, ratio, 64, torch.float32)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        comp.wkv.weight.copy_(torch.eye(64))
        if ratio > 1:
            comp.wgate.weight.copy_(2 * torch.eye(64))
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    return comp


def test_v41_compressor_ratio2_gated_pooling():
    # wkv = I, wgate = 2 I: channel c of group g pools tokens (a, b) = x[2g, c], x[2g + 1, c] as
    # (a e^{2a} + b e^{2b}) / (e^{2a} + e^{2b}), no position bias, no overlap; then RMSNorm.
    # 5 tokens -> 2 complete groups, the 5th token waits for its partner.
    comp = _hand_compressor(2)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(13))
    got = call_compressor(comp, x)
    assert got.shape == (1, 2, 64)
    w = comp.norm.weight.tolist()
    for grp in range(2):
        pooled = []
        for c in range(64):
            a, b = x[0, 2 * grp, c].item(), x[0, 2 * grp + 1, c].item()
            ea, eb = math.exp(2 * a), math.exp(2 * b)
            pooled.append((a * ea + b * eb) / (ea + eb))
        torch.testing.assert_close(got[0, grp], torch.tensor(_rms(pooled, w)), atol=1e-5, rtol=1e-5)


def test_v41_compressor_ratio1_is_a_projection():
    comp = _hand_compressor(1)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(14))
    got = call_compressor(comp, x)
    assert got.shape == (1, 3, 64)
    w = comp.norm.weight.tolist()
    for s in range(3):
        torch.testing.assert_close(got[0, s], torch.tensor(_rms(x[0, s].tolist(), w)), atol=1e-5, rtol=1e-5)


def test_compressed_entries_and_index_keys_from_the_prerope_latent(tiny, monkeypatch):
    # entry g of ratio r is rotated at position g * r; the index keys are k_norm(wk(latent)) of the
    # same, unrotated latent, rotated at g * r too (quant_sim off: no rounding in between)
    ids = prompt(LONG)
    calls = []
    wrap_method(monkeypatch, Compressor, "forward", calls)
    collect = record_source_outputs(monkeypatch, tiny)
    with torch.no_grad():
        tiny.hidden_states(ids)
    latents = {id(c): _first(latent) for c, _, latent in calls}
    compressed, keys = collect()
    for i in (2, 5):
        att = tiny.layers[i].attn
        r = att.role.compress_ratio
        latent = latents[id(att.compressor)]
        G = latent.shape[1]
        assert G == LONG // r
        cos, sin = att.rotary.cos_sin(torch.arange(G) * r)
        with torch.no_grad():
            want_kv = apply_rope(latent, cos[None], sin[None])
            want_k = apply_rope(att.indexer.k_norm(att.indexer.wk(latent)), cos[None], sin[None])
        assert torch.equal(compressed[i][0], want_kv), i
        assert torch.equal(keys[i][0], want_k), i


# ============================================================================ 5. single-pass mHC


def _mixes(h, fn, base, scale, hc, iters, eps, norm_eps):
    """MODEL.md §4, written out independently: pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]."""
    x = h.flatten(2).float()
    m = (x @ fn.float().T) / torch.sqrt((x * x).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*m.shape[:-1], hc, hc)
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def _collapse(h, w):
    return (w.unsqueeze(-1) * h).sum(2)


def _expand(f, h, post, comb):
    return post.unsqueeze(-1) * f.unsqueeze(2) + torch.einsum("bsjk,bsjd->bskd", comb, h)


def _hand_mhc(model, ids, v4_wiring=False):
    c = model.config
    B, S = ids.shape
    positions = torch.arange(S)
    h = model.embed.weight[ids].unsqueeze(2).expand(B, S, c.hc_mult, c.hidden_size).clone()
    pre = torch.zeros(B, S, c.hc_mult)
    pre[..., 0] = 1.0  # first collapse: one-hot on stream 0
    shared, cache = new_shared(), new_cache(c.sliding_window)
    args = (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
    for layer in model.layers:
        a_pre, a_post, a_comb = _mixes(h, layer.hc_attn_fn, layer.hc_attn_base, layer.hc_attn_scale, *args)
        x = _collapse(h, a_pre if v4_wiring else pre)  # attention site: the previous site's pre
        h = _expand(call_attention(layer.attn, layer.attn_norm(x), positions, shared, cache), h, a_post, a_comb)
        f_pre, f_post, f_comb = _mixes(h, layer.hc_ffn_fn, layer.hc_ffn_base, layer.hc_ffn_scale, *args)
        x = _collapse(h, f_pre if v4_wiring else a_pre)  # FFN site: the attention site's pre
        h = _expand(layer.ffn(layer.ffn_norm(x), ids), h, f_post, f_comb)
        pre = f_pre
    return _collapse(h, pre)  # before the head: the last FFN site's pre


@pytest.mark.parametrize("ratios", [[0], [0, 1]])
def test_single_pass_mhc_wiring(ratios):
    n = len(ratios)
    sources = [i for i, r in enumerate(ratios) if r]
    config = tiny_config(
        num_hidden_layers=n,
        compress_ratios=ratios,
        kv_source_layer_ids=sources,
        index_source_layer_ids=sources,
        candidate_source_layer_id=-1,
    )
    model = build(config, seed=3)
    ids = prompt(6, seed=4)
    with torch.no_grad():
        got = model.hidden_states(ids)
        want = _hand_mhc(model, ids)
        v4_style = _hand_mhc(model, ids, v4_wiring=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the check can tell the wirings apart
    assert (v4_style - want).abs().max() > 1e-3


def test_one_hot_pre():
    # the first collapse puts all weight on stream 0. (At the model level any weights summing to
    # one would pass, since the embedding is copied into identical streams.)
    pre = one_hot_pre(torch.randn(2, 3, 4, 8))
    assert pre.dtype == torch.float32
    assert pre.tolist() == [[[1.0, 0.0, 0.0, 0.0]] * 3] * 2


def test_no_hc_head_parameters_in_v41(tiny):
    names = [n for n, _ in tiny.named_parameters()]
    assert not any("hc_head" in n for n in names)
    v4 = Dsv4Model(v4_config(), torch.float32)
    assert {"hc_head_fn", "hc_head_base", "hc_head_scale"} <= {n for n, _ in v4.named_parameters()}


# ============================================================================ 6. encoder-decoder KV


def test_changing_decoder_kv_source_only_affects_later_layers(tiny):
    ids = prompt(LONG)
    other = copy.deepcopy(tiny)
    with torch.no_grad():
        w = other.layers[5].attn.compressor.wkv.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
    with torch.no_grad():
        out_a, a = run_with_hooks(tiny, ids)
        out_b, b = run_with_hooks(other, ids)
    assert sorted(a) == sorted(b) == list(range(8))
    for i in range(5):
        assert torch.equal(a[i], b[i]), f"layer {i} changed"
    for i in range(5, 8):
        assert (a[i] - b[i]).abs().max() > 1e-6, f"layer {i} did not change"
    assert (out_a - out_b).abs().max() > 1e-6


# ============================================================================ 7. decoder replay


@pytest.mark.parametrize("S", [5, WINDOW])
def test_decoder_replay_is_exact_within_the_window(tiny, S):
    ids = prompt(S)
    with torch.no_grad():
        off, hooks_off = run_with_hooks(tiny, ids, decoder_replay=False)
        on, hooks_on = run_with_hooks(tiny, ids, decoder_replay=True)
    assert torch.equal(on, off)
    for i in range(8):
        assert torch.equal(hooks_on[i], hooks_off[i])


def test_decoder_replay_model_attribute_default(tiny):
    ids = prompt(LONG)
    assert tiny.decoder_replay is False
    with torch.no_grad():
        assert tiny.hidden_states(ids).shape[1] == LONG
        tiny.decoder_replay = True
        try:
            assert tiny.hidden_states(ids).shape[1] == WINDOW
        finally:
            tiny.decoder_replay = False


def test_decoder_replay_beyond_the_window(tiny, monkeypatch):
    ids = prompt(LONG)
    B, S = ids.shape
    start = tiny.config.decoder_start
    assert start == 6
    keep = slice(S - WINDOW, S)

    # replay off, recording each block's (streams, carried pre) and the SharedKV
    original = Block.forward
    blocks = record_blocks(monkeypatch)
    made = record_shared(monkeypatch)
    collect = record_source_outputs(monkeypatch, tiny)
    attn_positions = []
    wrap_method(monkeypatch, Attention, "forward", attn_positions)
    with torch.no_grad():
        off, hooks_off = run_with_hooks(tiny, ids, decoder_replay=False)
    shared_off = made[-1]
    compressed, keys = collect()
    h5, pre5 = blocks[start - 1]
    attn_positions.clear()
    with torch.no_grad():
        on, hooks_on = run_with_hooks(tiny, ids, decoder_replay=True)

    # encoder layers identical, decoder layers see the last `window` rows at their true positions
    for i in range(start):
        assert torch.equal(hooks_on[i], hooks_off[i]), i
    for i in range(start, 8):
        assert hooks_on[i].shape == (B, WINDOW, 4, 64), i
    positions = {id(layer.attn): layer.role.layer_id for layer in tiny.layers}
    for att, args, _ in attn_positions:
        want = torch.arange(S - WINDOW, S) if positions[id(att)] >= start else torch.arange(S)
        assert torch.equal(args[1], want), positions[id(att)]
    assert on.shape == (B, WINDOW, 64)

    # independent construction: the encoder's state of the replay-off run, cut to the last window,
    # fed through the decoder layers with fresh state holding only what the encoder produced
    assert max(compressed) < start and max(keys) < start
    enc_kv = {k: v[0] for k, v in compressed.items()}
    enc_keys = {k: v[0] for k, v in keys.items()}
    topk = {k: v[:, keep] for k, v in shared_off.topk.items() if k < start}
    shared = new_shared(topk, shared_off.candidates[:, keep])
    cache = new_cache(WINDOW, enc_kv, enc_keys)
    h, pre = h5[:, keep], pre5[:, keep]
    with torch.no_grad():
        for layer in tiny.layers[start:]:
            h, pre = call_block(original, layer, h, pre, ids[:, keep], torch.arange(S - WINDOW, S), shared, cache)
    want = _collapse(h.float(), pre)
    assert torch.equal(on, want.to(on.dtype))

    # the truncated windows make replay approximate: rows differ, finitely, from the exact model
    diff = (on - off[:, keep]).abs()
    assert torch.isfinite(diff).all()
    assert diff.max() > 0
    print(f"decoder replay vs exact, S={S}, window={WINDOW}: max |diff| all rows {diff.max():.3e}, "
          f"last row {diff[:, -1].max():.3e}")


class _StubHasher:
    """Fixed random Engram row ids [B, S, 1 layer, (N-1) * H = 4] for a prompt, one row per position."""

    def __init__(self, rows: int):
        self.rows = rows

    def hash_ids(self, input_ids, start):
        B, S = input_ids.shape
        g = torch.Generator().manual_seed(20)
        return torch.randint(0, self.rows, (B, S, 1, 4), generator=g)


def test_decoder_replay_with_engram_in_a_decoder_layer(monkeypatch):
    # An Engram lookup at decoder layer 7 must read the hash rows of the kept positions.
    config = tiny_config(
        engram_layer_ids=[7], engram_num_embeddings=[50], engram_n_heads=2, engram_head_dim=32,
        engram_max_ngram_size=3,
    )
    model = build(config, seed=21)
    model.engram_hasher = _StubHasher(50)
    ids = prompt(LONG)
    S, start, keep = LONG, config.decoder_start, slice(LONG - WINDOW, LONG)
    original = Block.forward
    blocks = record_blocks(monkeypatch)
    made = record_shared(monkeypatch)
    collect = record_source_outputs(monkeypatch, model)
    with torch.no_grad():
        model.hidden_states(ids, decoder_replay=False)
    compressed, keys = collect()
    enc_kv, enc_keys = {k: v[0] for k, v in compressed.items()}, {k: v[0] for k, v in keys.items()}
    enc = made[0]
    topk = {k: v[:, keep] for k, v in enc.topk.items() if k < start}
    shared = new_shared(topk, enc.candidates[:, keep])
    cache = new_cache(WINDOW, enc_kv, enc_keys)
    h, pre = blocks[start - 1]
    h, pre = h[:, keep], pre[:, keep]
    rows = _StubHasher(50).hash_ids(ids, 0)[:, keep, 0]
    with torch.no_grad():
        for layer in model.layers[start:]:
            engram_rows = rows if layer.role.engram else None
            h, pre = call_block(original, layer, h, pre, ids[:, keep], torch.arange(S - WINDOW, S), shared, cache,
                                engram_rows)
    with torch.no_grad():
        on = model.hidden_states(ids, decoder_replay=True)
    assert torch.equal(on, _collapse(h.float(), pre))


def test_decoder_replay_with_window_covering_prompt():
    # the same tiny model with a window as long as the prompt: replay cuts nothing
    model = build(tiny_config(sliding_window=LONG), seed=0)
    ids = prompt(LONG)
    with torch.no_grad():
        assert torch.equal(model.hidden_states(ids, decoder_replay=True), model.hidden_states(ids))


# ============================================================================ 8. precision steps


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax.double() / qmax)))


def _nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value by brute force over the 8 magnitudes (ties do not occur in random data)."""
    mags = E2M1_MAGNITUDES.to(v.device)
    pick = (v.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    return torch.sign(v) * mags[pick]


def _on_e2m1_grid(v: torch.Tensor) -> bool:
    return bool(torch.isin(v.abs(), E2M1_MAGNITUDES).all())


def check_fp8_blocks(x, y, block):
    """y is x in e4m3 with one power-of-two scale per `block` (all channels, RoPE tail included)."""
    xb, yb = x.double().reshape(-1, block), y.double().reshape(-1, block)
    s = _pow2_scale(xb.abs().amax(-1), 448.0).unsqueeze(-1)
    q = yb / s
    assert (q.abs() <= 448).all()
    assert torch.equal(q.float().to(torch.float8_e4m3fn).double(), q), "values off the e4m3 grid"
    assert torch.equal(yb, (xb / s).float().to(torch.float8_e4m3fn).double() * s), "not nearest"


def check_nvfp4_blocks(x, y):
    """y is x as e2m1 values times one e4m3 scale (amax / 6, rounded to e4m3) per 16."""
    xb, yb = x.double().reshape(-1, 16), y.double().reshape(-1, 16)
    s = (xb.abs().amax(-1) / 6).float().to(torch.float8_e4m3fn).double().unsqueeze(-1)
    q = yb / s
    assert _on_e2m1_grid(q), "values off the e2m1 grid"
    assert torch.equal(q, _nearest_e2m1(xb / s)), "not nearest"
    return s


def check_mxfp4_blocks(x, y):
    """y is x as e2m1 values times one power-of-two scale per 32."""
    xb, yb = x.double().reshape(-1, 32), y.double().reshape(-1, 32)
    s = _pow2_scale(xb.abs().amax(-1), 6.0).unsqueeze(-1)
    q = yb / s
    assert _on_e2m1_grid(q), "values off the e2m1 grid"
    assert torch.equal(q, _nearest_e2m1(xb / s)), "not nearest"


@pytest.fixture(scope="module")
def quant_run(tiny):
    """One quant_sim forward of the tiny model, recording the precision steps' inputs and outputs."""
    model = copy.deepcopy(tiny)
    model.set_quant_sim(True)
    window, compressed, fp4 = [], [], []
    mp = pytest.MonkeyPatch()
    try:
        wrap_method(mp, Attention, "_window_quant", window)
        wrap_method(mp, Attention, "_compressed_quant", compressed)
        wrap_method(mp, Indexer, "_fp4", fp4)
        with torch.no_grad():
            out = model.hidden_states(prompt(LONG))
    finally:
        mp.undo()
    return out, window, compressed, fp4


def test_quant_sim_window_kv_fp8_all_dims(quant_run):
    out, window, _, _ = quant_run
    assert torch.isfinite(out).all()
    assert len(window) == 8  # every layer quantizes its window KV once
    for _, (x,), y in window:
        assert y.shape == x.shape and y.shape[-1] == 64
        check_fp8_blocks(x, y, 32)
        assert not torch.equal(y[..., -32:], x[..., -32:])  # the RoPE tail is quantized too


def test_quant_sim_compressed_kv_nvfp4(quant_run):
    _, _, compressed, _ = quant_run
    assert len(compressed) == 2  # the two KV sources
    scales = []
    for _, (x,), y in compressed:
        scales.append(check_nvfp4_blocks(x, y))
    s = torch.cat([t.flatten() for t in scales])
    # e4m3 scales, not powers of two: some scale has a non-zero mantissa
    assert (torch.log2(s) != torch.round(torch.log2(s))).any()


def test_quant_sim_indexer_mxfp4(quant_run):
    _, _, _, fp4 = quant_run
    assert len(fp4) == 2 + 3  # keys of the 2 KV sources, queries of the 3 index layers
    for _, (x,), y in fp4:
        assert y.shape == x.shape
        check_mxfp4_blocks(x, y)


def test_quant_sim_changes_the_output(tiny, quant_run):
    out, _, _, _ = quant_run
    with torch.no_grad():
        exact = tiny.hidden_states(prompt(LONG))
    diff = (out - exact).abs().max()
    assert 0 < diff < 10 * exact.abs().max()


def _quant_attention():
    config = tiny_config()
    att = Attention(config, config.layer_roles[5], torch.float32)
    att.quant_sim = True
    return att


def test_window_quant_blocks_are_32_wide():
    # FP8 with power-of-two scales only depends on the block through subnormals: a block of large
    # values next to a block of tiny ones tells block 32 from block 64 (with one scale for both, the
    # tiny ones would round to multiples of 2**-9).
    g = torch.Generator().manual_seed(8)
    x = torch.cat((300 * torch.randn(32, generator=g), 1e-3 * torch.randn(32, generator=g))).view(1, 1, 64)
    y = _quant_attention()._window_quant(x)
    check_fp8_blocks(x, y, 32)
    s64 = _pow2_scale(x.abs().amax(), 448.0)
    one_scale = ((x.double() / s64).float().to(torch.float8_e4m3fn).double() * s64).float()
    assert not torch.equal(y, one_scale)


def test_compressed_quant_blocks_are_16_wide():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 3, 64, generator=g) * torch.tensor([5.0, 0.01, 1.0, 0.2]).repeat_interleave(16)
    y = _quant_attention()._compressed_quant(x)
    check_nvfp4_blocks(x, y)


def test_precision_steps_off_without_quant_sim():
    att = _quant_attention()
    att.quant_sim = False
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(10))
    assert torch.equal(att._window_quant(x), x) and torch.equal(att._compressed_quant(x), x)


def test_indexer_fp4_blocks_are_32_wide():
    config = tiny_config()
    idx = Indexer(config, owns_keys=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 3, 64, generator=g) * torch.tensor([8.0, 0.05]).repeat_interleave(32)
    check_mxfp4_blocks(x, idx._fp4(x))


def test_fp8_block32_known_vector():
    # block 1 amax 900: 900 * fp32(1/448) = 2.009 -> scale 2**ceil(log2 2.009) = 4
    #   900/4 = 225 -> e4m3 in [128, 256) steps by 16 -> 224
    #   1/4 = .25 exact;  -3.3/4 = -.825 -> [.5, 1) steps by 1/16: .8125 (off .0125) vs .875 -> -.8125
    #   .01/4 = .0025 -> subnormal steps of 2**-9 = .001953125: 1.28 steps -> 1 step
    #   4.25/4 = 1.0625, the tie of 1.0 (even mantissa) and 1.125 -> 1.0
    # block 2 amax .5: .5/448 = 2**-9.81 -> scale 2**-9, .5 / 2**-9 = 256 exact
    x = torch.zeros(64)
    x[:5] = torch.tensor([900.0, 1.0, -3.3, 0.01, 4.25])
    x[40] = 0.5
    q, scale = quantize_fp8(x, (32,))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.float().tolist() == [4.0, 2.0**-9]
    want_q = torch.zeros(64)
    want_q[:5] = torch.tensor([224.0, 0.25, -0.8125, 2.0**-9, 1.0])
    want_q[40] = 256.0
    assert torch.equal(q.float(), want_q)
    want = torch.zeros(64)
    want[:5] = torch.tensor([896.0, 1.0, -3.25, 2.0**-7, 4.0])
    want[40] = 0.5
    assert torch.equal(fake_quant_fp8(x, 32), want)


def test_nvfp4_block16_known_vector():
    # amax 6.6: 6.6/6 = 1.1 -> e4m3 in [1, 2) steps by .125 -> 1.125 (a non-power-of-two scale)
    #   6.6/1.125 = 5.87 -> 6 (code 7);  1/1.125 = .89 -> 1 (code 2);  -2.2/1.125 = -1.96 -> -2 (code 12)
    #   .3/1.125 = .267 -> .5 (code 1);  3.1/1.125 = 2.76 -> 3 (code 5)
    #   2.8125/1.125 = 2.5, the tie of 2 (code 4, even) and 3 (code 5) -> 2 (code 4)
    x = torch.zeros(16)
    x[:6] = torch.tensor([6.6, 1.0, -2.2, 0.3, 3.1, 2.8125])
    packed, scale = quantize_nvfp4(x, 16)
    assert scale.dtype == torch.float8_e4m3fn and scale.float().tolist() == [1.125]
    # two codes per byte, even element in the low nibble: 7|2<<4, 12|1<<4, 5|4<<4
    assert packed.tolist() == [0x27, 0x1C, 0x45, 0, 0, 0, 0, 0]
    want = torch.zeros(16)
    want[:6] = torch.tensor([6.75, 1.125, -2.25, 0.5625, 3.375, 2.25])
    assert torch.equal(dequantize_nvfp4(packed, scale, 16), want)
    assert torch.equal(fake_quant_nvfp4(x, 16), want)


def test_mxfp4_block32_known_vector():
    # amax 10: 10/6 = 1.67 -> scale 2**ceil(log2 1.67) = 2
    #   10/2 = 5, the tie of 4 (code 6, even) and 6 (code 7) -> 4 (code 6)
    #   -.7/2 = -.35 -> -.5 (code 9);  2.6/2 = 1.3 -> 1.5 (code 3)
    #   .26/2 = .13 -> 0;  .5/2 = .25, the tie of 0 (code 0, even) and .5 (code 1) -> 0
    x = torch.zeros(32)
    x[:5] = torch.tensor([10.0, -0.7, 2.6, 0.26, 0.5])
    packed, scale = quantize_mxfp4(x, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.float().tolist() == [2.0]
    assert packed.tolist() == [0x96, 0x03] + [0] * 14  # 6|9<<4, 3|0<<4
    want = torch.zeros(32)
    want[:3] = torch.tensor([8.0, -1.0, 3.0])
    assert torch.equal(dequantize_mxfp4(packed, scale, 32), want)
    assert torch.equal(fake_quant_mxfp4(x, 32), want)


# ============================================================================ 9. V4.1 vs V4 structure


def test_compressor_position_bias_only_in_v4(tiny):
    for layer in tiny.layers:
        for m in layer.modules():
            if isinstance(m, Compressor):
                assert not hasattr(m, "ape")
                assert m.overlap is False
    v4 = Dsv4Model(v4_config(), torch.float32)
    assert v4.layers[1].attn.compressor.ape.shape == (4, 2 * 64)  # CSA: overlapping, 2x wide
    assert v4.layers[1].attn.indexer.compressor.ape.shape == (4, 2 * 64)
    assert v4.layers[2].attn.compressor.ape.shape == (128, 64)  # HCA


def _window_attention(config, seed):
    att = Attention(config, config.layer_roles[0], torch.float32)
    fill_(att, seed)
    for m in att.modules():
        m.quant_sim = False
    return att


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_per_head_q_norm_only_in_v4(family):
    # V4 RMS-normalizes each query head (no weight), so scaling wq_b changes nothing;
    # V4.1 has no such norm, so the scores (and the output) change.
    config = v4_config() if family == "deepseek_v4" else tiny_config()
    att = _window_attention(config, seed=5)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = call_attention(att, x, torch.arange(6), new_shared())
        att.wq_b.weight.mul_(4.0)
        after = call_attention(att, x, torch.arange(6), new_shared())
    if family == "deepseek_v4":
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    else:
        assert (after - before).abs().max() > 1e-3


# ============================================================================ 10. image tokens


def test_image_tokens_are_rejected():
    model = build(tiny_config(image_token_id=63), seed=0)
    ids = prompt(6, vocab=60)
    ids[1, 3] = 63
    with pytest.raises(ValueError, match="image"):
        model.hidden_states(ids)
    with pytest.raises(ValueError, match="image"):
        model(ids)
    ids[1, 3] = 62
    assert model.hidden_states(ids).shape == (2, 6, 64)


@pytest.mark.parametrize("bad, message", [(-1, "token id -1 is outside the vocabulary"),
                                          (64, "token id 64 is outside the vocabulary of 64")])
def test_ids_outside_the_vocabulary_are_named(bad, message):
    model = build(tiny_config(image_token_id=63), seed=0)
    ids = prompt(6, vocab=60)
    ids[0, 2] = bad
    with pytest.raises(ValueError, match=message):
        model.hidden_states(ids)
    with pytest.raises(ValueError, match="must be integers"):
        model.hidden_states(ids.float())
