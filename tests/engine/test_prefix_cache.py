"""Prefix caching and the KV manager, on the tiny V4.1 model (fp32, quant_sim, block 8, window 16).

A hit must compute what its definition says: under SWA bounded replay the state
`bounded_replay_state` defines, without it the cold run. Eviction never serves recycled blocks, shared
blocks stay valid while any sequence holds them, and the memory a cached block costs is reported.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.engine import BlockPool, KVManager, OutOfBlocks, PrefixCache, Snapshot
from dsv4.engine import prefix_cache as prefix_cache_module
from dsv4.reference.cache import DenseCache
from dsv4.reference.model import bounded_replay_state

from .conftest import blocks_budget, forward_chunks, greedy_decode

B = 8  # block size
DECODE = 3


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def manager(model, n_blocks: int = 32, replay: bool = True) -> KVManager:
    return KVManager(model, blocks_budget(model, n_blocks, B), block_size=B, swa_bounded_replay=replay)


def serve(model, kv: KVManager, prompt: list[int], bounds_after_resume: list[int] = (), session=None):
    """Run one request as the engine does (see `run`). Returns (cache, resume, logits, decoded tokens)."""
    cache, resume, replay_from = kv.start(prompt, session)
    return (cache, resume, *run(model, kv, cache, resume, replay_from, prompt, bounds_after_resume))


def run(model, kv: KVManager, cache, resume: int, replay_from, prompt: list[int], bounds_after_resume=()):
    """Replay the window if asked, prefill the rest (in chunks ending at `bounds_after_resume`, then
    at the prompt's end), decode greedily, committing after every forward. Returns the logits of the
    prefill and the decode, and the decoded tokens."""
    if replay_from is not None:
        forward_chunks(model, prompt, cache, [replay_from, resume])

    def commit(end: int) -> None:
        kv.commit(cache, end)

    logits = forward_chunks(model, prompt, cache, [resume, *bounds_after_resume, len(prompt)], commit)
    decoded, decode_logits = greedy_decode(model, prompt, cache, logits[:, -1], DECODE, commit)
    return torch.cat((logits, decode_logits), dim=1), decoded


def reference(model, cache: DenseCache, prompt: list[int], start: int):
    """Logits of prompt[start:] and of the greedy decode after it, continuing `cache` at `start`."""
    logits = forward_chunks(model, prompt, cache, [start, len(prompt)])
    decoded, decode_logits = greedy_decode(model, prompt, cache, logits[:, -1], DECODE)
    return torch.cat((logits, decode_logits), dim=1), decoded


FIRST = tokens(0, 40)
SECOND = FIRST[:37] + tokens(1, 10)  # shares 4 full blocks (32 tokens) with FIRST


# ----------------------------------------------------------------------------- (a), (b), (e)
def test_replay_hit_computes_what_bounded_replay_state_defines(v41):
    """The first request prefills [0, 32) in one piece, as bounded_replay_state's cold pass does, so
    the cached state is that pass's bit for bit; the hit replays [16, 32) and continues."""
    kv = manager(v41, replay=True)
    first, resume, _, _ = serve(v41, kv, FIRST, [32])
    assert resume == 0
    kv.release(first)
    _, resume, logits, decoded = serve(v41, kv, SECOND)
    assert resume == 32  # (e) cached tokens
    with torch.inference_mode():
        expected, expected_decoded = reference(v41, bounded_replay_state(v41, torch.tensor([SECOND[:32]])), SECOND, 32)
    assert decoded == expected_decoded
    assert torch.equal(logits, expected)


def test_hit_without_replay_reproduces_the_cold_run(v41):
    kv = manager(v41, replay=False)
    first, _, _, _ = serve(v41, kv, FIRST, [16, 32])
    kv.release(first)
    _, resume, logits, decoded = serve(v41, kv, SECOND)
    assert resume == 32
    cold = DenseCache(v41.config.sliding_window)
    forward_chunks(v41, SECOND, cold, [0, 16, 32])  # the chunks the first request computed them in
    expected, expected_decoded = reference(v41, cold, SECOND, 32)
    assert decoded == expected_decoded
    assert torch.equal(logits, expected)


# ----------------------------------------------------------------------------- (c)
def test_replay_hits_shorter_than_the_window_are_not_used(v41):
    kv = manager(v41, replay=True)
    cache, _, _ = kv.start(FIRST)
    cache.write_tokens(0, torch.tensor([FIRST]))  # the blocks' rows do not matter to lookups
    kv.commit(cache, 40)
    assert kv.prefix.lookup(FIRST[:8] + tokens(2, 20), True).length == 0  # one block < W = 16
    assert kv.prefix.lookup(FIRST[:16] + tokens(2, 20), True).length == 16
    assert kv.prefix.lookup(FIRST[:24], True).length == 16  # one prompt token must stay to compute
    assert kv.prefix.lookup(FIRST + [1], True).length == 40


# ----------------------------------------------------------------------------- (d)
def snapshot() -> Snapshot:
    return Snapshot({}, None)


def register(prefix: PrefixCache, ids: list[int]) -> list[int]:
    """Cache a sequence's full blocks through fresh blocks; the sequence lets go of them."""
    parent, blocks = prefix_cache_module.ROOT_HASH, []
    for i in range(len(ids) // B):
        blocks.append(prefix.allocate())
        parent = prefix.insert(parent, ids[i * B : (i + 1) * B], blocks[-1], snapshot())
        prefix.pool.release(blocks[-1])
    return blocks


def test_eviction_never_serves_recycled_blocks(v41):
    pool = BlockPool(v41.config, 3, block_size=B, dtype=torch.float32)
    prefix = PrefixCache(pool)
    old = tokens(3, 24)
    old_blocks = register(prefix, old)
    assert prefix.lookup(old + [1], True).blocks == tuple(old_blocks)
    new = tokens(4, 24)
    new_blocks = register(prefix, new)  # evicts every old block, recycling them
    assert sorted(new_blocks) == sorted(old_blocks)
    assert prefix.lookup(old + [1], True).length == 0
    assert prefix.lookup(old + [1], False).length == 0
    assert prefix.lookup(new + [1], True).blocks == tuple(new_blocks)


def test_evicted_then_recomputed_prefix_serves_correct_logits(v41):
    kv = manager(v41, n_blocks=7, replay=True)
    first, _, _, _ = serve(v41, kv, FIRST, [32])  # 6 blocks with the decode
    kv.release(first)
    other, _, _, _ = serve(v41, kv, tokens(5, 40))  # needs 6 blocks: evicts FIRST's chain
    kv.release(other)
    assert kv.prefix.lookup(SECOND, True).length == 0
    again, _, _, _ = serve(v41, kv, FIRST, [32])
    kv.release(again)
    _, resume, logits, _ = serve(v41, kv, SECOND)
    assert resume == 32
    with torch.inference_mode():
        expected, _ = reference(v41, bounded_replay_state(v41, torch.tensor([SECOND[:32]])), SECOND, 32)
    assert torch.equal(logits, expected)


def test_hash_alone_is_never_trusted(v41, monkeypatch):
    monkeypatch.setattr(prefix_cache_module, "block_hash", lambda parent, ids: b"same")
    pool = BlockPool(v41.config, 4, block_size=B, dtype=torch.float32)
    prefix = PrefixCache(pool)
    a, b = tokens(6, 16), tokens(7, 16)
    register(prefix, a[:8])
    assert prefix.lookup(b + [1], True).length == 0
    assert prefix.insert(prefix_cache_module.ROOT_HASH, b[:8], prefix.allocate(), snapshot()) is None


# ----------------------------------------------------------------------------- (f)
def test_sequences_share_prefix_blocks(v41):
    kv = manager(v41, replay=True)
    first, _, _, _ = serve(v41, kv, FIRST, [32])
    shared = first.block_table[:4]
    kv.release(first)
    assert [kv.pool.refcount(b) for b in shared] == [1] * 4  # the prefix cache's own reference
    a, b = kv.start(SECOND), kv.start(SECOND)
    assert a[0].block_table == b[0].block_table == shared and a[1:] == b[1:] == (32, 16)
    assert [kv.pool.refcount(b) for b in shared] == [3] * 4
    logits_a, _ = run(v41, kv, *a, SECOND)
    kv.release(a[0])
    assert [kv.pool.refcount(b) for b in shared] == [2] * 4
    kv.release(serve(v41, kv, tokens(14, 20))[0])  # allocates and frees blocks meanwhile
    logits_b, _ = run(v41, kv, *b, SECOND)
    with torch.inference_mode():
        expected, _ = reference(v41, bounded_replay_state(v41, torch.tensor([SECOND[:32]])), SECOND, 32)
    assert torch.equal(logits_a, expected) and torch.equal(logits_b, expected)


# ----------------------------------------------------------------------------- (g)
def test_window_snapshots_cost_their_bytes(v41):
    layout = manager(v41).layout
    sizes = {}
    for replay in (True, False):
        kv = manager(v41, replay=replay)
        serve(v41, kv, FIRST, [32])
        sizes[replay] = kv.prefix.lookup(FIRST + [1], replay).snapshot.nbytes  # the block ending at 40
        assert kv.cached_block_bytes == kv.pool.bytes_per_block + layout.snapshot_bytes(replay)
    assert sizes[True] == layout.boundary_carry_bytes == 0
    assert sizes[False] - sizes[True] == layout.window_snapshot_bytes
    assert layout.window_snapshot_bytes == v41.config.num_hidden_layers * 15 * layout.window_slot_bytes


# ----------------------------------------------------------------------------- sessions and memory
def test_pinned_session_blocks_are_evicted_last(v41):
    kv = manager(v41, n_blocks=4, replay=True)
    pinned, _, _ = kv.start(tokens(8, 16), session_id="chat")
    pinned.write_tokens(0, torch.tensor([tokens(8, 16)]))
    kv.commit(pinned, 16)
    kv.pin("chat")
    kv.release(pinned)
    other, _, _ = kv.start(tokens(9, 16))
    other.write_tokens(0, torch.tensor([tokens(9, 16)]))
    kv.commit(other, 16)
    kv.release(other)  # now the least recently used blocks are the session's
    assert kv.can_admit(32) and not kv.can_admit(33)
    third, _, _ = kv.start(tokens(10, 16))
    third.write_tokens(0, torch.tensor([tokens(10, 16)]))  # two evictions: the unpinned chain goes
    assert kv.prefix.lookup(tokens(8, 16) + tokens(10, 1), True).length == 16
    assert kv.prefix.lookup(tokens(9, 16) + tokens(10, 1), True).length == 0
    kv.unpin("chat")
    third.write_tokens(16, torch.tensor([tokens(11, 8)]))
    assert kv.prefix.lookup(tokens(8, 16) + tokens(10, 1), True).length == 0


def test_out_of_blocks_when_every_block_is_held(v41):
    kv = manager(v41, n_blocks=3, replay=True)
    a, _, _ = kv.start(tokens(12, 24))
    a.write_tokens(0, torch.tensor([tokens(12, 24)]))
    assert not kv.can_admit(1)
    b, _, _ = kv.start(tokens(13, 8))
    with pytest.raises(OutOfBlocks):
        b.write_tokens(0, torch.tensor([tokens(13, 8)]))
    kv.release(a)  # uncommitted blocks go straight back
    assert kv.pool.num_free == 3
    b.write_tokens(0, torch.tensor([tokens(13, 8)]))


def test_prefix_caching_off(v41):
    kv = KVManager(v41, blocks_budget(v41, 8, B), block_size=B, enable_prefix_caching=False)
    cache, _, _, _ = serve(v41, kv, FIRST)
    kv.release(cache)
    assert kv.pool.num_free == 8
    assert kv.start(FIRST)[1:] == (0, None)
