"""dsv4.fast.kernels.rope.query_heads against its twin (the reference's head_rms_norm and apply_rope): the same
values where each head's mean square is exact, one bf16 step at most and rarely elsewhere (the order of its sum).

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, as the test session sets it)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls its twin)", allow_module_level=True)

from dsv4.fast.kernels.rope import query_heads, query_heads_twin
from dsv4.reference.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def case(seed: int, n: int, heads: int, width: int, rope: int, exact: bool, dtype=torch.bfloat16):
    """wq_b's output for n rows at random positions (V4's RoPE tables, YaRN); `exact`: values k / 8, |k| <= 8, whose
    squares sum exactly in fp32 in any order."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        q = torch.randint(-8, 9, (n, heads * width), generator=gen).float() / 8
    else:
        q = torch.randn(n, heads * width, generator=gen) * torch.exp2(torch.randint(-4, 5, (n, 1), generator=gen).float())
    yarn = {"original_max_position_embeddings": 65536, "factor": 16, "beta_fast": 32, "beta_slow": 1}
    cos, sin = Rotary(rope, 160000.0, yarn).cos_sin(torch.randint(0, 1 << 20, (n,), generator=gen))
    return q.to(dtype).to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


def twin(q, cos, sin, heads: int, normed: bool) -> torch.Tensor:
    """The twin on the CPU (CUDA's rsqrt is not correctly rounded; the kernel's 1 / sqrt is, as the CPU's)."""
    return query_heads_twin(q.cpu(), cos.cpu(), sin.cpu(), heads, EPS, normed)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3), heads=st.sampled_from([1, 2, 4, 8]),
       shape=st.sampled_from([(64, 16), (128, 64), (512, 64)]), normed=st.booleans(), fp32=st.booleans())
def test_heads_with_exact_mean_squares_get_the_twins_values(seed, n, heads, shape, normed, fp32):
    width, rope = shape
    q, cos, sin = case(seed, n, heads, width, rope, exact=True, dtype=torch.float32 if fp32 else torch.bfloat16)
    got = query_heads(q, cos, sin, heads, EPS, normed)
    assert got.shape == (n, heads, width) and got.dtype == q.dtype
    assert torch.equal(got.cpu(), twin(q, cos, sin, heads, normed))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 2))
def test_any_v4_head_is_within_one_bf16_step_of_the_twins(seed, n):
    """V4's queries (64 heads of 512, 64 rotated) from random values: the sum of squares in another order moves a
    normed value by one bf16 step at most, and rarely. The rotation then carries that step into both values of its
    pair: where they nearly cancel, the step is one of the pair's magnitude (which the rotation keeps), not of the
    small result (seed 1710: -0.6523 for -0.6484 before, -0.2422 for -0.2402 after), plus one step of each rounding."""
    q, cos, sin = case(seed, n, 64, 512, 64, exact=False)
    got, want = query_heads(q, cos, sin, 64, EPS, True).cpu().float(), twin(q, cos, sin, 64, True).float()
    pair = want[..., -64:].unflatten(-1, (32, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)  # [N, 64, 64]
    scale = want.abs() + torch.nn.functional.pad(pair, (512 - 64, 0))
    assert ((got - want).abs() <= scale * 2.0**-7).all()
    assert (got != want).float().mean() < 0.01


def test_bad_arguments_fail_clearly():
    q, cos, sin = case(0, 2, 4, 64, 16, exact=True)
    with pytest.raises(ValueError, match="with 3 heads"):
        query_heads(q, cos, sin, 3, EPS, True)
    with pytest.raises(ValueError, match="cos and sin"):
        query_heads(q, cos[:1], sin[:1], 4, EPS, True)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        query_heads(q.half(), cos, sin, 4, EPS, True)
    with pytest.raises(ValueError, match="powers of two"):
        query_heads(q[:, :192], cos, sin, 4, EPS, True)
