"""dsv4.fast.kernels.fp8_gemv against its twin (the weight dequantized exactly, fp32 matmul, one rounding).

Products of e4m3 values, power-of-two scales and bf16 activations are exact in fp32, so kernel and twin differ
only in the fp32 summation order: |y - twin| <= 1e-5 * sum_k |x||w| (plus one output rounding for bf16).
On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by conftest before any import),
its codes decoded arithmetically; the GPU test runs the PTX decode on the same cases.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.quant import dequantize_fp8, quantize_fp8
from dsv4.reference.linear import rms_norm
from dsv4.reference.rope import apply_rope

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls the twin)", allow_module_level=True)

from dsv4.fast.kernels.fp8_gemv import (MAX_M, _fp8_gemv_triton, _tiles, _tma_tiles, _word_scaled, fp8_gemv,
                                        fp8_gemv_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(seed: int, M: int, N: int, K: int, block: tuple[int, int], dtype=torch.bfloat16, groups: int = 1):
    """x [M, groups * K] and a weight whose magnitude changes per block by 2^-6..2^6 (so the scales differ), FP8."""
    gen = torch.Generator().manual_seed(seed)
    nr, nc = -(-N // block[0]), -(-K // block[1])
    exp = torch.randint(-6, 7, (nr, nc), generator=gen).float()
    full = exp.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:N, :K]
    w, s = quantize_fp8(torch.randn(N, K, generator=gen) * torch.exp2(full), block)
    x = (torch.randn(M, groups * K, generator=gen) * 3).to(dtype)
    return x.to(DEVICE), w.to(DEVICE), s.to(DEVICE)


def check(y: torch.Tensor, x, w, s, block, groups: int = 1) -> None:
    twin = fp8_gemv_reference(x, w, s, *block, torch.float32, groups)
    (M, N), K = y.shape, w.shape[1]
    wabs = dequantize_fp8(w, s, block).abs().double().view(groups, N // groups, K)
    bound = torch.einsum("mgk,gnk->mgn", x.abs().double().view(M, groups, K), wabs).reshape(M, N)
    tol = 1e-5 * bound.float()
    if y.dtype == torch.bfloat16:
        tol = tol + twin.abs() * 2.0**-8  # one bf16 rounding
    assert ((y.float() - twin).abs() <= tol + 1e-30).all(), (y.float() - twin).abs().max()


@settings(max_examples=30, deadline=None)
@given(
    M=st.integers(1, 5),
    N=st.integers(1, 80),
    words=st.integers(1, 40),
    block=st.sampled_from([(16, 16), (32, 32), (128, 128), (16, 64)]),
    out_bf16=st.booleans(),
    x_bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_twin(M, N, words, block, out_bf16, x_bf16, seed):
    """Any N (a partial last row block), K up to 160 in words of four (a partial last K block), both dtypes."""
    x, w, s = make_case(seed, M, N, 4 * words, block, torch.bfloat16 if x_bf16 else torch.float32)
    y = fp8_gemv(x, w, s, *block, torch.bfloat16 if out_bf16 else torch.float32)
    assert y.shape == (M, N) and y.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    check(y, x, w, s, block)


@pytest.mark.parametrize("K", [256, 512, 260])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_k_steps_with_and_without_a_k_mask(K, groups, block):
    """K a multiple of the K step (256, 512: the kernel's unmasked K loop, the real shapes' case) and not (260:
    the masked one), plain and grouped, against the twin; whole steps read their scales as words (`_word_scaled`:
    32-wide blocks four a word or more, 128-wide ones one a step, within a word; rows of scales in whole words),
    masked steps and 128-wide blocks' rows of 2 scale bytes (K = 256) as bytes. Each
    block's weights carry their own power of two (2^-6 .. 2^6), so a column read with another block's scale is off
    by a factor of 2 or more wherever the two differ."""
    x, w, s = make_case(K + groups, 2, 32 * groups, K, block, groups=groups)
    BK = _tiles(2, 32 * groups, K, groups, block[0], {})[1]
    assert _word_scaled(K, BK, block[1], s.view(torch.uint8)) == (K % BK == 0 and K // block[1] % 4 == 0)
    check(fp8_gemv(x, w, s, *block, torch.float32, groups), x, w, s, block, groups)


@pytest.mark.parametrize("N, K, groups, norm", [(40, 256, 1, False), (64, 512, 2, False), (24, 1024, 1, True)])
def test_tma_tiles_give_the_pointer_loads_bits(N, K, groups, norm):
    """Whole K steps come as bulk tensor copies (`_tma_tiles`: a ragged last row block read as 0 by the copy
    engine, grouped rows, the normed first step taken out of the loop); the same bits as the pointer loads, and
    the same values as the twin."""
    x, w, s, nw = normed_case(K + N, 2, N, K, (32, 32))
    x = x.repeat(1, groups)
    BN, BK = _tiles(2, N, K, groups, 32, {})[:2]
    assert _tma_tiles(w, BN, BK)
    args = (x, w, s, 32, 32, torch.float32, groups)
    extra = (nw, 1e-6) if norm else ()
    y = _fp8_gemv_triton(*args, {"tma": True}, *extra)
    assert torch.equal(y, _fp8_gemv_triton(*args, None, *extra))
    check(y, rms_norm(x, nw, 1e-6) if norm else x, w, s, (32, 32), groups)


@pytest.mark.parametrize("block, BK", [((128, 128), 256), ((128, 128), 128), ((64, 64), 256)])
def test_scale_bytes_within_a_word(block, BK):
    """Steps of one or two scale bytes (V4's 128-wide blocks in 256- and 128-wide steps) read the word holding them
    at each step's byte offset, every byte of the word in its turn; against the twin."""
    x, w, s = make_case(7, 1, 48, 1024, block)
    assert _word_scaled(1024, BK, block[1], s.view(torch.uint8))
    check(_fp8_gemv_triton(x, w, s, *block, torch.float32, 1, {"BK": BK}), x, w, s, block)


@settings(max_examples=20, deadline=None)
@given(
    M=st.integers(1, 3),
    groups=st.integers(2, 4),
    rows=st.sampled_from([8, 16, 24, 40]),
    words=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_groups_match_twin(M, groups, rows, words, seed):
    """Grouped (the attention's wo_a): each group of `rows` output rows reads its own K columns of x; group sizes
    that are not a multiple of the default 16-row tile (8, 24, 40) shrink the tile."""
    x, w, s = make_case(seed, M, groups * rows, 4 * words, (16, 16), groups=groups)
    y = fp8_gemv(x, w, s, 16, 16, torch.float32, groups)
    check(y, x, w, s, (16, 16), groups)
    # the groups are not interchangeable: x's columns of one group moved to another change the result
    assert not torch.equal(y, fp8_gemv(x.roll(4 * words, dims=1), w, s, 16, 16, torch.float32, groups))


def normed_case(seed: int, M: int, N: int, K: int, block: tuple[int, int], dtype=torch.bfloat16):
    """make_case's weight with x of values k / 8, |k| <= 8 (their squares sum exactly in fp32 in any order, so the
    kernel's mean square is the twin's bits), and an RMSNorm weight [K]."""
    x, w, s = make_case(seed, M, N, K, block, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randint(-8, 9, (M, K), generator=gen).float() / 8).to(dtype).to(DEVICE)
    norm = (1 + torch.randn(K, generator=gen) / 4).to(dtype).to(DEVICE)
    return x, w, s, norm


def partial_squares(x: torch.Tensor, parts: int) -> torch.Tensor:
    """x's sums of squares as `parts` partial sums over consecutive columns [M, parts] fp32, as a producer hands
    them on (`mhc_post_partial`'s squares by d step)."""
    return torch.stack([c.sum(1) for c in x.float().square().tensor_split(parts, dim=1)], 1)


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 4), N=st.integers(1, 48), words=st.integers(1, 300),
       block=st.sampled_from([(32, 32), (128, 128), (16, 64)]), x_bf16=st.booleans(), parts=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_a_norm_weight_makes_the_gemv_read_the_normed_rows(M, N, words, block, x_bf16, parts, seed):
    """With norm_weight the kernel reads rms_norm(x) (rounded to x's dtype) as the twin does: the GEMV of the twin's
    normed rows up to the fp32 summation order, across norm chunks (K up to 1200: two of 1024) and K masks; the
    same with the sum of squares handed on as partial sums (any count, not a power of two), not summed from x."""
    x, w, s, norm = normed_case(seed, M, N, 4 * words, block, torch.bfloat16 if x_bf16 else torch.float32)
    y = fp8_gemv(x, w, s, *block, torch.float32, 1, norm, 1e-6)
    check(y, rms_norm(x, norm, 1e-6), w, s, block)
    handed = fp8_gemv(x, w, s, *block, torch.float32, 1, norm, 1e-6, squares=partial_squares(x, min(parts, 4 * words)))
    check(handed, rms_norm(x, norm, 1e-6), w, s, block)
    assert torch.equal(fp8_gemv_reference(x, w, s, *block, torch.float32, 1, norm, 1e-6),
                       fp8_gemv_reference(rms_norm(x, norm, 1e-6), w, s, *block, torch.float32))


def test_squares_without_a_norm_weight_or_of_another_shape_are_refused():
    x, w, s, norm = normed_case(0, 2, 64, 64, (32, 32))
    with pytest.raises(ValueError, match=r"squares go with a norm weight.*alone"):
        fp8_gemv(x, w, s, 32, 32, squares=partial_squares(x, 4))
    with pytest.raises(ValueError, match=r"squares go with a norm weight, \[2, S >= 1\] float32"):
        fp8_gemv(x, w, s, 32, 32, torch.bfloat16, 1, norm, 1e-6, squares=partial_squares(x[:1], 4))
    with pytest.raises(ValueError, match="float32"):
        fp8_gemv(x, w, s, 32, 32, torch.bfloat16, 1, norm, 1e-6, squares=partial_squares(x, 4).double())


def test_a_norm_weight_of_another_width_or_with_groups_is_refused():
    x, w, s, norm = normed_case(0, 1, 64, 64, (32, 32))
    with pytest.raises(ValueError, match=r"a norm weight \[64\] goes with one group"):
        fp8_gemv(x, w, s, 32, 32, torch.bfloat16, 1, norm[:32])
    with pytest.raises(ValueError, match="goes with one group"):
        fp8_gemv(torch.cat((x, x), 1), w, s, 32, 32, torch.bfloat16, 2, norm)


def rope_tables(M: int, R: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(M, R // 2, generator=torch.Generator().manual_seed(seed)) * 100
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def rotated(y: torch.Tensor, cos, sin, heads: int, head_dim: int) -> torch.Tensor:
    """y's first `heads` heads of head_dim through apply_rope (written out here, not `rotated_heads`, which the
    twin uses), the rest as they are."""
    q = y[:, :heads * head_dim].view(y.shape[0], 1, heads, head_dim)
    return torch.cat((apply_rope(q, cos[:, None], sin[:, None]).flatten(1), y[:, heads * head_dim:]), 1)


@settings(max_examples=20, deadline=None)
@given(M=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.sampled_from([16, 32, 64]), extra=st.integers(0, 40),
       rope=st.sampled_from([2, 8, 16]), block=st.sampled_from([(16, 16), (32, 32)]), out_bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_heads_are_the_outputs_rotated(M, heads, head_dim, extra, rope, block, out_bf16, seed):
    """With RoPE tables the first heads come out as apply_rope makes them of the GEMV's own rounded outputs, bit for
    bit (the rotation's products rounded apart, as the reference's), the rows after them untouched; the twin
    likewise of its outputs."""
    N, R = heads * head_dim + extra, min(rope, head_dim // 2) * 2
    x, w, s = make_case(seed, M, N, 64, block)
    cos, sin = rope_tables(M, R, seed)
    out = torch.bfloat16 if out_bf16 else torch.float32
    y = fp8_gemv(x, w, s, *block, out, 1, None, 0.0, False, cos, sin, heads, head_dim)
    assert torch.equal(y, rotated(fp8_gemv(x, w, s, *block, out), cos, sin, heads, head_dim))
    twin = fp8_gemv_reference(x, w, s, *block, out, 1, None, 0.0, cos, sin, heads, head_dim)
    assert torch.equal(twin, rotated(fp8_gemv_reference(x, w, s, *block, out), cos, sin, heads, head_dim))


@pytest.mark.parametrize("bad, message", [
    ({"groups": 2}, "one group"),
    ({"head_dim": 24}, "a multiple of 16"),
    ({"heads": 3}, "must lie in the weight's 64 rows"),
    ({"tables": (1, 4)}, r"cos and sin \[N, R/2\]"),
    ({"heads": 0}, "RoPE takes cos, sin and rope_heads > 0 together"),
])
def test_bad_rope_names_the_problem(bad, message):
    groups = bad.get("groups", 1)
    x, w, s = make_case(0, 2, 64, 32, (32, 32), groups=groups)
    cos, sin = rope_tables(*bad.get("tables", (2, 8)), 0)
    with pytest.raises(ValueError, match=message):
        fp8_gemv(x, w, s, 32, 32, torch.bfloat16, groups, None, 0.0, False, cos, sin, bad.get("heads", 2),
                 bad.get("head_dim", 32))


def test_every_code_decodes_exactly():
    """Each of the 254 finite e4m3 codes at its own K position against x = 1: y is the code's value times the
    scale, exactly (the decode itself, with no summation to hide an error)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    K = 256
    w = torch.zeros(len(codes), K, dtype=torch.uint8)
    w[torch.arange(len(codes)), torch.arange(len(codes))] = codes
    w = w.view(torch.float8_e4m3fn).to(DEVICE)
    s = torch.full((-(-len(codes) // 32), K // 32), 130, dtype=torch.uint8).view(torch.float8_e8m0fnu).to(DEVICE)
    x = torch.ones(1, K, dtype=torch.float32, device=DEVICE)
    y = fp8_gemv(x, w, s, 32, 32, torch.float32)
    expect = codes.view(torch.float8_e4m3fn).float().to(DEVICE) * 8.0
    assert torch.equal(y[0], expect)


@pytest.mark.parametrize("bad, message", [
    (lambda x, w, s: (x.half(), w, s), "bfloat16 or float32"),
    (lambda x, w, s: (x, w.view(torch.uint8), s), "float8_e4m3fn"),
    (lambda x, w, s: (x[:, :-4], w, s), "disagree on K"),
    (lambda x, w, s: (x, w, s[:, :-1]), "w_scale must be"),
    (lambda x, w, s: (x.expand(MAX_M + 1, -1), w, s), "at most"),
])
def test_bad_input_names_the_problem(bad, message):
    x, w, s = make_case(0, 1, 64, 64, (32, 32))
    with pytest.raises(ValueError, match=message):
        fp8_gemv(*bad(x, w, s), 32, 32, torch.bfloat16)


@pytest.mark.parametrize("groups, width, message", [(3, 192, "divide the weight's 64 rows"), (0, 64, "positive"),
                                                    (2, 64, "2 group")])
def test_bad_groups_name_the_problem(groups, width, message):
    x, w, s = make_case(0, 1, 64, 64, (32, 32))
    with pytest.raises(ValueError, match=message):
        fp8_gemv(torch.zeros(1, width, dtype=x.dtype, device=x.device), w, s, 32, 32, torch.bfloat16, groups)


def test_k_not_in_words_is_refused():
    x, w, s = make_case(0, 1, 8, 6, (16, 16))
    with pytest.raises(ValueError, match="multiples of 4"):
        fp8_gemv(x, w, s, 16, 16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 4, 16])
@pytest.mark.parametrize("N, K, groups", [(36864, 1280, 1), (5120, 8192, 1), (8192, 4096, 8), (1792, 5120, 1),
                                          (300, 1000, 1)])
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_gpu_decode_shapes(M, N, K, groups, block):
    """V4.1's wq_b + indexer wq_b, wo_b, grouped wo_a and wq_a + wkv widths (and a ragged one) at decode batch
    sizes, in V4.1's and V4's weight blocks, through the PTX decode and the default tiles of each batch size."""
    x, w, s = make_case(M + N, M, N, K, block, groups=groups)
    y = fp8_gemv(x, w, s, *block, torch.bfloat16, groups)
    check(y, x, w, s, block, groups)
    # its successor started early (wo_b's, before the site's post) changes nothing
    assert torch.equal(fp8_gemv(x, w, s, *block, torch.bfloat16, groups, start_successor=True), y)
    if groups == 1:  # with the norm before it (attn_norm before wq_a + wkv, q_norm before wq_b), on the CPU's norm
        x, _, _, norm = normed_case(M + N, M, N, K, block)
        y = fp8_gemv(x, w, s, *block, torch.bfloat16, 1, norm, 1e-6)
        check(y, rms_norm(x.cpu(), norm.cpu(), 1e-6).to(DEVICE), w, s, block)
        # the sum of squares handed on as the mHC post hands it (80 partial sums at V4.1's width)
        y = fp8_gemv(x, w, s, *block, torch.bfloat16, 1, norm, 1e-6, squares=partial_squares(x, 80))
        check(y, rms_norm(x.cpu(), norm.cpu(), 1e-6).to(DEVICE), w, s, block)
