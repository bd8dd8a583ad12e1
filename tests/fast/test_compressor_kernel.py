"""dsv4.fast.kernels.compressor.compressor_pool against its twin (the ring writes and the softmax pooling in torch
ops): the same rings always; the same latent where the softmax's sums are exact, and within the error of summing
the group in another order elsewhere.

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, as the test session sets it)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the op only calls its twin)", allow_module_level=True)

from dsv4.fast.kernels.compressor import compressor_pool, compressor_pool_twin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 4
# (ratio, overlap, latent width, ring rows): V4's ratio-4 compressors (overlapping; the ring of resume span 128 and
# the shortest), its ratio-128 one, V4.1's ratio 2, a group whose rows are no power of two
SHAPES = [(4, True, 64, 132), (4, True, 32, 8), (128, False, 32, 256), (2, False, 64, 4), (3, True, 16, 6)]


def case(seed: int, n: int, shape: tuple, exact: bool, ape: bool):
    """n rows' projections, ape, the slots' rings before the step, positions (the first completes group 0) and
    distinct slots. `exact`: kv k / 8 (|k| <= 8); every score a latent channel pools the same value once ape is added (ape's
    rows equal too), so the softmax weights are 1 / (the group's live rows), a power of two at the positions
    drawn: every sum is exact."""
    ratio, overlap, d, R = shape
    C = 2 * d if overlap else d
    gen = torch.Generator().manual_seed(seed)
    if exact:
        kv = torch.randint(-8, 9, (n, C), generator=gen).float() / 8
        ring_kv = torch.randint(-8, 9, (SLOTS, R, C), generator=gen).float() / 8
        # a latent channel pools column c of the previous group's rows and d + c of its own: one level for both
        level = (torch.randint(-16, 17, (d,), generator=gen).float() / 8).repeat(C // d)
        bias = torch.randint(-16, 17, (C,), generator=gen).float() / 8 if ape else torch.zeros(C)
        score, ring_score = (level - bias).expand(n, C).clone(), level.expand(SLOTS, R, C).clone()
        ape_t = bias.expand(ratio, C).clone() if ape else None
    else:
        kv, ring_kv = torch.randn(n, C, generator=gen) * 4, torch.randn(SLOTS, R, C, generator=gen) * 4
        score, ring_score = torch.randn(n, C, generator=gen) * 3, torch.randn(SLOTS, R, C, generator=gen) * 3
        ape_t = torch.randn(ratio, C, generator=gen) if ape else None
    # exact: every row live (where groups overlap, from position 2 ratio - 1 on) or the first group's
    pos = torch.randint(2 * ratio - 1 if exact else 0, 3 * R, (n,), generator=gen)
    pos[0] = ratio - 1
    slots = torch.randperm(SLOTS, generator=gen)[:n]
    return kv, score, ape_t, ring_kv, ring_score, pos, slots


def both(kv, score, ape, ring_kv, ring_score, pos, slots, ratio, overlap, dtype):
    """(latent, kv ring, score ring) from the kernel (on DEVICE) and from the twin (on the CPU). The kernel reads kv
    and score as the decode step hands them over: column slices of one GEMV's output."""
    on = [None if t is None else t.to(DEVICE, copy=True) for t in (kv, score, ape, ring_kv, ring_score, pos, slots)]
    shared = torch.cat((on[0], on[1], torch.full_like(on[0][:, :3], float("nan"))), dim=1)  # [N, 2 C + 3]
    on[:2] = shared.split(kv.shape[1], dim=1)[:2]
    got = compressor_pool(*on, ratio, overlap, dtype)
    rings = ring_kv.clone(), ring_score.clone()
    want = compressor_pool_twin(kv, score, ape, *rings, pos, slots, ratio, overlap, dtype)
    return (got.cpu(), on[3].cpu(), on[4].cpu()), (want, *rings)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, SLOTS), shape=st.sampled_from(SHAPES),
       ape=st.booleans(), bf16=st.booleans())
def test_exact_groups_get_the_twins_latent_and_rings(seed, n, shape, ape, bf16):
    ratio, overlap, d, _ = shape
    if ratio & (ratio - 1):  # the weights 1 / rows are exact for powers of two only
        ratio, shape = 4, (4, overlap, d, shape[3] + 2)
    dtype = torch.bfloat16 if bf16 else torch.float32
    got, want = both(*case(seed, n, shape, exact=True, ape=ape), ratio, overlap, dtype)
    assert got[0].shape == (n, d) and got[0].dtype == dtype
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, SLOTS), shape=st.sampled_from(SHAPES),
       ape=st.booleans(), bf16=st.booleans())
def test_any_group_is_within_the_error_of_its_sums_order(seed, n, shape, ape, bf16):
    """Each of the group's weighted terms carries a few ulps (exp, division, the sum of the weights: at most
    rows + 4 of them) and the sum over the rows another rows - 1 times their magnitude, in both: twice that bound,
    of the sum of the terms' magnitudes, and one step of the latent's dtype where rounding falls either side."""
    ratio, overlap = shape[:2]
    dtype = torch.bfloat16 if bf16 else torch.float32
    inputs = case(seed, n, shape, exact=False, ape=ape)
    got, want = both(*inputs, ratio, overlap, dtype)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    kv, score, ape_t, ring_kv, ring_score, pos, slots = inputs
    magnitude = compressor_pool_twin(kv.abs(), score, ape_t, ring_kv.abs(), ring_score.clone(), pos, slots, ratio,
                                     overlap, torch.float32)
    rows = 2 * ratio if overlap else ratio
    bound = 2 * (2 * rows + 4) * 2.0**-24 * magnitude + (want[0].float().abs() * 2.0**-7 if bf16 else 0)
    assert ((got[0].float() - want[0].float()).abs() <= bound).all()


def test_bad_arguments_fail_clearly():
    kv, score, ape, ring_kv, ring_score, pos, slots = case(0, 2, (4, True, 32, 8), exact=False, ape=True)
    args = {"kv": kv, "score": score, "ape": ape, "kv_ring": ring_kv, "score_ring": ring_score, "pos": pos,
            "slots": slots, "ratio": 4, "overlap": True, "dtype": torch.bfloat16}
    for change, message in [({"kv": kv.bfloat16()}, "kv and score fp32"),
                            ({"score": score.t().contiguous().t()}, "unit channel strides"),
                            ({"kv_ring": ring_kv[:, :7].contiguous()},
                             r"kv_ring must be contiguous fp32 \[slots, R >= 8"),
                            ({"ape": ape[:3]}, r"ape fp32 \[4, 64\]"),
                            ({"pos": pos.float()}, "pos and slots int32 or int64"),
                            ({"ratio": 1}, "a ratio above 1"),
                            ({"dtype": torch.float16}, "bf16 or fp32")]:
        with pytest.raises(ValueError, match=message):
            compressor_pool(**{**args, **change})
