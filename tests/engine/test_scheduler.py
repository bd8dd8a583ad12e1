"""The scheduler's work plan for a prefix hit under bounded replay: the replay leads the first chunk."""

import pytest

from dsv4.engine.request import Request, SamplingParams
from dsv4.engine.scheduler import Scheduler


class HitEverything:
    """A KV manager whose every prompt hits at 32 tokens, with the window replay from 16."""

    block_size = 8

    def can_admit(self, n_tokens: int) -> bool:
        return True

    def start(self, prompt_ids, session_id=None):
        return object(), 32, 16


def plan(budget: int, n_tokens: int = 70):
    scheduler = Scheduler(HitEverything(), max_num_batched_tokens=budget)
    scheduler.add(Request("0", list(range(n_tokens)), SamplingParams(), [], None, None, "cpu"))
    return scheduler, [(w.start, w.end, w.replay) for w in scheduler.schedule()]


def test_the_replay_and_the_first_chunk_are_one_work():
    assert plan(48)[1] == [(16, 64, False)]  # 16 replayed + 32 prompt tokens, cut at a block end
    assert plan(100)[1] == [(16, 70, False)]  # the whole prompt


def test_a_budget_the_replay_fills_runs_the_replay_alone_then_the_prompt():
    scheduler, works = plan(10)
    assert works == [(16, 32, True)]  # a replay is never split, even past the budget
    req = scheduler.running[0]
    req.replay_from = None  # as the engine does once the replay ran
    assert [(w.start, w.end, w.replay) for w in scheduler.schedule()] == [(32, 40, False)]


@pytest.mark.parametrize("budget, seqs", [(0, 4), (8, 0)])
def test_a_budget_or_batch_of_nothing_is_refused(budget, seqs):
    with pytest.raises(ValueError, match="at least 1"):
        Scheduler(HitEverything(), max_num_batched_tokens=budget, max_num_seqs=seqs)
