"""The offline engine: vLLM-shaped API, continuous batching, preemption, sessions, sampling."""

import shutil

import pytest
import torch

from dsv4.engine.llm import LLM
from dsv4.engine.request import SamplingParams
from dsv4.engine.router import ConsistentHashRing, Replicas
from dsv4.reference.model import bounded_replay_state

from .conftest import greedy_decode


@pytest.fixture(scope="module")
def llm(tiny_v41_dir):
    # quant_sim off: the exact model, so chunked engine runs equal one full pass to fp32 rounding
    return LLM(tiny_v41_dir, quant_sim=False, max_num_batched_tokens=48)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the whole sequence each step (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_generation_equals_full_recompute(llm):
    prompts = [prompt(1, 37), prompt(2, 5), prompt(3, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy_reference(llm.model, p, 6)
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == p
        assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0
        assert out.metrics.time_per_output_token(6) is not None


def test_the_image_token_is_never_sampled(llm, monkeypatch):
    # the tiny checkpoint's image id lies past its vocabulary; make it the token greedy decoding would pick
    p = prompt(6, 12)
    logits = llm.model(torch.tensor([p]))[0, -1]
    first = int(logits.argmax())
    monkeypatch.setattr(llm.config, "image_token_id", first)
    out = llm.generate(p, SamplingParams(max_tokens=1, ignore_eos=True))[0].outputs[0].token_ids
    assert out == [int(logits.index_fill(0, torch.tensor(first), float("-inf")).argmax())]


def test_text_prompts_and_stop_tokens(llm):
    out = llm.generate("Hello there", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    first = out.outputs[0].token_ids[0]
    assert isinstance(out.outputs[0].text, str) and out.prompt == "Hello there"
    stopped = llm.generate("Hello there", SamplingParams(max_tokens=5, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, top_p=0.9, seed=123, ignore_eos=True)
    a = llm.generate(prompt(4, 20), sp)[0].outputs[0].token_ids
    b = llm.generate(prompt(4, 20), sp)[0].outputs[0].token_ids
    c = llm.generate(prompt(4, 20), SamplingParams(**{**sp.__dict__, "seed": 124}))[0].outputs[0].token_ids
    assert a == b and a != c


def test_second_turn_of_a_session_hits_the_prefix_cache(llm):
    turn1 = prompt(5, 40)
    out1 = llm.generate(turn1, SamplingParams(max_tokens=4, ignore_eos=True), session_ids="s1")[0]
    turn2 = turn1 + out1.outputs[0].token_ids + prompt(6, 9)
    out2 = llm.generate(turn2, SamplingParams(max_tokens=4, ignore_eos=True), session_ids="s1")[0]
    assert out2.num_cached_tokens >= llm.config.sliding_window
    assert out2.num_cached_tokens % llm.kv.block_size == 0


def test_a_replayed_hit_computes_what_bounded_replay_state_defines(llm):
    """The scheduler runs a hit's window replay and the prompt after it as one forward; the tokens are those
    of the state `bounded_replay_state` defines at the hit, continued by the rest of the prompt."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = prompt(5, 40)
    first = llm.generate(turn1, sp, session_ids="r")[0].outputs[0].token_ids
    turn2 = turn1 + first + prompt(7, 30)
    out = llm.generate(turn2, sp, session_ids="r")[0]
    hit = out.num_cached_tokens
    assert hit >= llm.config.sliding_window
    with torch.inference_mode():
        cache = bounded_replay_state(llm.model, torch.tensor([turn2[:hit]]))
        logits = llm.model(torch.tensor([turn2[hit:]]), cache=cache, start_pos=hit)[:, -1]
        want, _ = greedy_decode(llm.model, turn2, cache, logits, 4)
    assert out.outputs[0].token_ids == want


def test_preemption_loses_nothing(tiny_v41_dir):
    """With room for about one long request, concurrent requests are preempted and recomputed;
    every output equals the one a solo run gives."""
    roomy = LLM(tiny_v41_dir, quant_sim=False, enable_prefix_caching=False)
    prompts = [prompt(10 + i, 60) for i in range(3)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    solo = [roomy.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    block = roomy.kv.layout.bytes_per_block(roomy.kv.block_size)
    tight = LLM(tiny_v41_dir, quant_sim=False, enable_prefix_caching=False,  # ~1.5 requests' worth
                kv_cache_memory=block * 7, max_num_batched_tokens=16)
    outs = tight.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == solo


def test_bare_checkpoint_serves_token_ids(tiny_v4_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_v4_dir, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    engine = LLM(bare, quant_sim=False, dtype=torch.float32)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text is None
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate("text needs a tokenizer")


@pytest.mark.parametrize(
    "bad, message",
    [([], "empty prompt"), ([10**7], "outside the vocabulary"), ("x" * 10, None)],
)
def test_bad_prompts(llm, bad, message):
    if message is None:  # longer than the context
        sp = SamplingParams(max_tokens=llm.config.max_position_embeddings)
        with pytest.raises(ValueError, match="exceeds the context"):
            llm.generate(bad, sp)
    else:
        with pytest.raises(ValueError, match=message):
            llm.generate([bad])


def test_sampling_params_validation():
    for kwargs in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_sessions_stick_to_one_replica():
    ring = ConsistentHashRing(["a", "b", "c"])
    sessions = [f"session-{i}" for i in range(300)]
    placed = {s: ring.lookup(s) for s in sessions}
    assert placed == {s: ring.lookup(s) for s in sessions}  # stable
    assert set(placed.values()) == {"a", "b", "c"}  # spread
    grown = ConsistentHashRing(["a", "b", "c", "d"])
    moved = [s for s in sessions if grown.lookup(s) != placed[s]]
    assert all(grown.lookup(s) == "d" for s in moved)  # only sessions taken by the new replica move
    assert 0 < len(moved) < len(sessions) / 2


def test_replicas_route_a_session_to_the_replica_holding_its_prefix(llm):
    class Recorder:
        def __init__(self):
            self.seen = []

        def generate(self, prompts, params, sessions):
            self.seen += sessions
            return [None] * len(prompts)

    engines = {"r0": Recorder(), "r1": Recorder(), "r2": Recorder()}
    replicas = Replicas(engines)
    for turn in range(5):
        replicas.generate([[1, 2, 3]] * 3, None, ["alice", "bob", "carol"])
    for name, engine in engines.items():
        for session in set(engine.seen):
            assert replicas.replica_for(session) == name
            assert engine.seen.count(session) == 5


def test_a_session_stays_warm_under_memory_pressure(tiny_v41_dir):
    """Other traffic evicts cached blocks, but not the latest blocks of a live session."""
    probe = LLM(tiny_v41_dir, quant_sim=False)
    block = probe.kv.layout.bytes_per_block(probe.kv.block_size)
    engine = LLM(tiny_v41_dir, quant_sim=False, kv_cache_memory=block * 12)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    turn1 = prompt(20, 60)
    out1 = engine.generate(turn1, sp, session_ids="keep")[0]
    for i in range(6):  # unrelated requests that need the whole pool in turn
        engine.generate(prompt(30 + i, 90), sp)
    turn2 = turn1 + out1.outputs[0].token_ids + prompt(21, 5)
    assert engine.generate(turn2, sp, session_ids="keep")[0].num_cached_tokens >= engine.config.sliding_window
    # without the session, the same history is evicted by the same traffic
    engine.end_session("keep")
    for i in range(6):
        engine.generate(prompt(40 + i, 90), sp)
    assert engine.generate(turn2 + prompt(22, 3), sp)[0].num_cached_tokens == 0
