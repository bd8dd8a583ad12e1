"""Continuous batching: every step mixes decode tokens and prefill chunks under a token budget.

Each step takes, in order: one token for every running request that is decoding, then prefill
chunks for running and waiting requests until `max_num_batched_tokens` is spent. A prefix hit's
128-token window replay leads its first chunk, in the same work (positions continue from the replay
into the prompt, as between two chunks), so a hit pays for one forward, not two (the fast executor
still ends a V4 forward at the hit when the chunk passes no later block boundary: its overlapping
compressors need forwards to end at block boundaries). When the KV manager runs out of blocks, the
newest running request is preempted: its cache is released and it waits again with every token it
has so far, to be recomputed later (prefix hits make that cheap); nothing it generated is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsv4.engine.request import Request


@dataclass
class Work:
    """Compute positions [start, end) of `request`; `replay` work only rebuilds windows (a hit's replay that
    the budget left no prompt tokens to join) and yields no token."""

    request: Request
    start: int
    end: int
    replay: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its last logits give the next token."""
        return not self.replay and self.end == len(self.request.token_ids)

    @property
    def is_step(self) -> bool:
        """One token appended to a cache that already holds a prompt: what a batched decode step computes."""
        return not self.replay and self.end - self.start == 1 and self.start > 0


class Scheduler:
    def __init__(self, kv, max_num_batched_tokens: int = 512, max_num_seqs: int = 64):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be at least 1, got {max_num_batched_tokens} "
                             f"and {max_num_seqs}")
        self.kv = kv
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        budget = self.budget
        work: list[Work] = []
        for req in self.running:  # decode first: one token each keeps latency flat
            if req.computed == len(req.token_ids) - 1 and budget > 0 and req.replay_from is None:
                work.append(Work(req, req.computed, req.computed + 1))
                budget -= 1
        for req in [r for r in self.running if r.computed < len(r.token_ids) - 1 or r.replay_from is not None]:
            budget = self._prefill(req, budget, work)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.can_admit(len(req.token_ids)):
                if not self.running:
                    raise RuntimeError(f"request {req.request_id} needs more KV memory than the engine has")
                break
            self.waiting.popleft()
            self._admit(req)
            budget = self._prefill(req, budget, work)
        return work

    def _admit(self, req: Request) -> None:
        req.cache, req.computed, req.replay_from = self.kv.start(req.token_ids, req.session_id)
        req.num_cached_tokens = req.computed
        self.running.append(req)

    def _prefill(self, req: Request, budget: int, work: list[Work]) -> int:
        if budget <= 0:
            return budget
        start = req.computed if req.replay_from is None else req.replay_from
        budget -= req.computed - start  # a replay runs as one piece, whatever the budget: windows need all of it
        end = min(len(req.token_ids), req.computed + max(budget, 0))
        aligned = end - end % self.kv.block_size
        if end < len(req.token_ids) and aligned > req.computed:
            end = aligned  # cut at a block end: the prefix cache can resume there
        if end > start:
            work.append(Work(req, start, end, replay=end == req.computed))
        return budget - (end - req.computed)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req.cache)
        req.cache = None

    def preempt_newest(self) -> Request:
        """Give the newest running request's memory back; it waits again, nothing lost."""
        req = self.running.pop()
        self.kv.release(req.cache)
        req.cache, req.computed, req.replay_from = None, 0, None
        self.waiting.appendleft(req)
        return req
