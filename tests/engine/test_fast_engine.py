"""LLM(impl="fast") against LLM(impl="reference"): the same requests through both engines.

Rounding-free (fp32, quant_sim off), the two engines compute the same function in different summation
orders and chunkings, so greedy tokens agree: batched decode against one request at a time, chunked
prefill, and prefix hits (retained slots against cached blocks) with SWA bounded replay on and off.
The fast engine runs on the host here, its kernels computing with their reference twins (conftest's
`kernel_twins`): on the GPU the kernels take bf16 operands, so no fp32 comparison holds there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4.config import Dsv4Config
from dsv4.engine import llm as llm_module
from dsv4.engine.executor import FastExecutor
from dsv4.engine.llm import LLM, default_block_size
from dsv4.engine.request import SamplingParams
from dsv4.fast.cache import SlotState
from dsv4.fast.runner import Runner

MAX_LEN = 256  # tokens per slot: small slots keep the twins' per-step scans short


pytestmark = pytest.mark.usefixtures("kernel_twins")


def reference_engine(path, **kwargs) -> LLM:
    return LLM(path, impl="reference", dtype=torch.float32, quant_sim=False, **kwargs)


def fast_engine(model, slots: int, **kwargs) -> LLM:
    """A fast engine on the host (the GPU kernels compute in bf16) over a checkpoint path or a loaded fp32
    model, whose KV memory holds exactly `slots` slots of MAX_LEN tokens."""
    config = Dsv4Config.from_json(model) if isinstance(model, (str, Path)) else model.config
    per_slot = SlotState.bytes_per_slot(config, MAX_LEN, torch.float32, False, default_block_size(config))
    return LLM(model, impl="fast", device="cpu", dtype=torch.float32, quant_sim=False, max_model_len=MAX_LEN,
               kv_cache_memory=(slots + 1) * per_slot, **kwargs)  # one more: the runner's scratch slot


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batched_decode_and_chunked_prefill_equal_the_reference_engine(arch_dir):
    prompts = [prompt(1, 37), prompt(2, 5), prompt(3, 150), prompt(4, 70)]  # V4: 150 passes a block boundary
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    fast = fast_engine(arch_dir, slots=6, max_num_batched_tokens=40)
    assert fast.kv.runner.state.max_seqs == 6
    want = reference_engine(arch_dir, max_num_batched_tokens=40).generate(prompts, sp)
    got = fast.generate(prompts, sp)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 4
    assert [o.num_cached_tokens for o in got] == [0] * 4


def test_a_decode_batch_mixing_greedy_and_sampled_requests_samples_each_as_alone(tiny_v41_dir):
    # the engine draws a decode batch's greedy tokens in one argmax, the others each with their own generator
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(max_tokens=5, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    prompts, params = [prompt(1, 20), prompt(2, 9), prompt(3, 14)], [greedy, sampled, greedy]
    fast = fast_engine(tiny_v41_dir, slots=3)
    alone = [tokens(fast.generate(p, sp))[0] for p, sp in zip(prompts, params)]
    assert tokens(fast.generate(prompts, params)) == alone


def test_a_stream_left_inside_a_decode_batch_leaves_every_request_schedulable(tiny_v41_dir):
    # the first 3 tokens come from the prefills; the 4th is the first of a batched decode step's group
    fast = fast_engine(tiny_v41_dir, slots=4)
    prompts, params = [prompt(1, 10), prompt(2, 7), prompt(3, 12)], SamplingParams(max_tokens=4, ignore_eos=True)
    stream = fast.stream(prompts, params)
    for _ in range(4):
        next(stream)
    stream.close()
    running = list(fast.scheduler.running)
    assert len(running) == 3 and all(r.computed == len(r.token_ids) - 1 for r in running)
    # the next stream finishes them too, yielding only its own tokens; the step that ran ahead when the
    # stream was left was dropped and runs again
    assert [i for i, _ in fast.stream([prompt(4, 9)], SamplingParams(max_tokens=2, ignore_eos=True))] == [0, 0]
    assert not fast.scheduler.has_work
    whole = fast_engine(tiny_v41_dir, slots=4).generate(prompts, params)
    assert [r.output_ids for r in running] == tokens(whole)


class Interrupted(Exception):
    """What the test raises where a KeyboardInterrupt could land: while the host waits for the tokens."""


@pytest.mark.parametrize("how", ["closed", "left open", "interrupted"])
def test_requests_of_a_stream_left_while_steps_run_ahead_finish_as_if_uninterrupted(tiny_v41_dir, how, monkeypatch):
    """A stream left at a yield (closed, or only no longer read) while a decode step runs ahead, or interrupted
    while it waits for the tokens with two steps launched: the next engine call finishes its requests with the
    tokens of an uninterrupted run (the steps ahead are dropped, the computed ones completed)."""
    prompts, params = [prompt(1, 10), prompt(2, 7), prompt(3, 12)], SamplingParams(max_tokens=6, ignore_eos=True)
    whole = tokens(fast_engine(tiny_v41_dir, slots=4).generate(prompts, params))
    fast = fast_engine(tiny_v41_dir, slots=4)
    stream = fast.stream(prompts, params)
    if how == "interrupted":
        read, reads = llm_module._read, []

        def interrupted_once(*args):
            reads.append(1)
            if len(reads) == 2:  # the second step's tokens: the third step is launched already
                raise Interrupted
            return read(*args)

        with monkeypatch.context() as patch, pytest.raises(Interrupted):
            patch.setattr(llm_module, "_read", interrupted_once)
            list(stream)
    else:
        for _ in range(5):  # the prefills' 3 tokens, then inside the decode steps
            next(stream)
        if how == "closed":
            stream.close()
    running = list(fast.scheduler.running)
    assert len(running) == 3 and all(r.computed == len(r.token_ids) - 1 for r in running)
    fast.generate(prompt(4, 9), SamplingParams(max_tokens=2, ignore_eos=True))
    assert [r.output_ids for r in running] == whole
    stream.close()  # a loop a later one took over leaves everything as it is
    assert not fast.scheduler.has_work


def first_repeat_free(ids: list[int], start: int) -> int:
    """The first token at or after `start` that does not occur before it."""
    return next(t for k, t in enumerate(ids) if k >= start and t not in ids[:k])


@pytest.mark.parametrize("replay", [True, False], ids=["bounded-replay", "no-replay"])
def test_decode_steps_run_ahead_change_nothing(arch_dir, replay, monkeypatch):
    """The fast engine launches a steady batch's next decode step before it reads the tokens of the last, and
    drops the step of a request that stopped on a stop token. Its tokens are the reference engine's (a sampled
    request's too: the same draws from its generator), and each session's next turn (a prefix hit on the slot
    the dropped step wrote into) is what the same engine computes with no step run ahead."""
    sessions = ["a", "b", "c", "d"]
    n = 40 if Dsv4Config.from_json(arch_dir).is_v41 else 140  # V4: past its 128-token block
    prompts = [prompt(11, n), prompt(12, n - 7), prompt(13, 30), prompt(15, 21)]
    free = tokens(reference_engine(arch_dir).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True)))
    # the first two stop on a token of their own (after 3 and 5 tokens or later), the others run to max_tokens
    params = [SamplingParams(max_tokens=8, stop_token_ids=[first_repeat_free(free[0], 2)]),
              SamplingParams(max_tokens=8, stop_token_ids=[first_repeat_free(free[1], 4)]),
              SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=50, seed=3, ignore_eos=True)]
    want = tokens(reference_engine(arch_dir).generate(prompts, params))

    def two_turns():
        fast = fast_engine(arch_dir, slots=5, swa_bounded_replay=replay)
        first = fast.generate(prompts, params, session_ids=sessions)
        turn2 = [p + o.outputs[0].token_ids + prompt(14 + i, 9) for i, (p, o) in enumerate(zip(prompts, first))]
        return first, fast.generate(turn2, SamplingParams(max_tokens=4, ignore_eos=True), session_ids=sessions)

    dropped = []
    discard = FastExecutor.discard
    with monkeypatch.context() as patch:
        patch.setattr(FastExecutor, "discard", lambda self, step: (dropped.append(step), discard(self, step)))
        first, second = two_turns()
    with monkeypatch.context() as patch:
        patch.setattr(LLM, "_steady", lambda self, works: False)  # every step waits for the tokens before it
        first_in_turn, second_in_turn = two_turns()
    assert tokens(first) == tokens(first_in_turn) == want
    assert [o.outputs[0].finish_reason for o in first] == ["stop", "stop", "length", "length"]
    assert sorted(step.request.prompt_ids for step in dropped) == sorted(prompts[:2])  # a step ran ahead of each stop
    assert tokens(second) == tokens(second_in_turn)
    computed = [len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, first)]
    block = default_block_size(Dsv4Config.from_json(arch_dir))
    cached = [o.num_cached_tokens for o in second]
    assert cached == [o.num_cached_tokens for o in second_in_turn] == [c // block * block if replay else c for c in computed]


@pytest.mark.parametrize("replay", [True, False], ids=["bounded-replay", "no-replay"])
def test_a_sessions_second_turn_resumes_its_retained_slot(arch_dir, replay):
    """Turn 2 extends turn 1 (prompt + reply): with bounded replay it hits at the last block boundary
    turn 1 computed, as the reference engine's cached blocks do; without, it continues the slot exactly
    where turn 1 stopped. Either way its tokens are the reference engine's. The fast engine prefills
    turn 1 in one chunk (V4: past a block boundary, where its rings must still hold the group before),
    the reference engine in chunks ending on block boundaries, where its blocks are resumable."""
    ref = reference_engine(arch_dir, swa_bounded_replay=replay, max_num_batched_tokens=64)
    fast = fast_engine(arch_dir, slots=3, swa_bounded_replay=replay)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = prompt(5, 40 if fast.config.is_v41 else 140)  # V4's blocks are 128 tokens
    outs = {}
    for name, llm in (("ref", ref), ("fast", fast)):
        first = llm.generate(turn1, sp, session_ids="s")[0]
        turn2 = turn1 + first.outputs[0].token_ids + prompt(6, 9)
        outs[name] = (first, llm.generate(turn2, sp, session_ids="s")[0])
    assert tokens(outs["fast"]) == tokens(outs["ref"])
    computed = len(turn1) + sp.max_tokens - 1  # the last sampled token was never run
    block = fast.kv.block_size
    hit = outs["fast"][1].num_cached_tokens
    assert hit == (computed // block * block if replay else computed) and hit > 0
    if replay:
        assert hit == outs["ref"][1].num_cached_tokens


def test_requests_sharing_a_retained_prefix_each_copy_it(tiny_v41_dir):
    """Requests sharing a finished one's prefix all hit its retained slot: each resumes in a copy, so the
    slot stays retained for the next. (V4.1: at any block boundary the slot passed.)"""
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    base = prompt(7, 40)
    fast = fast_engine(tiny_v41_dir, slots=4)
    ref = reference_engine(tiny_v41_dir)
    runs = {}
    for name, llm in (("ref", ref), ("fast", fast)):
        done = llm.generate(base, sp)[0]
        history = base + done.outputs[0].token_ids
        runs[name] = llm.generate([history + prompt(8, 5), history + prompt(9, 7), base[:25] + prompt(10, 6)], sp)
    assert tokens(runs["fast"]) == tokens(runs["ref"])
    assert [o.num_cached_tokens for o in runs["fast"]] == [32, 32, 16]
    assert fast.kv.num_retained == 4


def test_retained_slots_are_evicted_least_recently_used_a_live_session_last(tiny_v41_dir):
    fast = fast_engine(tiny_v41_dir, slots=3, max_num_seqs=2)
    ref = reference_engine(tiny_v41_dir)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    turn1 = prompt(20, 40)
    out1 = fast.generate(turn1, sp, session_ids="keep")[0]
    traffic = [prompt(30 + i, 30) for i in range(4)]  # two at a time: four slots wanted, three exist
    assert tokens(fast.generate(traffic, sp)) == tokens(ref.generate(traffic, sp))
    assert fast.kv.num_retained == 3
    turn2 = turn1 + out1.outputs[0].token_ids + prompt(21, 5)
    assert fast.generate(turn2, sp, session_ids="keep")[0].num_cached_tokens == 32
    fast.end_session("keep")
    fast.generate([prompt(40 + i, 30) for i in range(3)], sp)
    assert fast.generate(turn2 + prompt(22, 3), sp)[0].num_cached_tokens == 0


def test_bad_arguments_fail_clearly(tiny_v41_dir):
    fast = fast_engine(tiny_v41_dir, slots=1)
    with pytest.raises(ValueError, match=r"exceeds the context of 256 \(max_model_len\)"):
        fast.generate(prompt(1, 250), SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="max_model_len must be in 1..4096"):
        LLM(tiny_v41_dir, impl="fast", device="cpu", max_model_len=5000)
    with pytest.raises(ValueError, match="runs on the host"):
        LLM(tiny_v41_dir, device="cuda")


def test_an_engine_over_a_loaded_model_equals_one_over_its_checkpoint(tiny_v41_dir):
    """LLM(model=<Dsv4Model>) (how the benchmarks serve random full-width models) runs the model it is given:
    the same greedy tokens as the engine that loads the checkpoint; a second engine over the same, already
    converted fast model reuses it."""
    from dsv4.reference.model import load_model

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [prompt(1, 30), prompt(2, 17)]
    want = tokens(fast_engine(tiny_v41_dir, 2).generate(prompts, params))
    model = load_model(str(tiny_v41_dir), torch.float32, progress=False)
    for _ in range(2):
        llm = fast_engine(model, 2)
        assert llm.tokenizer is None and llm.model is model
        assert tokens(llm.generate(prompts, params)) == want


def test_an_engine_keeping_engram_tables_in_host_memory_computes_the_same_tokens(tiny_v41_wide_engram_dir):
    """engram_tables="host": the tables stay in host memory, prefill chunks gather from them and decode steps
    prefetch from them; the tokens of the engine holding them on the device."""
    prompts, sp = [prompt(1, 30), prompt(2, 17)], SamplingParams(max_tokens=6, ignore_eos=True)
    host = fast_engine(tiny_v41_wide_engram_dir, slots=3, engram_tables="host")
    assert host.model.engram_prefetch is not None
    want = tokens(fast_engine(tiny_v41_wide_engram_dir, slots=3).generate(prompts, sp))
    assert tokens(host.generate(prompts, sp)) == want
    with pytest.raises(ValueError, match="engram_tables is 'device' or, for impl='fast', 'host'"):
        reference_engine(tiny_v41_wide_engram_dir, engram_tables="host")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steps_run_ahead_through_cuda_graphs_change_nothing(tiny_v41_dir, monkeypatch):
    """On the GPU a decode step's logits are its graph's output buffer, which the step run ahead overwrites:
    every read of them is queued before that step. Stop tokens shrink the batch (other graph sizes) and a seeded
    request samples: the tokens of the same engine reading each step's tokens before it launches the next."""
    prompts = [prompt(i, 20 + 7 * i) for i in range(5)]
    llm = LLM(tiny_v41_dir, impl="fast", max_num_seqs=5, max_model_len=256, kv_cache_memory=2**28,
              enable_prefix_caching=False)
    free = tokens(llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True)))
    params = [SamplingParams(max_tokens=24, stop_token_ids=[first_repeat_free(free[i], 2 + 4 * i)]) for i in range(3)]
    params += [SamplingParams(max_tokens=24, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=1.0, top_k=50, seed=3, ignore_eos=True)]
    run = lambda: [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
    ahead = run()
    monkeypatch.setattr(LLM, "_steady", lambda self, works: False)
    assert run() == ahead
    assert [reason for _, reason in ahead][:3] == ["stop"] * 3


def test_enforce_eager_builds_the_runner_without_compile_or_graphs(tiny_v41_dir, monkeypatch):
    """vLLM's enforce_eager reaches the runner (which elsewhere compiles and captures when the model is on a GPU)."""
    built = []
    init = Runner.__init__
    monkeypatch.setattr(Runner, "__init__", lambda self, *a, **kw: built.append(kw) or init(self, *a, **kw))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    want = tokens(reference_engine(tiny_v41_dir).generate(prompt(5, 30), sp))
    assert tokens(fast_engine(tiny_v41_dir, slots=2, enforce_eager=True).generate(prompt(5, 30), sp)) == want
    assert built[-1]["compile"] is False and built[-1]["cuda_graphs"] is False
    fast_engine(tiny_v41_dir, slots=2)
    assert "compile" not in built[-1] and "cuda_graphs" not in built[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_enforce_eager_serves_on_the_gpu_without_compiling_or_capturing(tiny_v41_dir):
    counters.clear()
    llm = LLM(tiny_v41_dir, impl="fast", enforce_eager=True, max_num_seqs=2, max_model_len=256,
              kv_cache_memory=2**21)
    outs = llm.generate([prompt(1, 20), prompt(2, 9)], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(t) for t in tokens(outs)] == [5, 5]
    assert not llm.kv.runner.compiled and not llm.kv.runner.cuda_graphs and not llm.kv.runner._graphs
    assert not counters["stats"]["unique_graphs"]  # nothing went through torch.compile


def test_a_replay_alone_in_its_step_runs_as_the_runners_replay_step(tiny_v41_dir, monkeypatch):
    """A token budget of one window leaves a hit's replay a step of its own: the fast executor runs it as the
    runner's replay (the decode step over the window's rows), and the tokens are the reference engine's."""
    W = Dsv4Config.from_json(tiny_v41_dir).sliding_window
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    fast = fast_engine(tiny_v41_dir, slots=3, max_num_batched_tokens=W)
    ref = reference_engine(tiny_v41_dir, max_num_batched_tokens=W)
    replays = []
    replay = fast.kv.runner.replay
    monkeypatch.setattr(fast.kv.runner, "replay", lambda slot: replays.append(slot) or replay(slot))
    base = prompt(9, 3 * W)
    second = {}
    for name, llm in (("ref", ref), ("fast", fast)):
        llm.generate(base, sp)
        second[name] = llm.generate(base + prompt(10, 5), sp)[0]
    assert tokens([second["fast"]]) == tokens([second["ref"]])
    assert second["fast"].num_cached_tokens == second["ref"].num_cached_tokens == 3 * W
    assert len(replays) == 1
