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

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls the twin)", allow_module_level=True)

from dsv4.fast.kernels.fp8_gemv import MAX_M, fp8_gemv, fp8_gemv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(seed: int, M: int, N: int, K: int, block: tuple[int, int], dtype=torch.bfloat16):
    """x [M, K] and a weight whose magnitude changes per block by 2^-6..2^6 (so the scales differ), FP8."""
    gen = torch.Generator().manual_seed(seed)
    nr, nc = -(-N // block[0]), -(-K // block[1])
    exp = torch.randint(-6, 7, (nr, nc), generator=gen).float()
    full = exp.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:N, :K]
    w, s = quantize_fp8(torch.randn(N, K, generator=gen) * torch.exp2(full), block)
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    return x.to(DEVICE), w.to(DEVICE), s.to(DEVICE)


def check(y: torch.Tensor, x, w, s, block) -> None:
    twin = fp8_gemv_reference(x, w, s, *block, torch.float32)
    bound = x.abs().double() @ dequantize_fp8(w, s, block).abs().double().T
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


def test_k_not_in_words_is_refused():
    x, w, s = make_case(0, 1, 8, 6, (16, 16))
    with pytest.raises(ValueError, match="multiples of 4"):
        fp8_gemv(x, w, s, 16, 16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 4, 16])
@pytest.mark.parametrize("N, K", [(32768, 1280), (5120, 8192), (300, 1000)])
def test_gpu_decode_shapes(M, N, K):
    """V4.1's wq_b and wo_b widths (and a ragged one) at decode batch sizes, through the PTX decode."""
    x, w, s = make_case(M + N, M, N, K, (128, 128))
    check(fp8_gemv(x, w, s, 128, 128, torch.bfloat16), x, w, s, (128, 128))
