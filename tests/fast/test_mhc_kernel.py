"""dsv4::mhc_pre and dsv4::mhc_post against their twins (dsv4.reference.mhc), and the decode pairs (V4.1's
dsv4::mhc_pre_partial + dsv4::mhc_post_finish / mhc_post_partial, V4's dsv4::mhc_post_sums + dsv4::mhc_pre_finish)
against mhc_pre's and mhc_post's twins.

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before the kernel
module is imported); the `gpu` tests run them compiled, at the real width too.

Tolerances:
- fp32 outputs (x for fp32 h; pre, post and comb always, since their math is fp32 from either h dtype):
  |out - ref| <= 1e-5 |ref| + 1e-5 max|ref| (relative 1e-5, with an absolute floor at 1e-5 of the
  tensor's scale for entries near zero).
- bf16 outputs (x for bf16 h, mhc_post for bf16 f): at most 1 bf16 ulp of the reference value, plus
  1e-5 max|ref| (both sides round fp32 sums that agree to ~1e-7 of their terms; the rounding can land on
  either neighbour, and where the terms cancel to near zero the fp32 difference is many small ulps).
"""

from __future__ import annotations

import itertools

import pytest
import torch

# tests/conftest.py chooses the Triton interpreter (no GPU) before any triton import
pytest.importorskip("triton")

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.fast.kernels import mhc as K
from dsv4.fast.kernels.fp8_gemv import fp8_gemv
from dsv4.fast.kernels.moe_routing import gate_route_normed
from dsv4.quant import quantize_fp8

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def examples(n: int) -> int:
    """n hypothesis examples, fewer when the loaded profile (CI's) asks for fewer."""
    return min(n, settings.default.max_examples)


def make_inputs(N, hc, D, dtype, with_collapse, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    M = (2 + hc) * hc
    h = torch.randn(N, hc, D, generator=g).to(dtype)
    fn = torch.randn(M, hc * D, generator=g) / (hc * D) ** 0.5 * 4
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(M, generator=g) * 0.5
    pre_prev = torch.rand(N, hc, generator=g) + 1e-6 if with_collapse else None
    out = (h, fn, scale, base, pre_prev)
    return tuple(t.to(device) if t is not None else None for t in out)


def assert_fp32_close(out, ref, what=""):
    out, ref = out.double(), ref.double()
    tol = 1e-5 * ref.abs() + 1e-5 * ref.abs().max().clamp_min(1e-30)
    err = (out - ref).abs()
    assert not torch.isnan(out).any(), what
    assert (err <= tol).all(), f"{what}: max err {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    mag = ref.float().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_bf16_within_ulp(out, ref, what=""):
    assert out.dtype == torch.bfloat16 and ref.dtype == torch.bfloat16
    err = (out.float() - ref.float()).abs()
    tol = bf16_ulp(ref) + 1e-5 * ref.float().abs().max()
    assert (err <= tol).all(), f"{what}: {(err / bf16_ulp(ref)).max().item():.3g} ulp"


def check_pre(out, ref, dtype):
    x, pre, post, comb = out
    rx, rpre, rpost, rcomb = ref
    assert x.dtype == dtype and x.shape == rx.shape
    if dtype == torch.bfloat16:
        assert_bf16_within_ulp(x, rx, "x")
    else:
        assert_fp32_close(x, rx, "x")
    for name, a, b in (("pre", pre, rpre), ("post", post, rpost), ("comb", comb, rcomb)):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert_fp32_close(a, b, name)


@settings(deadline=None, max_examples=examples(30))
@given(
    N=st.integers(1, 40),
    hc=st.sampled_from([2, 4]),
    D=st.sampled_from([32, 64, 96]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_collapse=st.booleans(),
    iters=st.sampled_from([1, 2, 7, 20]),
    seed=st.integers(0, 2**31 - 1),
)
def test_mhc_pre_matches_twin(N, hc, D, dtype, with_collapse, iters, seed):
    h, fn, scale, base, pre_prev = make_inputs(N, hc, D, dtype, with_collapse, seed)
    norm_eps = 1e-20 if with_collapse else 1e-6  # V4.1's and V4's
    out = K.mhc_pre(h, fn, scale, base, pre_prev, norm_eps, 1e-6, iters)
    ref = K.mhc_pre_twin(h, fn, scale, base, pre_prev, norm_eps, 1e-6, iters)
    check_pre(out, ref, dtype)
    # the last step divides each column by (its sum + hc_eps): sums land in (0, 1]
    col = out[3].double().sum(dim=-2)
    assert ((col > 0) & (col <= 1 + 1e-6)).all()
    assert (out[3] >= 0).all() and (out[1] > 0).all() and ((out[2] >= 0) & (out[2] <= 2)).all()


@pytest.mark.parametrize("hc", [2, 4])
def test_sinkhorn_columns_sum_to_one(hc):
    """With moderate logits (no column starved below ~1e-2) the columns sum to 1 - O(hc_eps)."""
    h, fn, scale, base, _ = make_inputs(37, hc, 64, torch.float32, False, 5)
    comb = K.mhc_pre(h, fn * 0.25, scale, base, None, 1e-6, 1e-6, 20)[3]
    col = comb.double().sum(dim=-2)
    assert (col - 1).abs().max() < 1e-4
    row = comb.double().sum(dim=-1)  # rows only approximately: the last step is a column one
    assert (row - 1).abs().max() < 0.1


@settings(deadline=None, max_examples=examples(30))
@given(
    N=st.integers(1, 40),
    hc=st.sampled_from([2, 4]),
    D=st.sampled_from([32, 64, 96, 48]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_mhc_post_matches_twin(N, hc, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(N, D, generator=g).to(dtype)
    res = torch.randn(N, hc, D, generator=g).to(dtype)
    post = 2 * torch.rand(N, hc, generator=g)
    comb = torch.rand(N, hc, hc, generator=g)
    comb = comb / comb.sum(dim=-2, keepdim=True)
    out = K.mhc_post(f, res, post, comb)
    ref = K.mhc_post_twin(f, res, post, comb)
    assert out.shape == (N, hc, D) and out.dtype == dtype
    if dtype == torch.bfloat16:
        assert_bf16_within_ulp(out, ref, "h'")
    else:
        assert_fp32_close(out, ref, "h'")


def test_mhc_pre_split_configs_agree():
    """Every split of D gives the same answer (the workspace reduction covers each d exactly once, also when the
    finish kernel sums the splits in several steps, the last one partial: SB 4 of 6)."""
    h, fn, scale, base, pre_prev = make_inputs(19, 4, 96, torch.float32, True, 3)
    ref = K.mhc_pre_twin(h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20)
    for cfg in ({"BD": 16, "split": 1}, {"BD": 16, "split": 6}, {"BD": 16, "split": 6, "SB": 4}, {"BD": 32, "split": 2},
                {"BN": 32, "BN2": 32}):
        check_pre(K.mhc_pre_triton(h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20, cfg=cfg), ref, torch.float32)
        check_pre(K.mhc_pre_triton(h, fn, scale, base, None, 1e-6, 1e-6, 20, cfg=cfg),
                  K.mhc_pre_twin(h, fn, scale, base, None, 1e-6, 1e-6, 20), torch.float32)


def test_fallback_is_the_twin(monkeypatch):
    monkeypatch.setattr(K, "use_triton", lambda t: False)
    h, fn, scale, base, pre_prev = make_inputs(3, 4, 32, torch.bfloat16, True, 1)
    for a, b in zip(K.mhc_pre(h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20),
                    K.mhc_pre_twin(h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    f, post, comb = torch.randn(3, 32).bfloat16(), torch.rand(3, 4), torch.rand(3, 4, 4)
    torch.testing.assert_close(K.mhc_post(f, h, post, comb), K.mhc_post_twin(f, h, post, comb), rtol=0, atol=0)


def check_finish_in_post(h, fn, scale, base, pre_prev, f, iters):
    """mhc_pre_partial then mhc_post_finish (the coefficients finished in the post) give mhc_pre's x and pre and
    mhc_post's h' of the twins: x and h' within their dtype's tolerance, pre as an fp32 output."""
    x, ws = K.mhc_pre_partial(h, fn, pre_prev)
    out, pre = K.mhc_post_finish(f, h, ws, scale, base, 1e-20, 1e-6, iters)
    rx, rpre, rpost, rcomb = K.mhc_pre_twin(h, fn, scale, base, pre_prev, 1e-20, 1e-6, iters)
    rout = K.mhc_post_twin(f, h, rpost, rcomb)
    assert ws.shape == (K.partial_splits(h.shape[2], h.element_size()), h.shape[0], fn.shape[0] + 1)
    assert (x.dtype, out.dtype, pre.dtype) == (h.dtype, f.dtype, torch.float32) and out.shape == h.shape
    check = assert_bf16_within_ulp if h.dtype == torch.bfloat16 else assert_fp32_close
    check(x, rx, "x")
    check(out, rout, "h'")
    assert_fp32_close(pre, rpre, "pre")


def check_post_then_partial(h, fn, scale, base, pre_prev, f, fn_next, iters, post_partial=K.mhc_post_partial):
    """mhc_post_partial (a site's post, then the next site's partial pass in the same kernel) gives the twins' h'
    (mhc_post_finish's), and from that h' (its own: one bf16 rounding of it may land on the other neighbour) the
    twins' x (collapsed with this site's pre) and, through mhc_post_finish at the next site, its pre (the only
    reader of the partial sums), and x's squares by d step as `squares_by_step` sums them from that x.
    `post_partial`: the op, or its Triton path at a launch configuration."""
    ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
    out, x, ws_next, squares = post_partial(f, h, ws, scale, base, fn_next, 1e-20, 1e-6, iters, squares=True)
    rout, rpre = K.mhc_post_finish_twin(f, h, K.mhc_pre_partial_twin(h, fn, pre_prev)[1], scale, base, 1e-20, 1e-6,
                                        iters)
    rx, rnext_pre = K.mhc_pre_twin(out, fn_next, scale, base, rpre, 1e-20, 1e-6, iters)[:2]
    assert ws_next.shape == (K.partial_splits(h.shape[2], f.element_size()), h.shape[0], fn.shape[0] + 1)
    assert (out.dtype, x.dtype) == (f.dtype, f.dtype) and out.shape == h.shape and x.shape == f.shape
    check = assert_bf16_within_ulp if f.dtype == torch.bfloat16 else assert_fp32_close
    check(out, rout, "h'")
    check(x, rx, "x")
    assert_fp32_close(squares, K.squares_by_step(x), "x's squares")
    next_pre = K.mhc_post_finish(f, out, ws_next, scale, base, 1e-20, 1e-6, iters)[1]
    assert_fp32_close(next_pre, rnext_pre, "the next site's pre")


def check_v4_pair(h, fn, scale, base, f, fn_next, iters):
    """V4's decode pair: mhc_post_sums (a site's post with its coefficients as given, then the next site's partial
    sums in the same kernel) gives mhc_post's twin's h', and mhc_pre_finish on that h' (its own: one bf16 rounding
    of it may land on the other neighbour) and that workspace gives mhc_pre's twin's x, pre, post and comb at the
    next site."""
    N, _, D = h.shape
    _, _, post, comb = K.mhc_pre_twin(h, fn, scale, base, None, 1e-6, 1e-6, iters)
    out, ws = K.mhc_post_sums(f, h, post, comb, fn_next)
    assert ws.shape == (K.partial_splits(D, f.element_size()), N, fn.shape[0] + 1) and ws.dtype == torch.float32
    assert out.dtype == f.dtype and out.shape == h.shape
    check = assert_bf16_within_ulp if f.dtype == torch.bfloat16 else assert_fp32_close
    check(out, K.mhc_post_twin(f, h, post, comb), "h'")
    got = K.mhc_pre_finish(out, ws, scale, base, 1e-6, 1e-6, iters)
    check_pre(got, K.mhc_pre_twin(out, fn_next, scale, base, None, 1e-6, 1e-6, iters), f.dtype)


def check_decode_ops(arch, h, fn, scale, base, pre_prev, f, fn_next, iters):
    """An architecture's decode ops against mhc_pre's and mhc_post's twins: V4.1's (`check_finish_in_post`,
    `check_post_then_partial`), V4's (`check_v4_pair`)."""
    if arch == "v41":
        check_finish_in_post(h, fn, scale, base, pre_prev, f, iters)
        check_post_then_partial(h, fn, scale, base, pre_prev, f, fn_next, iters)
    else:
        check_v4_pair(h, fn, scale, base, f, fn_next, iters)


@pytest.mark.parametrize("arch", ["v41", "v4"])
@settings(deadline=None, max_examples=examples(20))
@given(
    N=st.integers(1, 12),
    hc=st.sampled_from([2, 4]),
    D=st.sampled_from([32, 64, 96]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    iters=st.sampled_from([1, 2, 20]),
    seed=st.integers(0, 2**31 - 1),
)
def test_decode_ops_match_pre_then_post(arch, N, hc, D, dtype, iters, seed):
    """The decode ops (V4.1: the coefficients finished in the post, the post with the next site's partial pass; V4:
    the post with the next site's partial sums, then the finish alone; the fused posts one kernel up to
    POST_PARTIAL_MAX_N rows, two past it) against mhc_pre's and mhc_post's twins."""
    h, fn, scale, base, pre_prev = make_inputs(N, hc, D, dtype, arch == "v41", seed)
    g = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(N, D, generator=g).to(dtype)
    check_decode_ops(arch, h, fn, scale, base, pre_prev, f, torch.randn(fn.shape, generator=g) / (hc * D) ** 0.5 * 4,
                     iters)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_decode_ops_fallback_is_their_twins(arch, monkeypatch):
    """Without Triton the decode ops run their twins (the partial sums by D split, summed where they are finished),
    which give the same as mhc_pre's and mhc_post's."""
    monkeypatch.setattr(K, "use_triton", lambda t: False)
    h, fn, scale, base, pre_prev = make_inputs(3, 4, 64, torch.float32, arch == "v41", 4)
    check_decode_ops(arch, h, fn, scale, base, pre_prev, torch.randn(3, 64), fn * 0.5, 20)


@pytest.mark.parametrize("arch", ["v41", "v4"])
@settings(deadline=None, max_examples=examples(2))  # V4.1's three posts: ~5 s an example interpreted
@given(N=st.integers(1, K.POST_PARTIAL_MAX_N), slots=st.integers(0, 3), bf16=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_a_settled_post_gives_the_same_bits(arch, N, slots, bf16, seed):
    """The fused posts and V4.1's post with its finish, with `settled` (everything but f read, and the coefficients
    finished, before the PDL wait), give bit for bit what they give without it: only the order of the loads moves."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    h, fn, scale, base, pre_prev = make_inputs(N, 4, 64, dtype, arch == "v41", seed)
    g = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(N, slots, 64, generator=g) if slots else torch.randn(N, 64, generator=g).to(dtype)
    fn_next = torch.randn(fn.shape, generator=g) / 16
    if arch == "v41":
        ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
        run = lambda settled: (*K.mhc_post_partial(f, h, ws, scale, base, fn_next, 1e-20, 1e-6, 20, settled),
                               *K.mhc_post_finish(f, h, ws, scale, base, 1e-20, 1e-6, 20, settled))
    else:
        _, _, post, comb = K.mhc_pre_twin(h, fn, scale, base, None, 1e-6, 1e-6, 20)
        run = lambda settled: K.mhc_post_sums(f, h, post, comb, fn_next, settled)
    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


class _RecordingLaunch:
    """A Triton kernel stand-in that launches the kernel and records each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_a_settled_post_reads_early_only_what_it_was_given(monkeypatch):
    """`settled` moves the reads before the PDL wait only where the kernel reads the tensors it was given: an input
    it first converts (here bf16 scales, made fp32 by a kernel just before it) is the predecessor's output."""
    h, fn, scale, base, pre_prev = make_inputs(2, 4, 64, torch.float32, True, 3)
    ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
    recording = _RecordingLaunch(K._post_partial_kernel)
    monkeypatch.setattr(K, "_post_partial_kernel", recording)
    f = torch.randn(2, 64)
    for s, settled in ((scale, False), (scale, True), (scale.bfloat16(), True)):
        K.mhc_post_partial_triton(f, h, ws, s, base, fn, 1e-20, 1e-6, 20, settled)
    assert [k["SETTLED"] for k in recording.launches] == [False, True, False]


def test_opcheck():
    h, fn, scale, base, pre_prev = make_inputs(5, 4, 32, torch.bfloat16, True, 2)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.dsv4.mhc_pre, (h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20), test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_pre, (h, fn, scale, base, None, 1e-6, 1e-6, 20), test_utils=tests)
    f, post, comb = torch.randn(5, 32).bfloat16(), torch.rand(5, 4), torch.rand(5, 4, 4)
    torch.library.opcheck(torch.ops.dsv4.mhc_post, (f, h, post, comb), test_utils=tests)
    ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
    torch.library.opcheck(torch.ops.dsv4.mhc_pre_partial, (h, fn, pre_prev), test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_finish, (f, h, ws, scale, base, 1e-20, 1e-6, 20), test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_partial, (f, h, ws, scale, base, fn, 1e-20, 1e-6, 20),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_sums, (f, h, post, comb, fn), test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_sums, (f, h, post, comb, fn, True), test_utils=tests)
    slots = torch.randn(5, 7, 32)  # the MoE's, summed in the fused posts
    torch.library.opcheck(torch.ops.dsv4.mhc_post_partial, (slots, h, ws, scale, base, fn, 1e-20, 1e-6, 20),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_sums, (slots, h, post, comb, fn), test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_post_finish, (slots, h, ws, scale, base, 1e-20, 1e-6, 20, True),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.dsv4.mhc_pre_finish, (h, ws, scale, base, 1e-6, 1e-6, 20), test_utils=tests)


@pytest.mark.parametrize("arch", ["v41", "v4"])
@settings(deadline=None, max_examples=examples(6))  # the V4.1 post's Sinkhorn: ~3 s an example interpreted
@given(N=st.integers(1, K.POST_PARTIAL_MAX_N + 1), slots=st.integers(1, 7), D=st.sampled_from([32, 96]),
       bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_fused_posts_sum_the_moes_slots_as_the_module_does(arch, N, slots, D, bf16, seed):
    """mhc_post_partial and mhc_post_finish (V4.1) and mhc_post_sums (V4) given the MoE's slots [N, S, D] fp32 give,
    bit for bit, what they give for the slots' sum in order rounded to the streams' dtype (`summed_slots`, the
    module's output), the fused posts in one kernel up to POST_PARTIAL_MAX_N rows and past it (two kernels); the
    outputs in the streams' dtype."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    h, fn, scale, base, pre_prev = make_inputs(N, 4, D, dtype, True, seed)
    g = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(N, slots, D, generator=g) * torch.exp2(torch.randint(-6, 6, (N, slots, 1), generator=g).float())
    fn_next = torch.randn(fn.shape, generator=g) / (4 * D) ** 0.5 * 4
    if arch == "v41":
        ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
        run = lambda f: (*K.mhc_post_partial(f, h, ws, scale, base, fn_next, 1e-20, 1e-6, 20),
                         *K.mhc_post_finish(f, h, ws, scale, base, 1e-20, 1e-6, 20))
    else:
        _, _, post, comb = K.mhc_pre_twin(h, fn, scale, base, None, 1e-6, 1e-6, 20)
        run = lambda f: K.mhc_post_sums(f, h, post, comb, fn_next)
    got, want = run(f), run(K.summed_slots(f, dtype))
    assert got[0].dtype == dtype
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_fused_posts_refuse_misshapen_slots():
    h, fn, scale, base, pre_prev = make_inputs(2, 4, 32, torch.bfloat16, True, 0)
    ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
    for f in (torch.randn(2, 3, 32).bfloat16(), torch.randn(2, 3, 16), torch.randn(3, 32).bfloat16()):
        with pytest.raises(ValueError, match=r"f \[2, 32\] or fp32 slots \[2, S, 32\]"):
            K.mhc_post_partial(f, h, ws, scale, base, fn, 1e-20, 1e-6, 20)
        with pytest.raises(ValueError, match=r"f \[2, 32\] or fp32 slots"):
            K.mhc_post_sums(f, h, torch.rand(2, 4), torch.rand(2, 4, 4), fn)
        with pytest.raises(ValueError, match=r"mhc_post_finish: f \[2, 32\] or fp32 slots"):
            K.mhc_post_finish(f, h, ws, scale, base, 1e-20, 1e-6, 20)


# ------------------------------------------------------------------------------------------------
# GPU: the compiled kernels (bf16 three-piece MMA split, tf32x3, libdevice exp), at the real width too


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_collapse", [False, True])
@pytest.mark.parametrize("N,hc,D", [(1, 4, 5120), (7, 4, 5120), (64, 4, 4096), (300, 4, 5120), (33, 2, 96)])
def test_mhc_pre_gpu(N, hc, D, dtype, with_collapse):
    h, fn, scale, base, pre_prev = make_inputs(N, hc, D, dtype, with_collapse, N * 31 + D, "cuda")
    norm_eps = 1e-20 if with_collapse else 1e-6
    out = K.mhc_pre(h, fn, scale, base, pre_prev, norm_eps, 1e-6, 20)
    ref = K.mhc_pre_twin(h.cpu(), fn.cpu(), scale.cpu(), base.cpu(), pre_prev.cpu() if with_collapse else None,
                         norm_eps, 1e-6, 20)
    torch.cuda.synchronize()
    check_pre(tuple(t.cpu() for t in out), ref, dtype)


@gpu
@needs_cuda
@settings(deadline=None, max_examples=examples(25))
@given(
    N=st.integers(1, 40),
    hc=st.sampled_from([2, 4]),
    D=st.sampled_from([32, 64, 96]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_collapse=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mhc_pre_gpu_small(N, hc, D, dtype, with_collapse, seed):
    h, fn, scale, base, pre_prev = make_inputs(N, hc, D, dtype, with_collapse, seed)
    ref = K.mhc_pre_twin(h, fn, scale, base, pre_prev, 1e-6, 1e-6, 20)
    cuda = [t.cuda() if t is not None else None for t in (h, fn, scale, base, pre_prev)]
    out = K.mhc_pre(*cuda, 1e-6, 1e-6, 20)
    check_pre(tuple(t.cpu() for t in out), ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,D", [(1, 5120), (9, 5120), (513, 4096)])
def test_mhc_post_gpu(N, D, dtype):
    g = torch.Generator().manual_seed(N)
    f = torch.randn(N, D, generator=g).to(dtype)
    res = torch.randn(N, 4, D, generator=g).to(dtype)
    post, comb = 2 * torch.rand(N, 4, generator=g), torch.rand(N, 4, 4, generator=g)
    out = K.mhc_post(f.cuda(), res.cuda(), post.cuda(), comb.cuda()).cpu()
    ref = K.mhc_post_twin(f, res, post, comb)
    if dtype == torch.bfloat16:
        assert_bf16_within_ulp(out, ref, "h'")
    else:
        assert_fp32_close(out, ref, "h'")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 7, 64])
@pytest.mark.parametrize("arch,D", [("v41", 5120), ("v4", 4096)])
def test_decode_ops_gpu(arch, D, N, dtype):
    """The decode ops at the architecture's width, compiled."""
    h, fn, scale, base, pre_prev = make_inputs(N, 4, D, dtype, arch == "v41", N, device="cuda")
    f = torch.randn(N, D, generator=torch.Generator().manual_seed(N + 1)).to(dtype).cuda()
    check_decode_ops(arch, h, fn, scale, base, pre_prev, f, fn * 0.5, 20)


@gpu
@needs_cuda
@pytest.mark.parametrize("arch,D", [("v41", 5120), ("v4", 4096)])
def test_gpu_a_settled_post_after_its_early_starting_gemv(arch, D):
    """The decode step's order with real PDL: a site's pass, wo_b's FP8 GEMV starting its successor early, then the
    settled post reading the GEMV's output; V4.1's post then starts the normed gate GEMM as it passes its wait
    (`start_next`), which asks for its first weights before its own and reads the post's x and squares. Eager and
    replayed in a CUDA graph on new streams and a new GEMV input each time, it gives the bits of the unsettled post
    and gate after the plain GEMV: early reads see what the pass wrote, and f, x and the squares only once their
    kernel is done."""
    h, fn, scale, base, pre_prev = make_inputs(1, 4, D, torch.bfloat16, True, 7, device="cuda")
    g = torch.Generator().manual_seed(8)
    w, s = (t.cuda() for t in quantize_fp8(torch.randn(D, 8192, generator=g) / 64, (128, 128)))
    o = torch.randn(1, 8192, generator=g).bfloat16().cuda()
    gate_w = (torch.randn(384, D, generator=g) / 64).bfloat16().cuda()
    norm_w = (1 + torch.randn(D, generator=g) / 8).bfloat16().cuda()
    bias = (torch.randn(384, generator=g) / 8).cuda()
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step(settled: bool):
        if arch == "v41":
            ws = K.mhc_pre_partial(h, fn, pre_prev)[1]
        else:
            _, _, post, comb = K.mhc_pre(h, fn, scale, base, None, 1e-6, 1e-6, 20)
        f = fp8_gemv(o, w, s, 128, 128, torch.bfloat16, start_successor=settled)
        if arch == "v41":
            out = K.mhc_post_partial(f, h, ws, scale, base, fn * 0.5, 1e-20, 1e-6, 20, settled, squares=True,
                                     start_next=settled)
            return *out, *gate_route_normed(out[1], out[3], norm_w, 1e-6, gate_w, bias, None, 6, 1.0, 1.5, True,
                                            "sqrtsoftplus", count)
        return K.mhc_post_sums(f, h, post, comb, fn * 0.5, settled)

    for a, b in zip(step(True), step(False), strict=True):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(True)
    for seed in range(3):
        g.manual_seed(seed)
        h.copy_(torch.randn(h.shape, generator=g))
        o.copy_(torch.randn(o.shape, generator=g))
        graph.replay()
        for a, b in zip(got, step(False), strict=True):
            assert torch.equal(a, b)


def check_post_partial_at(warps, D, device):
    """mhc_post_partial's kernel launched at `warps` (what `bench/mhc.py --sweep` times) against the twins."""
    h, fn, scale, base, pre_prev = make_inputs(1, 4, D, torch.bfloat16, True, warps, device=device)
    f = torch.randn(1, D, generator=torch.Generator().manual_seed(warps)).bfloat16().to(device)
    check_post_then_partial(h, fn, scale, base, pre_prev, f, fn * 0.5, 20, post_partial=lambda *a, **k: (
        K.mhc_post_partial_triton(*a, **k, cfg={"num_warps": warps})))


def test_post_partial_takes_a_launch_config():
    check_post_partial_at(4, 64, "cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("warps", [2, 4, 8])
def test_post_partial_at_other_warps_gpu(warps):
    check_post_partial_at(warps, 5120, "cuda")


@gpu
@needs_cuda
def test_mhc_compiles_and_captures(graph_replay):
    """torch.compile(fullgraph=True) traces through the ops, and a CUDA graph replays them: a site's pre and post,
    and V4.1's decode chain (partial pass, post with the next partial pass, post finishing its coefficients)."""
    h, fn, scale, base, pre_prev = make_inputs(8, 4, 5120, torch.bfloat16, True, 0, "cuda")

    def site(h):
        x, _, post, comb = torch.ops.dsv4.mhc_pre(h, fn, scale, base, pre_prev, 1e-20, 1e-6, 20)
        return torch.ops.dsv4.mhc_post(x, h, post, comb)

    def v41_sites(h):
        x, ws = torch.ops.dsv4.mhc_pre_partial(h, fn, pre_prev)
        h, x, ws, _ = torch.ops.dsv4.mhc_post_partial(x, h, ws, scale, base, fn, 1e-20, 1e-6, 20)
        return torch.ops.dsv4.mhc_post_finish(x, h, ws, scale, base, 1e-20, 1e-6, 20)

    for fn_under_test in (site, v41_sites):
        want = fn_under_test(h)
        torch.testing.assert_close(torch.compile(fn_under_test, fullgraph=True)(h), want, rtol=0, atol=0)
        torch.testing.assert_close(graph_replay(fn_under_test, h), want, rtol=0, atol=0)


def ieee_sinkhorn_step(comb: torch.Tensor, eps: float) -> torch.Tensor:
    """One Sinkhorn step (rows, then columns) of comb [N, 4, 4] with the kernel's sums, (a + c) + (b + d) + eps,
    and IEEE quotients (torch's division, on the CPU and on CUDA)."""
    s = (comb[..., 0] + comb[..., 2]) + (comb[..., 1] + comb[..., 3]) + eps
    comb = comb / s[..., None]
    s = (comb[..., 0, :] + comb[..., 2, :]) + (comb[..., 1, :] + comb[..., 3, :]) + eps
    return comb / s[..., None, :]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
@pytest.mark.parametrize("N", [1, 4])
def test_sinkhorn_in_threads_steps_are_correctly_rounded(device, N):
    """One token a program (each thread holding its 4 x 4 matrix; on the GPU the quotients of a sum share a
    refined reciprocal and take div.rn's correction step): each step is the IEEE step of the last one's output,
    bit for bit. (The lane form, two tokens a program, was not: on the H200 11 of 16 entries 1-2 ulps off after
    one step.)"""
    h, fn, scale, base, pre_prev = make_inputs(N, 4, 5120 if device == "cuda" else 64, torch.bfloat16, True, N, device)
    steps = [K.mhc_pre_triton(h, fn, scale, base, pre_prev, 1e-20, 1e-6, it, {"BN2": 1})[3] for it in (1, 2, 3)]
    for before, after in itertools.pairwise(steps):
        assert torch.equal(after.view(torch.int32), ieee_sinkhorn_step(before, 1e-6).view(torch.int32))
