"""dsv4.fast.kernels.indexer_query against its twin (the reference's RoPE, V4's Hadamard transform and MXFP4
rounding): the same bits.

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, as the test session sets it)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls its twin)", allow_module_level=True)

from dsv4.fast.kernels.indexer_query import indexer_query, indexer_query_twin
from dsv4.reference.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(seed: int, n: int, heads: int, width: int, rope: int, spread: float = 1.0):
    """Projections as the indexer makes them (bf16, one magnitude a block of 32, zeros and signed zeros among them)
    at random positions, with V4.1's YaRN RoPE tables."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-6, 6, (n, heads * width // 32, 1), generator=gen).float()
    q = torch.randn(n, heads * width // 32, 32, generator=gen) * torch.exp2(exponents) * spread
    kind = torch.randint(0, 16, q.shape, generator=gen)
    q = torch.where(kind == 0, 0.0, torch.where(kind == 1, -0.0, q)).flatten(1).bfloat16()
    w = (torch.randn(n, heads, generator=gen) * 3).bfloat16()
    yarn = {"original_max_position_embeddings": 65536, "factor": 16, "beta_fast": 32, "beta_slow": 1}
    cos, sin = Rotary(rope, 160000.0, yarn).cos_sin(torch.randint(0, 1 << 20, (n,), generator=gen))
    return [t.to(DEVICE) for t in (q, w, cos, sin)]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same dtype, shape and bits."""
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.view(bits), want.view(bits))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3),
       shape=st.sampled_from([(4, 64, 16), (2, 32, 32), (8, 128, 64)]), spread=st.sampled_from([1.0, 2.0**-100, 2.0**60]),
       fp32=st.booleans(), hadamard=st.booleans())
def test_kernel_gives_the_twins_bits(seed, n, shape, spread, fp32, hadamard):
    heads, width, rope = shape
    q, w, cos, sin = case(seed, n, heads, width, rope, spread)
    if fp32:  # a float32 model's projections
        q, w = q.float(), w.float()
    scale = width**-0.5 * heads**-0.5
    got = indexer_query(q, w, cos, sin, scale, hadamard)
    want = indexer_query_twin(q, w, cos, sin, scale, hadamard)
    assert same(got[0], want[0]) and same(got[1], want[1])


def test_v4_width_with_the_hadamard_transform():
    """V4's indexer: 64 heads of 128, 64 RoPE channels, Hadamard-transformed before the MXFP4 rounding: the twin's
    bits, and not the bits without the transform."""
    q, w, cos, sin = case(11, 2, 64, 128, 64)
    scale = 128**-0.5 * 64**-0.5
    got, want = indexer_query(q, w, cos, sin, scale, True), indexer_query_twin(q, w, cos, sin, scale, True)
    assert same(got[0], want[0]) and same(got[1], want[1])
    assert not same(got[0], indexer_query_twin(q, w, cos, sin, scale)[0])


def test_v41_width():
    """V4.1's indexer: 32 heads of 128, 64 RoPE channels, weights scaled by 128^-0.5 * 32^-0.5."""
    q, w, cos, sin = case(7, 2, 32, 128, 64)
    scale = 128**-0.5 * 32**-0.5
    got, want = indexer_query(q, w, cos, sin, scale), indexer_query_twin(q, w, cos, sin, scale)
    assert same(got[0], want[0]) and same(got[1], want[1])


def test_rotation_rounds_ties_to_even():
    """A rotated channel lands exactly between two bf16 values, 1.74609375 between 1.7421875 and 1.75: to even, 1.75,
    which MXFP4 (scale 1: the block holds a 6) rounds to 2, where 1.7421875 would give 1.5."""
    heads, width, rope = 2, 64, 32
    q = torch.zeros(heads, width)
    q[:, width - rope::4], q[:, width - rope + 2::4] = 6.0, 1.0  # pairs (6, 0), (1, 0) in the rotated channels
    q = q.flatten().bfloat16()[None].to(DEVICE)
    w = torch.ones(1, heads, dtype=torch.bfloat16, device=DEVICE)
    cos = torch.tensor([1.0, 1.74609375] * (rope // 4), device=DEVICE)[None]
    sin = torch.zeros(1, rope // 2, device=DEVICE)
    got, want = indexer_query(q, w, cos, sin, 1.0), indexer_query_twin(q, w, cos, sin, 1.0)
    assert want[0][0, 0, width - rope + 2].item() == 2.0
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("bad, message", [
    (lambda q, w, c, s: (q[:, :-1], w, c, s), "q \\[N, H \\* d\\]"),
    (lambda q, w, c, s: (q, w, c[:, :-1], s), "cos and sin"),
    (lambda q, w, c, s: (q.float(), w, c, s), "both bf16 or both fp32"),
    (lambda q, w, c, s: (q[:, :24 * 3], w[:, :3], c, s), "powers of two"),
])
def test_bad_input_names_the_problem(bad, message):
    q, w, cos, sin = case(1, 2, 4, 64, 16)
    with pytest.raises(ValueError, match=message):
        indexer_query(*bad(q, w, cos, sin), 0.1)


def test_opcheck():
    q, w, cos, sin = case(3, 2, 4, 64, 16)
    for hadamard in (False, True):
        torch.library.opcheck(indexer_query, (q, w, cos, sin, 0.125, hadamard),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("heads,hadamard", [(32, False), (64, True)])
def test_gpu_rows(n, heads, hadamard):
    """V4.1's (32 heads) and V4's (64, the Hadamard transform) indexer queries on the GPU for decode batches, against
    the twin: the same bits."""
    q, w, cos, sin = case(n, n, heads, 128, 64)
    scale = 128**-0.5 * heads**-0.5
    got, want = indexer_query(q, w, cos, sin, scale, hadamard), indexer_query_twin(q, w, cos, sin, scale, hadamard)
    assert same(got[0], want[0]) and same(got[1], want[1])
