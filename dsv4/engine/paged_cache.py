"""One sequence's model state on top of a BlockPool, behind the cache interface the model uses.

The interface is dsv4/reference/cache.py's (`DenseCache` defines it); what differs is where rows
live and in what form:
- compressed entries and index keys go into the sequence's pool blocks, in the storage format
  (block table: block i covers positions [i * block_size, (i + 1) * block_size));
- window rows stay with the sequence (a fixed `sliding_window - 1` rows per layer), in the storage
  format too;
- compressor carries are kept as the compressor hands them over (fp32), tokens as ids.

Rows are decoded back to the model's dtype on every read, exactly: the model rounded them onto the
stored formats itself (see layout.py), so a forward through a PagedCache computes what it computes
through a DenseCache, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dsv4.engine.pool import BlockPool
from dsv4.reference.cache import DenseCache


@dataclass(frozen=True, eq=False)
class Snapshot:
    """What a sequence needs, besides its blocks, to resume at a block boundary: the compressor
    carries there and, unless bounded replay rebuilds them, each layer's window rows (stored form)."""

    states: dict[str, dict]
    windows: dict[int, torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in _tensors((self.states, self.windows)))


class PagedCache:
    """The state of one sequence (batch 1); blocks come from `allocate` (the pool's by default; the
    prefix cache's evicts cached blocks to make room). `free()` gives the blocks back."""

    def __init__(self, pool: BlockPool, allocate: Callable[[], int] | None = None):
        self.pool = pool
        self.window_size = pool.config.sliding_window
        self._allocate = allocate or pool.allocate
        self.block_table: list[int] = []
        self._rows: dict[tuple[str, int], int] = {}  # rows written per stream (kind, source)
        self._states: dict[str, dict] = {}  # compressor carries
        # tokens, and the window rings holding rows in stored form: DenseCache's logic
        self._held = DenseCache(self.window_size)

    @classmethod
    def from_prefix(
        cls,
        pool: BlockPool,
        blocks: Sequence[int],
        tokens: torch.Tensor,
        snapshot: Snapshot,
        allocate: Callable[[], int] | None = None,
    ) -> PagedCache:
        """A cache filled up to H = len(blocks) * block_size: the shared full `blocks` (each gains a
        reference), the prefix `tokens` [1, H] and the `snapshot` taken at H. Without windows in the
        snapshot the windows start empty, for a bounded replay to rebuild."""
        H = len(blocks) * pool.block_size
        if tokens.shape != (1, H):
            raise ValueError(f"{len(blocks)} blocks hold {H} tokens; got tokens of shape {tuple(tokens.shape)}")
        cache = cls(pool, allocate)
        for block in blocks:
            pool.retain(block)
        cache.block_table = list(blocks)
        cache._rows = {(s.kind, s.source): H // s.ratio for s in pool.layout.streams}
        cache._held.write_tokens(0, tokens)
        cache._states = dict(snapshot.states)
        for layer, rows in (snapshot.windows or {}).items():
            cache._held.append_window(layer, rows, torch.arange(H - rows.shape[1], H, device=tokens.device))
        return cache

    @property
    def tokens(self) -> torch.Tensor | None:
        """Token ids [1, T] so far."""
        return self._held.tokens

    @property
    def length(self) -> int:
        """Positions whose tokens the cache holds."""
        return 0 if self.tokens is None else self.tokens.shape[1]

    # tokens (and the blocks their positions need)
    def write_tokens(self, start: int, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] != 1:
            raise ValueError(f"a PagedCache holds one sequence; got a batch of {ids.shape[0]}")
        needed = -(-(start + ids.shape[1]) // self.pool.block_size)
        while len(self.block_table) < needed:
            self.block_table.append(self._allocate())
        return self._held.write_tokens(start, ids)

    # sliding windows: per sequence, stored form
    def window(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, positions = self._held.window(layer)
        return (None, None) if rows is None else (self._decode("window", rows), positions)

    def append_window(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        keep = self.window_size - 1  # only these can be kept, so only these are encoded
        self._held.append_window(layer, self.pool.codecs.window.encode(kv[:, -keep:]), positions[-keep:])

    def reset_windows(self) -> None:
        self._held.reset_windows()

    # compressed KV and index keys: pool blocks
    def compressed(self, source: int) -> torch.Tensor | None:
        return self._read(("compressed", source))

    def append_compressed(self, source: int, entries: torch.Tensor) -> None:
        self._write(("compressed", source), entries)

    def index_keys(self, source: int) -> torch.Tensor | None:
        return self._read(("index_keys", source))

    def append_index_keys(self, source: int, keys: torch.Tensor) -> None:
        self._write(("index_keys", source), keys)

    # compressor carries
    def state(self, key: str) -> dict | None:
        return self._states.get(key)

    def set_state(self, key: str, state: dict) -> None:
        # a carry's tensors are slices of the whole chunk's projections; keeping them as they are
        # would keep the chunk alive
        self._states[key] = {k: _compact(v) for k, v in state.items()}

    # ------------------------------------------------------------------ prefix caching
    def snapshot(self, at: int, with_windows: bool) -> Snapshot | None:
        """The state at block boundary `at` (<= length) a later sequence resumes from, or None when
        it is gone: windows and overlapping compressors' last groups exist only for `at == length`.
        Other carries are empty at every block boundary (blocks hold whole groups), so they are
        rebuilt for any `at`."""
        if at % self.pool.block_size or not 0 < at <= self.length:
            raise ValueError(f"snapshots are taken at block boundaries up to {self.length}, not at {at}")
        if at != self.length and (with_windows or any("prev" in s for s in self._states.values())):
            return None
        windows = None
        if with_windows:
            rings = (self._held.window(layer)[0] for layer in range(self.pool.config.num_hidden_layers))
            windows = {layer: _compact(rows) for layer, rows in enumerate(rings) if rows is not None}
        return Snapshot({key: _carry_at(state, at) for key, state in self._states.items()}, windows)

    def free(self) -> None:
        """Drop this sequence's reference to each of its blocks."""
        for block in self.block_table:
            self.pool.release(block)
        self.block_table = []

    # ------------------------------------------------------------------ block rows
    def _read(self, stream: tuple[str, int]) -> torch.Tensor | None:
        """The stream's rows so far, decoded: [1, n, dim] (None before the first)."""
        n = self._rows.get(stream, 0)
        if not n:
            return None
        store = self.pool.storage[stream]  # [num_blocks, per_block, width]
        per_block = store.shape[1]
        blocks = torch.tensor(self.block_table[: -(-n // per_block)], device=store.device)
        return self._decode(stream[0], store[blocks].flatten(0, 1)[:n]).unsqueeze(0)

    def _write(self, stream: tuple[str, int], rows: torch.Tensor) -> None:
        """Append rows [1, n, dim] after the stream's last one, in the blocks of their positions."""
        if rows.shape[0] != 1:
            raise ValueError(f"a PagedCache holds one sequence; got a batch of {rows.shape[0]}")
        kind, store = stream[0], self.pool.storage[stream]  # [num_blocks, per_block, width]
        per_block, start = store.shape[1], self._rows.get(stream, 0)
        index = torch.arange(start, start + rows.shape[1], device=store.device)
        block_ids = torch.tensor(self.block_table, device=store.device)[index // per_block]
        shared = [b for b in set(block_ids.tolist()) if self.pool.refcount(b) > 1]
        if shared:  # full blocks are immutable once shared: other sequences read them
            raise RuntimeError(f"{kind} rows from {start} would overwrite the shared blocks {shared}")
        store[block_ids, index % per_block] = getattr(self.pool.codecs, kind).encode(rows[0])
        self._rows[stream] = start + rows.shape[1]

    def _decode(self, kind: str, stored: torch.Tensor) -> torch.Tensor:
        return getattr(self.pool.codecs, kind).decode(stored).to(self.pool.dtype)


def _carry_at(state: dict, at: int) -> dict:
    """A compressor carry moved to block boundary `at`, where no group is unfinished."""
    return {k: (v[:, :0].clone() if k in ("kv", "score") else v) for k, v in state.items()} | {"next": at}


def _compact(value):
    """Tensors (also inside tuples) copied out of larger storage; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_compact(v) for v in value)
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
        return value.clone()
    return value


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
