"""The fast runner's sequence slots behind the KV-manager interface the scheduler uses (see KVManager).

A sequence runs in one `Runner` slot, which holds up to `max_len` tokens. Prefix caching is slot
retention: when a sequence is released (finished or preempted) its slot is kept, with the tokens whose
state it holds, until a slot is needed and it is the least recently used one (a pinned session's latest
slot goes last). A new prompt resumes from the retained slot it shares the longest usable prefix with:

- SWA bounded replay on (the default): at H, the largest multiple of `block_size` not past the common
  prefix, the slot's length or the prompt's last token, if H >= sliding_window and the slot can be
  resumed there (`Runner.resumable`; V4's overlapping compressors need the group before H, which the
  rings hold for `resume_span` = one block past a boundary the slot reached at a forward's end or by
  decode steps: a V4 slot serves hits at its last block boundary only). The new sequence gets the
  slot's state at H (`Runner.restore`: a copy into a free slot, so the prefix stays shared; or the slot
  itself, taken over in place, when it is the same session's or no slot is free) and recomputes
  [H - sliding_window, H) to rebuild its windows, as a prefix-cache hit of `KVManager` does.
- off: only a prompt that continues the retained sequence exactly where it stopped hits (H = its
  length, any alignment); the slot is taken over in place, windows and all, with nothing recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dsv4.fast.runner import Runner


@dataclass(eq=False)
class SlotSeq:
    """A sequence's hold on a runner slot: the slot, and on the host the tokens written into it."""

    slot: int
    session_id: str | None
    tokens: list[int] = field(default_factory=list)  # the slot's tokens, as written
    computed: int = 0  # tokens whose state the slot holds (committed)

    def record(self, start: int, ids: Sequence[int]) -> None:
        """The slot now holds ids at positions start.. (and nothing after them)."""
        self.tokens[start:] = ids


class SlotKV:
    """Sequence slots of a Runner, with prefix caching by slot retention (see the module docstring).

    Args:
        runner: the fast runner; each of its slots holds one sequence.
        block_size: bounded-replay hits are cut at multiples of it (a multiple of every compress ratio);
            a runner made with resume_span >= block_size lets a slot serve a hit at its last boundary.
        swa_bounded_replay, enable_prefix_caching: as for KVManager.
    """

    def __init__(self, runner: Runner, block_size: int, swa_bounded_replay: bool = True,
                 enable_prefix_caching: bool = True):
        bad = sorted(r for r in runner.config.compression_ratios if block_size % r)
        if block_size <= 0 or bad:
            raise ValueError(f"block_size {block_size} must be a positive multiple of every compress ratio "
                             f"({bad} do not divide it)")
        self.runner, self.block_size = runner, block_size
        self.swa_bounded_replay, self.enable_prefix_caching = swa_bounded_replay, enable_prefix_caching
        self._retained: OrderedDict[int, tuple[SlotSeq, np.ndarray]] = OrderedDict()  # slot -> (seq, tokens), LRU first
        self._latest: dict[str, SlotSeq] = {}  # each session's last released sequence
        self._pinned: set[str] = set()

    # ------------------------------------------------------------------ the scheduler's interface
    def can_admit(self, n_tokens: int) -> bool:
        return n_tokens <= self.runner.state.max_len and self.runner.num_free + len(self._retained) > 0

    def start(self, prompt_ids: list[int], session_id: str | None = None) -> tuple[SlotSeq, int, int | None]:
        """A slot for a new sequence, the tokens whose state it starts with, and, with bounded replay on a
        hit, where the window replay starts (run prompt[replay_from:computed] at replay_from, logits
        discarded, then prefill from `computed`)."""
        source, hit = self._lookup(prompt_ids)
        if not hit:
            seq = SlotSeq(self._free_slot(), session_id)
            return seq, 0, None
        same_session = session_id is not None and session_id == source.session_id
        if not self.swa_bounded_replay or same_session or not self.runner.num_free:
            slot = self._take(source.slot)
        else:
            self._retained.move_to_end(source.slot)
            slot = self.runner.allocate()
        if self.swa_bounded_replay:
            self.runner.restore(slot, source.slot, hit)
        seq = SlotSeq(slot, session_id, list(prompt_ids[:hit]), hit)
        replay_from = hit - self.runner.config.sliding_window if self.swa_bounded_replay else None
        return seq, hit, replay_from

    def commit(self, seq: SlotSeq, upto: int) -> None:
        """The slot holds the state of the sequence's first `upto` tokens."""
        if upto > len(seq.tokens):
            raise ValueError(f"cannot commit up to {upto}: the slot holds {len(seq.tokens)} tokens")
        seq.computed = upto

    def release(self, seq: SlotSeq) -> None:
        """The sequence is done (or preempted): its slot is retained for prefix hits, or freed."""
        if not self.enable_prefix_caching or not seq.computed:
            self.runner.release(seq.slot)
            return
        self._retained[seq.slot] = (seq, np.asarray(seq.tokens[: seq.computed]))
        if seq.session_id is not None:
            self._latest[seq.session_id] = seq

    # ------------------------------------------------------------------ sessions
    def pin(self, session_id: str) -> None:
        """Evict the session's latest slot only when no other retained slot is left."""
        self._pinned.add(session_id)

    def unpin(self, session_id: str) -> None:
        self._pinned.discard(session_id)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    # ------------------------------------------------------------------ hits and slots
    def _lookup(self, prompt_ids: list[int]) -> tuple[SlotSeq | None, int]:
        """The retained sequence giving the longest hit, and the hit's length (0: a miss)."""
        if not self._retained:
            return None, 0
        prompt = np.asarray(prompt_ids[:-1])  # at least one prompt token is computed, for its logits
        best, best_hit = None, 0
        for seq, tokens in reversed(self._retained.values()):  # most recent first wins a tie
            hit = self._hit(seq.slot, len(tokens), _common_prefix(tokens, prompt))
            if hit > best_hit:
                best, best_hit = seq, hit
        return best, best_hit

    def _hit(self, slot: int, length: int, shared: int) -> int:
        """Tokens a sequence can resume from a retained slot of `length` tokens sharing `shared` with it."""
        if not self.swa_bounded_replay:
            return length if shared == length else 0
        hit = shared // self.block_size * self.block_size
        return hit if self.runner.resumable(slot, hit) else 0

    def _free_slot(self) -> int:
        """A fresh slot, evicting the least recently used retained one if none is free."""
        if not self.runner.num_free:
            self._evict()
        return self.runner.allocate()

    def _evict(self) -> None:
        warm = {id(self._latest[s]) for s in self._pinned if s in self._latest}
        victim = next((slot for slot, (seq, _) in self._retained.items() if id(seq) not in warm), None)
        self.runner.release(self._take(next(iter(self._retained)) if victim is None else victim))

    def _take(self, slot: int) -> int:
        """Stop retaining `slot` (its sequence is no longer anyone's to resume)."""
        seq, _ = self._retained.pop(slot)
        if self._latest.get(seq.session_id) is seq:
            del self._latest[seq.session_id]
        return slot


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
