"""Static, preallocated model state for `max_seqs` sequence slots: what the fast runner decodes from.

Every buffer is allocated once, so a decode step captured in a CUDA graph always finds its state at the
same addresses; a slot's row ranges are fixed, and positions live in a device tensor (`lengths`). A slot's
rows are zeroed when it is allocated (`clear`), not before: slots never used cost no touched memory.

Per slot (one extra slot, `scratch`, absorbs the writes of padded batch rows):
- `tokens` [slots, max_len] and `lengths` [slots] (device; Engram look-backs and positions);
- per layer, a window ring of W = sliding_window rows in the stored form, row p % W for position p, and
  `window_start` [slots] (rows below it are not part of the window: a bounded replay rebuilds from there);
- per KV source, compressed entries (row g for the group ending at position (g + 1) * ratio - 1), and per
  index-key owner, MXFP4 index keys; `cap + POOL_BLOCK` rows per slot, row `cap` takes the writes of steps
  that complete no group;
- per compressor, a ring of raw fp32 projections (`kv`, `score`), row p % R for position p: the unfinished
  group and, for V4's overlapping compressor, the finished ones before it. R is 2 * ratio, except that an
  overlapping compressor keeps `resume_span` tokens more than its group: R = ratio + max(ratio, resume_span
  rounded up to a multiple of ratio), so a slot that has moved up to `resume_span` tokens past a group
  boundary still holds the group before it, which `copy_prefix` needs to resume there. (V4-Flash at resume
  span 128: a CSA layer's two ratio-4 rings grow from 8 to 132 rows, 1.2 MiB more per layer and slot, 25 MiB
  per slot in all, a third more than the 76 MiB of a slot at 8K tokens; V4.1 has no overlapping compressor.)

Stored forms (all exact round trips of what the reference model writes to its cache), when `packed`:
- V4.1: window FP8 (e4m3, e8m0 per 32), compressed NVFP4 (e2m1 + e4m3 per 16), index keys MXFP4;
- V4: window and compressed entries in the model dtype (the reference's FP8-on-the-non-RoPE-dims values
  are exact there), index keys MXFP4.
Unpacked (a model with quant_sim off), every row is kept in the model dtype.

`SlotCache(state, slot)` puts one slot behind the interface of `dsv4.reference.cache.DenseCache`, so
prefill runs the model's module path into the same buffers the decode graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.config import Dsv4Config, LayerRole
from dsv4.fast.kernels.quant import quant_write
from dsv4.quant import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4
from dsv4.reference.compressor import overlaps

POOL_BLOCK = 64  # entries per block of the indexer's pool-layout scoring (see dsv4.fast.kernels.indexer)


@dataclass
class Rows:
    """A store of rows in one format: data [slots, n, width] and, for packed formats, scale [slots, n, *].

    Packed bytes are held as uint8 (index_put has no fp8 kernels); `flat()` and `decode` view them back
    as `dtypes` (data, scale)."""

    fmt: str  # "fp8" | "nvfp4" | "mxfp4" | "dense"
    data: torch.Tensor
    scale: torch.Tensor | None = None
    dtypes: tuple[torch.dtype, torch.dtype | None] = (torch.uint8, None)

    @classmethod
    def allocate(cls, fmt: str, slots: int, n: int, dim: int, dtype: torch.dtype, device) -> Rows:
        """Uninitialized: zero a slot (`zero_`) before its rows are read."""

        def empty(width, dt=torch.uint8):
            return torch.empty(slots, n, width, dtype=dt, device=device)

        if fmt == "fp8":
            return cls(fmt, empty(dim), empty(dim // 32), (torch.float8_e4m3fn, torch.float8_e8m0fnu))
        if fmt == "nvfp4":
            return cls(fmt, empty(dim // 2), empty(dim // 16), (torch.uint8, torch.float8_e4m3fn))
        if fmt == "mxfp4":
            return cls(fmt, empty(dim // 2), empty(dim // 32), (torch.uint8, torch.float8_e8m0fnu))
        return cls(fmt, empty(dim, dtype), None, (dtype, None))

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows (as held) -> values [..., dim] in dtype, exactly."""
        data, scale = self._typed(data, scale)
        if self.fmt == "fp8":
            return dequantize_fp8(data, scale, (self.block,)).to(dtype)
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(data, scale, self.block).to(dtype)
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(data, scale, self.block).to(dtype)
        return data.to(dtype)

    @property
    def block(self) -> int:
        """Values one scale covers (the packed formats)."""
        return 16 if self.fmt == "nvfp4" else 32

    def write(self, slots: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [N, dim] at (slots [N], rows [N]), packed bit-identically to dsv4.quant's codecs."""
        if self.scale is None:
            self.data[slots, rows] = x.to(self.data.dtype)
        else:
            quant_write(x, self.data, self.scale, slots, rows, self.fmt, self.block)

    def read(self, slot: int, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of one slot, decoded: [end - start, dim]."""
        scale = None if self.scale is None else self.scale[slot, start:end]
        return self.decode(self.data[slot, start:end], scale, dtype)

    def zero_(self, slot: int) -> None:
        self.data[slot].zero_()
        if self.scale is not None:
            self.scale[slot].zero_()

    def flat(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[slots * n, width] views in the stored dtypes (a row id is slot * n + row), for the kernels."""
        scale = None if self.scale is None else self.scale.flatten(0, 1)
        return self._typed(self.data.flatten(0, 1), scale)

    def _typed(self, data, scale):
        return data.view(self.dtypes[0]), None if scale is None else scale.view(self.dtypes[1])


@dataclass
class LayerSlots:
    """One layer's part of a SlotState (`SlotState.layer_slots[layer_id]`), handed to the compiled decode
    block: nothing the block reads depends on which layer it is, so the layers of one kind share its code.

    - window: the layer's window ring (rows in the stored form), window_start [slots];
    - store: the compressed entries the layer attends to, its KV source's (a source writes its own), capacity
      entries per slot; a window-only layer's is the empty global store, capacity 0;
    - index_keys: the keys its indexer scores (V4: its own, V4.1: its source's), None without;
    - carry, index_carry: the rings of its compressor and of V4's indexer compressor, None without."""

    window: Rows
    window_start: torch.Tensor
    store: Rows
    capacity: int
    index_keys: Rows | None
    carry: tuple[torch.Tensor, torch.Tensor] | None
    index_carry: tuple[torch.Tensor, torch.Tensor] | None


def group_capacity(max_len: int, ratio: int) -> int:
    """Compressed rows a slot needs for max_len positions, rounded up to whole pool blocks."""
    return -(-(max_len // ratio) // POOL_BLOCK) * POOL_BLOCK


class SlotState:
    """The preallocated state of `max_seqs` sequences of up to `max_len` tokens (see the module doc).

    `resume_span`: tokens a slot may move past a group boundary and still be resumed from there (the
    overlapping compressors' ring length; default one group)."""

    def __init__(self, config: Dsv4Config, max_seqs: int, max_len: int, dtype: torch.dtype, device, packed: bool = True,
                 resume_span: int | None = None):
        c = self.config = config
        self.packed = packed
        self.max_seqs, self.max_len, self.dtype = max_seqs, max_len, dtype
        self.device = torch.device(device)
        self.scratch = max_seqs
        self.window_size = W = c.sliding_window
        slots = max_seqs + 1
        v41 = c.is_v41
        window_fmt, global_fmt, key_fmt = ("fp8" if v41 else "dense", "nvfp4" if v41 else "dense", "mxfp4") if packed else ("dense",) * 3
        self.tokens = torch.empty(slots, max_len, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=device)
        self.window_start = torch.zeros(slots, dtype=torch.int64, device=device)
        self.windows = {
            r.layer_id: Rows.allocate(window_fmt, slots, W, c.head_dim, dtype, device)
            for r in c.layer_roles
        }
        # what a window-only layer passes the attention kernel as its (empty) global store
        self.empty_global = Rows.allocate(global_fmt, 1, 1, c.head_dim, dtype, device)
        self.empty_global.zero_(0)
        self.capacity: dict[int, int] = {}  # compressed entries a slot holds, by KV source
        self.ratio_capacity: dict[int, int] = {}  # the same by compression ratio
        self.key_capacities: set[int] = set()  # the capacities of the packed index-key stores
        self.compressed: dict[int, Rows] = {}
        self.index_keys: dict[int, Rows] = {}
        self.carries: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.compressor_ratios: dict[str, int] = {}  # per compressor key
        self.overlapping: set[str] = set()
        # the overlapping compressors' ratio (V4: 4) and the tokens their rings keep past a group; None
        # without them (no compressor then needs the group before a resume point)
        r = self.overlap_ratio = next((r for r in c.compression_ratios if overlaps(c, r)), None)
        self.resume_span = None if r is None else max(r, -(-(resume_span or 0) // r) * r)
        for role in c.layer_roles:
            if not role.owns_compressor:
                continue
            i, r = role.layer_id, role.compress_ratio
            cap = self.capacity[i] = self.ratio_capacity[r] = group_capacity(max_len, r)
            self.compressed[i] = Rows.allocate(global_fmt, slots, cap + POOL_BLOCK, c.head_dim, dtype, device)
            self._carry(f"{i}.compressor", r, c.head_dim)
            if role.owns_index_keys:
                self.index_keys[i] = Rows.allocate(key_fmt, slots, cap + POOL_BLOCK, c.index_head_dim, dtype, device)
                if key_fmt == "mxfp4":  # scored by pool blocks (`StepRows.pool_blocks` in a decode step)
                    self.key_capacities.add(cap)
                if not v41:  # V4's indexer runs its own ratio-4 overlapping compressor
                    self._carry(f"{i}.indexer.compressor", 4, c.index_head_dim)
        # each layer's buffers by layer id, gathered once (the buffers never move): what a decode step hands its layers
        self.layer_slots = {r.layer_id: self._layer_slots(r) for r in c.layer_roles}
        self.clear(self.scratch)

    @classmethod
    def bytes_per_slot(cls, config: Dsv4Config, max_len: int, dtype: torch.dtype, packed: bool = True,
                       resume_span: int | None = None) -> int:
        """The bytes one slot of `max_len` tokens takes (a state of no slots holds just the scratch one)."""
        return cls(config, 0, max_len, dtype, "meta", packed, resume_span).nbytes

    def _carry(self, key: str, ratio: int, dim: int) -> None:
        """Ring buffers of a compressor of `ratio` over `dim`-wide entries (overlapping ones project twice as
        wide and keep `resume_span` tokens besides the unfinished group; see the module doc)."""
        self.compressor_ratios[key] = ratio
        rows, width = 2 * ratio, dim
        if overlaps(self.config, ratio):
            self.overlapping.add(key)
            rows, width = ratio + self.resume_span, 2 * dim
        if ratio > 1:
            shape = (self.max_seqs + 1, rows, width)
            self.carries[key] = tuple(torch.empty(shape, dtype=torch.float32, device=self.device) for _ in range(2))

    @property
    def nbytes(self) -> int:
        rows = [*self.windows.values(), *self.compressed.values(), *self.index_keys.values()]
        total = sum(r.data.nbytes + (0 if r.scale is None else r.scale.nbytes) for r in rows)
        return total + sum(t.nbytes for pair in self.carries.values() for t in pair) + self.tokens.nbytes

    def _layer_slots(self, role: LayerRole) -> LayerSlots:
        """The buffers of one layer, by its role."""
        i, source = role.layer_id, role.kv_source
        return LayerSlots(self.windows[i], self.window_start, self.compressed.get(source, self.empty_global),
                          self.capacity.get(source, 0), self.index_keys.get(source if self.config.is_v41 else i),
                          self.carries.get(f"{i}.compressor"), self.carries.get(f"{i}.indexer.compressor"))

    def clear(self, slot: int) -> None:
        """Forget a slot's sequence and zero its rows (masked-off reads of unwritten rows then see zeros)."""
        self.lengths[slot].zero_()
        self.window_start[slot].zero_()
        self.tokens[slot].zero_()
        for rows in (*self.windows.values(), *self.compressed.values(), *self.index_keys.values()):
            rows.zero_(slot)
        for pair in self.carries.values():
            for ring in pair:
                ring[slot].zero_()

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give slot `dst` slot `src`'s state at `length` (a block boundary of every ratio): tokens,
        compressed KV, index keys and carries, but no window (a bounded replay rebuilds it: the window
        starts at `length`, i.e. is empty, until rows are written below it)."""
        self.tokens[dst, :length] = self.tokens[src, :length]
        for i, rows in (*self.compressed.items(), *self.index_keys.items()):
            n = length // self.config.compress_ratios[i]
            rows.data[dst, :n] = rows.data[src, :n]
            if rows.scale is not None:
                rows.scale[dst, :n] = rows.scale[src, :n]
        for kv, score in self.carries.values():
            kv[dst], score[dst] = kv[src], score[src]
        self.lengths[dst].fill_(length)  # fill_, not item assignment: no host-to-device copy to wait for
        self.window_start[dst].fill_(length)


class SlotCache:
    """One slot of a SlotState behind the cache interface the model's module path uses (prefill)."""

    def __init__(self, state: SlotState, slot: int, length: int, window_start: int):
        """`length` and `window_start`: the slot's state.lengths / state.window_start entries, as the
        caller mirrors them on the host (reading them back would stall the host on a GPU)."""
        self.store, self.slot = state, slot
        self.window_size = state.window_size
        self.length = length
        self.window_start = window_start
        # positions appended; None: the window is empty (a fresh or restored slot), its next rows start it
        end = None if window_start >= length else length
        self._window_end = {layer: end for layer in state.windows}
        self._rows = {}  # (kind, source) -> rows written
        for i in state.compressed:
            self._rows[("compressed", i)] = self.length // state.config.compress_ratios[i]
        for i in state.index_keys:
            self._rows[("index_keys", i)] = self.length // state.config.compress_ratios[i]
        # a resumed slot (prefix copy) continues its compressors at its length
        self._next = {key: self.length for key in state.compressor_ratios} if self.length else {}

    @property
    def tokens(self) -> torch.Tensor:
        return self.store.tokens[self.slot : self.slot + 1, : self.length]

    def write_tokens(self, start: int, ids: torch.Tensor) -> torch.Tensor:
        S = ids.shape[1]
        if ids.shape[0] != 1:
            raise ValueError(f"a slot holds one sequence; got a batch of {ids.shape[0]}")
        if start > self.length:
            raise ValueError(f"slot holds {self.length} tokens; cannot continue at position {start}")
        if start + S > self.store.max_len:
            raise ValueError(f"{start + S} tokens exceed the runner's max_len of {self.store.max_len}")
        self.store.tokens[self.slot, start : start + S] = ids[0]
        self.length = start + S
        self.store.lengths[self.slot].fill_(self.length)
        return self.tokens

    # sliding windows: the ring, read back in position order
    def window(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        end = self._window_end[layer]
        first = max(self.window_start, (end or 0) - (self.window_size - 1))
        if end is None or end <= first:
            return None, None
        positions = torch.arange(first, end, device=self.store.device)
        rows = self.store.windows[layer]
        ring = positions % self.window_size
        scale = None if rows.scale is None else rows.scale[self.slot, ring]
        return rows.decode(rows.data[self.slot, ring], scale, self.store.dtype)[None], positions

    def append_window(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        keep = slice(-self.window_size, None)
        kv, positions = kv[0, keep], positions[keep]
        # the positions end where the tokens written end: the host knows them without reading them back
        end = self.length
        if self._window_end[layer] is None:  # the first rows after a reset start the window
            self._set_window_start(end - positions.shape[0])
        slots = torch.full_like(positions, self.slot)
        self.store.windows[layer].write(slots, positions % self.window_size, kv)
        self._window_end[layer] = end

    def reset_windows(self) -> None:
        """Windows restart at the next position written (a bounded replay's first)."""
        for layer in self._window_end:
            self._window_end[layer] = None
        self._set_window_start(self.length)

    def _set_window_start(self, position: int) -> None:
        self.window_start = position
        self.store.window_start[self.slot].fill_(position)

    # compressed KV and index keys
    def compressed(self, source: int) -> torch.Tensor | None:
        return self._read("compressed", source)

    def append_compressed(self, source: int, entries: torch.Tensor) -> None:
        self._write("compressed", source, entries)

    def index_keys(self, source: int) -> torch.Tensor | None:
        return self._read("index_keys", source)

    def append_index_keys(self, source: int, keys: torch.Tensor) -> None:
        self._write("index_keys", source, keys)

    def _store(self, kind: str, source: int) -> Rows:
        return (self.store.compressed if kind == "compressed" else self.store.index_keys)[source]

    def _read(self, kind: str, source: int) -> torch.Tensor | None:
        n = self._rows.get((kind, source), 0)
        return self._store(kind, source).read(self.slot, 0, n, self.store.dtype)[None] if n else None

    def _write(self, kind: str, source: int, entries: torch.Tensor) -> None:
        start = self._rows[(kind, source)]
        rows = torch.arange(start, start + entries.shape[1], device=self.store.device)
        self._store(kind, source).write(torch.full_like(rows, self.slot), rows, entries[0])
        self._rows[(kind, source)] = start + entries.shape[1]

    # compressor carries: the reference's dict form <-> the slot's rings
    def state(self, key: str) -> dict | None:
        if key not in self._next:
            return None
        nxt = self._next[key]
        if key not in self.store.carries:
            return {"next": nxt}
        kv, score = self.store.carries[key]
        ratio = self.store.compressor_ratios[key]
        g0 = nxt - nxt % ratio
        out = {"next": nxt, "kv": self._ring(kv, g0, nxt), "score": self._ring(score, g0, nxt)}
        if key in self.store.overlapping:
            out["prev"] = (self._ring(kv, g0 - ratio, g0), self._ring(score, g0 - ratio, g0)) if g0 else None
        return out

    def set_state(self, key: str, state: dict) -> None:
        nxt = self._next[key] = state["next"]
        if key not in self.store.carries:
            return
        kv, score = self.store.carries[key]
        n = state["kv"].shape[1]
        self._to_ring(kv, nxt - n, state["kv"][0])
        self._to_ring(score, nxt - n, state["score"][0])
        prev = state.get("prev")
        if prev is not None:
            ratio = self.store.compressor_ratios[key]
            g0 = nxt - n
            self._to_ring(kv, g0 - ratio, prev[0][0])
            self._to_ring(score, g0 - ratio, prev[1][0])

    def _ring(self, ring: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=ring.device) % ring.shape[1]
        return ring[self.slot, positions][None]

    def _to_ring(self, ring: torch.Tensor, start: int, rows: torch.Tensor) -> None:
        positions = torch.arange(start, start + rows.shape[0], device=ring.device) % ring.shape[1]
        ring[self.slot, positions] = rows
