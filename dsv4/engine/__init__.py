"""The serving engine: paged KV storage in the real packed formats, prefix caching, scheduling."""

from dsv4.engine.layout import CacheLayout, cache_layout
from dsv4.engine.paged_cache import PagedCache, Snapshot
from dsv4.engine.pool import BlockPool, OutOfBlocks
from dsv4.engine.prefix_cache import Hit, KVManager, PrefixCache

__all__ = [
    "BlockPool",
    "CacheLayout",
    "Hit",
    "KVManager",
    "OutOfBlocks",
    "PagedCache",
    "PrefixCache",
    "Snapshot",
    "cache_layout",
]
