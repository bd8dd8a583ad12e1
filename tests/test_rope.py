"""apply_rope against the rotation written out pair by pair (fp32 products and sums, then x's dtype)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.reference.rope import apply_rope


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """One row x [D], tables [R/2]: every trailing pair (e, o) -> (e c - o s, e s + o c) in fp32, one at a time."""
    out = x.clone()
    rd = 2 * cos.shape[0]
    for i in range(rd // 2):
        e, o = x[x.shape[0] - rd + 2 * i].float(), x[x.shape[0] - rd + 2 * i + 1].float()
        c, s = cos[i], (-sin[i] if inverse else sin[i])
        out[x.shape[0] - rd + 2 * i] = (e * c - o * s).to(x.dtype)
        out[x.shape[0] - rd + 2 * i + 1] = (e * s + o * c).to(x.dtype)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]), inverse=st.booleans(),
       shape=st.sampled_from([(8, 4), (16, 16), (12, 2)]))
def test_rotation_is_the_pairwise_formula_bit_for_bit(seed, dtype, inverse, shape):
    """Rotated channels are the formula's roundings (signed zeros and infinities included); the others are x's."""
    D, R = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, D, generator=g) * torch.exp2(torch.randint(-30, 30, (3, D), generator=g).float())
    kind = torch.randint(0, 12, x.shape, generator=g)
    x = torch.where(kind == 0, -0.0, torch.where(kind == 1, float("inf"), x)).to(dtype)
    cos, sin = torch.randn(3, R // 2, generator=g), torch.randn(3, R // 2, generator=g)
    got = apply_rope(x, cos, sin, inverse)  # rows as the S dim
    for row in range(3):
        want = rotate_pairs(x[row], cos[row], sin[row], inverse)
        same = (bits(got[row]) == bits(want)) | (got[row].isnan() & want.isnan())
        assert bool(same.all())


def test_heads_broadcast_and_unrotated_channels_untouched():
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(1, 2, 3, 8)  # [B, S, H, D]
    cos, sin = torch.zeros(1, 2, 2), torch.ones(1, 2, 2)  # a quarter turn on the last 4 channels
    got = apply_rope(x, cos, sin)
    assert torch.equal(got[..., :4], x[..., :4])
    assert torch.equal(got[..., 4::2], -x[..., 5::2]) and torch.equal(got[..., 5::2], x[..., 4::2])
    assert torch.equal(apply_rope(got, cos, sin, inverse=True), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_gpu_graph_capture(graph_replay):
    """The rotation makes its constants on the device, so a CUDA graph captures it."""
    x, cos, sin = torch.randn(4, 64, device="cuda"), torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    want = apply_rope(x, cos, sin)
    assert torch.equal(graph_replay(apply_rope, x, cos, sin), want)
