"""dsv4::topk_select / topk_select_pool (dsv4/fast/kernels/topk.py) against `top_entries`, exactly.

The property tests run the kernel on CPU through the Triton interpreter (TRITON_INTERPRET=1 before
triton.language is imported; tests/conftest.py sets it when there is no GPU). Scores are drawn to make ties
common: small integer values (with -0.0 next to 0.0), relu zeros, duplicated threshold values, -inf
entries and whole -inf rows, NaN. Equality is exact: same ids, same order, same -1s. Rows long enough
go through stages (per-chunk top-k, then a top-k of the candidates, itself staged while they are long); the
staged tests force it at small sizes. Rows up to a chunk are bisected in registers, longer ones streamed
through histogram passes; a test forces each search on the same rows. The `gpu` tests run the same
comparisons on CUDA at T = 2064 to 8192 (bisected), 16384 and 262144 (staged), k = 512.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4.fast.kernels.topk as tk
from dsv4.reference.indexer import top_entries

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
INTERP_OK = INTERP and tk.triton is not None and type(tk.tl.zeros).__name__ == "InterpretedFunction"
needs_interp = pytest.mark.skipif(
    not INTERP_OK, reason="CPU kernel tests need TRITON_INTERPRET=1 set before triton is imported"
)


def gpu(test):
    """A GPU test: `-m gpu` selects it, and without CUDA it skips."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEG_INF = float("-inf")


def make_scores(S: int, T: int, kind: str, seed: int, *, neg_inf: float = 0.0, nan: float = 0.0,
                device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ints":  # few distinct values: ties everywhere, -0.0 beside 0.0
        x = torch.randint(-3, 4, (S, T), generator=g).float()
        x = torch.where(torch.rand(S, T, generator=g) < 0.3, torch.full_like(x, -0.0), x)
    elif kind == "relu":  # zeros from relu
        x = torch.randn(S, T, generator=g).relu()
    elif kind == "dups":  # a handful of distinct reals, each repeated many times
        vals = torch.randn(7, generator=g)
        x = vals[torch.randint(0, 7, (S, T), generator=g)]
    elif kind == "neg":  # negative scores only
        x = -torch.rand(S, T, generator=g) - 0.5
    else:  # "randn", incl. some +inf and tiny magnitudes
        x = torch.randn(S, T, generator=g) * torch.exp2(torch.randint(-40, 40, (S, T), generator=g).float())
        x[torch.rand(S, T, generator=g) < 0.01] = float("inf")
    if neg_inf:
        x[torch.rand(S, T, generator=g) < neg_inf] = NEG_INF
    if nan:
        x[torch.rand(S, T, generator=g) < nan] = float("nan")
    if S > 1:
        x[-1] = NEG_INF  # a whole -inf row
    return x.to(device)


KINDS = st.sampled_from(["ints", "relu", "dups", "neg", "randn"])


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), T=st.integers(1, 700), k=st.integers(1, 800), kind=KINDS,
       neg_inf=st.sampled_from([0.0, 0.3, 0.95]), seed=st.integers(0, 2**31 - 1))
def test_topk_select_matches_top_entries(S, T, k, kind, neg_inf, seed):
    x = make_scores(S, T, kind, seed, neg_inf=neg_inf)
    got = tk.topk_select(x, k)
    assert torch.equal(got, top_entries(x, k)), (got, top_entries(x, k))


@needs_interp
def test_topk_select_threshold_ties_and_chunks():
    """T over several interpreter chunks, a threshold value duplicated across chunks, k cutting the tie."""
    T = 3 * tk.INTERP_BLOCK + 77
    x = torch.full((2, T), 1.0)
    x[:, ::5] = 2.0
    x[0, 7::97] = 3.0
    x[1] = -0.0
    x[1, 11::13] = 0.0
    for k in (1, 200, 700, T // 5 + 1, T - 1, T, T + 5):
        assert torch.equal(tk.topk_select(x, k), top_entries(x, k)), k


@needs_interp
def test_topk_select_nan_and_signed_zero():
    x = torch.tensor([[0.0, -0.0, float("nan"), 1.0, -0.0, 0.0, NEG_INF, float("nan"), -1.0, float("inf")]])
    for k in range(1, 12):
        assert torch.equal(tk.topk_select(x, k), top_entries(x, k)), k
    x = make_scores(3, 300, "randn", 5, neg_inf=0.2, nan=0.05)
    for k in (1, 10, 200, 300):
        assert torch.equal(tk.topk_select(x, k), top_entries(x, k)), k


@needs_interp
def test_topk_select_edges():
    x = torch.randn(2, 5)
    assert tk.topk_select(x, 0).shape == (2, 0)
    assert tk.topk_select(torch.empty(0, 9), 3).shape == (0, 3)
    assert tk.topk_select(torch.empty(2, 0), 3).shape == (2, 0)
    assert torch.equal(tk.topk_select(x[:, ::2], 2), top_entries(x[:, ::2], 2))  # strided rows
    assert tk.topk_select(x.double(), 2).dtype == torch.int64


def scatter_pool(scores: torch.Tensor, blocks: torch.Tensor, bs: int, T: int) -> torch.Tensor:
    """Pool-layout scores -> [S, T] entry scores, -inf outside the pool."""
    ent = blocks.long().unsqueeze(-1) * bs + torch.arange(bs)
    ent = torch.where(blocks.long().unsqueeze(-1) >= 0, ent, -1).flatten(-2)
    full = torch.full((scores.shape[0], T + 1), NEG_INF)
    full.scatter_(-1, torch.where(ent >= 0, ent, T), scores)
    return full[:, :T]


def make_pool(S, n_blocks, nb, bs, kind, seed, neg_inf=0.0, drop=0.2):
    g = torch.Generator().manual_seed(seed + 1)
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:nb] for _ in range(S)])
    blocks[torch.rand(S, nb, generator=g) < drop] = -1
    x = make_scores(S, nb * bs, kind, seed, neg_inf=neg_inf)
    return x, blocks.to(torch.int32)


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), nb=st.integers(1, 40), bs=st.sampled_from([1, 3, 8]), k=st.integers(1, 300),
       kind=KINDS, neg_inf=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_topk_select_pool_matches_top_entries(S, nb, bs, k, kind, neg_inf, seed):
    n_blocks = nb + 13
    x, blocks = make_pool(S, n_blocks, nb, bs, kind, seed, neg_inf)
    got = tk.topk_select_pool(x, blocks, bs, k)
    assert torch.equal(got, tk.twin_topk_select_pool(x, blocks, bs, k))
    # the twin of the whole computation: top_entries over entry ids, then the -1 padding differs only in width
    want = top_entries(scatter_pool(x, blocks, bs, n_blocks * bs), k)
    n_valid = int((got >= 0).sum(-1).max()) if got.numel() else 0
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    if n_valid:
        assert torch.equal(got[:, -n_valid:], want[:, -n_valid:])


@needs_interp
def test_topk_select_pool_cut_tie_uses_entry_ids():
    """Every score equal: the picks must be the lowest entry ids, although the pool lists blocks descending."""
    bs, nb = 8, 64
    blocks = torch.arange(nb - 1, -1, -1, dtype=torch.int32).view(1, nb) * 3 + 1000  # ids up to ~1.5K
    x = torch.zeros(1, nb * bs)
    x[0, 5::7] = 1.0
    for k in (1, 30, 100, 300, nb * bs):
        got = tk.topk_select_pool(x, blocks, bs, k)
        assert torch.equal(got, tk.twin_topk_select_pool(x, blocks, bs, k)), k
        want = top_entries(scatter_pool(x, blocks, bs, (3 * nb + 1000) * bs), k)
        assert torch.equal(got, want), k


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), nb=st.integers(1, 40), bs=st.sampled_from([1, 3, 8]), k=st.integers(1, 300),
       pooled=st.booleans(), kind=KINDS, neg_inf=st.sampled_from([0.0, 0.5]), nan=st.sampled_from([0.0, 0.05]),
       seed=st.integers(0, 2**31 - 1))
def test_streamed_and_resident_searches_pick_the_same(S, nb, bs, k, pooled, kind, neg_inf, nan, seed):
    """The two threshold searches, forced: histogram passes over 32-column chunks, and the bisection of the
    row held in registers. Both give the twin's picks (rows up to a chunk take the bisection by default)."""
    x, blocks = make_pool(S, nb + 13, nb, bs, kind, seed, neg_inf)
    if nan:
        x[torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < nan] = float("nan")
    K = min(k, x.shape[1])
    want = tk.twin_topk_select_pool(x, blocks, bs, k) if pooled else top_entries(x, k)
    table = blocks if pooled else None
    assert torch.equal(tk._launch(x, K, not pooled, table, bs, block=32, resident=False), want)
    assert torch.equal(tk._launch(x, K, not pooled, table, bs, resident=True), want)


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), T=st.integers(1, 300), k=st.integers(1, 40), chunk=st.sampled_from([16, 32, 64]),
       kind=KINDS, neg_inf=st.sampled_from([0.0, 0.3, 0.95]), nan=st.sampled_from([0.0, 0.05]),
       seed=st.integers(0, 2**31 - 1))
def test_two_stage_select_matches_top_entries(S, T, k, chunk, kind, neg_inf, nan, seed):
    """Long rows go through per-chunk top-k then a top-k of the candidates: the same picks, ties and -1s."""
    x = make_scores(S, T, kind, seed, neg_inf=neg_inf, nan=nan)
    K = min(k, T)
    assert torch.equal(tk._select(x, None, 1, K, chunk=chunk), top_entries(x, k))


@needs_interp
def test_long_dense_candidates_are_selected_in_stages_again(monkeypatch):
    """With chunks of 16, 300 columns and k = 4 take four launches (300 -> 76 -> 20 -> 8 candidates -> the
    picks: three stages of 16-column parts, then one program a row), and the picks are top_entries'."""
    x = make_scores(2, 300, "ints", 7, neg_inf=0.3, nan=0.05)
    launches = []
    real = tk._launch
    monkeypatch.setattr(tk, "_launch",
                        lambda s, *a, **kw: launches.append((s.shape[1], kw.get("part"))) or real(s, *a, **kw))
    assert torch.equal(tk._select(x, None, 1, 4, chunk=16), top_entries(x, 4))
    assert launches == [(300, 16), (76, 16), (20, 16), (8, None)]


def test_few_long_rows_take_small_chunks():
    """Balanced chunks (about sqrt(T k)) unless the first stage would run under FILL_PROGRAMS programs."""
    assert tk.first_stage_chunk(262144, 512) == 16384
    assert tk.first_stage_chunk(262144, 512, rows=2048) == 16384
    assert tk.first_stage_chunk(262144, 512, rows=1) == tk.STAGE_MIN_CHUNK
    assert tk.first_stage_chunk(8192, 512, rows=1) is None  # one program holds the row
    assert tk.first_stage_chunk(16384, 512, 8) == 4096  # pool rows: whole blocks, no rows given


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), nb=st.integers(1, 40), bs=st.sampled_from([1, 4, 8]), k=st.integers(1, 40),
       chunks=st.integers(1, 4), kind=KINDS, neg_inf=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_two_stage_select_pool_matches_twin(S, nb, bs, k, chunks, kind, neg_inf, seed):
    x, blocks = make_pool(S, nb + 13, nb, bs, kind, seed, neg_inf)
    K = min(k, x.shape[1])
    chunk = chunks * 16 * bs  # whole blocks per chunk
    assert torch.equal(tk._select(x, blocks, bs, K, chunk=chunk), tk.twin_topk_select_pool(x, blocks, bs, k))


def ascending_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Each row's block ids in ascending order where they were, its -1s left in place."""
    out = blocks.clone()
    for row, b in zip(out, blocks):
        row[b >= 0] = b[b >= 0].sort().values
    return out


@needs_interp
@PROPERTY
@given(S=st.integers(1, 3), nb=st.integers(1, 40), bs=st.sampled_from([1, 3, 8]), k=st.integers(1, 300),
       chunks=st.sampled_from([0, 1, 3]), kind=KINDS, neg_inf=st.sampled_from([0.0, 0.5]),
       nan=st.sampled_from([0.0, 0.05]), seed=st.integers(0, 2**31 - 1))
def test_ascending_pool_is_selected_as_a_dense_row(S, nb, bs, k, chunks, kind, neg_inf, nan, seed):
    """A pool whose blocks ascend along each row (as select_candidate_block_ids gives them; -1s anywhere) selected
    as a dense row, without the cut tie's id search and the sort: the twin's picks, in one pass and in stages."""
    x, blocks = make_pool(S, nb + 13, nb, bs, kind, seed, neg_inf)
    blocks = ascending_blocks(blocks)
    if nan:
        x[torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < nan] = float("nan")
    want = tk.twin_topk_select_pool(x, blocks, bs, k)
    assert torch.equal(tk.topk_select_pool(x, blocks, bs, k, ascending=True), want)
    if chunks:
        assert torch.equal(tk._select(x, blocks, bs, min(k, x.shape[1]), chunk=chunks * 16 * bs, ascending=True), want)


@needs_interp
def test_ascending_pool_takes_the_dense_launch(monkeypatch):
    launches = []
    real = tk._launch
    monkeypatch.setattr(tk, "_launch", lambda s, K, dense, *a, **kw: launches.append(dense) or real(s, K, dense, *a, **kw))
    x, blocks = make_pool(1, 40, 30, 8, "dups", 5)
    blocks = ascending_blocks(blocks)
    assert torch.equal(tk.topk_select_pool(x, blocks, 8, 50, ascending=True), tk.twin_topk_select_pool(x, blocks, 8, 50))
    assert launches == [True]


def test_topk_select_pool_opcheck():
    x, blocks = make_pool(2, 20, 7, 8, "ints", 3)
    for ascending in (False, True):
        torch.library.opcheck(torch.ops.dsv4.topk_select_pool.default, (x, ascending_blocks(blocks), 8, 16, ascending),
                              test_utils=("test_schema", "test_faketensor"))


def _gpu_check(T: int, k: int, S: int, kind: str, neg_inf: float = 0.0):
    x = make_scores(S, T, kind, T + S, neg_inf=neg_inf, device="cuda")
    want = top_entries(x.cpu(), k)
    assert torch.equal(tk.topk_select(x, k).cpu(), want)


@gpu
@pytest.mark.parametrize("T", [2064, 4096, 8192, 16384, 262144])
@pytest.mark.parametrize("kind", ["randn", "relu", "ints", "dups"])
def test_gpu_topk_select(T, kind):
    _gpu_check(T, 512, 1, kind)
    _gpu_check(T, 512, 4, kind, neg_inf=0.5)


@gpu
@pytest.mark.parametrize("ascending", [False, True])
@pytest.mark.parametrize("kind", ["randn", "relu", "ints"])
def test_gpu_topk_select_pool(kind, ascending):
    S, nb, bs, k = 2, 2048, 8, 512
    x, blocks = make_pool(S, 16384, nb, bs, kind, 3, neg_inf=0.1, drop=0.05)
    blocks = ascending_blocks(blocks) if ascending else blocks
    got = tk.topk_select_pool(x.cuda(), blocks.cuda(), bs, k, ascending=ascending).cpu()
    assert torch.equal(got, tk.twin_topk_select_pool(x, blocks, bs, k))


@gpu
def test_gpu_topk_select_graph(graph_replay):
    x = make_scores(1, 16384, "randn", 0, device="cuda")
    want = tk.topk_select(x, 512)
    assert torch.equal(graph_replay(tk.topk_select, x, 512), want)
