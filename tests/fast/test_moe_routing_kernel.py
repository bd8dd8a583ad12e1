"""dsv4::route_topk and dsv4::gate_route against their twins (dsv4.reference.moe route / router_scores).

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before the kernel
module is imported); the `gpu` tests run them compiled, at V4.1's E = 384 too.

Comparison: the chosen expert sets are equal exactly; weights, matched per expert id, agree within 1e-6
relative (5e-6 for gate_route, whose logits are summed in another order). The fused op returns ids by
descending biased score; that order is checked against a stable sort of the twin's biased scores.
Inputs keep a gap between consecutive biased scores (no near-ties), so the selection is well defined.
"""

from __future__ import annotations

import pytest
import torch

# tests/conftest.py chooses the Triton interpreter (no GPU) before any triton import
pytest.importorskip("triton")

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.fast.kernels import moe_routing as R
from dsv4.fast.kernels.moe_experts import activation_planes
from dsv4.reference.linear import rms_norm
from dsv4.reference.moe import router_scores

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def examples(n: int) -> int:
    """n hypothesis examples, fewer when the loaded profile (CI's) asks for fewer."""
    return min(n, settings.default.max_examples)


def separated(scores, sel, topk, floor=0.0):
    """Rows whose top-(k + 1) biased scores are apart by more than 1e-5 of the scores involved, plus
    `floor` (the two sides compute a score to ~1e-7 relative, so no choice can flip; gate_route's logits
    are summed in another order, hence a floor there)."""
    top, order = sel.topk(min(topk + 1, sel.shape[-1]), dim=-1)
    mag = scores.gather(-1, order).abs()
    return ((top[:, :-1] - top[:, 1:]) > 1e-5 * torch.maximum(mag[:, :-1], mag[:, 1:]) + floor).all(dim=-1)


def separated_logits(N, E, temp, score_func, bias, seed, topk=6):
    """Logits with no near-ties among any row's top-(k + 1) biased scores: rows with a near-tie are
    redrawn on their own (softmax scores couple a row's entries, so rows are checked whole)."""
    g = torch.Generator().manual_seed(seed)
    spread = 1.0 if score_func == "sigmoid" else 3.0  # sigmoid saturates: wide logits crowd its top at 1
    logits = torch.randn(N, E, generator=g) * spread
    for _ in range(50):
        scores = router_scores(logits / temp, score_func)
        bad = ~separated(scores, scores + (bias if bias is not None else 0), topk)
        if not bad.any():
            return logits
        logits[bad] = torch.randn(int(bad.sum()), E, generator=g) * spread
    raise AssertionError("could not draw separated logits")


def check_route(out, ref, sel, topk, rel=1e-6, hashed=False):
    w, ids = out
    rw, rids = ref
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == rw.shape and ids.shape == rids.shape
    if hashed:
        assert torch.equal(ids, rids)
    else:
        assert torch.equal(ids.sort(dim=-1).values, rids.sort(dim=-1).values)
        order = sel.gather(-1, ids)
        assert (order[:, :-1] > order[:, 1:]).all(), "ids are not by descending biased score"
    # weights matched per id: sort both by id
    w_by_id = w.gather(-1, ids.sort(dim=-1).indices)
    rw_by_id = rw.gather(-1, rids.sort(dim=-1).indices)
    err = (w_by_id.double() - rw_by_id.double()).abs()
    assert (err <= rel * rw_by_id.double().abs() + 1e-30).all(), f"max rel {(err / rw_by_id.abs()).max():.3g}"


@settings(deadline=None, max_examples=examples(40))
@given(
    N=st.integers(1, 40),
    E=st.sampled_from([8, 24, 64, 256, 384]),
    topk=st.sampled_from([1, 2, 6]),
    score_func=st.sampled_from(["sqrtsoftplus", "sqrtsoftplus", "sigmoid", "softmax"]),
    with_bias=st.booleans(),
    normalize=st.booleans(),
    temp=st.sampled_from([1.0, 0.7, 1.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_route_topk_matches_twin(N, E, topk, score_func, with_bias, normalize, temp, seed):
    g = torch.Generator().manual_seed(seed + 1)
    bias = torch.randn(E, generator=g) * 0.05 if with_bias else None
    logits = separated_logits(N, E, temp, score_func, bias, seed, topk)
    out = R.route_topk(logits, bias, None, topk, temp, 1.5, normalize, score_func)
    ref = R.route_topk_twin(logits, bias, None, topk, temp, 1.5, normalize, score_func)
    sel = router_scores(logits / temp, score_func) + (bias if bias is not None else 0)
    check_route(out, ref, sel, topk)


@settings(deadline=None, max_examples=examples(20))
@given(
    N=st.integers(1, 40),
    E=st.sampled_from([24, 256, 384]),
    score_func=st.sampled_from(["sqrtsoftplus", "sigmoid", "softmax"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_route_topk_hashed_matches_twin(N, E, score_func, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) * 3
    hashed = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(N)])  # V4 tid2eid rows
    out = R.route_topk(logits, None, hashed, 6, 1.0, 1.5, True, score_func)
    ref = R.route_topk_twin(logits, None, hashed, 6, 1.0, 1.5, True, score_func)
    check_route(out, ref, None, 6, hashed=True)


def test_route_topk_edges():
    # N = 1; E not a power of two; big logits through softplus's threshold (x > 20 is x itself)
    logits = torch.tensor([[30.0, -25.0, 21.0, 19.5, 0.3, -3.0, 5.0, 40.0, -60.0, 2.0, 1.0, 0.0]])
    for k in (1, 6, 12):
        out = R.route_topk(logits, None, None, k, 1.0, 2.5, True, "sqrtsoftplus")
        ref = R.route_topk_twin(logits, None, None, k, 1.0, 2.5, True, "sqrtsoftplus")
        check_route(out, ref, router_scores(logits, "sqrtsoftplus"), k)
    # N = 0
    w, ids = R.route_topk(torch.empty(0, 24), None, None, 6, 1.0, 1.5, True, "sqrtsoftplus")
    assert w.shape == (0, 6) and ids.shape == (0, 6)
    # bias steers the choice but not the weights
    logits = torch.linspace(-2, 2, 24)[None]
    bias = torch.zeros(24)
    bias[:6] = 10.0
    w, ids = R.route_topk(logits, bias, None, 6, 1.0, 1.0, False, "sqrtsoftplus")
    assert torch.equal(ids.sort().values, torch.arange(6)[None])
    torch.testing.assert_close(w, router_scores(logits, "sqrtsoftplus")[:, :6].flip(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("combine", [True, False])
def test_route_ties_go_to_the_lower_expert_id(combine):
    """Equal biased scores are taken lowest id first (the module's order; the twin's topk leaves ties open), by
    either form of a top-k round (one reduction of triples, as on the GPU, or three vectorized ones)."""
    bias = torch.zeros(24)
    bias[[3, 7, 11]] = 1.0
    bias[[5, 9, 13, 17]] = 0.5
    for logits, b, want in ((torch.zeros(2, 24), bias, [3, 7, 11, 5, 9, 13]),
                            (torch.full((1, 24), 0.25), None, [0, 1, 2, 3, 4, 5])):
        w, ids = R.route_topk_triton(logits, b, None, 6, 1.0, 1.0, True, "sqrtsoftplus", cfg={"combine": combine})
        assert torch.equal(ids, torch.tensor([want] * logits.shape[0]))
        assert torch.equal(w, torch.full_like(w, w[0, 0].item())), "tied experts weigh the same"


def test_both_round_forms_route_alike():
    """The GPU's one-reduction round and the interpreter's three-reduction round: the same ids and weights, bit
    for bit, on random logits with and without a bias (ties included: logits rounded to a coarse grid)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 40, generator=g) * 4).round() / 4
    for bias in (None, (torch.randn(40, generator=g) * 2).round() / 4):
        forms = [R.route_topk_triton(logits, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus", cfg={"combine": c})
                 for c in (True, False)]
        assert all(torch.equal(a, b) for a, b in zip(*forms))


@settings(deadline=None, max_examples=examples(15))
@given(
    N=st.integers(1, 40),
    E=st.sampled_from([24, 384]),
    D=st.sampled_from([64, 96, 200]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    hashed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gate_route_matches_twin(N, E, D, dtype, hashed, seed):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(E, D, generator=g) / D**0.5).to(dtype)
    x = (torch.randn(N, D, generator=g) * 3).to(dtype)
    bias = None if hashed else torch.randn(E, generator=g) * 0.05
    ids_in = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(N)]) if hashed else None
    logits = torch.nn.functional.linear(x.float(), weight.float())
    scores = router_scores(logits / 0.8, "sqrtsoftplus")
    sel = scores + (bias if bias is not None else 0)
    if not hashed and not separated(scores, sel, 6, floor=1e-5).all():
        return  # a near-tie: either choice is right
    out = R.gate_route(x, weight, bias, ids_in, 6, 0.8, 1.5, True, "sqrtsoftplus")
    ref = R.gate_route_twin(x, weight, bias, ids_in, 6, 0.8, 1.5, True, "sqrtsoftplus")
    check_route(out, ref, sel, 6, rel=5e-6, hashed=hashed)


def test_gate_route_split_configs_agree():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(21, 256, generator=g).bfloat16(), (torch.randn(40, 256, generator=g) / 16).bfloat16()
    bias = torch.randn(40, generator=g) * 0.05
    ref = R.gate_route_twin(x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus")
    sel = router_scores(torch.nn.functional.linear(x.float(), weight.float()), "sqrtsoftplus") + bias
    for cfg in ({"BK": 32, "split": 1}, {"BK": 32, "split": 8}, {"BK": 32, "split": 3, "route": {"SB": 2}},
                {"BE": 16, "BK": 64, "split": 3}, {"BM": 16}):
        out = R.gate_route_triton(x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus", cfg=cfg)
        check_route(out, ref, sel, 6, rel=5e-6)


@given(N=st.one_of(st.integers(0, 16), st.integers(17, 20000)), E=st.integers(1, 1024), D=st.integers(1, 16384),
       elt=st.sampled_from([2, 4]), target=st.integers(1, 1024))
def test_gate_config_splits_cover_k_once(N, E, D, elt, target):
    """The gate GEMM's K splits: every K step in exactly one split (split s takes steps s * per .. s * per + per - 1,
    the last cut at D), none empty (an empty one would still count itself in), at most DECODE_SPLITS in decode."""
    _, _, BK, split, per = R.gate_config(N, E, D, elt, target)
    steps = -(-D // BK)
    assert split >= 1 and per >= 1
    assert (split - 1) * per < steps <= split * per
    if N <= 16:
        assert split <= R.DECODE_SPLITS


@settings(deadline=None, max_examples=examples(8))
@given(N=st.integers(1, 8), E=st.sampled_from([24, 384]), hashed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_gemms_last_program_routes_as_the_routing_kernel(N, E, hashed, seed):
    """With a count (the decode step's), up to 8 rows are routed by the gate GEMM's last program: the weights and
    ids of the two launches, bit for bit (the same partials summed in the same order), and the count back at 0."""
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(N, 96, generator=g).bfloat16(), (torch.randn(E, 96, generator=g) / 10).bfloat16()
    bias = None if hashed else torch.randn(E, generator=g) * 0.05
    ids_in = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(N)]) if hashed else None
    assert R.fused_route_rows(N, E, 16) == 1 << (N - 1).bit_length()
    count = torch.zeros(1, dtype=torch.int32)
    args = (x, weight, bias, ids_in, 6, 0.8, 1.5, True, "sqrtsoftplus")
    for _ in range(2):  # the count set back for the next call
        for a, b in zip(R.gate_route(*args, count), R.gate_route(*args), strict=True):
            assert torch.equal(a, b)
        assert count.item() == 0


def test_the_gemm_routes_few_rows_of_few_experts_only(monkeypatch):
    """The GEMM's last program routes one row block of the routing kernel's (at most 8 rows of up to 512 experts),
    within the GEMM's one row block; else the routing keeps its launch."""
    assert [R.fused_route_rows(N, 384, 16) for N in (0, 1, 2, 3, 8, 9)] == [0, 1, 2, 4, 8, 0]
    assert R.fused_route_rows(4, 1024, 16) == 0 and R.fused_route_rows(8, 384, 4) == 0
    launches, kernel = [], R._route_kernel

    class Recording:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(R, "_route_kernel", Recording())
    count, weight = torch.zeros(1, dtype=torch.int32), torch.randn(384, 64).bfloat16()
    for N in (8, 9):
        R.gate_route(torch.randn(N, 64).bfloat16(), weight, None, None, 6, 1.0, 1.5, True, "sqrtsoftplus", count)
    assert len(launches) == 1  # the 9 rows'


@pytest.mark.parametrize("kernels", [True, False])
def test_no_rows_route_to_no_rows(monkeypatch, kernels):
    """An empty batch through the gate and the router: the Triton path (with and without the GEMM's count) and
    the twin alike give [0, k] weights and ids."""
    if not kernels:
        monkeypatch.setattr(R, "use_triton", lambda t: False)
    x, weight = torch.empty(0, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    for count in (None, torch.zeros(1, dtype=torch.int32)):
        w, ids = R.gate_route(x, weight, None, None, 6, 1.0, 1.5, True, "sqrtsoftplus", count)
        assert w.shape == (0, 6) and w.dtype == torch.float32 and ids.shape == (0, 6) and ids.dtype == torch.int64
    w, ids = R.route_topk(torch.empty(0, 24), None, None, 6, 1.0, 1.5, True, "sigmoid")
    assert w.shape == (0, 6) and ids.shape == (0, 6)


def test_a_misshapen_count_is_refused():
    x, weight = torch.randn(2, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    for count in (torch.zeros(1), torch.zeros(2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="gate_route: count must be one int32"):
            R.gate_route(x, weight, None, None, 6, 1.0, 1.5, True, "sqrtsoftplus", count)


def test_fallback_is_the_twin(monkeypatch):
    monkeypatch.setattr(R, "use_triton", lambda t: False)
    logits, bias = torch.randn(4, 24), torch.randn(24)
    hashed = torch.randint(0, 24, (4, 6))
    for bias_, hashed_ in ((bias, None), (None, hashed)):
        for a, b in zip(R.route_topk(logits, bias_, hashed_, 6, 1.0, 1.5, True, "sqrtsoftplus"),
                        R.route_topk_twin(logits, bias_, hashed_, 6, 1.0, 1.5, True, "sqrtsoftplus")):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    x, weight = torch.randn(4, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    for a, b in zip(R.gate_route(x, weight, None, hashed, 6, 1.0, 1.5, True, "sqrtsoftplus"),
                    R.gate_route_twin(x, weight, None, hashed, 6, 1.0, 1.5, True, "sqrtsoftplus")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def normed_by_squares(x: torch.Tensor, squares: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x, norm_weight, eps) with x's sum of squares given as partial sums squares [N, S]."""
    r = torch.rsqrt(squares.float().sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (norm_weight.float() * (x.float() * r)).to(x.dtype)


def normed_case(N: int, D: int, dtype, hashed: bool, seed: int):
    """gate_route_normed's arguments: rows x, their squares in four d steps, a norm weight, a gate of 384 experts."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, D, generator=g) * 3).to(dtype)
    squares = x.float().square().view(N, 4, D // 4).sum(-1)
    norm_weight = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    weight = (torch.randn(384, D, generator=g) / D**0.5).to(dtype)
    bias = None if hashed else torch.randn(384, generator=g) * 0.05
    ids_in = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(N)]) if hashed else None
    return (x, squares, norm_weight, 1e-6), (weight, bias, ids_in, 6, 0.8, 1.5, True, "sqrtsoftplus")


@settings(deadline=None, max_examples=examples(8))
@given(N=st.integers(1, 9), D=st.sampled_from([64, 96, 200]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       hashed=st.booleans(), counted=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gate_route_normed_is_gate_route_of_its_normed_rows(N, D, dtype, hashed, counted, seed):
    """The gate GEMM normalizing x as it loads it routes as gate_route of the rows it stores, bit for bit (the same
    values through the same sums), stores their planes as `activation_planes` lays them out, and those rows are
    rms_norm(x)'s, as computed from the given squares (`normed_by_squares`), to the squares' summation order: one
    step of bf16, or in fp32 the classical bound of a sum of D positive terms in another order (D / 2 + 3 rounding
    errors)."""
    normed, gate = normed_case(N, D, dtype, hashed, seed)
    count = (torch.zeros(1, dtype=torch.int32),) if counted else ()
    w, ids, xn, planes = R.gate_route_normed(*normed, *gate, *count)
    want_w, want_ids = R.gate_route(xn, *gate, *count)
    assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    assert torch.equal(planes, activation_planes(xn))
    assert xn.dtype == dtype
    for want in (normed_by_squares(*normed), rms_norm(normed[0], *normed[2:])):
        ulp = torch.finfo(dtype).eps * want.float().abs() * (1 if dtype == torch.bfloat16 else D / 2 + 3)
        assert xn.shape == want.shape and ((xn.float() - want.float()).abs() <= ulp).all()


def test_gate_route_normed_refuses_misshapen_inputs():
    (x, squares, nw, eps), gate = normed_case(2, 64, torch.bfloat16, False, 0)
    with pytest.raises(ValueError, match="squares \\[N, S\\]"):
        R.gate_route_normed(x, squares[:1], nw, eps, *gate)
    with pytest.raises(ValueError, match="one dtype"):
        R.gate_route_normed(x.float(), squares, nw, eps, *gate)
    with pytest.raises(ValueError, match="gate_route_normed: count must be one int32"):
        R.gate_route_normed(x, squares, nw, eps, *gate, torch.zeros(1))


def test_opcheck():
    logits, bias = torch.randn(5, 24), torch.randn(24)
    hashed = torch.randint(0, 24, (5, 6))
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.dsv4.route_topk, (logits, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus"),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.route_topk, (logits, None, hashed, 6, 1.0, 1.5, True, "sigmoid"),
                          test_utils=tests)
    x, weight = torch.randn(5, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    torch.library.opcheck(torch.ops.dsv4.gate_route, (x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus"),
                          test_utils=tests)
    count = torch.zeros(1, dtype=torch.int32)
    torch.library.opcheck(torch.ops.dsv4.gate_route,
                          (x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus", count), test_utils=tests)
    normed, gate = normed_case(2, 64, torch.bfloat16, False, 1)
    torch.library.opcheck(torch.ops.dsv4.gate_route_normed, (*normed, *gate, count), test_utils=tests)


# ------------------------------------------------------------------------------------------------
# GPU: the compiled kernels (libdevice expf/log1pf, as torch's CUDA softplus calls them)


@gpu
@needs_cuda
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("N,E", [(1, 384), (16, 384), (256, 384), (1000, 256), (7, 24)])
def test_route_topk_gpu(N, E, score_func):
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.05
    logits = separated_logits(N, E, 1.0, score_func, bias, N + E)
    out = R.route_topk(logits.cuda(), bias.cuda(), None, 6, 1.0, 1.5, True, score_func)
    ref = R.route_topk_twin(logits, bias, None, 6, 1.0, 1.5, True, score_func)
    sel = router_scores(logits, score_func) + bias
    check_route(tuple(t.cpu() for t in out), ref, sel, 6)
    # against torch's CUDA ops too (same libdevice calls): the same ids
    ref_cuda = R.route_topk_twin(logits.cuda(), bias.cuda(), None, 6, 1.0, 1.5, True, score_func)
    check_route(tuple(t.cpu() for t in out), tuple(t.cpu() for t in ref_cuda), sel, 6)


@gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 16, 128, 300])
def test_gate_route_gpu(N):
    g = torch.Generator().manual_seed(N)
    D, E = 5120, 384
    x = (torch.randn(N, D, generator=g)).bfloat16()
    weight = (torch.randn(E, D, generator=g) / D**0.5).bfloat16()
    bias = torch.randn(E, generator=g) * 0.05
    logits = torch.nn.functional.linear(x.float(), weight.float())
    scores = router_scores(logits, "sqrtsoftplus")
    sel = scores + bias
    keep = separated(scores, sel, 6, floor=1e-5)  # drop rows with near-ties
    out = R.gate_route(x.cuda(), weight.cuda(), bias.cuda(), None, 6, 1.0, 1.5, True, "sqrtsoftplus")
    ref = R.gate_route_twin(x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus")
    check_route(tuple(t.cpu()[keep] for t in out), tuple(t[keep] for t in ref), sel[keep], 6, rel=5e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 4, 8])
def test_gate_route_by_the_gemms_last_program_gpu(N):
    """The decode step's count on the GPU (the atomic count's release and acquire, the L2 loads of the partials):
    the twin's routing, eager and replayed from a CUDA graph three times on new rows (the count back at 0 after
    each), the ids and weights of the two launches (bit for bit at one row, where both sum the partials alike)."""
    g = torch.Generator().manual_seed(N)
    D, E = 5120, 384
    weight = (torch.randn(E, D, generator=g) / D**0.5).bfloat16().cuda()
    bias = (torch.randn(E, generator=g) * 0.05).cuda()
    x = torch.randn(N, D, generator=g).bfloat16().cuda()
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def route(*counted):
        return R.gate_route(x, weight, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus", *counted)

    route(count)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = route(count)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=g.manual_seed(seed)))
        graph.replay()
        want = route()
        sel = router_scores(torch.nn.functional.linear(x.float(), weight.float()), "sqrtsoftplus") + bias
        keep = separated(sel - bias, sel, 6, floor=1e-5).cpu()
        check_route(tuple(t.cpu()[keep] for t in got), tuple(t.cpu()[keep] for t in want), sel.cpu()[keep], 6,
                    rel=5e-6)
        if N == 1:
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert count.item() == 0


@gpu
@needs_cuda
def test_gate_route_normed_gpu():
    """The decode step's gate at V4.1's widths (D 5120, 384 experts, one row, x's squares in 80 d steps, the
    count): gate_route of the rows it normalized, bit for bit, their planes, one bf16 step from rms_norm at most;
    eager and replayed from a CUDA graph on new rows."""
    normed, gate = normed_case(1, 5120, torch.bfloat16, False, 5)
    x, squares, nw, eps = (t.cuda() if isinstance(t, torch.Tensor) else t for t in normed)
    gate = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in gate)
    squares = x.float().square().view(1, 80, 64).sum(-1)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    run = lambda: R.gate_route_normed(x, squares, nw, eps, *gate, count)
    run()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).bfloat16() * 3)
        squares.copy_(x.float().square().view(1, 80, 64).sum(-1))
        eager = run()
        graph.replay()
        for w, ids, xn, planes in (eager, got):
            want_w, want_ids = R.gate_route(xn, *gate, count)
            assert torch.equal(w, want_w) and torch.equal(ids, want_ids) and count.item() == 0
            assert torch.equal(planes, activation_planes(xn))
            want = rms_norm(x, nw, eps).float()
            assert ((xn.float() - want).abs() <= torch.finfo(torch.bfloat16).eps * want.abs()).all()


@gpu
@needs_cuda
def test_routing_compiles_and_captures(graph_replay):
    logits, bias = torch.randn(64, 384, device="cuda"), torch.randn(384, device="cuda") * 0.05

    def fn(logits):
        return torch.ops.dsv4.route_topk(logits, bias, None, 6, 1.0, 1.5, True, "sqrtsoftplus")

    want = fn(logits)
    got = torch.compile(fn, fullgraph=True)(logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(graph_replay(fn, logits), want))
