"""dsv4.fast.kernels.attention against its twin (dsv4.quant dequantization + reference sparse_attention +
inverse RoPE).

Tolerance: |o - twin| <= 2e-2 * max|twin| + 1e-2 * |twin| (bf16 outputs; the kernel rounds probabilities to
bf16 against a running max, the twin against the final one, and sums in another order). Dequantization itself
is checked exactly: with one valid entry and a sink far below it, the output is that row, bit for bit.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported); without it and without CUDA the ops would only call the twin, so the module skips.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4.quant import quantize_fp8, quantize_nvfp4
from dsv4.reference.rope import apply_rope

pytest.importorskip("triton")  # the kernels themselves; without triton every op is its twin
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (else the ops only call the twin)", allow_module_level=True)

from dsv4.fast.kernels.attention import (  # noqa: E402
    BF16,
    FP4,
    FP8,
    INTERPRETER_CONFIG,
    KV,
    Config,
    plan_splits,
    sparse_attn,
    sparse_attn_bf16,
    sparse_attn_fp4,
    sparse_attn_fp8,
    sparse_attn_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["fp4", "fp8", "bf16"]


def make_store(fmt: str, x: torch.Tensor) -> KV:
    """Quantize latent rows x [N, D] the way the V4.1 caches do."""
    if fmt == "fp4":
        return KV(FP4, *quantize_nvfp4(x, 16))
    if fmt == "fp8":
        return KV(FP8, *quantize_fp8(x, (32,)))
    return KV(BF16, x.to(torch.bfloat16))


def on_device(kv: KV) -> KV:
    return KV(kv.fmt, kv.data.to(DEVICE), None if kv.scale is None else kv.scale.to(DEVICE))


def call_op(fmt: str, q, win: KV, win_idx, glob: KV, glob_idx, sink, scale, cos, sin, split_size=0, settled=False):
    """The custom op of a format (window FP8 for fp4/fp8, bf16 for bf16)."""
    if fmt == "fp4":
        return sparse_attn_fp4(q, win.data, win.scale, win_idx, glob.data, glob.scale, glob_idx, sink, scale, cos, sin,
                               split_size, settled)
    if fmt == "fp8":
        return sparse_attn_fp8(q, win.data, win.scale, win_idx, glob.data, glob.scale, glob_idx, sink, scale, cos, sin,
                               split_size, settled)
    return sparse_attn_bf16(q, win.data, win_idx, glob.data, glob_idx, sink, scale, cos, sin, split_size, settled)


def index_lists(gen, S: int, n: int, k: int, p_skip: float, all_skip_rows: torch.Tensor) -> torch.Tensor:
    """[S, k] int32: duplicate-free indices into n rows, a fraction -1, some rows all -1."""
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(S)]) if k else torch.zeros(S, 0, dtype=torch.long)
    skip = torch.rand(S, k, generator=gen) < p_skip
    skip |= all_skip_rows[:, None]
    return torch.where(skip, -1, idx).to(torch.int32)


def make_case(seed, fmt, S, H, D, R, W, G, kw, kg, p_skip, glob_all_skip):
    gen = torch.Generator().manual_seed(seed)
    win_x = torch.randn(W, D, generator=gen) * torch.exp2(torch.randint(-3, 4, (W, 1), generator=gen).float())
    glob_x = torch.randn(G, D, generator=gen) * torch.exp2(torch.randint(-3, 4, (G, 1), generator=gen).float())
    win = KV(FP8, *quantize_fp8(win_x, (32,))) if fmt != "bf16" else KV(BF16, win_x.to(torch.bfloat16))
    glob = make_store(fmt, glob_x)
    win_idx = index_lists(gen, S, W, kw, p_skip, torch.zeros(S, dtype=torch.bool))
    glob_idx = index_lists(gen, S, G, kg, p_skip, torch.full((S,), glob_all_skip))
    # at least one valid index per row: revive the first window (else global) slot where a row has none
    dead = ~((win_idx >= 0).any(1) | (glob_idx >= 0).any(1))
    if kw:
        win_idx[dead, 0] = torch.randint(0, W, (int(dead.sum()),), generator=gen, dtype=torch.int32)
    elif kg and not glob_all_skip:
        glob_idx[dead, 0] = torch.randint(0, G, (int(dead.sum()),), generator=gen, dtype=torch.int32)
    q = (torch.randn(S, H, D, generator=gen) * 2.0 ** torch.randint(-1, 3, (S, H, 1), generator=gen)).to(torch.bfloat16)
    sink = torch.randn(H, generator=gen) * 2
    ang = torch.rand(S, R // 2, generator=gen) * 100
    return (q.to(DEVICE), on_device(win), win_idx.to(DEVICE), on_device(glob), glob_idx.to(DEVICE), sink.to(DEVICE),
            D**-0.5, ang.cos().to(DEVICE), ang.sin().to(DEVICE))


def assert_close_to_twin(o: torch.Tensor, want: torch.Tensor) -> None:
    assert o.dtype == torch.bfloat16 and o.shape == want.shape
    scale = want.float().abs().max().item()
    torch.testing.assert_close(o.float(), want.float(), atol=2e-2 * scale + 1e-6, rtol=1e-2)


@st.composite
def cases(draw):
    S = draw(st.integers(1, 4))
    W, G = draw(st.integers(1, 40)), draw(st.integers(1, 90))
    kw = draw(st.integers(0, min(W, 24)))
    kg = draw(st.integers(0 if kw else 1, min(G, 64)))
    return dict(
        S=S, H=draw(st.integers(2, 8)), D=draw(st.sampled_from([64, 128])), R=draw(st.sampled_from([16, 32])),
        W=W, G=G, kw=kw, kg=kg,
        p_skip=draw(st.sampled_from([0.0, 0.3, 0.8])),
        glob_all_skip=draw(st.booleans()) if kw else False,
        seed=draw(st.integers(0, 2**31 - 1)),
        split_size=draw(st.sampled_from([0, 16, 32, 48, 1000])),
    )


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=25, deadline=None)
@given(case=cases())
@example(case=dict(S=1, H=8, D=128, R=32, W=40, G=90, kw=24, kg=64, p_skip=0.3, glob_all_skip=False, seed=1, split_size=16))
@example(case=dict(S=3, H=2, D=64, R=16, W=5, G=9, kw=0, kg=9, p_skip=0.0, glob_all_skip=False, seed=2, split_size=0))
@example(case=dict(S=2, H=3, D=64, R=16, W=5, G=9, kw=5, kg=9, p_skip=0.0, glob_all_skip=True, seed=3, split_size=16))
def test_matches_twin(fmt, case):
    case = dict(case)  # explicit examples are shared between the parametrized tests
    split_size = case.pop("split_size")
    args = make_case(fmt=fmt, **case)
    o = call_op(fmt, *args, split_size=split_size)
    assert_close_to_twin(o, sparse_attn_reference(*args))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=10, deadline=None)
@given(case=cases())
@example(case=dict(S=1, H=8, D=128, R=32, W=40, G=90, kw=24, kg=64, p_skip=0.3, glob_all_skip=False, seed=1, split_size=16))
@example(case=dict(S=2, H=3, D=64, R=16, W=5, G=9, kw=5, kg=9, p_skip=0.0, glob_all_skip=False, seed=4, split_size=48))
def test_settled_changes_nothing(fmt, case):
    """settled (a split's first global tile loaded before the PDL wait) gives the same bits: splits of window tiles
    only, of global tiles only (the early tile, then the rest) and of both (the early tile after the window's)."""
    case = dict(case)
    split_size = case.pop("split_size")
    args = make_case(fmt=fmt, **case)
    assert torch.equal(call_op(fmt, *args, split_size=split_size, settled=True),
                       call_op(fmt, *args, split_size=split_size))


def test_settled_reads_early_only_what_it_was_given(monkeypatch):
    """`settled` moves the global tile's loads before the PDL wait only where the kernel reads the index list and
    store it was given: one it first converts (int64 indices, made int32 by a kernel just before it) is the
    predecessor's output."""
    import dsv4.fast.kernels.attention as A

    launches = []
    kernel = A._attn_kernel

    class Recording:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs["SETTLED"]) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(A, "_attn_kernel", Recording())
    q, win, win_idx, glob, glob_idx, sink, scale, cos, sin = make_case(7, "fp4", 1, 4, 64, 16, 8, 20, 6, 10, 0.0, False)
    for idx, settled in ((glob_idx, False), (glob_idx, True), (glob_idx.long(), True)):
        sparse_attn(q, win, win_idx, glob, idx, sink, scale, cos, sin, settled=settled)
    assert launches == [False, True, False]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split_size", [0, 16])
def test_rows_without_entries_are_zero(fmt, split_size):
    """A row with no valid index (all -1, or kw = kg = 0) has only the sink in its softmax: o = 0."""
    q, win, win_idx, glob, glob_idx, sink, scale, cos, sin = make_case(5, fmt, 3, 4, 64, 16, 8, 20, 6, 10, 0.0, False)
    win_idx[1], glob_idx[1] = -1, -1
    o = call_op(fmt, q, win, win_idx, glob, glob_idx, sink, scale, cos, sin, split_size)
    assert torch.equal(o[1].float(), torch.zeros_like(o[1].float()))
    assert_close_to_twin(o, sparse_attn_reference(q, win, win_idx, glob, glob_idx, sink, scale, cos, sin))
    empty = win_idx[:, :0]
    o = call_op(fmt, q, win, empty, glob, glob_idx[:, :0], sink, scale, cos, sin, split_size)
    assert torch.equal(o.float(), torch.zeros_like(o.float()))
    assert torch.equal(sparse_attn_reference(q, win, empty, glob, glob_idx[:, :0], sink, scale, cos, sin).float(), o.float())


def random_store(fmt: int, n: int, D: int, gen) -> KV:
    """Arbitrary stored bytes (not just what a quantizer writes): every e2m1 code, e4m3 scales down to the
    subnormals, e4m3 values of every finite code, e8m0 scales over a wide range."""
    if fmt == FP4:
        data = torch.randint(0, 256, (n, D // 2), generator=gen, dtype=torch.uint8)
        scale = torch.randint(1, 0x7F, (n, D // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return KV(FP4, data, scale)
    if fmt == FP8:
        data = torch.randint(0, 256, (n, D), generator=gen, dtype=torch.uint8)
        data = torch.where((data & 0x7F) == 0x7F, 0, data).view(torch.float8_e4m3fn)  # no NaN codes
        scale = torch.randint(97, 158, (n, D // 32), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return KV(FP8, data, scale)
    return KV(BF16, (torch.randn(n, D, generator=gen) * 1e3).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", [FP4, FP8, BF16])
def test_dequantization_is_exact(fmt):
    """One valid entry per row and a sink far below: p = 1 and o is that row, dequantized; the dims outside
    RoPE must equal dsv4.quant's dequantization bit for bit."""
    gen = torch.Generator().manual_seed(fmt)
    S, H, D, R, n = 24, 3, 64, 16, 40
    win, glob = random_store(FP8 if fmt != BF16 else BF16, n, D, gen), random_store(fmt, n, D, gen)
    rows = torch.randperm(n, generator=gen)[:S]
    in_window = torch.arange(S) % 2 == 0
    win_idx = torch.full((S, 4), -1, dtype=torch.int32)
    glob_idx = torch.full((S, 4), -1, dtype=torch.int32)
    win_idx[in_window, 2] = rows[in_window].int()
    glob_idx[~in_window, 1] = rows[~in_window].int()
    q = torch.randn(S, H, D, generator=gen).to(torch.bfloat16) * 1e-3
    sink = torch.full((H,), -1e30)
    ang = torch.rand(S, R // 2, generator=gen) * 100
    win, glob, rows, cos, sin = on_device(win), on_device(glob), rows.to(DEVICE), ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    args = (q.to(DEVICE), win, win_idx.to(DEVICE), glob, glob_idx.to(DEVICE), sink.to(DEVICE), 0.1, cos, sin)
    o = sparse_attn(*args)
    want = torch.where(in_window.to(DEVICE)[:, None], win.dequantize(rows), glob.dequantize(rows))  # [S, D] bf16
    assert torch.equal(o[..., : D - R], want[:, None, : D - R].expand(S, H, D - R))
    rotated = apply_rope(want[None, :, None].expand(1, S, H, D), cos[None], sin[None], inverse=True)[0]
    torch.testing.assert_close(o.float(), rotated.float(), atol=1e-5 * rotated.float().abs().max().item(), rtol=2**-7)
    assert_close_to_twin(o, sparse_attn_reference(*args))


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_long_list(fmt):
    """Decode (S = 1) over a long list, cut into many splits, and the same with one split."""
    args = make_case(11, fmt, 1, 4, 64, 16, 40, 700, 32, 600, 0.1, False)
    want = sparse_attn_reference(*args)
    assert plan_splits(1, 4, 32, 600, torch.device(DEVICE), Config(block_n=16), split_size=48)[0] == 14
    cfg = Config(block_n=32, num_warps=4, num_stages=1) if DEVICE == "cuda" else INTERPRETER_CONFIG
    for split_size in (16, 48, 100_000):
        assert_close_to_twin(sparse_attn(*args, split_size=split_size, config=cfg), want)
    # the 64-row tiles a lone row over a long list takes on the GPU
    assert_close_to_twin(sparse_attn(*args, split_size=128, config=Config(block_n=64, num_stages=2)), want)


def test_config_resolve():
    """What the launcher picks: 16 heads for a lone row over a short list, 64 heads with 64-row tiles in 2 stages
    over a long one, 64 heads with 32-row tiles for a prefill chunk, 8 warps; a field that is set is kept."""
    decode = Config().resolve(1, 64, 128, 512)
    assert (decode.block_h, decode.block_n, decode.num_warps, decode.num_stages) == (16, 32, 8, 3)
    long_list = Config().resolve(1, 64, 128, 1 << 18)
    assert (long_list.block_h, long_list.block_n, long_list.num_stages) == (64, 64, 2)
    chunk = Config().resolve(4096, 64, 128, 512)
    assert (chunk.block_h, chunk.block_n, chunk.num_stages) == (64, 32, 3)
    assert Config().resolve(4, 64, 128, 512).block_h == 32  # 80 tiles: short, more programs
    assert Config(block_n=32, num_stages=1, num_warps=4).resolve(1, 64, 128, 1 << 18) == Config(
        block_n=32, block_h=64, num_warps=4, num_stages=1)


def test_plan_splits():
    cfg = Config(block_n=32)
    cuda = torch.device("cuda")
    # prefill fills the GPU with rows: one split
    assert plan_splits(4096, 64, 128, 512, torch.device("cpu"), cfg) == (1, 20)
    # a forced split size is rounded up to whole tiles
    assert plan_splits(1, 64, 128, 512, cuda if torch.cuda.is_available() else torch.device("cpu"), cfg, 40) == (10, 2)
    # nothing to read: one (empty) split
    assert plan_splits(1, 64, 0, 0, torch.device("cpu"), cfg) == (1, 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_and_compile(fmt):
    """Fake implementation (and schema where opcheck can run it), and a fullgraph torch.compile trace."""
    args = make_case(13, fmt, 2, 2, 64, 16, 8, 12, 4, 6, 0.0, False)
    q, win, win_idx, glob, glob_idx, sink, scale, cos, sin = args
    if fmt == "bf16":
        op_args = (q, win.data, win_idx, glob.data, glob_idx, sink, scale, cos, sin)
        op = sparse_attn_bf16
    else:
        op_args = (q, win.data, win.scale, win_idx, glob.data, glob.scale, glob_idx, sink, scale, cos, sin)
        op = sparse_attn_fp4 if fmt == "fp4" else sparse_attn_fp8
    # opcheck's schema test compares inputs with allclose, which float8 tensors do not support (CPU or CUDA)
    utils = ("test_schema", "test_faketensor") if fmt == "bf16" else ("test_faketensor",)
    torch.library.opcheck(op, op_args, test_utils=utils)
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*op_args), op(*op_args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("S, kg, G", [(1, 512, 4096), (8, 512, 4096), (1, 16384, 32768), (300, 512, 8192)])
def test_gpu_real_shapes(fmt, S, kg, G):
    """V4.1 shapes: H = 64, D = 512, RoPE 64, window 128 + top-512 (CSA2), a long HCA-like list, a prefill."""
    args = make_case(17, fmt, S, 64, 512, 64, 128, G, 128, kg, 0.05, False)
    assert_close_to_twin(call_op(fmt, *args), sparse_attn_reference(*args))
