"""How an engine step's work runs through a model, one executor per implementation.

`run(works)` computes each Work's positions into its request's cache and yields (works, logits) as they
are done: a group of works computed together (the fast executor's batched decodes, else one work) and
logits [len(works), vocab] fp32 of each work's last position (rows of works that do not sample are
unused; None when none does). Works of requests preempted earlier in the step are skipped. The engine
commits, samples (one batched draw per group) and finishes a group's requests as the group arrives,
before the next work runs (so a finished request's memory is free for the rest of the step). The fast
executor also launches decode steps whose tokens are still on the device (`decode_ahead`), which the engine
then `record`s or `discard`s.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from dsv4.engine.pool import OutOfBlocks
from dsv4.engine.scheduler import Scheduler, Work

if TYPE_CHECKING:  # the reference engine never imports the fast runner's kernels
    from dsv4.engine.slot_cache import SlotKV


class ReferenceExecutor:
    """The reference model over each request's paged cache, one work at a time. A request whose KV
    blocks run out is preempted: the newest running request gives its memory back and waits again."""

    def __init__(self, model, scheduler: Scheduler):
        self.model, self.scheduler = model, scheduler

    @torch.inference_mode()
    def run(self, works: Sequence[Work]) -> Iterator[tuple[list[Work], torch.Tensor | None]]:
        for work in works:
            req = work.request
            if req.cache is None:  # preempted earlier in this step
                continue
            ids = torch.tensor([req.token_ids[work.start : work.end]])
            try:
                hidden = self.model.hidden_states(ids, cache=req.cache, start_pos=work.start)
            except OutOfBlocks:
                self._preempt(req)
                continue
            yield [work], self.model.logits(hidden[0, -1:]) if work.samples else None

    def _preempt(self, req) -> None:
        running = self.scheduler.running
        if len(running) == 1:
            raise RuntimeError(f"request {req.request_id} needs more KV memory than the engine has")
        running.remove(req)
        running.append(req)  # make it the newest, then give its memory back
        self.scheduler.preempt_newest()


class FastExecutor:
    """The fast runner over each request's slot (`SlotKV`): every single-token work of the step (the
    decodes) in one batched `Runner.decode`, then each prefill chunk (a hit's window replay leading the first)
    through the module path; a replay that no prompt tokens joined is the runner's replay step. Slots hold
    whole sequences, so nothing is ever preempted."""

    def __init__(self, kv: SlotKV):
        self.runner, self.block_size = kv.runner, kv.block_size

    def run(self, works: Sequence[Work]) -> Iterator[tuple[list[Work], torch.Tensor | None]]:
        steps = [w for w in works if w.is_step]
        if steps:
            ids = [w.request.token_ids[w.start] for w in steps]
            slots = [w.request.cache.slot for w in steps]
            logits = self.runner.decode(slots, torch.tensor(ids))  # [B, vocab]; the runner uploads the ids
            for work, token in zip(steps, ids):
                self.record(work, token)
            yield steps, logits
        for work in works:
            if work.replay:  # a hit's replay alone (no prompt tokens joined it): the runner's replay graph
                self.runner.replay(work.request.cache.slot)
                yield [work], None
            elif not work.is_step:
                yield [work], self._prefill(work)[None]

    def decode_ahead(self, steps: Sequence[Work], tokens: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Launch decode steps whose input tokens are not on the host yet: tokens [n] on the device, rows[i] the
        one steps[i] takes -> logits [len(steps), vocab]. Each step is then `record`ed once its token is read,
        or `discard`ed."""
        ids = tokens if list(rows) == list(range(len(tokens))) else tokens[self.runner.to_device(torch.tensor(rows))]
        return self.runner.decode([w.request.cache.slot for w in steps], ids)

    def record(self, step: Work, token: int) -> None:
        """The step's input token, now known on the host, is its slot's."""
        step.request.cache.record(step.start, [token])

    def discard(self, step: Work) -> None:
        """Undo a launched step that is not wanted (its request finished, or nobody reads it)."""
        if self.runner.length(step.request.cache.slot) != step.end:
            raise RuntimeError(f"step {step.start}..{step.end} of request {step.request.request_id} is not its slot's last")
        self.runner.drop_last(step.request.cache.slot)

    def _prefill(self, work: Work) -> torch.Tensor:
        """Run a chunk (a hit's replay leading it) into its slot -> logits [vocab] of its last position. With overlapping
        compressors (V4), a chunk passing a block boundary runs as two forwards split there: only a
        forward ending at a boundary leaves that prefix's last group in the rings, which a later hit at
        the boundary (the retained slot's last, typically) needs."""
        seq, tokens = work.request.cache, work.request.token_ids
        cuts = [work.start, work.end]
        boundary = (work.end - 1) // self.block_size * self.block_size
        if self.runner.state.overlap_ratio is not None and boundary > work.start:
            cuts.insert(1, boundary)
        for start, end in itertools.pairwise(cuts):
            logits = self.runner.prefill(seq.slot, tokens[start:end], start_pos=start)
            seq.record(start, tokens[start:end])
        return logits
