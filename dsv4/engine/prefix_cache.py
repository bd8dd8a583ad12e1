"""Prefix caching over the block pool, and the KV manager the engine talks to.

A cached block is a pool block itself (shared copy-free, refcounted) plus a snapshot of what a
sequence needs to resume at the block's end (paged_cache.Snapshot). Blocks are keyed by chained
hashes, h_i = blake2b(h_{i-1} || token ids of block i), and each entry keeps its parent hash and
token ids: a lookup verifies both, block by block from the first, and never trusts a hash alone.

What a hit at H restores follows `dsv4.reference.model.bounded_replay_state`:
- SWA bounded replay on (the default, as DeepSeek and vLLM): the cached compressed KV, index keys,
  carries and tokens; the windows are rebuilt by recomputing positions [H - W, H), whose compressors
  skip what they consumed already. Hits shorter than the window W are not used.
- off: the snapshot also holds the windows at H, so a hit computes exactly what a cold run computes,
  for `layout.window_snapshot_bytes` more per cached block.

Eviction takes the least recently used cached block no sequence holds, a pinned session's blocks
last, and removes its hash entry before the block goes back to the pool: no lookup can reach a block
after it is recycled.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4.engine.layout import CacheLayout
from dsv4.engine.paged_cache import PagedCache, Snapshot
from dsv4.engine.pool import BlockPool

ROOT_HASH = bytes(32)  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """h_i = blake2b(h_{i-1} || int64 token ids of block i)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<i8").tobytes(), digest_size=32).digest()


@dataclass(frozen=True)
class _Entry:
    block: int
    parent: bytes
    tokens: tuple[int, ...]
    snapshot: Snapshot | None  # None: the block's end was never materialized (still a chain link)


@dataclass(frozen=True)
class Hit:
    """A cached prefix: `length` tokens (0 on a miss) in `blocks`, chained `hashes`, and the snapshot
    at its end."""

    length: int = 0
    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    snapshot: Snapshot | None = None


class PrefixCache:
    """Cached full blocks of a BlockPool, each holding one pool reference of its own."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pins: dict[str, frozenset[bytes]] = {}

    # ------------------------------------------------------------------ lookups
    def lookup(self, prompt_ids: Sequence[int], swa_bounded_replay: bool) -> Hit:
        """The longest cached chain of full blocks matching the start of the prompt that a sequence
        can resume from, leaving at least one prompt token to compute."""
        B = self.pool.block_size
        chain: list[tuple[bytes, _Entry]] = []
        parent = ROOT_HASH
        for i in range((len(prompt_ids) - 1) // B):
            tokens = tuple(prompt_ids[i * B : (i + 1) * B])
            h = block_hash(parent, tokens)
            entry = self._entries.get(h)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            chain.append((h, entry))
            parent = h
        while chain and not _resumable(chain[-1][1].snapshot, swa_bounded_replay):
            chain.pop()
        if not chain or (swa_bounded_replay and len(chain) * B < self.pool.config.sliding_window):
            return Hit()
        hashes = tuple(h for h, _ in chain)
        self.touch(hashes)
        return Hit(len(chain) * B, tuple(e.block for _, e in chain), hashes, chain[-1][1].snapshot)

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain as just used, its deepest blocks least recent: evicting a block orphans the
        blocks after it, so chains are evicted from their ends."""
        for h in reversed(hashes):
            if h in self._entries:
                self._entries.move_to_end(h)

    # ------------------------------------------------------------------ registration
    def insert(self, parent: bytes, tokens: Sequence[int], block: int, snapshot: Snapshot | None) -> bytes | None:
        """Cache the full `block` following the chain `parent`; returns its hash. A block already
        cached under that hash keeps its entry (the caller's copy stays the caller's). None when the
        hash is taken by other content: this chain can then not be extended safely."""
        tokens = tuple(tokens)
        h = block_hash(parent, tokens)
        entry = self._entries.get(h)
        if entry is None:
            self.pool.retain(block)
            self._entries[h] = _Entry(block, parent, tokens, snapshot)
        elif entry.parent != parent or entry.tokens != tokens:
            return None
        return h

    # ------------------------------------------------------------------ memory
    def pin(self, key: str, hashes: Sequence[bytes]) -> None:
        """Evict these blocks only when nothing else is left (until `unpin(key)` or a new pin)."""
        self._pins[key] = frozenset(hashes)

    def unpin(self, key: str) -> None:
        self._pins.pop(key, None)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return sum(1 for e in self._entries.values() if self._idle(e))

    @property
    def snapshot_bytes(self) -> int:
        return sum(e.snapshot.nbytes for e in self._entries.values() if e.snapshot is not None)

    def evict(self) -> bool:
        """Free the least recently used block no sequence holds, pinned ones last; False if none."""
        idle = [h for h, e in self._entries.items() if self._idle(e)]
        if not idle:
            return False
        pinned = frozenset().union(*self._pins.values())
        victim = next((h for h in idle if h not in pinned), idle[0])
        entry = self._entries.pop(victim)  # unreachable first, then recyclable
        self.pool.release(entry.block)
        return True

    def allocate(self) -> int:
        """A free pool block, evicting a cached one if none is free (OutOfBlocks when all are held)."""
        if not self.pool.num_free:
            self.evict()
        return self.pool.allocate()

    def _idle(self, entry: _Entry) -> bool:
        return self.pool.refcount(entry.block) == 1  # only the cache's own reference


def _resumable(snapshot: Snapshot | None, swa_bounded_replay: bool) -> bool:
    return snapshot is not None and (swa_bounded_replay or snapshot.windows is not None)


# ============================================================================ the engine's KV API
@dataclass
class _Sequence:
    session_id: str | None
    hashes: list[bytes] = field(default_factory=list)  # its blocks registered so far, in order
    registering: bool = True  # False after a hash collision: its chain is not extended


class KVManager:
    """Blocks, prefix cache and per-sequence caches for one model.

    Args:
        model: a Dsv4Model (its config, dtype, device and quant_sim decide the storage).
        memory_bytes: bytes of pool blocks. On top come each running sequence's windows and carries
            (`layout.fixed_bytes_per_sequence`) and each cached block's snapshot (at most
            `layout.snapshot_bytes(swa_bounded_replay)`; `cached_block_bytes` adds it up).
        block_size: tokens per block, a multiple of every compress ratio.
        swa_bounded_replay: see the module docstring.
        enable_prefix_caching: off, every sequence starts empty and its blocks are freed on release.
        format: KV storage format (see `layout.storage_format`); None picks packed wherever exact.
    """

    def __init__(
        self,
        model,
        memory_bytes: int,
        block_size: int = 256,
        swa_bounded_replay: bool = True,
        enable_prefix_caching: bool = True,
        format: str | None = None,
    ):
        weight = model.embed.weight
        quant_sim = model.layers[0].attn.quant_sim  # set_quant_sim sets every module alike
        self.pool = BlockPool.for_memory(
            model.config, memory_bytes, block_size, format, weight.dtype, quant_sim, weight.device
        )
        self.prefix = PrefixCache(self.pool) if enable_prefix_caching else None
        self.swa_bounded_replay = swa_bounded_replay
        self._sequences: dict[PagedCache, _Sequence] = {}
        self._session_chains: dict[str, tuple[bytes, ...]] = {}  # each session's latest blocks
        self._pinned: set[str] = set()

    @property
    def layout(self) -> CacheLayout:
        return self.pool.layout

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def start(self, prompt_ids: list[int], session_id: str | None = None) -> tuple[PagedCache, int, int | None]:
        """A cache for a new sequence, the position to resume at (the cached tokens) and, with bounded
        replay, where the window replay starts: run the model over prompt[replay_from:resume] at
        start_pos=replay_from (logits discarded), then prefill from `resume`."""
        hit = self.prefix.lookup(prompt_ids, self.swa_bounded_replay) if self.prefix else Hit()
        allocate = self.prefix.allocate if self.prefix else self.pool.allocate
        if hit.length:
            tokens = torch.tensor([prompt_ids[: hit.length]], device=self.pool.device)
            cache = PagedCache.from_prefix(self.pool, hit.blocks, tokens, hit.snapshot, allocate)
        else:
            cache = PagedCache(self.pool, allocate)
        self._sequences[cache] = _Sequence(session_id, list(hit.hashes))
        replay = hit.length and self.swa_bounded_replay
        return cache, hit.length, hit.length - self.pool.config.sliding_window if replay else None

    def commit(self, cache: PagedCache, upto: int) -> None:
        """Cache every block the sequence completed below position `upto` (whose state the cache
        holds). A block gets a snapshot when its end can be resumed from (see PagedCache.snapshot:
        always under bounded replay for V4.1; otherwise when a forward ended there, so chunking
        prefills at block boundaries makes every block resumable)."""
        seq = self._sequences[cache]
        if self.prefix is None or not seq.registering:
            return
        if upto > cache.length:
            raise ValueError(f"cannot commit up to {upto}: the cache holds {cache.length} tokens")
        B = self.block_size
        for i in range(len(seq.hashes), upto // B):
            tokens = cache.tokens[0, i * B : (i + 1) * B].tolist()
            snapshot = cache.snapshot((i + 1) * B, with_windows=not self.swa_bounded_replay)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            h = self.prefix.insert(parent, tokens, cache.block_table[i], snapshot)
            if h is None:
                seq.registering = False
                break
            seq.hashes.append(h)
        if seq.session_id is not None:
            self._session_chains[seq.session_id] = tuple(seq.hashes)
            if seq.session_id in self._pinned:
                self.prefix.pin(seq.session_id, seq.hashes)

    def release(self, cache: PagedCache) -> None:
        """The sequence is done (or preempted): its blocks go back, cached ones stay cached."""
        seq = self._sequences.pop(cache)
        if self.prefix is not None:
            self.prefix.touch(seq.hashes)
        cache.free()

    # ------------------------------------------------------------------ sessions and memory
    def pin(self, session_id: str) -> None:
        """Keep the session's latest blocks cached as long as anything else can be evicted."""
        self._pinned.add(session_id)
        if self.prefix is not None:
            self.prefix.pin(session_id, self._session_chains.get(session_id, ()))

    def unpin(self, session_id: str) -> None:
        self._pinned.discard(session_id)
        if self.prefix is not None:
            self.prefix.unpin(session_id)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence can get: free ones plus cached ones no sequence holds."""
        return self.pool.num_free + (self.prefix.num_evictable if self.prefix else 0)

    def can_admit(self, n_tokens: int) -> bool:
        return -(-n_tokens // self.block_size) <= self.num_free_blocks

    @property
    def cached_block_bytes(self) -> int:
        """Memory of one cached block: the block and, at most, its snapshot."""
        return self.pool.bytes_per_block + self.layout.snapshot_bytes(self.swa_bounded_replay)
