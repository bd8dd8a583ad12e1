"""Tests for dsv4.quant: exact codecs.

Expected values in the known-vector tests are derived by hand from the format
definitions (e2m1 grid, e4m3 grid, power-of-two scales); the derivation is in
the comments so a reader can re-check it without trusting the code under test.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.quant import (
    E2M1_VALUES,
    _e2m1_computed,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    fake_quant_fp8,
    fake_quant_mxfp4,
    fake_quant_nvfp4,
    nvfp4_global_scale,
    pack_fp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    scale_values,
    ue8m0_scale,
    unpack_fp4,
)

FAST = settings(max_examples=150, deadline=None)

# e2m1 magnitudes for codes 0..7, written out from the format: e2m1 has one
# subnormal (0.5) and normals 2**e * (1 + m/2) for e in 0..2, m in 0..1.
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def finite_e4m3_values() -> torch.Tensor:
    """All finite float8_e4m3fn values, by reinterpreting every byte."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[~torch.isnan(vals)]


def is_power_of_two(x: torch.Tensor) -> torch.Tensor:
    m, _ = torch.frexp(x.double())
    return (m == 0.5) & (x > 0)


# ----------------------------------------------------------------- e2m1 table

def test_e2m1_table_values():
    expected = GRID + [-v for v in GRID]
    assert E2M1_VALUES.dtype == torch.float32
    assert E2M1_VALUES.tolist() == expected
    assert math.copysign(1.0, E2M1_VALUES[8].item()) == -1.0  # code 8 is -0.0


def test_e2m1_decode_matches_table():
    """The CPU's table lookup and the computed decode (other devices) agree bit for bit, -0.0 included."""
    codes = torch.arange(16, dtype=torch.uint8)
    dec = e2m1_decode(codes)
    assert dec.dtype == torch.float32
    assert dec.tolist() == GRID + [-v for v in GRID]
    computed = _e2m1_computed(codes)
    assert computed.dtype == torch.float32
    assert torch.equal(computed.view(torch.int32), dec.view(torch.int32))
    assert torch.equal(_e2m1_computed(codes.to(torch.int64)).view(torch.int32), dec.view(torch.int32))


def test_e2m1_encode_decode_roundtrip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    back = e2m1_encode(e2m1_decode(codes))
    assert back.dtype == torch.uint8
    assert back.tolist() == list(range(16))  # -0.0 keeps its sign: 8 -> 8


@pytest.mark.parametrize(
    "x, code",
    [
        # exact ties between neighbours go to the even code
        (0.25, 0),   # 0 | 0.5   -> 0   (code 0)
        (0.75, 2),   # 0.5 | 1   -> 1.0 (code 2)
        (1.25, 2),   # 1 | 1.5   -> 1.0 (code 2)
        (1.75, 4),   # 1.5 | 2   -> 2.0 (code 4)
        (2.5, 4),    # 2 | 3     -> 2.0 (code 4)
        (3.5, 6),    # 3 | 4     -> 4.0 (code 6)
        (5.0, 6),    # 4 | 6     -> 4.0 (code 6)
        # nearest, not a tie
        (0.2, 0), (0.3, 1), (0.7, 1), (0.8, 2), (1.3, 3), (1.8, 4),
        (2.6, 5), (3.4, 5), (3.6, 6), (4.9, 6), (5.1, 7),
        # saturation
        (6.0, 7), (7.0, 7), (100.0, 7), (float("inf"), 7),
        (-6.0, 15), (-7.0, 15), (-100.0, 15), (float("-inf"), 15),
        # negatives: sign in bit 3, kept when the magnitude rounds to 0
        (-0.1, 8), (-0.0, 8), (-1e-30, 8), (-0.25, 8), (0.0, 0),
        (-0.75, 10), (-1.3, 11), (-2.5, 12), (-5.0, 14), (-5.1, 15),
    ],
)
def test_e2m1_encode_hand_values(x, code):
    assert e2m1_encode(t([x])).item() == code


@FAST
@given(st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=64))
def test_e2m1_encode_is_nearest(xs):
    x = t(xs)
    got = e2m1_decode(e2m1_encode(x))
    target = x.clamp(-6, 6)
    dist_all = (target.unsqueeze(-1) - E2M1_VALUES).abs().min(dim=-1).values
    assert torch.equal((got - target).abs(), dist_all)


def test_e2m1_encode_accepts_bf16_and_shapes():
    x = t([[0.75, -3.5], [5.0, 9.0]], torch.bfloat16)
    assert e2m1_encode(x).tolist() == [[2, 14], [6, 7]]


def test_e2m1_encode_nan_raises():
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(t([1.0, float("nan")]))


# ----------------------------------------------------------------- packing

def test_pack_known_vector():
    packed = pack_fp4(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0x21, 0x43]  # even element in the low nibble
    assert unpack_fp4(packed).tolist() == [1, 2, 3, 4]


def test_pack_high_codes_and_int8_input():
    codes = torch.tensor([15, 8, 0, 15], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [0x8F, 0xF0]
    as_int8 = packed.view(torch.int8)
    assert as_int8.tolist() == [-113, -16]  # negative bytes: shift must be logical
    assert unpack_fp4(as_int8).tolist() == codes.tolist()


@FAST
@given(
    st.lists(st.integers(1, 4), min_size=0, max_size=3),
    st.integers(1, 16),
    st.randoms(use_true_random=False),
)
def test_pack_unpack_roundtrip(lead, half_k, rnd):
    shape = (*lead, 2 * half_k)
    gen = torch.Generator().manual_seed(rnd.randint(0, 2**31 - 1))
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=gen)
    packed = pack_fp4(codes)
    assert packed.shape == (*lead, half_k)
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), codes)


def test_pack_odd_k_raises():
    with pytest.raises(ValueError, match="divisible"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------- ue8m0 scale

@pytest.mark.parametrize(
    "amax, qmax, expected",
    [
        (448.0, 448.0, 1.0),
        (449.0, 448.0, 2.0),
        (1.0, 448.0, 2.0**-8),    # 1/448 = 2**-8.81 -> ceil -> 2**-8
        (224.0, 448.0, 0.5),      # exactly 2**-1
        (1000.0, 448.0, 4.0),     # 2.23 -> 4
        (6.0, 6.0, 1.0),
        (6.01, 6.0, 2.0),
        (3.0, 6.0, 0.5),
        (1000.0, 6.0, 256.0),     # 166.7 -> 2**8
        (6 * 2.0**-126, 6.0, 2.0**-126),
    ],
)
def test_ue8m0_known(amax, qmax, expected):
    s = ue8m0_scale(t([amax]), qmax)
    assert s.dtype == torch.float32
    assert s.item() == expected


@FAST
@given(
    st.lists(st.floats(2.0**-100, 2.0**100, width=32), min_size=1, max_size=32),
    st.sampled_from([448.0, 6.0]),
)
def test_ue8m0_power_of_two_and_bounds(amaxes, qmax):
    amax = t(amaxes)
    s = ue8m0_scale(amax, qmax)
    ratio = amax.double() / qmax
    assert bool(is_power_of_two(s).all())
    assert bool((s.double() >= ratio).all())
    assert bool((s.double() < 2 * ratio).all())


def test_ue8m0_leading_dims():
    amax = torch.full((2, 3, 4), 449.0)
    assert torch.equal(ue8m0_scale(amax, 448.0), torch.full((2, 3, 4), 2.0))


def test_scale_values_decode_every_e8m0_byte_as_torch_casts_it():
    """The bit decoding that torch.compile can fuse: byte b is 2^(b - 127) (the format: 0 is 2^-127, a subnormal
    fp32, and 255 NaN), bit for bit what torch's own e8m0 cast gives."""
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = scale_values(scales)
    assert got.dtype == torch.float32
    powers = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64).float()
    assert torch.equal(got[:255].view(torch.int32), powers.view(torch.int32))
    assert torch.equal(got[:255].view(torch.int32), scales.float()[:255].view(torch.int32))
    assert torch.isnan(got[255]) and torch.isnan(scales.float()[255])
    other = torch.tensor([0.5, 3.0], dtype=torch.bfloat16)  # any other scale dtype: a plain cast
    assert torch.equal(scale_values(other), other.float())


# ----------------------------------------------------------------- FP8

def test_fp8_known_exact_block():
    x = t([448.0, 1.0, -3.5, 0.0])
    q, s = quantize_fp8(x, (4,))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.float().tolist() == [1.0]
    assert q.float().tolist() == [448.0, 1.0, -3.5, 0.0]
    assert dequantize_fp8(q, s, (4,)).tolist() == [448.0, 1.0, -3.5, 0.0]


def test_fp8_known_rounded_block():
    # amax 1000: 1000/448 = 2.23 -> scale 4. 1000/4 = 250; e4m3 near 250 are
    # 240 and 256 (spacing 16 in [128, 256)), 250 -> 256 -> dequant 1024.
    # 1/4, 2/4, 3/4 are exact e4m3 values.
    x = t([1000.0, 1.0, 2.0, 3.0])
    q, s = quantize_fp8(x, (4,))
    assert s.float().tolist() == [4.0]
    assert q.float().tolist() == [256.0, 0.25, 0.5, 0.75]
    assert dequantize_fp8(q, s, (4,)).tolist() == [1024.0, 1.0, 2.0, 3.0]


def test_fp8_saturates_instead_of_nan():
    # amax 449 -> scale 2; 449/2 = 224.5 -> 224. Scale is never below amax/448,
    # but a huge value must never turn into NaN anyway.
    x = t([449.0, -449.0, 3e38, 1.0])
    q, s = quantize_fp8(x, (4,))
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().max().item() <= 448.0


def test_fp8_activation_blocks_layout():
    x = torch.ones(2, 3, 256)
    x[1, 2, 128:] = 1000.0  # second block of the last row
    for bs in (32, 64, 128):
        q, s = quantize_fp8(x, (bs,))
        assert q.shape == x.shape and s.shape == (2, 3, 256 // bs)
    q, s = quantize_fp8(x, (128,))
    # amax 1 -> 2**-8; amax 1000 -> 4
    assert s.float()[0, 0].tolist() == [2.0**-8, 2.0**-8]
    assert s.float()[1, 2].tolist() == [2.0**-8, 4.0]


@FAST
@given(
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=32, max_size=32),
    st.integers(-30, 30),
)
def test_fp8_roundtrip_error_bound(vals, exp):
    x = t(vals) * 2.0**exp
    q, s = quantize_fp8(x, (32,))
    deq = dequantize_fp8(q, s, (32,))
    scale = s.float().item()
    # e4m3 has 3 mantissa bits: RNE relative error <= 2**-4 for normals;
    # below 2**-6 (subnormal) the spacing is 2**-9, so abs error <= 2**-10 * s.
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale
    assert bool(((deq - x).abs() <= bound).all())


@FAST
@given(
    st.lists(st.integers(0, 253), min_size=32, max_size=32),
    st.integers(-4, 40),
)
def test_fp8_grid_values_roundtrip_exactly(idx, exp):
    # exp >= -4 keeps any non-zero amax >= 2**-9 * 2**-4 above the 1e-4 clamp,
    # below which the scale is no longer amax-driven and tiny values may flush.
    grid = finite_e4m3_values()  # 254 values
    x = grid[torch.tensor(idx)] * 2.0**exp
    q, s = quantize_fp8(x, (32,))
    assert torch.equal(dequantize_fp8(q, s, (32,)), x)


def test_fp8_weight_blocks_partial_edges():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 40, generator=gen)
    w[:32, :32] = 0.0               # an all-zero block
    w[32:64, 32:40] *= 0.001
    w[40, 35] = 1000.0              # block (1, 1): amax 1000 -> scale 4
    w[64:70, 32:40] = 0.0
    w[65, 33] = 3.0                 # partial corner block: 3/448 -> 2**-7
    q, s = quantize_fp8(w, (32, 32))
    assert q.shape == (70, 40) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (3, 2) and s.dtype == torch.float8_e8m0fnu
    sf = s.float()
    assert sf[0, 0].item() == 2.0**-22  # amax clamped to 1e-4: 1e-4/448 = 2**-22.09
    assert sf[1, 1].item() == 4.0
    assert sf[2, 1].item() == 2.0**-7
    deq = dequantize_fp8(q, s, (32, 32))
    assert deq.shape == (70, 40)
    assert torch.equal(deq[:32, :32], torch.zeros(32, 32))
    assert deq[40, 35].item() == 1024.0  # 250 -> 256, as in the 1-D case
    assert deq[65, 33].item() == 3.0
    scale_full = sf.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :40]
    assert bool(((deq - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * scale_full).all())


def test_fp8_weight_blocks_checkpoint_shape_and_leading_dims():
    w = torch.randn(1280, 5120)
    _, s = quantize_fp8(w, (32, 32))
    assert s.shape == (40, 160)
    _, s = quantize_fp8(torch.randn(300, 200), (128, 128))
    assert s.shape == (3, 2)
    stacked = torch.randn(3, 70, 40)
    q, s = quantize_fp8(stacked, (32, 32))
    assert s.shape == (3, 3, 2)
    for i in range(3):
        qi, si = quantize_fp8(stacked[i], (32, 32))
        assert torch.equal(q[i].float(), qi.float()) and torch.equal(s[i].float(), si.float())
    assert dequantize_fp8(q, s, (32, 32)).shape == (3, 70, 40)


def test_fp8_errors():
    with pytest.raises(ValueError, match="30.*32"):
        quantize_fp8(torch.randn(4, 30), (32,))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8(t([1.0, float("nan"), 0.0, 0.0]), (4,))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8(torch.full((40, 40), float("nan")), (32, 32))
    with pytest.raises(ValueError):
        quantize_fp8(torch.randn(4, 32), (32, 32, 32))
    with pytest.raises(ValueError, match="divisible"):
        fake_quant_fp8(torch.randn(100), 64)


def test_fake_quant_fp8_dtype_shape_and_value():
    x = torch.randn(3, 5, 128)
    y = fake_quant_fp8(x.bfloat16(), 128)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = dequantize_fp8(*quantize_fp8(x, (64,)), (64,))
    assert torch.equal(fake_quant_fp8(x, 64), ref)


# ----------------------------------------------------------------- MXFP4

def test_mxfp4_known_vector():
    # amax 3 -> s = 2**ceil(log2(3/6)) = 0.5. x/s and the nearest e2m1 value:
    #  3 -> 6 (7) | -3 -> -6 (15) | 1 -> 2 (4)  | 0.3 -> 0.6 -> 0.5 (1)
    #  0.2 -> 0.4 -> 0.5 (1) | 2.2 -> 4.4 -> 4 (6) | -1.3 -> -2.6 -> -3 (13)
    #  0.75 -> 1.5 (3) | 1.25 -> 2.5 tie -> 2 (4) | -0.125 -> -0.25 tie -> -0 (8)
    x = torch.zeros(32)
    x[:10] = t([3.0, -3.0, 1.0, 0.3, 0.2, 2.2, -1.3, 0.75, 1.25, -0.125])
    packed, s = quantize_mxfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (16,)
    assert s.dtype == torch.float8_e8m0fnu and s.float().tolist() == [0.5]
    assert packed[:5].tolist() == [0xF7, 0x14, 0x61, 0x3D, 0x84]
    assert packed[5:].tolist() == [0] * 11
    deq = dequantize_mxfp4(packed, s)
    assert deq[:10].tolist() == [3.0, -3.0, 1.0, 0.25, 0.25, 2.0, -1.5, 0.75, 1.0, -0.0]
    assert deq[10:].tolist() == [0.0] * 22


def test_mxfp4_known_large_block():
    # amax 1000: 1000/6 = 166.7 -> s = 256; 1000/256 = 3.906 -> 4 -> 1024.
    # 100/256 = 0.39 -> 0.5 -> 128.
    x = torch.zeros(2, 32)
    x[1, 0], x[1, 1] = 1000.0, 100.0
    x[0, 0] = 6.0  # s = 1 exactly
    packed, s = quantize_mxfp4(x)
    assert s.float().tolist() == [[1.0], [256.0]]
    deq = dequantize_mxfp4(packed, s)
    assert deq[1, :2].tolist() == [1024.0, 128.0]
    assert deq[0, 0].item() == 6.0


def test_mxfp4_all_zero_block():
    packed, s = quantize_mxfp4(torch.zeros(64))
    assert s.float().tolist() == [2.0**-126, 2.0**-126]
    assert torch.equal(packed, torch.zeros(32, dtype=torch.uint8))


@FAST
@given(
    st.lists(st.integers(0, 15), min_size=64, max_size=64),
    st.integers(-100, 100),
)
def test_mxfp4_grid_inputs_roundtrip_exactly(codes, exp):
    # Any e2m1 values times 2**exp: the block scale is a power of two that
    # maps amax into (3, 6], and that only ever doubles grid values onto the grid.
    x = e2m1_decode(torch.tensor(codes)) * 2.0**exp
    packed, s = quantize_mxfp4(x)
    assert torch.equal(dequantize_mxfp4(packed, s), x)


def _half_spacing(a: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 grid spacing around magnitude a in [0, 6]."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


@FAST
@given(
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=64, max_size=64),
    st.integers(-60, 60),
)
def test_mxfp4_error_bound(vals, exp):
    x = t(vals).reshape(2, 32) * 2.0**exp
    packed, s = quantize_mxfp4(x)
    deq = dequantize_mxfp4(packed, s)
    sf = s.float()  # [2, 1]
    assert bool((x.abs() <= 6 * sf * (1 + 1e-6)).all())  # in range: no saturation
    err = (deq - x).abs()
    assert bool((err <= sf).all())  # top spacing is 2 (4 -> 6): half of it, times s
    assert bool((err <= _half_spacing(x.abs() / sf) * sf * (1 + 1e-6)).all())


def test_mxfp4_errors_and_fake_quant():
    with pytest.raises(ValueError, match="33.*32"):
        quantize_mxfp4(torch.randn(33))
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(torch.full((32,), float("nan")))
    x = torch.randn(4, 3, 64)
    y = fake_quant_mxfp4(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(fake_quant_mxfp4(x), dequantize_mxfp4(*quantize_mxfp4(x)))


# ----------------------------------------------------------------- NVFP4

def test_nvfp4_known_vectors():
    x = torch.zeros(3, 16)
    # block 0: amax 6 -> s = e4m3(6/6) = 1. 6 -> 6 (7); -1.2 -> -1 (10);
    #          0.3 -> 0.5 (1); 2.6 -> 3 (5)
    x[0, :4] = t([6.0, -1.2, 0.3, 2.6])
    # block 1: amax 7 -> 7/6 = 1.1667; e4m3 neighbours 1.125 / 1.25 -> 1.125.
    #          7/1.125 = 6.22 saturates -> 6 -> 6.75; 1/1.125 = 0.89 -> 1 -> 1.125;
    #          -3.3/1.125 = -2.93 -> -3 -> -3.375
    x[1, :3] = t([7.0, 1.0, -3.3])
    # block 2: all zero: amax clamped to 6 * 2**-9 -> s = 2**-9 (e4m3 min subnormal)
    packed, s = quantize_nvfp4(x)
    assert packed.shape == (3, 8) and s.shape == (3, 1)
    assert s.dtype == torch.float8_e4m3fn
    assert s.float().flatten().tolist() == [1.0, 1.125, 2.0**-9]
    assert packed[0, :2].tolist() == [0xA7, 0x51]
    deq = dequantize_nvfp4(packed, s)
    assert deq[0, :4].tolist() == [6.0, -1.0, 0.5, 3.0]
    assert deq[1, :3].tolist() == [6.75, 1.125, -3.375]
    assert deq[2].tolist() == [0.0] * 16


@FAST
@given(
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=16, max_size=16),
    st.floats(0.1, 2000.0),
)
def test_nvfp4_error_bound(vals, amax):
    x = t(vals)
    x[0] = 1.0
    x = x * amax  # block amax in [0.1, 2000]: amax/6 in e4m3's normal range
    packed, s = quantize_nvfp4(x)
    sf = s.float()
    err = (dequantize_nvfp4(packed, s) - x).abs()
    # e4m3 rounding of amax/6 may shrink s by <= 2**-4 relative, so x/s <= 6.375:
    # saturation costs <= 0.375 s, rounding inside the grid <= 1 s (4 -> 6 gap).
    assert bool((err <= sf * (1 + 1e-6)).all())


@FAST
@given(
    st.lists(st.integers(0, 15), min_size=32, max_size=32),
    st.lists(st.integers(0, 118), min_size=2, max_size=2),
    st.integers(-20, 20),
)
def test_nvfp4_global_scale_grid_roundtrip_exactly(codes, scale_idx, gexp):
    # x = e2m1 * s * g with s a normal e4m3 value, g a power of two and one
    # element per block at 6 (so amax/6/g recovers s exactly).
    normals = finite_e4m3_values()
    normals = normals[normals >= torch.finfo(torch.float8_e4m3fn).tiny]  # 119 values
    s = normals[torch.tensor(scale_idx)]  # [2]
    g = torch.tensor(2.0**gexp)
    vals = e2m1_decode(torch.tensor(codes)).reshape(2, 16)
    vals[:, 0] = 6.0
    x = (vals * (s * g).unsqueeze(-1)).flatten()
    packed, sq = quantize_nvfp4(x, global_scale=g)
    assert sq.float().tolist() == s.tolist()
    assert torch.equal(dequantize_nvfp4(packed, sq, global_scale=g), x)


def test_nvfp4_global_scale_roundtrip_bound():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=gen) * torch.logspace(-3, 3, 8).unsqueeze(-1)
    g = nvfp4_global_scale(x)
    assert g.dim() == 0 and g.dtype == torch.float32
    assert g.item() == pytest.approx(x.abs().max().item() / 2688, rel=1e-6)
    packed, s = quantize_nvfp4(x, global_scale=g)
    assert s.float().max().item() == 448.0  # the tensor's amax block uses e4m3's top
    eff = (s.float() * g).repeat_interleave(16, dim=-1)
    err = (dequantize_nvfp4(packed, s, global_scale=g) - x).abs()
    assert bool((err <= eff * (1 + 1e-5)).all())


def test_nvfp4_global_scale_known_and_zero():
    assert nvfp4_global_scale(t([-2688.0, 1.0])).item() == 1.0
    g0 = nvfp4_global_scale(torch.zeros(16))
    assert g0.item() > 0
    packed, s = quantize_nvfp4(torch.zeros(16), global_scale=g0)
    assert s.float().item() == 2.0**-6  # clamped to the smallest normal e4m3
    assert torch.equal(dequantize_nvfp4(packed, s, global_scale=g0), torch.zeros(16))


def test_nvfp4_errors_and_fake_quant():
    with pytest.raises(ValueError, match="20.*16"):
        quantize_nvfp4(torch.randn(20))
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4(t([float("nan")] + [0.0] * 15))
    with pytest.raises(ValueError, match="NaN"):
        fake_quant_nvfp4(t([float("nan")] + [0.0] * 15))
    x = torch.randn(2, 5, 64)
    y = fake_quant_nvfp4(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    y16 = fake_quant_nvfp4(x.half())
    assert y16.dtype == torch.float16
    assert torch.equal(fake_quant_nvfp4(x), dequantize_nvfp4(*quantize_nvfp4(x)))
