"""Paged storage for the KV that grows with a sequence: fixed-size, refcounted blocks.

Block b of a sequence covers its positions [b * block_size, (b + 1) * block_size); it holds, for every
stream (`layout.kv_streams`: each KV source's compressed entries, each index-key owner's keys), the
`block_size / ratio` rows belonging to those positions, in the storage format's stored form. One
tensor per stream holds that stream's rows of every block: [num_blocks, block_size / ratio, width].

Blocks are shared copy-free: a sequence and the prefix cache each hold a reference, and a block
returns to the free list when the last one is released.
"""

from __future__ import annotations

from collections import deque

import torch

from dsv4.config import Dsv4Config
from dsv4.engine.layout import CacheLayout, Stream, cache_layout, row_width, storage_format


class OutOfBlocks(RuntimeError):
    """Every KV block is in use (the scheduler preempts a sequence on it)."""


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens, allocated from a free list, refcounted.

    Args:
        config: the model configuration.
        num_blocks: blocks in the pool.
        block_size: tokens per block; a multiple of every compress ratio (V4: of 128).
        format: "packed", "dense", or None for packed wherever it is exact (see `storage_format`).
        dtype, quant_sim: the model's compute dtype and precision mode, which decide what is exact;
            dtype is also the dense format's storage dtype and the dtype rows are read back in.
        device: where the blocks live.
    """

    def __init__(
        self,
        config: Dsv4Config,
        num_blocks: int,
        block_size: int = 256,
        format: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        quant_sim: bool = True,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.format, self.layout, self.bytes_per_block = _layout(config, block_size, format, dtype, quant_sim)
        self.config, self.num_blocks, self.block_size, self.dtype = config, num_blocks, block_size, dtype
        self.device = torch.device(device)
        self.codecs = self.layout.codecs
        # one tensor per stream: [num_blocks, block_size / ratio, row width]
        self.storage = {(s.kind, s.source): self._blocks_of(s) for s in self.layout.streams}
        self._refs = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @classmethod
    def for_memory(
        cls,
        config: Dsv4Config,
        bytes_available: int,
        block_size: int = 256,
        format: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        quant_sim: bool = True,
        device: torch.device | str = "cpu",
    ) -> BlockPool:
        """As many blocks as `bytes_available` holds."""
        _, _, per_block = _layout(config, block_size, format, dtype, quant_sim)
        if bytes_available < per_block:
            raise ValueError(f"{bytes_available} bytes hold no KV block of {per_block} bytes")
        return cls(config, bytes_available // per_block, block_size, format, dtype, quant_sim, device)

    def _blocks_of(self, stream: Stream) -> torch.Tensor:
        codec = getattr(self.codecs, stream.kind)
        rows = self.block_size // stream.ratio
        # empty, not zeros: rows are read only after they are written, and untouched pages cost nothing
        return torch.empty(self.num_blocks, rows, row_width(codec), dtype=codec.storage_dtype, device=self.device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self) -> int:
        """A free block, holding one reference."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks of {self.block_size} tokens are in use")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is free; only held blocks can be shared")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; the last one returns the block to the free list."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is already free")
        self._refs[block] -= 1
        if not self._refs[block]:
            self._free.append(block)


def _layout(
    config: Dsv4Config, block_size: int, format: str | None, dtype: torch.dtype, quant_sim: bool
) -> tuple[str, CacheLayout, int]:
    """(storage format, layout, bytes per block), checking the format and the block size."""
    format = storage_format(config, dtype, quant_sim, format)
    layout = cache_layout(config, format, dtype)
    return format, layout, layout.bytes_per_block(block_size)
