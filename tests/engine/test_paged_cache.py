"""PagedCache over a BlockPool: the model computes bit-identical logits through it and through a
DenseCache, for any chunking; storage takes exactly the layout's bytes; blocks are accounted."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.engine import BlockPool, OutOfBlocks, PagedCache, Snapshot, cache_layout
from dsv4.reference.cache import DenseCache
from dsv4.reference.model import load_model

from .conftest import blocks_budget, forward_chunks


def prompt_and_chunks(data, vocab: int, lengths: tuple[int, int], max_cuts: int) -> tuple[list[int], list[int]]:
    """A random prompt and chunk bounds 0 = b_0 < ... < b_n = len(prompt)."""
    length = data.draw(st.integers(*lengths), label="length")
    cuts = data.draw(st.sets(st.integers(1, length - 1), max_size=max_cuts), label="cuts")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids, [0, *sorted(cuts), length]


def paged_equals_dense(model, ids: list[int], bounds: list[int], pool: BlockPool) -> PagedCache:
    dense = forward_chunks(model, ids, DenseCache(model.config.sliding_window), bounds)
    cache = PagedCache(pool)
    paged = forward_chunks(model, ids, cache, bounds)
    assert torch.equal(paged, dense)
    assert len(cache.block_table) == math.ceil(len(ids) / pool.block_size)
    return cache


# ----------------------------------------------------------------------------- bit-identical logits
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_v41_packed_paged_cache_is_bit_identical(v41, data):
    """Block 8: chunks cross ratio-2 groups and blocks anywhere, single tokens act as decode steps."""
    ids, bounds = prompt_and_chunks(data, v41.config.vocab_size, (18, 40), 5)
    pool = BlockPool(v41.config, 8, block_size=8, dtype=torch.float32)
    assert pool.format == "packed"
    cache = paged_equals_dense(v41, ids, bounds, pool)
    cache.free()
    assert pool.num_free == pool.num_blocks


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_v4_bf16_packed_paged_cache_is_bit_identical(v4_bf16, data):
    """Block 128 (HCA pools 128 tokens); ~300 tokens cross two block and HCA-group boundaries."""
    ids, bounds = prompt_and_chunks(data, v4_bf16.config.vocab_size, (260, 300), 3)
    pool = BlockPool(v4_bf16.config, 3, block_size=128, dtype=torch.bfloat16)
    assert pool.format == "packed"
    paged_equals_dense(v4_bf16, ids, bounds, pool)


def test_dense_format_serves_models_packed_rows_cannot(tiny_v41_dir):
    model = load_model(str(tiny_v41_dir), torch.float32, quant_sim=False, progress=False)
    pool = BlockPool(model.config, 8, block_size=8, dtype=torch.float32, quant_sim=False)
    assert pool.format == "dense"
    ids = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    paged_equals_dense(model, ids, [0, 11, 12, 30], pool)


# ----------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("model_name, block_size", [("v41", 8), ("v4_bf16", 128)])
def test_storage_bytes_equal_the_layout(model_name, block_size, request):
    model = request.getfixturevalue(model_name)
    layout = cache_layout(model.config)
    pool = BlockPool(model.config, 3, block_size, dtype=model.embed.weight.dtype)
    for (kind, _), store in pool.storage.items():
        assert store.dtype == torch.uint8 and store.shape[2] == layout.row_bytes(kind)
    total = sum(t.nbytes for t in pool.storage.values())
    assert total == 3 * layout.bytes_per_block(block_size) == 3 * pool.bytes_per_block
    assert pool.bytes_per_block == block_size * layout.growth_bytes_per_token

    ids = list(range(3, 4 + max(block_size, model.config.sliding_window)))
    cache = PagedCache(pool)
    forward_chunks(model, ids, cache, [0, len(ids)])
    for layer in range(model.config.num_hidden_layers):  # windows: W - 1 rows of window_slot_bytes
        rows = cache._held.window(layer)[0]
        assert rows.dtype == torch.uint8
        assert rows.shape == (1, model.config.sliding_window - 1, layout.window_slot_bytes)


def carry_nbytes(cache: PagedCache) -> int:
    """Bytes of the compressor carries the cache holds now."""
    return Snapshot(cache._states, None).nbytes


def test_v4_carries_take_the_layout_bytes(v4_bf16):
    """At 127 tokens every compressor's carry is largest (HCA: 127 pending tokens; CSA: 3 pending and
    the previous group); at the block boundary 128 only the overlapping compressors' last group."""
    layout = cache_layout(v4_bf16.config)
    pool = BlockPool(v4_bf16.config, 2, block_size=128, dtype=torch.bfloat16)
    cache = PagedCache(pool)
    ids = list(range(3, 3 + 128))
    forward_chunks(v4_bf16, ids, cache, [0, 127])
    assert carry_nbytes(cache) == layout.carry_bytes
    forward_chunks(v4_bf16, ids, cache, [127, 128])
    assert cache.snapshot(128, with_windows=False).nbytes == layout.boundary_carry_bytes > 0


# ----------------------------------------------------------------------------- pool accounting
def test_blocks_follow_the_tokens_and_return_on_free(v41):
    pool = BlockPool(v41.config, 5, block_size=8, dtype=torch.float32)
    a, b = PagedCache(pool), PagedCache(pool)
    a.write_tokens(0, torch.tensor([list(range(3, 20))]))  # 17 tokens: 3 blocks
    assert len(a.block_table) == 3 and pool.num_free == 2
    a.write_tokens(17, torch.tensor([[5] * 7]))  # 24 tokens: still 3
    assert len(a.block_table) == 3
    b.write_tokens(0, torch.tensor([[7] * 16]))
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        b.write_tokens(16, torch.tensor([[7]]))
    a.free()
    assert pool.num_free == 3 and all(pool.refcount(i) == 0 for i in range(5) if i not in b.block_table)
    b.write_tokens(16, torch.tensor([[7]]))
    assert len(b.block_table) == 3


def test_pool_sizing_and_checks(v41, v4_bf16):
    budget = blocks_budget(v41, 7, 8)
    assert BlockPool.for_memory(v41.config, budget + 5, 8, dtype=torch.float32).num_blocks == 7
    with pytest.raises(ValueError, match="hold no KV block"):
        BlockPool.for_memory(v41.config, 10, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        BlockPool(v4_bf16.config, 2, block_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="RoPE dims in bf16"):
        BlockPool(v4_bf16.config, 2, block_size=128, format="packed", dtype=torch.float32)
    pool = BlockPool(v41.config, 1, block_size=8, dtype=torch.float32)
    block = pool.allocate()
    pool.release(block)
    with pytest.raises(ValueError, match="already free"):
        pool.release(block)
    with pytest.raises(ValueError, match="one sequence"):
        PagedCache(pool).write_tokens(0, torch.zeros(2, 3, dtype=torch.long))
