"""The state a prompt leaves behind for the tokens after it, behind one small interface.

The model reads and writes, per sequence batch:
- `tokens`: every token id so far [B, T] (Engram hashes look back up to max_ngram - 1 tokens);
- per layer, its sliding window: the newest `window - 1` rows of post-RoPE KV and their positions;
- per KV source, its compressed entries [B, G, head_dim] (rotated; entry g belongs to position g * ratio);
- per index-key owner, the indexer keys [B, G, index_head_dim];
- per compressor, a carry state: raw projections of the tokens of the unfinished group (and, for V4's
  overlapping compressor, of the last finished group) plus the next position it expects.

`DenseCache` keeps all of it as plain tensors; the engine keeps the same state in the packed
formats of the real system. A forward over positions [p, p + S) needs the cache filled up to p. A
compressor skips positions below its `next` (already consumed), which is how a prefix-cache hit
replays the last window without touching the compressed KV it restored.
"""

from __future__ import annotations

import torch


class DenseCache:
    """All model state as dense tensors in the model's dtype (the reference's cache)."""

    def __init__(self, window: int):
        self.window_size = window
        self.tokens: torch.Tensor | None = None  # [B, T]
        self._window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._compressed: dict[int, torch.Tensor] = {}
        self._index_keys: dict[int, torch.Tensor] = {}
        self._states: dict[str, dict] = {}

    # tokens
    def write_tokens(self, start: int, ids: torch.Tensor) -> torch.Tensor:
        """Record ids [B, S] at positions start..start+S-1 and return the history [B, start+S]."""
        if self.tokens is None:
            self.tokens = ids.new_zeros(ids.shape[0], 0)
        if self.tokens.shape[1] < start:
            raise ValueError(f"cache holds {self.tokens.shape[1]} tokens; cannot continue at position {start}")
        self.tokens = torch.cat((self.tokens[:, :start], ids), dim=1)
        return self.tokens

    @property
    def length(self) -> int:
        """Tokens written so far: where the positions of the latest `write_tokens` end."""
        return 0 if self.tokens is None else self.tokens.shape[1]

    # sliding window
    def window(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Past window rows [B, P, D] and their positions [P] (P < window), or (None, None)."""
        return self._window.get(layer, (None, None))

    def append_window(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        past, past_pos = self.window(layer)
        if past is not None:
            kv, positions = torch.cat((past, kv), dim=1), torch.cat((past_pos, positions))
        keep = self.window_size - 1  # the next query adds itself as the window's last row
        self._window[layer] = (kv[:, -keep:], positions[-keep:])

    def reset_windows(self) -> None:
        self._window.clear()

    # compressed KV and index keys
    def compressed(self, source: int) -> torch.Tensor | None:
        return self._compressed.get(source)

    def append_compressed(self, source: int, entries: torch.Tensor) -> None:
        self._compressed[source] = _cat(self._compressed.get(source), entries)

    def index_keys(self, source: int) -> torch.Tensor | None:
        return self._index_keys.get(source)

    def append_index_keys(self, source: int, keys: torch.Tensor) -> None:
        self._index_keys[source] = _cat(self._index_keys.get(source), keys)

    # compressor carries
    def state(self, key: str) -> dict | None:
        return self._states.get(key)

    def set_state(self, key: str, state: dict) -> None:
        self._states[key] = state


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat((old, new), dim=1)
