"""The sparse MQA scoring kernels (dsv4/fast/kernels/indexer.py) against their torch twin.

The property tests run the kernels on CPU tensors through the Triton interpreter: TRITON_INTERPRET=1 must
be in the environment before triton.language is first imported (importing dsv4 imports it), e.g.
`TRITON_INTERPRET=1 python -m pytest tests/fast/test_indexer_kernel.py`; without it they skip. The `gpu`
tests run the same checks on CUDA at edge-case and realistic shapes.

Tolerances (one place): scores are fp32 sums of exact products, so kernel and twin differ only by fp32
summation order: |kernel - twin| <= RTOL * |twin| + ATOL * mag, with mag = sum_h |w_h| * sum_i |q_hi * k_i|
(fp64), the scale of the sum. -inf entries must match exactly. Top-k picks must equal the twin's index
sets exactly, except where twin scores tie within that tolerance at the k-th value (relu makes exact 0
ties common when H is small); there any pick among the tied entries is accepted.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4.fast.kernels.indexer as ix
from dsv4.fast.kernels import triton_importable
from dsv4.quant import dequantize_mxfp4, quantize_mxfp4
from dsv4.reference.indexer import index_scores, select_candidate_blocks, top_entries

RTOL = 1e-5
ATOL = 1e-5
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter only works when triton.language itself was imported in interpreter mode
INTERP_OK = INTERP and triton_importable() and type(ix.tl.zeros).__name__ == "InterpretedFunction"
needs_interp = pytest.mark.skipif(
    not INTERP_OK, reason="CPU kernel tests need TRITON_INTERPRET=1 set before triton is imported"
)
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# inputs and the twin
# --------------------------------------------------------------------------------------------------


def make_inputs(S, H, d, T, seed, *, q_dtype=torch.bfloat16, visible="random", device="cpu", key_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, d, generator=g).to(q_dtype)
    keys = torch.randn(T, d, generator=g) * key_scale
    # some rows with a wide spread of block scales
    keys[: T // 5] *= torch.exp2(torch.randint(-6, 7, (T // 5, d // 32), generator=g).float()).repeat_interleave(32, -1)
    k_packed, k_scale = quantize_mxfp4(keys)
    w = torch.randn(S, H, generator=g) * (d**-0.5 * H**-0.5)
    if visible == "random":
        vis = torch.randint(0, T + 1, (S,), generator=g)
    elif visible == "all":
        vis = torch.full((S,), T)
    elif visible == "none":
        vis = torch.zeros(S, dtype=torch.long)
    else:  # causal prefill chunk ending at T
        vis = torch.arange(T - S + 1, T + 1).clamp(min=0)
    vis = vis.to(torch.int32)
    to = {"device": device}
    return q.to(**to), k_packed.to(**to), k_scale.to(**to), w.to(**to), vis.to(**to)


def random_pool(S, T, block_size, nb, seed, *, p_empty=0.2, device="cpu"):
    """[S, nb] distinct block ids of the T entries (in random order), some slots -1."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-T // block_size)
    rows = []
    for _ in range(S):
        ids = torch.randperm(n_blocks, generator=g)[:nb]
        ids = torch.cat((ids, torch.full((nb - ids.numel(),), -1, dtype=torch.long)))
        ids = torch.where(torch.rand(nb, generator=g) < p_empty, -1, ids)
        rows.append(ids[torch.randperm(nb, generator=g)])
    return torch.stack(rows).to(torch.int32).to(device) if S else torch.zeros(0, nb, dtype=torch.int32, device=device)


def pool_mask(blocks, block_size, T):
    """[S, T] bool: entries inside the listed blocks."""
    S = blocks.shape[0]
    ent = ix.pool_entry_ids(blocks, block_size)
    ok = (ent >= 0) & (ent < T)
    mask = torch.zeros(S, T + 1, dtype=torch.bool, device=blocks.device)
    mask.scatter_(1, torch.where(ok, ent, T), True)
    return mask[:, :T]


def in_pool_layout(score, mag, blocks, block_size):
    """A dense twin's (score, mag) [S, T] in the pool layout of `blocks`: -inf at -1 blocks and past T."""
    ent = ix.pool_entry_ids(blocks, block_size)
    ok = (ent >= 0) & (ent < score.shape[1])
    idx = torch.where(ok, ent, 0)
    return torch.where(ok, score.gather(1, idx), float("-inf")), mag.gather(1, idx)


def twin(q, k_packed, k_scale, w, vis, mask=None):
    """(score [S, T] fp32, masked like Indexer.forward; mag [S, T] fp64, the scale of each sum)."""
    keys = dequantize_mxfp4(k_packed, k_scale)
    T = keys.shape[0]
    score = index_scores(q.float()[None], keys[None], w.float()[None])[0]
    reach = torch.arange(T, device=q.device) < vis.view(-1, 1)
    if mask is not None:
        reach = reach & mask
    mag = torch.einsum("shd,td,sh->st", q.double().abs(), keys.double().abs(), w.double().abs())
    return score.masked_fill(~reach, float("-inf")), mag


def assert_scores(got, want, mag):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not got.isnan().any()
    assert torch.equal(got == float("-inf"), want == float("-inf")), "the -inf patterns differ"
    fin = want > float("-inf")
    err = (got[fin].double() - want[fin].double()).abs()
    bound = RTOL * want[fin].double().abs() + ATOL * mag[fin] + 1e-30
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


def assert_topk(got, score, k, mag):
    """got: [S, width] ids from the kernel path; score: the masked twin score; exact unless tied."""
    want = top_entries(score, k)
    assert got.shape == want.shape and got.dtype == want.dtype
    if torch.equal(got, want):
        return
    tol = (RTOL * score.abs().nan_to_num(posinf=0, neginf=0) + ATOL * mag.float()).to(score.device)
    for s in range(score.shape[0]):
        g, w_ = got[s], want[s]
        if torch.equal(g, w_):
            continue
        assert (g == -1).sum() == (w_ == -1).sum(), f"row {s}: -1 counts differ"
        gs, ws = g[g >= 0], w_[w_ >= 0]
        assert gs.unique().numel() == gs.numel(), f"row {s}: repeated picks"
        kth = score[s, ws].min()
        # every pick is selectable and at least the k-th value (within tolerance) ...
        assert (score[s, gs] > float("-inf")).all()
        assert (score[s, gs] >= kth - tol[s, gs]).all(), f"row {s}: a pick below the k-th value"
        # ... and everything the twin picked above the tie band is picked too
        sure = ws[score[s, ws] > kth + tol[s, ws]]
        assert torch.isin(sure, gs).all(), f"row {s}: missed a clear top-k entry"


def candidate_blocks(keep: torch.Tensor, block_size: int, nb: int) -> torch.Tensor:
    """select_candidate_blocks' entry mask [S, T] -> [S, nb] block ids (ascending, -1 padded)."""
    T = keep.shape[1]
    per_block = torch.nn.functional.pad(keep, (0, -T % block_size)).unflatten(-1, (-1, block_size)).any(-1)
    ids = torch.where(per_block, torch.arange(per_block.shape[-1]), per_block.shape[-1] + 1)
    ids = ids.sort(-1).values[:, :nb]
    ids = torch.where(ids <= per_block.shape[-1], ids, -1)
    return torch.nn.functional.pad(ids, (0, nb - ids.shape[-1]), value=-1).to(torch.int32)


# --------------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------------

shapes = st.fixed_dictionaries(
    {
        "S": st.sampled_from([1, 1, 2, 3, 5]),
        "H": st.sampled_from([1, 2, 3, 4, 8, 32]),
        "d": st.sampled_from([32, 64, 64, 128]),
        "T": st.integers(1, 160),
        "visible": st.sampled_from(["random", "all", "none", "causal"]),
        "seed": st.integers(0, 2**31 - 1),
    }
)


# --------------------------------------------------------------------------------------------------
# CPU (interpreter) and twin-path tests
# --------------------------------------------------------------------------------------------------


@needs_interp
@PROPERTY
@given(shapes, st.sampled_from([torch.bfloat16, torch.float32]))
def test_dense_scores_match_twin(p, q_dtype):
    q, kp, ks, w, vis = make_inputs(p["S"], p["H"], p["d"], p["T"], p["seed"], q_dtype=q_dtype, visible=p["visible"])
    got = ix.mqa_index_scores(q, kp, ks, w, vis)
    assert_scores(got, *twin(q, kp, ks, w, vis))


@needs_interp
@PROPERTY
@given(
    shapes,
    st.sampled_from(["fp32", "scaled"]),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 3, None]),
    st.sampled_from([None, False, True]),
)
def test_dense_tilings_and_modes(p, mode, block_t, block_s, programs, queries_stationary):
    """Every tiling, both interpreter-runnable MMA modes, the grouped loops (few programs), and a program a query
    tile over every key tile (queries_stationary; None: the launch's own choice)."""
    q, kp, ks, w, vis = make_inputs(p["S"], p["H"], p["d"], p["T"], p["seed"], visible=p["visible"])
    out = torch.full((p["S"], p["T"]), float("nan"))  # poisoned: every element must be written
    qq, kp2, ks2, w2, vis2 = ix._prep(q, kp, ks, w, vis)
    ix._launch_dense(qq, kp2, ks2, w2, vis2, out, block_t=block_t, block_s=block_s, programs=programs, mode=mode,
                     queries_stationary=queries_stationary)
    assert_scores(out, *twin(q, kp, ks, w, vis))


def test_dense_grid_turns_to_query_tiles_for_a_prefill_chunk():
    """The launch's own choice at the H200's 4 x 132 programs: an 8K chunk's 2048 query tiles (4 queries each) over
    128 key tiles take a program a query tile, every key tile in it; a decode row, or a chunk too short to fill the
    GPU by its query tiles, keeps the key tiles first; a grid past the launch's second dimension too."""
    target = 4 * 132
    assert ix.dense_grid(128, 2048, target) == (1, 2048, 128, 1)
    assert ix.dense_grid(128, 1, target) == (128, 1, 1, 1)  # decode: a key tile a program, the query once
    t_splits, s_splits, _, s_per = ix.dense_grid(128, 256, target)  # a 1K chunk: key tiles lead
    assert s_per > 1 and t_splits * s_splits <= 2 * target
    assert ix.dense_grid(128, 70000, target)[2] < 128  # 70000 query-tile programs do not fit the grid's y


@needs_interp
@pytest.mark.parametrize("queries_stationary", [False, True])
def test_dense_prefill_chunk_both_grids(queries_stationary):
    """A causal chunk of 40 queries over 150 keys (the chunk ends at the last key) in both grids, at the prefill
    tiles: each query sees only the keys up to its position, the rest -inf."""
    S, H, d, T = 40, 8, 64, 150
    q, kp, ks, w, vis = make_inputs(S, H, d, T, 5, visible="causal")
    out = torch.full((S, T), float("nan"))
    qq, kp2, ks2, w2, vis2 = ix._prep(q, kp, ks, w, vis)
    ix._launch_dense(qq, kp2, ks2, w2, vis2, out, block_t=32, block_s=4, programs=4, mode="scaled",
                     queries_stationary=queries_stationary)
    assert_scores(out, *twin(q, kp, ks, w, vis))


@needs_interp
@PROPERTY
@given(
    shapes,
    st.sampled_from([1, 2, 3, 8]),
    st.integers(1, 12),
    st.sampled_from(["fp32", "scaled"]),
    st.sampled_from([16, 64]),
    st.sampled_from([1, 2, None]),
)
def test_pool_scores_match_twin(p, block_size, nb, mode, block_t, programs):
    S, T = p["S"], p["T"]
    q, kp, ks, w, vis = make_inputs(S, p["H"], p["d"], T, p["seed"], visible=p["visible"])
    blocks = random_pool(S, T, block_size, nb, p["seed"] + 1)
    want_pool, mag_pool = in_pool_layout(*twin(q, kp, ks, w, vis), blocks, block_size)
    got = ix.mqa_index_scores_pool(q, kp, ks, w, vis, blocks, block_size)
    assert got.shape == (S, nb * block_size)
    assert_scores(got, want_pool, mag_pool)

    out = torch.full((S, nb * block_size), float("nan"))
    qq, kp2, ks2, w2, vis2 = ix._prep(q, kp, ks, w, vis)
    ix._launch_pool(qq, kp2, ks2, w2, vis2, blocks, block_size, out, block_t=block_t, programs=programs, mode=mode)
    assert_scores(out, want_pool, mag_pool)


@needs_interp
@PROPERTY
@given(shapes, st.sampled_from([1, 4, 16, 64, 200]))
def test_topk_dense_matches_top_entries(p, k):
    q, kp, ks, w, vis = make_inputs(p["S"], p["H"], p["d"], p["T"], p["seed"], visible=p["visible"])
    got = ix.mqa_index_topk(q, kp, ks, w, vis, k)
    score, mag = twin(q, kp, ks, w, vis)
    assert_topk(got, score, k, mag)


@needs_interp
@PROPERTY
@given(shapes, st.sampled_from([1, 2, 3, 8]), st.integers(1, 12), st.sampled_from([1, 4, 16, 64, 200]))
def test_topk_pool_matches_top_entries(p, block_size, nb, k):
    S, T = p["S"], p["T"]
    q, kp, ks, w, vis = make_inputs(S, p["H"], p["d"], T, p["seed"], visible=p["visible"])
    blocks = random_pool(S, T, block_size, nb, p["seed"] + 1)
    got = ix.mqa_index_topk(q, kp, ks, w, vis, k, blocks=blocks, block_size=block_size)
    score, mag = twin(q, kp, ks, w, vis, mask=pool_mask(blocks, block_size, T))
    assert_topk(got, score, k, mag)
    if T:
        assert pool_mask(blocks, block_size, T).gather(1, got.clamp(min=0))[got >= 0].all()


@needs_interp
@PROPERTY
@given(shapes, st.integers(1, 6), st.sampled_from([2, 8]), st.sampled_from([4, 32]))
def test_two_level_topk_like_the_reference(p, topk_blocks, block_size, k):
    """Level one (select_candidate_blocks on the dense kernel's twin) feeds level two (the pool kernel)."""
    S, T = p["S"], p["T"]
    q, kp, ks, w, vis = make_inputs(S, p["H"], p["d"], T, p["seed"], visible="causal")
    score, _ = twin(q, kp, ks, w, vis)
    keep = select_candidate_blocks(score[None], vis, topk_blocks, block_size)[0]
    blocks = candidate_blocks(keep, block_size, topk_blocks)
    q2 = q * 1.5  # a later index layer: its own queries, the same keys
    got = ix.mqa_index_topk(q2, kp, ks, w, vis, k, blocks=blocks, block_size=block_size)
    score2, mag2 = twin(q2, kp, ks, w, vis, mask=keep)
    assert_topk(got, score2, k, mag2)


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), T=st.integers(1, 200), topk_blocks=st.integers(1, 30), block=st.sampled_from([1, 4, 8]),
       ints=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_select_candidate_block_ids_like_the_reference(S, T, topk_blocks, block, ints, seed):
    """Level one with the radix select (or, when every block fits, no selection) keeps the blocks of the stable
    sort's mask, each once: tied block maxima (integer scores), blocks past the visible entries at
    -inf, the newest pinned."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(-2, 3, (S, T), generator=g).float() if ints else torch.randn(S, T, generator=g)
    visible = torch.randint(0, T + 1, (S,), generator=g)
    score = score.masked_fill(torch.arange(T) >= visible[:, None], float("-inf"))
    want = select_candidate_blocks(score[None], visible, topk_blocks, block)[0]
    ids = ix.select_candidate_block_ids(score, visible, topk_blocks, block)
    assert ids.shape == (S, min(-(-T // block), topk_blocks))
    for row in ids.tolist():  # the kept ids: each once, ascending
        kept = [b for b in row if b >= 0]
        assert kept == sorted(set(kept))
    assert torch.equal(ix.candidate_mask(ids, T, block), want)


def test_topk_width_edges():
    """k > T, k > pool width, pool wider than T, T = 0: shapes follow top_entries(score, k)."""
    for T, nb, bs, k in [(5, 3, 4, 8), (40, 2, 4, 16), (40, 8, 8, 3), (0, 2, 8, 4), (9, 1, 8, 9)]:
        q, kp, ks, w, vis = make_inputs(2, 4, 64, T, 7 + T, visible="all")
        score, mag = twin(q, kp, ks, w, vis)
        assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, k), score, k, mag)
        blocks = random_pool(2, T, bs, nb, 3, p_empty=0.0) if T else torch.full((2, nb), -1, dtype=torch.int32)
        score, mag = twin(q, kp, ks, w, vis, mask=pool_mask(blocks, bs, T))
        assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, k, blocks=blocks, block_size=bs), score, k, mag)


def test_interpreter_setup():
    """TRITON_INTERPRET=1 set after triton.language was imported leaves a half-interpreted Triton."""
    if INTERP and triton_importable() and not INTERP_OK:
        pytest.fail("TRITON_INTERPRET=1 was set after triton.language was imported: set it before importing "
                    "dsv4 (tests/conftest.py, first lines) or in the environment")


def test_pool_helpers():
    blocks = torch.tensor([[3, -1, 0]], dtype=torch.int32)
    assert ix.pool_entry_ids(blocks, 2).tolist() == [[6, 7, -1, -1, 0, 1]]
    pos = torch.tensor([[5, 0, 2, 1]])
    assert ix.pool_positions_to_entries(pos, blocks, 2).tolist() == [[1, 6, -1, 7]]


def check_e2m1_codes_and_scales(device: str, mode: str | None = None):
    """All 256 byte values, scales 2^-127 .. 2^113 (e8m0 0 .. 240), against dequantize_mxfp4."""
    T, d = 256, 64
    kp = torch.arange(256, dtype=torch.uint8).view(T, 1).expand(T, d // 2).contiguous()
    e = [0, 1, 20, 100, 126, 127, 128, 140, 200, 240]
    if mode == "scaled":  # dequantize_mxfp4 never writes 0 (scales >= 2^-126); Triton's e8m0 0 is its own
        e = e[1:]
    e = torch.tensor(e, dtype=torch.uint8)
    ks = e[torch.arange(T * 2) % e.numel()].view(T, 2).view(torch.float8_e8m0fnu)
    kp, ks = kp.to(device), ks.to(device)
    keys = dequantize_mxfp4(kp, ks)
    vis = torch.tensor([T], dtype=torch.int32, device=device)
    old = ix.BF16_MODE
    ix.BF16_MODE = mode or old
    try:
        g = torch.Generator().manual_seed(0)
        q_dtype = torch.float32 if mode in (None, "fp32") else torch.bfloat16
        # q ~ 2^-100 keeps the 2^113 rows finite; bf16 q is exact in either dtype
        q = (torch.randn(1, 2, d, generator=g) * 2.0**-100).to(q_dtype).to(device)
        w = torch.ones(1, 2, device=device)
        assert_scores(ix.mqa_index_scores(q, kp, ks, w, vis), *twin(q, kp, ks, w, vis))
        # one-hot queries (one head each) read single elements back, exactly: score[s, t] = relu(+-k[t, s % d])
        q = torch.zeros(2 * d, 1, d)
        q[torch.arange(2 * d), 0, torch.arange(2 * d) % d] = torch.cat((torch.ones(d), -torch.ones(d)))
        q = q.to(q_dtype).to(device)
        w = torch.ones(2 * d, 1, device=device)
        vis = torch.full((2 * d,), T, dtype=torch.int32, device=device)
        got = ix.mqa_index_scores(q, kp, ks, w, vis)
        assert torch.equal(got, torch.cat((keys, -keys), dim=1).relu().T)
    finally:
        ix.BF16_MODE = old


def test_e2m1_every_code_and_extreme_scales():
    check_e2m1_codes_and_scales("cpu")


def test_twin_fallback_path(monkeypatch):
    """Without Triton (use_triton false) the ops compute with the torch twin, same results."""
    monkeypatch.setattr(ix, "use_triton", lambda t: False)
    q, kp, ks, w, vis = make_inputs(3, 4, 64, 50, 11)
    assert_scores(ix.mqa_index_scores(q, kp, ks, w, vis), *twin(q, kp, ks, w, vis))
    blocks = random_pool(3, 50, 8, 4, 12)
    score, mag = twin(q, kp, ks, w, vis, mask=pool_mask(blocks, 8, 50))
    assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, 10, blocks=blocks, block_size=8), score, 10, mag)


def test_twin_pool_decodes_whichever_is_fewer(monkeypatch):
    """The torch twin of the pool scores decodes only the pool's rows when they are fewer than the cache's (a
    decode step over a long cache), else the whole cache: the same scores either way."""
    monkeypatch.setattr(ix, "use_triton", lambda t: False)
    q, kp, ks, w, vis = make_inputs(2, 4, 64, 300, 5)
    for nb in (2, 40):  # 2 x 2 x 8 = 32 pool rows < 300 cache rows; 2 x 40 x 8 = 640 >= 300
        blocks = random_pool(2, 300, 8, nb, 6)
        assert_scores(ix.mqa_index_scores_pool(q, kp, ks, w, vis, blocks, 8),
                      *in_pool_layout(*twin(q, kp, ks, w, vis), blocks, 8))


def test_custom_op_registration():
    """Schemas and fake (meta) kernels: what torch.compile and CUDA graphs rely on."""
    q, kp, ks, w, vis = make_inputs(2, 4, 64, 40, 5)
    ks = ks.view(torch.uint8)  # the schema test multiplies inputs, which e8m0 does not support
    blocks = random_pool(2, 40, 8, 3, 6)
    torch.library.opcheck(torch.ops.dsv4.mqa_index_scores.default, (q, kp, ks, w, vis),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.dsv4.mqa_index_scores_pool.default, (q, kp, ks, w, vis, blocks, 8),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_shapes_are_rejected():
    q, kp, ks, w, vis = make_inputs(2, 4, 64, 40, 5)
    with pytest.raises(ValueError):
        ix.mqa_index_scores(q[..., :48], kp, ks, w, vis)
    with pytest.raises(ValueError):
        ix.mqa_index_scores(q, kp[:, :16], ks, w, vis)
    with pytest.raises(ValueError):
        ix.mqa_index_scores_pool(q, kp, ks, w, vis, torch.zeros(3, 2, dtype=torch.int32), 8)


# --------------------------------------------------------------------------------------------------
# CUDA at realistic shapes (V4.1 decoder: H = 32, d = 128, pool 2048 blocks x 8, top-512)
# --------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [8192, 65536 + 37])
@pytest.mark.parametrize("S", [1, 7, 64])
@pytest.mark.parametrize("mode", ["scaled", "bf16", "fp32"])
def test_gpu_realistic(T, S, mode):
    H, d, k, nb, bs = 32, 128, 512, 2048, 8
    q_dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    q, kp, ks, w, vis = make_inputs(S, H, d, T, T + S, q_dtype=q_dtype, visible="causal", device="cuda")
    score, mag = twin(q, kp, ks, w, vis)
    old = ix.BF16_MODE
    ix.BF16_MODE = mode if mode != "fp32" else old
    try:
        assert_scores(ix.mqa_index_scores(q, kp, ks, w, vis), score, mag)
        assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, k), score, k, mag)
        blocks = random_pool(S, T, bs, nb, T, device="cuda")
        pmask = pool_mask(blocks, bs, T)
        pscore, pmag = twin(q, kp, ks, w, vis, mask=pmask)
        got = ix.mqa_index_scores_pool(q, kp, ks, w, vis, blocks, bs)
        ent = ix.pool_entry_ids(blocks, bs)
        ok = (ent >= 0) & (ent < T)
        idx = torch.where(ok, ent, 0)
        assert_scores(got, torch.where(ok, score.gather(1, idx), float("-inf")), mag.gather(1, idx))
        assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, k, blocks=blocks, block_size=bs), pscore, k, pmag)
    finally:
        ix.BF16_MODE = old


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["scaled", "bf16", "fp32"])
def test_gpu_e2m1_every_code_and_extreme_scales(mode):
    check_e2m1_codes_and_scales("cuda", mode)


GPU_EDGE_SHAPES = [  # S, H, d, T, visible
    (1, 1, 64, 1, "all"),
    (1, 32, 128, 63, "random"),
    (1, 32, 128, 129, "all"),
    (3, 3, 64, 130, "causal"),
    (5, 32, 128, 1000, "none"),
    (2, 8, 32, 77, "random"),
    (9, 32, 128, 700, "causal"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_EDGE_SHAPES)
@pytest.mark.parametrize("mode", ["scaled", "bf16", "fp32"])
def test_gpu_edge_shapes(shape, mode):
    """The CPU property checks' edge cases (partial tiles, H = 1 and odd H, visible = 0, odd S, -1 blocks,
    a partial last block) on the GPU, every MMA mode, dense and pool, scores and top-k."""
    S, H, d, T, visible = shape
    q_dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    q, kp, ks, w, vis = make_inputs(S, H, d, T, T + S, q_dtype=q_dtype, visible=visible, device="cuda")
    old = ix.BF16_MODE
    ix.BF16_MODE = mode if mode != "fp32" else old
    try:
        score, mag = twin(q, kp, ks, w, vis)
        assert_scores(ix.mqa_index_scores(q, kp, ks, w, vis), score, mag)
        assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, 16), score, 16, mag)
        for bs, nb in ((8, 5), (3, 7)):
            blocks = random_pool(S, T, bs, nb, T + bs, device="cuda")
            ent = ix.pool_entry_ids(blocks, bs)
            ok = (ent >= 0) & (ent < T)
            idx = torch.where(ok, ent, 0)
            got = ix.mqa_index_scores_pool(q, kp, ks, w, vis, blocks, bs)
            assert_scores(got, torch.where(ok, score.gather(1, idx), float("-inf")), mag.gather(1, idx))
            pscore, pmag = twin(q, kp, ks, w, vis, mask=pool_mask(blocks, bs, T))
            assert_topk(ix.mqa_index_topk(q, kp, ks, w, vis, 16, blocks=blocks, block_size=bs), pscore, 16, pmag)
    finally:
        ix.BF16_MODE = old


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_decode():
    """The decode path (scores + top-k, dense and pool) captures in a CUDA graph and replays correctly."""
    H, d, T, k, bs, nb = 32, 128, 32768, 512, 8, 2048
    q, kp, ks, w, vis = make_inputs(1, H, d, T, 1, visible="all", device="cuda")
    blocks = random_pool(1, T, bs, nb, 2, device="cuda")
    run = lambda: (ix.mqa_index_topk(q, kp, ks, w, vis, k), ix.mqa_index_topk(q, kp, ks, w, vis, k, blocks, bs))
    eager = run()  # also compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    q.copy_(torch.randn_like(q))
    vis.fill_(T - 5)
    graph.replay()
    torch.cuda.synchronize()
    eager = run()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
