"""dsv4.fast.kernels.dense_gemv against its twin (fp32 products and sums, one rounding).

Products of bf16 values are exact in fp32, so kernel and twin differ only in the fp32 summation order (fp32
operands: also in the products' rounding): |y - twin| <= 1e-5 * sum_k |x||w| (plus one output rounding for bf16).
On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by conftest before any import).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls the twin)", allow_module_level=True)

from dsv4.fast.kernels.dense_gemv import MAX_M, dense_gemv, dense_gemv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(seed: int, M: int, N: int, K: int, dtype=torch.bfloat16):
    """x [M, K] and w [N, K] whose rows' magnitudes span 2^-6..2^6."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.exp2(torch.randint(-6, 7, (N, 1), generator=gen).float())
    x = torch.randn(M, K, generator=gen) * 3
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def check(y: torch.Tensor, x, w) -> None:
    twin = dense_gemv_reference(x, w, torch.float32)
    tol = 1e-5 * (x.abs().double() @ w.abs().double().T).float()
    if y.dtype == torch.bfloat16:
        tol = tol + twin.abs() * 2.0**-8  # one bf16 rounding
    assert y.shape == twin.shape
    assert ((y.float() - twin).abs() <= tol + 1e-30).all(), (y.float() - twin).abs().max()


@settings(max_examples=30, deadline=None)
@given(
    M=st.integers(1, 5),
    N=st.integers(1, 80),
    K=st.integers(1, 200),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    out_fp32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_twin(M, N, K, dtype, out_fp32, seed):
    """Ragged shapes (K steps whole and partial, a partial last row tile), both dtypes, both outputs."""
    x, w = make_case(seed, M, N, K, dtype)
    y = dense_gemv(x, w, torch.float32 if out_fp32 else dtype)
    assert y.dtype == (torch.float32 if out_fp32 else dtype)
    check(y, x, w)


def test_most_rows_and_a_long_k():
    x, w = make_case(1, MAX_M, 40, 320)
    check(dense_gemv(x, w, torch.bfloat16), x, w)


def test_the_bf16_output_is_the_rounded_fp32_sum():
    """bf16 output: the fp32 sum rounded to nearest even, not truncated (a rounding up happens somewhere)."""
    x, w = make_case(2, 2, 64, 128)
    y, y32 = dense_gemv(x, w, torch.bfloat16), dense_gemv(x, w, torch.float32)
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert (y.float().abs() > y32.abs()).any()


@pytest.mark.parametrize("bad, message", [
    (lambda x, w: (x, w.float(), torch.bfloat16), "both bfloat16 or both float32"),
    (lambda x, w: (x.half(), w.half(), torch.float16), "both bfloat16 or both float32"),
    (lambda x, w: (x, w, torch.float16), "out_dtype"),
    (lambda x, w: (x[:, :-1], w, torch.bfloat16), "disagree on K"),
    (lambda x, w: (x.repeat(MAX_M, 1), w, torch.bfloat16), f"at most {MAX_M} rows"),
    (lambda x, w: (x[0], w, torch.bfloat16), "2-D"),
])
def test_bad_input_names_the_problem(bad, message):
    x, w = make_case(0, 2, 8, 32)
    with pytest.raises(ValueError, match=message):
        dense_gemv(*bad(x, w))


def test_opcheck():
    x, w = make_case(3, 1, 24, 96)
    torch.library.opcheck(torch.ops.dsv4.dense_gemv, (x, w, torch.float32), test_utils=("test_schema",
                                                                                        "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2, 4, 16])
@pytest.mark.parametrize("N, K", [(1824, 5120), (2560, 5120), (300, 1000)])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_gpu_decode_shapes(M, N, K, out_fp32):
    """V4.1's index-layer bf16 part on x (wq_a, wkv, weights_proj) and a compressor-sized fp32-output part (and a
    ragged one) at decode batch sizes, through the default tiles of each."""
    x, w = make_case(M + N, M, N, K)
    check(dense_gemv(x, w, torch.float32 if out_fp32 else torch.bfloat16), x, w)
