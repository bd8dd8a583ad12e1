"""dsv4::engram_hash and the Engram row gather / prefetcher against their twins (dsv4.reference.engram).

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before the kernel
module is imported); the `gpu` tests run them compiled, read the table from pinned host memory over
UVA on a side stream, and check that the main stream is never synchronized.

Comparison: the hash is integer work and must equal engram_hash_ids exactly. Gathered rows must equal
EngramEmbedding.forward bit for bit (NaN codes of e4m3 / e8m0 only need to stay NaN).
"""

from __future__ import annotations

import time

import pytest
import torch

# tests/conftest.py chooses the Triton interpreter (no GPU) before any triton import
pytest.importorskip("triton")

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.fast.engram_prefetch import (
    EngramPrefetcher,
    HostEngramTable,
    clear_cuda_error,
    cuda_runtime_paths,
    thp_setting,
)
from dsv4.fast.kernels import engram as E
from dsv4.reference.engram import DEAD, EngramEmbedding, engram_hash_ids

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# int64 products wrap on purpose (as in torch); the interpreter's numpy reports it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

COMPRESSED_VOCAB = 99_092
MULT_BOUND = (2**63 - 1) // COMPRESSED_VOCAB


def make_constants(L, N, H, seed, vocab=16_000_000):
    g = torch.Generator().manual_seed(seed)
    mult = torch.randint(0, MULT_BOUND // 2, (L, N), generator=g, dtype=torch.int64) * 2 + 1
    primes = vocab - 1 + torch.randint(1, 200_000, (L, N - 1, H), generator=g, dtype=torch.int64)
    flat = primes.flatten(1)
    offsets = torch.cumsum(flat, 1) - flat  # exclusive cumulative sum, per layer
    return mult, primes, offsets


def make_history(B, T, dead_p, seed, vocab=COMPRESSED_VOCAB):
    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(0, vocab, (B, T), generator=g, dtype=torch.int64)
    dead = torch.rand(B, T, generator=g) < dead_p
    return comp.masked_fill(dead, DEAD)


# ------------------------------------------------------------------------------------------------ hash


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3), T=st.integers(1, 70), start_frac=st.floats(0, 1), N=st.integers(2, 4),
    H=st.integers(1, 8), L=st.integers(1, 2), dead_p=st.sampled_from([0.0, 0.1, 0.4]),
    pad=st.integers(0, COMPRESSED_VOCAB - 1), seed=st.integers(0, 2**31),
)
def test_hash_equals_twin(B, T, start_frac, N, H, L, dead_p, pad, seed):
    start = int(start_frac * T)
    comp = make_history(B, T, dead_p, seed)
    mult, primes, offsets = make_constants(L, N, H, seed + 1)
    out = E.engram_hash(comp, start, mult, primes, offsets, pad)
    ref = engram_hash_ids(comp, start, mult, primes, offsets, pad)
    assert out.shape == ref.shape == (B, T - start, L, (N - 1) * H)
    assert out.dtype == torch.int64
    assert torch.equal(out, ref)


def test_hash_extremes():
    """Largest multipliers and ids (products near int64 max), all-DEAD and no-DEAD rows, strided input."""
    L, N, H = 2, 4, 8
    mult = torch.full((L, N), MULT_BOUND - (MULT_BOUND + 1) % 2, dtype=torch.int64)  # largest odd
    _, primes, offsets = make_constants(L, N, H, 3)
    comp = torch.full((3, 40), COMPRESSED_VOCAB - 1, dtype=torch.int64)
    comp[1] = DEAD
    comp[2, ::3] = DEAD
    wide = torch.stack([comp, comp], -1)[..., 0]  # non-contiguous [B, T]
    for start in (0, 1, 5, 39, 40):
        ref = engram_hash_ids(comp, start, mult, primes, offsets, 2)
        assert torch.equal(E.engram_hash(wide, start, mult, primes, offsets, 2), ref)
    assert (ref >= 0).all()


def test_hash_fake_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    comp = make_history(2, 9, 0.2, 0)
    mult, primes, offsets = make_constants(2, 4, 8, 0)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (comp, mult, primes, offsets)]
        out = E.engram_hash(args[0], 3, args[1], args[2], args[3], 2)
    assert out.shape == (2, 6, 2, 24) and out.dtype == torch.int64
    torch.library.opcheck(E.engram_hash, (comp, 3, mult, primes, offsets, 2),
                          test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------------ gather


def make_embedding(rows, seed, nan_free=False):
    g = torch.Generator().manual_seed(seed)
    emb = EngramEmbedding(rows, 256)
    w = torch.randint(0, 256, (rows, 256), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 140, (rows, 8), generator=g, dtype=torch.uint8)
    if not nan_free:  # every e4m3 code (NaNs included) and the e8m0 extremes
        w[0] = torch.arange(256, dtype=torch.uint8)
        s[0] = torch.tensor([0, 1, 127, 254, 255, 126, 128, 120], dtype=torch.uint8)
    else:
        w[(w & 0x7F) == 0x7F] = 0
    emb.weight.data = w.view(torch.float8_e4m3fn)
    emb.scale.data = s.view(torch.float8_e8m0fnu)
    return emb


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that a NaN only needs to be a NaN."""
    a, b = a.cpu(), b.cpu()
    bits_eq = a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32) == b.view(
        torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    return a.shape == b.shape and bool((bits_eq | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_equals_embedding(dtype):
    emb = make_embedding(300, 1)
    table = HostEngramTable.from_embedding(emb, mode="pageable")
    assert table.mode == "pageable" and table.data.shape == (300, 264)
    ids = torch.randint(0, 300, (2, 5, 2, 24), generator=torch.Generator().manual_seed(2))
    ids[0, 0, 1, :3] = 0  # the row with every code
    for layer in range(2):
        view = ids[:, :, layer]  # strided, as the prefetcher passes it
        out = E.engram_gather(table.data, view, dtype=dtype)
        assert same_rows(out, emb(view, dtype))
        assert same_rows(E.engram_gather_twin(table.data, view, dtype), emb(view, dtype))


def test_table_loads_in_chunks():
    emb = make_embedding(1000, 3)
    table = HostEngramTable(1000, mode="pageable").load_(emb.weight.data, emb.scale.data, chunk_rows=128)
    assert torch.equal(table.data[:, :256], emb.weight.data.view(torch.uint8))
    assert torch.equal(table.data[:, 256:], emb.scale.data.view(torch.uint8))
    with pytest.raises(ValueError):
        HostEngramTable(999, mode="pageable").load_(emb.weight.data, emb.scale.data)


def test_prefetcher_cpu_rows_and_buffer_reuse():
    embs = [make_embedding(500, 4), make_embedding(700, 5)]
    tables = [HostEngramTable.from_embedding(e, mode="pageable") for e in embs]
    pre = EngramPrefetcher(tables, "cpu", max_tokens=16)
    g = torch.Generator().manual_seed(6)
    ptrs = None
    for B, S in [(1, 1), (2, 8), (4, 4), (1, 3), (16, 1)]:
        ids = torch.stack([torch.randint(0, 500, (B, S, 24), generator=g),
                           torch.randint(0, 700, (B, S, 24), generator=g)], 2)  # [B, S, L, C]
        pre.start(ids)
        for layer in (1, 0):
            assert same_rows(pre.wait(layer), embs[layer](ids[:, :, layer], torch.bfloat16))
        now = [(b.data_ptr(), b.numel()) for b in pre.buffers]
        assert ptrs is None or now == ptrs, "the staging buffers must be reused, not reallocated"
        ptrs = now
    assert pre.buffers[0].numel() == 16 * 24 * 256


def test_prefetcher_holds_only_the_ids_of_a_start_that_ran():
    """rows_for knows the ids of the last start made with hold=True, and of no start that failed (a graph's
    buffers would have handed another step's rows) or did not hold them."""
    embs = [make_embedding(500, 4)]
    pre = EngramPrefetcher([HostEngramTable.from_embedding(embs[0], mode="pageable")], "cpu", max_tokens=2)
    small = torch.randint(0, 500, (1, 2, 1, 24))
    pre.start(small, hold=True)
    assert same_rows(pre.rows_for(0, small[:, :, 0], torch.bfloat16), embs[0](small[:, :, 0], torch.bfloat16))
    pre._captured = True  # as after a CUDA graph captured a start
    big = torch.randint(0, 500, (1, 8, 1, 24))
    with pytest.raises(RuntimeError, match="larger max_tokens"):
        pre.start(big, hold=True)
    assert pre.rows_for(0, big[:, :, 0], torch.bfloat16) is None
    assert pre.rows_for(0, small[:, :, 0], torch.bfloat16) is None
    pre.start(small)
    assert pre.rows_for(0, small[:, :, 0], torch.bfloat16) is None
    assert pre.fits(2, 24) and not pre.fits(3, 24) and not pre.fits(2, 16)


def test_the_cuda_runtime_is_found_among_the_mappings():
    lines = [
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libcudart.so.13.0.1\n",
        "7f10-7f20 r--p 00010000 08:01 1 /usr/lib/libcudart.so.13.0.1\n",
        "7f20-7f30 r-xp 00000000 08:01 2 /opt/my libs/libcudart.so.12 (deleted)\n",
        "7f30-7f40 r-xp 00000000 08:01 3 /wheels/torch/lib/libcudart-d0da41ae.so.11.0\n",
        "7f40-7f50 r-xp 00000000 08:01 4 /usr/lib/libcudart_static_helper.a\n",
        "7f50-7f60 r-xp 00000000 08:01 5 /usr/lib/libcudnn.so.9\n",
        "7f60-7f70 rw-p 00000000 00:00 0\n",
        "7f70-7f80 r-xp 00000000 08:01 6 /home/libcudart_fans/libfoo.so\n",
    ]
    assert cuda_runtime_paths(lines) == ["/opt/my libs/libcudart.so.12", "/usr/lib/libcudart.so.13.0.1",
                                         "/wheels/torch/lib/libcudart-d0da41ae.so.11.0"]


# ------------------------------------------------------------------------------------------------ GPU


def test_prefetcher_cpu_many_tables_one_launch_each_four():
    """Five tables: launches of four and one; non-contiguous int32 ids are taken as they come."""
    embs = [make_embedding(60 + 7 * i, 20 + i) for i in range(5)]
    tables = [HostEngramTable.from_embedding(e, mode="pageable") for e in embs]
    pre = EngramPrefetcher(tables, "cpu", max_tokens=4)
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randint(0, e.num_embeddings, (2, 3, 4), generator=g) for e in embs], 2)
    ids[0, 0, :, 0] = 0
    ids[1, 2, 3, 1] = -5  # off the table: a row of zeros
    strided = ids.to(torch.int32).transpose(0, 1).contiguous().transpose(0, 1)
    pre.start(strided)
    for layer in range(5):
        want = embs[layer](ids[:, :, layer].clamp(min=0), torch.bfloat16)
        want[1, 2, 1] = 0 if layer == 3 else want[1, 2, 1]
        assert same_rows(pre.wait(layer), want)


@gpu
@needs_cuda
def test_gpu_hash_v41_shapes():
    mult, primes, offsets = make_constants(2, 4, 8, 7)
    comp = make_history(4, 4096, 0.02, 8).cuda()
    for start in (0, 4000, 4095):
        out = E.engram_hash(comp, start, mult.cuda(), primes.cuda(), offsets.cuda(), 2)
        ref = engram_hash_ids(comp.cpu(), start, mult, primes, offsets, 2)
        assert torch.equal(out.cpu(), ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["auto", "thp", "registered", "pinned"])
def test_gpu_table_modes(mode):
    emb = make_embedding(5000, 9)
    table = HostEngramTable.from_embedding(emb, mode=mode)
    allowed = {"auto": {"thp-registered", "registered", "pinned"}, "thp": {"thp-registered", "pinned"},
               "registered": {"registered", "pinned"}, "pinned": {"pinned"}}[mode]
    assert table.mode in allowed and table.is_pinned
    if table.mode == "pinned":
        assert table.data.is_pinned()
    # the mode each request gets when nothing fails ("thp" succeeds as "thp-registered")
    wanted = {"auto": "thp-registered", "thp": "thp-registered", "registered": "registered", "pinned": "pinned"}
    if table.mode != wanted[mode]:
        assert table.notes, "a fallback must say why"
    if thp_setting() in ("never", "unavailable"):
        assert table.mode != "thp-registered"
    ids = torch.randint(0, 5000, (3, 7, 24), device="cuda")
    ids[0, 0, :2] = 0  # the row with every e4m3 code (-0.0 included: it must keep its sign bit)
    out = E.engram_gather(table.data, ids)  # the GPU reads host memory directly
    torch.cuda.synchronize()
    assert out.is_cuda and same_rows(out, emb(ids.cpu(), torch.bfloat16))
    print(f"mode {table.mode}, AnonHugePages {table.thp_kb} kB, notes {table.notes}")


def _tables(n=2, rows=20000):
    embs = [make_embedding(rows, 10 + i, nan_free=True) for i in range(n)]
    return embs, [HostEngramTable.from_embedding(e) for e in embs]


@gpu
@needs_cuda
def test_gpu_prefetch_rows_equal_twin():
    embs, tables = _tables()
    pre = EngramPrefetcher(tables, "cuda", max_tokens=64)
    for B, S in [(1, 1), (8, 1), (2, 32), (1, 200)]:
        ids = torch.randint(0, 20000, (B, S, 2, 24), device="cuda")
        pre.start(ids)
        for layer in range(2):
            rows = pre.wait(layer)
            assert same_rows(rows, embs[layer](ids[:, :, layer].cpu(), torch.bfloat16))
    assert pre._compiled[0] is not None, "after the first launch start() must launch the compiled kernel directly"


@gpu
@needs_cuda
def test_gpu_prefetch_never_blocks_host_or_main_stream():
    embs, tables = _tables()
    pre = EngramPrefetcher(tables, "cuda", max_tokens=256)
    ids = torch.randint(0, 20000, (4, 64, 2, 24), device="cuda")
    pre.start(ids)  # warm-up: compiles the kernel
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()

    # 1) start() returns without waiting for busy main-stream work queued before it
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the main stream
    t = time.perf_counter()
    pre.start(ids)
    host_s = time.perf_counter() - t
    assert not main.query(), "start() must not synchronize the main stream"
    assert host_s < 0.05
    torch.cuda.synchronize()

    # 2) the gather runs while the main stream computes: its events finish first
    pre.start(ids)
    torch.cuda._sleep(400_000_000)
    pre.events[1].synchronize()  # the host waits for the side stream only
    assert not main.query(), "the lookup did not overlap the main stream's work"
    rows = pre.wait(1)
    assert same_rows(rows, embs[1](ids[:, :, 1].cpu(), torch.bfloat16))


@gpu
@needs_cuda
def test_gpu_prefetch_buffers_stay_where_a_graph_captured_them():
    """Once a CUDA graph captured a start, a step larger than the buffers raises instead of reallocating them
    (the graph would go on writing the freed ones); steps that fit go on, and the graph's rows are right."""
    embs, tables = _tables()
    pre = EngramPrefetcher(tables, "cuda", max_tokens=8)
    ids = torch.randint(0, 20000, (4, 1, 2, 24), device="cuda")
    pre.start(ids)  # warm-up: buffers and the compiled kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pre.start(ids)
        rows = [pre.wait(layer).clone() for layer in range(2)]
    ids.copy_(torch.randint(0, 20000, ids.shape, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(2):
        assert same_rows(rows[layer], embs[layer](ids[:, :, layer].cpu(), torch.bfloat16))
    with pytest.raises(RuntimeError, match="larger max_tokens"):
        pre.start(torch.randint(0, 20000, (16, 1, 2, 24), device="cuda"))
    small = torch.randint(0, 20000, (2, 1, 2, 24), device="cuda")
    pre.start(small)
    assert same_rows(pre.wait(0), embs[0](small[:, :, 0].cpu(), torch.bfloat16))


@gpu
@needs_cuda
def test_gpu_a_failed_host_registration_leaves_no_cuda_error():
    """A failed cudaHostRegister (here: the range is registered already) leaves the runtime's last error set,
    which torch's next kernel launch check would raise; clear_cuda_error resets it."""
    table = HostEngramTable(1000, mode="registered")
    assert table.mode == "registered", f"registration failed here: {table.notes}"
    err = int(torch.cuda.cudart().cudaHostRegister(table.data.data_ptr(), table.nbytes, 0))
    assert err != 0
    assert clear_cuda_error() == err
    assert clear_cuda_error() == 0
    assert torch.ones(4, device="cuda").add_(1).sum().item() == 8
