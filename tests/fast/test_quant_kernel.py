"""dsv4.fast.kernels.quant against dsv4.quant: the same bytes, always.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported); without it and without CUDA the ops would only call dsv4.quant, so the module skips.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4 import quant as ref

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the ops only call dsv4.quant)", allow_module_level=True)

from dsv4.fast.kernels import quant
from dsv4.fast.kernels.quant import fp8_quant, mxfp4_quant, nvfp4_quant, quant_write  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAST = settings(max_examples=60, deadline=None)

# (op, reference, block sizes to draw from, largest |code value|)
FORMATS = {
    "fp8": (fp8_quant, lambda x, b: ref.quantize_fp8(x, (b,)), [16, 32, 64, 128, 3, 48], 448.0),
    "mxfp4": (mxfp4_quant, ref.quantize_mxfp4, [32, 16, 64, 2, 6], 6.0),
    "nvfp4": (nvfp4_quant, ref.quantize_nvfp4, [16, 32, 8, 2, 6], 6.0),
}

# e2m1 rounding ties (midpoints between neighbouring magnitudes)
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def e4m3_ties() -> torch.Tensor:
    """Midpoints between neighbouring finite positive e4m3 values, subnormal ones included."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    return (grid[1:] + grid[:-1]) / 2


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def make_values(seed: int, shape: tuple[int, ...], block: int, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Values spanning many magnitudes: per-block exponents, zeros, -0.0, fp32-subnormal tinies, rounding
    ties of the element format (exact when the block holds a +-qmax anchor), all-zero and huge blocks."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    nb = n // block
    qmax = FORMATS[fmt][3]
    lo, hi = (-20, 4) if dtype == torch.float16 else (-60, 60)
    exp = torch.randint(lo, hi + 1, (nb, 1), generator=gen).float()
    base = torch.randn(nb, block, generator=gen) * torch.exp2(torch.randint(-8, 3, (nb, block), generator=gen).float())
    ties = torch.tensor(E2M1_TIES) if fmt != "fp8" else e4m3_ties()
    tie = ties[torch.randint(0, len(ties), (nb, block), generator=gen)]
    tie = tie * (1 - 2 * torch.randint(0, 2, (nb, block), generator=gen).float())
    kind = torch.randint(0, 8, (nb, block), generator=gen)
    v = torch.where(kind == 2, tie, base)
    v = torch.where(kind == 3, torch.randn(nb, block, generator=gen) * 2.0**-100, v)  # x 2^exp -> fp32 subnormal
    v = torch.where(kind == 0, torch.zeros(()), v)
    v = torch.where(kind == 1, torch.full((), -0.0), v)
    anchor = torch.rand(nb, generator=gen) < 0.5
    v[:, 0] = torch.where(anchor, qmax * (1 - 2 * torch.randint(0, 2, (nb,), generator=gen).float()), v[:, 0])
    block_kind = torch.randint(0, 8, (nb, 1), generator=gen)
    x = v * torch.exp2(exp)
    x = torch.where(block_kind == 0, torch.zeros(()), x)  # all-zero block: the amax clamp
    tiny = 2.0**-20 if dtype == torch.float16 else 2.0**-40
    x = torch.where(block_kind == 1, v * tiny, x)  # all tiny
    if dtype != torch.float16:
        x = torch.where(block_kind == 2, base * 2.0**110, x)  # huge
    x = x.to(dtype)
    assert torch.isfinite(x).all()
    return x.reshape(shape).to(DEVICE)


shapes = st.tuples(st.lists(st.integers(1, 3), min_size=0, max_size=2), st.integers(1, 6))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_subnormals_quantize_as_their_fp32_values(fmt):
    """Every bf16 subnormal magnitude, both signs, alone in its block or beside a normal one: the same bytes
    as the codec, and as the kernel gives for the same values in fp32."""
    op, reference, _, _ = FORMATS[fmt]
    tiny = torch.arange(1, 129, dtype=torch.int16).view(torch.bfloat16)  # 2^-133 .. 2^-126, the least normal
    alone = torch.stack([tiny, -tiny], dim=1)  # blocks of two subnormals
    anchored = torch.stack([tiny, torch.full_like(tiny, 2.0**-120)], dim=1)
    x = torch.cat([alone, anchored]).reshape(-1, 16).to(DEVICE)  # [..., 16]: blocks of 2 (fp4) / 16
    block = 16 if fmt == "fp8" else 2
    got, want, wide = op(x, block), reference(x, block), op(x.float(), block)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    assert same_bytes(got[0], wide[0]) and same_bytes(got[1], wide[1])


@pytest.mark.parametrize("fmt", list(FORMATS))
@FAST
@given(shape=shapes, block_pick=st.integers(0, 5), dtype=dtypes, seed=st.integers(0, 2**31 - 1))
@example(shape=([], 1), block_pick=0, dtype=torch.float32, seed=0)
@example(shape=([2, 3], 5), block_pick=1, dtype=torch.bfloat16, seed=1)
@example(shape=([3], 4), block_pick=3, dtype=torch.bfloat16, seed=1)  # a bf16 subnormal (the interpreter's cast)
def test_bytes_match_reference(fmt, shape, block_pick, dtype, seed):
    op, reference, blocks, _ = FORMATS[fmt]
    block = blocks[block_pick % len(blocks)]
    lead, nblocks = shape
    x = make_values(seed, (*lead, nblocks * block), block, fmt, dtype)
    got, want = op(x, block), reference(x, block)
    assert same_bytes(got[0], want[0])
    assert same_bytes(got[1], want[1])


@pytest.mark.parametrize("fmt", list(FORMATS))
@FAST
@given(rows=st.integers(1, 24), nblocks=st.integers(1, 4), block_pick=st.integers(0, 5), dtype=dtypes,
       seed=st.integers(0, 2**31 - 1))
@example(rows=1, nblocks=4, block_pick=1, dtype=torch.bfloat16, seed=2)  # 32 NVFP4 blocks: one small program
@example(rows=5, nblocks=4, block_pick=0, dtype=torch.float32, seed=3)  # 20 blocks: a partial second program
def test_decode_and_prefill_tiles_give_the_same_bytes(fmt, rows, nblocks, block_pick, dtype, seed):
    """The same rows through the tiles quant_config picks for them (decode sizes: 1 warp, at most 256 values a
    program) and through the prefill tiles (4096 values, 4 warps): the reference's bytes both times."""
    _, reference, blocks, _ = FORMATS[fmt]
    block = blocks[block_pick % len(blocks)]
    x = make_values(seed, (rows, nblocks * block), block, fmt, dtype)  # [rows, nblocks * block]
    small = quant.quant_config(rows, nblocks * block, block)
    prefill = quant.quant_config(4096, 4096, block)
    assert small["num_warps"] == 1 and prefill["num_warps"] == 4
    want = [t.view(torch.uint8) for t in reference(x, block)]
    for cfg in (small, prefill):
        got = quant._launch(x, block, quant.FORMAT_CODES[fmt], cfg)
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1]), cfg


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_hand_vectors(fmt):
    """Ties, signed zeros and saturation inside one block whose scale is exactly 1 (amax = qmax)."""
    op, reference, _, _ = FORMATS[fmt]
    if fmt == "fp8":
        row = [448.0, -0.0, 0.0, 2.0**-10, -3 * 2.0**-10, 2.0**-7 + 2.0**-10, 1.0625, -1.1875, 240.0, 464.0 / 2, 1e-30]
    else:
        row = [6.0, -0.0, 0.0, *E2M1_TIES, *[-t for t in E2M1_TIES], -1e-30, 5.9]
    row = row + [0.0] * (-len(row) % 16)
    x = torch.tensor(row, device=DEVICE)
    got, want = op(x, len(row)), reference(x, len(row))
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_strided_and_empty_inputs(fmt):
    op, reference, _, _ = FORMATS[fmt]
    x = make_values(7, (4, 128), 32, fmt, torch.bfloat16)[:, ::2]  # non-contiguous [4, 64]
    got, want = op(x, 32), reference(x, 32)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    empty = torch.zeros(0, 64, device=DEVICE)
    got, want = op(empty, 32), reference(empty, 32)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


def row_stores(fmt: str, slots: int, rows: int, k: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's (data, scale) uint8 row stores [slots, rows, width] full of random bytes, as an earlier step left."""
    gen = torch.Generator().manual_seed(seed)
    width = k if fmt == "fp8" else k // 2
    data, scale = (torch.randint(0, 256, (slots, rows, w), generator=gen, dtype=torch.uint8) for w in (width, k // block))
    return data.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("fmt", list(FORMATS))
@FAST
@given(n=st.integers(1, 12), nblocks=st.integers(1, 4), dtype=dtypes, int32_ids=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
@example(n=1, nblocks=4, dtype=torch.bfloat16, int32_ids=False, seed=0)  # a decode step's one row
def test_quant_write_stores_the_reference_bytes_at_the_rows(fmt, n, nblocks, dtype, int32_ids, seed):
    """quant_write(x, data, scale, slots, rows) against the codec and an index write: row i's bytes land at
    (slots[i], rows[i]) and every other row keeps its bytes."""
    _, reference, blocks, _ = FORMATS[fmt]
    block = blocks[0] if fmt != "fp8" else 32
    k = nblocks * block
    x = make_values(seed, (n, k), block, fmt, dtype)
    data, scale = row_stores(fmt, 3, 8, k, block, seed)
    places = torch.randperm(3 * 8, generator=torch.Generator().manual_seed(seed))[:n].to(DEVICE)  # distinct rows
    slots, rows = places // 8, places % 8
    if int32_ids:
        slots, rows = slots.int(), rows.int()
    want_data, want_scale = data.clone(), scale.clone()
    q, sc = reference(x, block)
    want_data[slots.long(), rows.long()] = q.view(torch.uint8)
    want_scale[slots.long(), rows.long()] = sc.view(torch.uint8)
    quant_write(x, data, scale, slots, rows, fmt, block)
    assert torch.equal(data, want_data) and torch.equal(scale, want_scale)


def test_quant_write_names_what_is_wrong():
    x = torch.zeros(2, 64, device=DEVICE)
    data, scale = row_stores("fp8", 2, 4, 64, 32, 0)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="unknown format"):
        quant_write(x, data, scale, ids, ids, "int8", 32)
    with pytest.raises(ValueError, match=r"slots \[N\] and rows \[N\]"):
        quant_write(x, data, scale, ids[:1], ids, "fp8", 32)
    with pytest.raises(ValueError, match="data must be contiguous uint8"):
        quant_write(x, data[..., :32], scale, ids, ids, "fp8", 32)
    with pytest.raises(ValueError, match="scale must be contiguous uint8"):
        quant_write(x, data, scale.float(), ids, ids, "fp8", 32)
    with pytest.raises(ValueError, match="divisible"):
        quant_write(x, data, scale, ids, ids, "fp8", 48)
    with pytest.raises(ValueError, match="int32 or int64"):
        quant_write(x, data, scale, ids, ids.float(), "fp8", 32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_write_opcheck(fmt):
    """The mutating op's schema and fake implementation (torch.compile traces the decode step's writes)."""
    x = make_values(5, (2, 64), 32, fmt, torch.bfloat16)
    data, scale = row_stores(fmt, 2, 4, 64, 32, 1)
    ids = torch.tensor([1, 0], device=DEVICE)
    torch.library.opcheck(quant_write, (x, data, scale, ids, ids + 2, fmt, 32), test_utils=("test_schema", "test_faketensor"))


def test_bad_block_raises():
    x = torch.zeros(2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="divisible"):
        fp8_quant(x, 32)
    with pytest.raises(ValueError, match="even"):
        mxfp4_quant(x, 3)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_opcheck(fmt):
    """Schema, fake (meta) implementation and dispatch are consistent (torch.library.opcheck)."""
    op, _, blocks, _ = FORMATS[fmt]
    x = make_values(3, (2, 64), blocks[0], fmt, torch.bfloat16)
    torch.library.opcheck(op, (x, blocks[0]), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes(fmt, dtype):
    """Activation shapes of V4.1-Flash (hidden 5120), a decode row and a prefill batch."""
    op, reference, blocks, _ = FORMATS[fmt]
    for rows in (1, 4096):
        x = make_values(rows, (rows, 5120), blocks[0], fmt, dtype)
        got, want = op(x, blocks[0]), reference(x, blocks[0])
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt, k, block", [("fp8", 512, 32), ("nvfp4", 512, 16), ("mxfp4", 128, 32)])
@pytest.mark.parametrize("n", [1, 8, 4096])
def test_gpu_quant_write_real_rows(fmt, k, block, n):
    """V4.1's cache writes on the GPU: a window row (FP8), a compressed entry (NVFP4), an index key (MXFP4), for a
    decode batch of 1 or 8 and a 4096-token prefill, into stores of 3 slots of 4160 rows."""
    _, reference, _, _ = FORMATS[fmt]
    x = make_values(n, (n, k), block, fmt, torch.bfloat16)
    data, scale = row_stores(fmt, 3, 4160, k, block, n)
    places = torch.randperm(3 * 4160, generator=torch.Generator().manual_seed(n))[:n].to(DEVICE)
    slots, rows = places // 4160, places % 4160
    want_data, want_scale = data.clone(), scale.clone()
    q, sc = reference(x, block)
    want_data[slots, rows], want_scale[slots, rows] = q.view(torch.uint8), sc.view(torch.uint8)
    quant_write(x, data, scale, slots, rows, fmt, block)
    assert torch.equal(data, want_data) and torch.equal(scale, want_scale)
