"""dsv4.fast.kernels.fp8_gemm against its twins: the block-scaled FP8 GEMM and the FP8 linear layer.

Products of e4m3 values times power-of-two scales are exact in fp32, so kernel and twin (dequantize, fp32 matmul)
differ only in the fp32 summation order: |y - twin| <= 1e-5 * sum_k |a||w| (plus one output rounding for bf16).
On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by conftest before any import).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.quant import dequantize_fp8, quantize_fp8
from dsv4.reference.linear import Linear

pytest.importorskip("triton")  # the kernels themselves; without triton every op is its twin
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the ops only call the twin)", allow_module_level=True)

from dsv4.fast.kernels.fp8_gemm import (  # noqa: E402
    GemmConfig,
    fp8_block_gemm,
    fp8_block_gemm_reference,
    fp8_gemm,
    fp8_linear,
    fp8_linear_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAST = settings(max_examples=40, deadline=None)


def spread(gen: torch.Generator, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Gaussian values whose magnitude changes per (block) tile by 2^-6..2^6, so the scales differ."""
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    exp = torch.randint(-6, 7, (nr, nc), generator=gen).float()
    full = exp.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return torch.randn(rows, cols, generator=gen) * torch.exp2(full)


def make_case(seed: int, M: int, N: int, K: int, block: tuple[int, int], ak: int):
    gen = torch.Generator().manual_seed(seed)
    a_q, a_s = quantize_fp8(spread(gen, M, K, (1, ak)), (ak,))
    w_q, w_s = quantize_fp8(spread(gen, N, K, block), block)
    return [t.to(DEVICE) for t in (a_q, a_s, w_q, w_s)]


def bound(a_q, a_s, w_q, w_s, block, ak) -> torch.Tensor:
    """sum_k |a||w| per output, [M, N] fp32."""
    a = dequantize_fp8(a_q, a_s, (ak,)).abs()
    w = dequantize_fp8(w_q, w_s, block).abs()
    return a.double() @ w.double().T


def assert_matches(y: torch.Tensor, twin32: torch.Tensor, scale: torch.Tensor, rtol: float = 1e-5) -> None:
    """y (any dtype) against the fp32 twin: rtol * sum|a||w| (+ one rounding of y's dtype)."""
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[y.dtype]
    over = twin32.to(y.dtype).isinf()  # fp16 overflow: the same infinity
    assert torch.equal(y[over], twin32.to(y.dtype)[over])
    y, twin32 = y.masked_fill(over, 0), twin32.masked_fill(over, 0)
    err = (y.double() - twin32.double()).abs()
    tol = rtol * scale + ulp * twin32.double().abs() + 1e-30
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off; worst err/tol {(err / tol).max().item():.3g}"


def ak_for(block: tuple[int, int], K: int, choice: int) -> int:
    """An activation block dividing K that the kernel takes: bk, or 32, or 128 over 32 x 32 weights."""
    options = [b for b in (block[1], 32, 128) if K % b == 0]
    return options[choice % len(options)]


# ---------------------------------------------------------------------------------------------- the GEMM


@FAST
@given(
    seed=st.integers(0, 2**16),
    M=st.integers(1, 40),
    n32=st.integers(1, 7),
    k32=st.integers(1, 8),
    big_blocks=st.booleans(),
    ak_choice=st.integers(0, 2),
    out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    tile=st.sampled_from([None, (32, 16, 1, 128), (64, 32, 3, 128), (32, 16, 5, 32), (32, 64, 2, 64)]),
)
def test_gemm_matches_twin(seed, M, n32, k32, big_blocks, ak_choice, out_dtype, tile):
    """N, K multiples of 32; with 128 x 128 blocks the last weight block row/column is usually partial. Tiles are
    (bn, bm, split, step_k): bm >= 64 reads the activation scales from a column-major copy."""
    N, K = 32 * n32, 32 * k32
    block = (128, 128) if big_blocks else (32, 32)
    ak = ak_for(block, K, ak_choice)
    a_q, a_s, w_q, w_s = make_case(seed, M, N, K, block, ak)
    config = None if tile is None else GemmConfig(bn=tile[0], bm=tile[1], split=tile[2], step_k=tile[3], num_stages=1)
    y = fp8_gemm(a_q, a_s, w_q, w_s, *block, out_dtype, config)
    assert y.shape == (M, N) and y.dtype == out_dtype
    twin = fp8_block_gemm_reference(a_q, a_s, w_q, w_s, *block, torch.float32)
    assert_matches(y, twin, bound(a_q, a_s, w_q, w_s, block, ak))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # fp16 outputs past 65504 (the twin's inf too)
@pytest.mark.parametrize("M, N, K, block, ak", [
    (3, 160, 96, (128, 128), 32),     # partial last weight block in both N and K
    (1, 160, 256, (128, 128), 128),   # decode row, partial N block, two K blocks
    (33, 96, 256, (32, 32), 128),     # activation block larger than the weight's
    (16, 64, 64, (64, 32), 64),       # rectangular weight blocks
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_op_cases(M, N, K, block, ak, out_dtype):
    a_q, a_s, w_q, w_s = make_case(7, M, N, K, block, ak)
    y = fp8_block_gemm(a_q, a_s, w_q, w_s, block[0], block[1], out_dtype)
    twin = fp8_block_gemm_reference(a_q, a_s, w_q, w_s, *block, torch.float32)
    assert_matches(y, twin, bound(a_q, a_s, w_q, w_s, block, ak))


def test_gemm_exact_on_small_sums():
    """Integer-valued products with sums far below 2^24 are exact in any order: the kernel must be bit-equal."""
    gen = torch.Generator().manual_seed(3)
    M, N, K, block = 5, 96, 128, (32, 32)
    a = torch.randint(-8, 9, (M, K), generator=gen).float()
    w = torch.randint(-8, 9, (N, K), generator=gen).float()
    a_q, a_s = quantize_fp8(a, (32,))
    w_q, w_s = quantize_fp8(w, block)
    a_q, a_s, w_q, w_s = (t.to(DEVICE) for t in (a_q, a_s, w_q, w_s))
    y = fp8_block_gemm(a_q, a_s, w_q, w_s, 32, 32, torch.float32)
    assert torch.equal(y.cpu(), fp8_block_gemm_reference(a_q, a_s, w_q, w_s, 32, 32, torch.float32).cpu())


def test_gemm_edges_and_errors():
    a_q, a_s, w_q, w_s = make_case(1, 0, 64, 64, (32, 32), 32)
    assert fp8_block_gemm(a_q, a_s, w_q, w_s, 32, 32, torch.bfloat16).shape == (0, 64)
    a_q, a_s, w_q, w_s = make_case(1, 2, 64, 64, (32, 32), 32)
    with pytest.raises(ValueError):
        fp8_block_gemm(a_q, a_s, w_q, w_s[:1], 32, 32, torch.bfloat16)  # wrong scale grid
    with pytest.raises(ValueError):
        fp8_block_gemm(a_q.float(), a_s, w_q, w_s, 32, 32, torch.bfloat16)
    # a 16-wide activation block: no kernel, the op computes with the twin
    a16_q, a16_s = quantize_fp8(torch.randn(2, 64), (16,))
    a16_q, a16_s = a16_q.to(DEVICE), a16_s.to(DEVICE)
    y = fp8_block_gemm(a16_q, a16_s, w_q, w_s, 32, 32, torch.float32)
    assert torch.equal(y, fp8_block_gemm_reference(a16_q, a16_s, w_q, w_s, 32, 32, torch.float32))


def test_gemm_fake_and_compile_shapes():
    """register_fake: shapes and dtype under FakeTensorMode, as torch.compile traces them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a_q = torch.empty(7, 96, dtype=torch.float8_e4m3fn)
        a_s = torch.empty(7, 3, dtype=torch.float8_e8m0fnu)
        w_q = torch.empty(160, 96, dtype=torch.float8_e4m3fn)
        w_s = torch.empty(2, 1, dtype=torch.float8_e8m0fnu)
        y = torch.ops.dsv4.fp8_block_gemm(a_q, a_s, w_q, w_s, 128, 128, torch.bfloat16)
        assert y.shape == (7, 160) and y.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- the linear layer


def make_linear(seed: int, K: int, N: int, block: tuple[int, int], act_block: int | None, fp32: bool = False):
    gen = torch.Generator().manual_seed(seed)
    lin = Linear(K, N, "fp8", block, act_block, fp32=fp32)
    q, s = quantize_fp8(spread(gen, N, K, block) * 0.05, block)
    lin.weight.data.copy_(q)
    lin.scale.data.copy_(s)
    return lin.to(DEVICE)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("x_dtype, fp32", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_linear_matches_reference_forward(block, x_dtype, fp32):
    K, N = 256, 160
    lin = make_linear(11, K, N, block, block[1], fp32)
    lin.quant_sim = True
    x = (torch.randn(2, 9, K, generator=torch.Generator().manual_seed(5)) * 3).to(x_dtype).to(DEVICE)
    want = lin(x)
    got = fp8_linear(x, lin.weight, lin.scale, lin.block, lin.act_block, torch.float32 if fp32 else None)
    assert got.shape == want.shape and got.dtype == want.dtype
    a_q, a_s = quantize_fp8(x.reshape(-1, K), (block[1],))
    scale = bound(a_q, a_s, lin.weight, lin.scale, block, block[1]).reshape(*want.shape)
    twin32 = fp8_linear_reference(x, lin.weight, lin.scale, block, block[1], torch.float32)
    assert_matches(got, twin32, scale)
    assert_matches(want, twin32, scale, rtol=0.0)  # the twin is Linear.forward, rounded the same way


def test_linear_without_act_block_is_reference():
    lin = make_linear(2, 128, 64, (32, 32), None)
    x = torch.randn(3, 128, device=DEVICE)
    assert torch.equal(fp8_linear(x, lin.weight, lin.scale, lin.block, None), lin(x))


# ---------------------------------------------------------------------------------------------- GPU, real shapes

REAL = [  # (name, N, K, block)
    ("v41_wq_a", 1280, 5120, (32, 32)),
    ("v41_wkv", 512, 5120, (32, 32)),
    ("v41_wo_b", 5120, 8192, (32, 32)),
    ("v41_shared_w1", 2304, 5120, (32, 32)),
    ("v4_1024x4096", 1024, 4096, (128, 128)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, N, K, block", REAL, ids=[r[0] for r in REAL])
@pytest.mark.parametrize("M", [1, 8, 64, 512])
def test_gpu_real_shapes(name, N, K, block, M):
    """On Hopper the FP8 MMA accumulates one KB-wide product with reduced precision (as DeepSeek's kernel does),
    so the bound is 2^-10 of sum|a||w| rather than 1e-5; the bf16 output adds one rounding."""
    a_q, a_s, w_q, w_s = make_case(M + N, M, N, K, block, block[1])
    y = fp8_block_gemm(a_q, a_s, w_q, w_s, *block, torch.bfloat16)
    twin = fp8_block_gemm_reference(a_q, a_s, w_q, w_s, *block, torch.float32)
    assert_matches(y, twin, bound(a_q, a_s, w_q, w_s, block, block[1]), rtol=2.0**-10)
    lin = make_linear(M, K, N, block, block[1])
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    got = fp8_linear(x, lin.weight, lin.scale, lin.block, lin.act_block)
    a_q, a_s = quantize_fp8(x, (block[1],))
    assert_matches(got, fp8_linear_reference(x, lin.weight, lin.scale, block, block[1], torch.float32),
                   bound(a_q, a_s, lin.weight, lin.scale, block, block[1]), rtol=2.0**-10)
