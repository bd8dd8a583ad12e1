"""The fast runner against the reference model: the same requests through both, step by step.

Rounding-free comparisons (`packed_kv=False` against the reference with quant_sim off, fp32) must agree
to float32 summation order and pick the same greedy tokens: chunked prefill, batched decode with padded
batches, and a prefix resumed under SWA bounded replay. With the packed KV formats on, a value a hair
from an FP8/FP4 rounding boundary can land on the other side in another summation order (a discrete
jump of one code), so that path is held to a stated looser bound.

Off the GPU the kernels compute with their reference twins here (conftest's `kernel_twins`). The `gpu`
tests run the Triton kernels and CUDA graphs.
"""

from __future__ import annotations

import time
from collections import Counter
from itertools import pairwise

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4.engine.llm import LLM
from dsv4.engine.request import SamplingParams
from dsv4.fast import engram_prefetch
from dsv4.fast import model as model_module
from dsv4.fast.engram_prefetch import HostEngramEmbedding, keep_engram_on_host
from dsv4.fast.kernels.compressor import compressor_pool_twin
from dsv4.fast.kernels.indexer_query import indexer_query_twin
from dsv4.fast.kernels.rope import query_heads_twin
from dsv4.fast.kernels.window_write import window_write_rounded_twin, window_write_twin
from dsv4.fast.model import FastIndexer, FastLinear, Fp8Copy, compile_options, make_fast
from dsv4.fast.runner import OutOfSlots, Runner, write_padded
from dsv4.quant import dequantize_fp8
from dsv4.reference.cache import DenseCache
from dsv4.reference.compressor import overlaps
from dsv4.reference.engram import EngramEmbedding
from dsv4.reference.linear import Linear
from dsv4.reference.model import bounded_replay_state, load_model
from dsv4.tiny import make_tiny_checkpoint

EXACT = 1e-5  # of max |logit|: float32 summation order
PACKED = 5e-2  # of max |logit|: a KV value crossing an FP8/FP4 rounding boundary moves by one code


pytestmark = pytest.mark.usefixtures("kernel_twins")


def models(path, packed: bool, dtype=torch.float32, device="cpu", fp8_decode: bool | None = None):
    ref = load_model(str(path), dtype, progress=False).to(device)
    ref.set_quant_sim(packed, activations=False)
    fast = make_fast(load_model(str(path), dtype, progress=False).to(device), packed_kv=packed, fp8_decode=fp8_decode)
    return ref, fast


class ReferenceSequence:
    """One sequence through the reference model, incrementally (DenseCache)."""

    def __init__(self, model, cache: DenseCache | None = None, length: int = 0):
        self.model, self.length = model, length
        self.cache = cache or DenseCache(model.config.sliding_window)

    def run(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], device=self.model.embed.weight.device)
        hidden = self.model.hidden_states(x, cache=self.cache, start_pos=self.length)
        self.length += len(ids)
        return self.model.logits(hidden[0, -1])


def assert_close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    bound = rel * b.abs().max().item()
    assert (a - b).abs().max().item() <= bound, f"max |diff| {(a - b).abs().max().item():.3g} > {bound:.3g}"


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_chunked_prefill_and_padded_batched_decode_equal_the_reference(arch_dir):
    ref, fast = models(arch_dir, packed=False)
    runner = Runner(fast, max_seqs=4, max_len=96)
    prompts = [prompt(37, 1), prompt(9, 2), prompt(64, 3)]
    chunks = [[0, 5, 20, 37], [0, 9], [0, 31, 33, 64]]  # across group, window and pool-block edges
    slots, refs, logits = [], [], []
    for ids, cuts in zip(prompts, chunks):
        slot, seq = runner.allocate(), ReferenceSequence(ref)
        for a, b in pairwise(cuts):
            got, want = runner.prefill(slot, ids[a:b]), seq.run(ids[a:b])
            assert_close(got, want, EXACT)
        slots.append(slot)
        refs.append(seq)
        logits.append(want)
    tokens = torch.stack([l.argmax() for l in logits])
    for _ in range(6):  # three sequences: the batch of 4 carries one padding row
        got = runner.decode(slots, tokens)
        want = torch.stack([seq.run([int(t)]) for seq, t in zip(refs, tokens)])
        assert_close(got, want, EXACT)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1)


def test_graph_inputs_are_written_in_place_padding_rows_included():
    """A decode graph's inputs take each step's rows in place, then the fill in the padding rows: a smaller batch
    leaves nothing of a larger one's rows behind, and the buffer stays the one the graph reads."""
    dst = torch.full((4,), 7)
    where = dst.data_ptr()
    write_padded(dst, torch.tensor([1, 2, 3]), 0)
    assert dst.tolist() == [1, 2, 3, 0]
    write_padded(dst, torch.tensor([5]), 9)
    assert dst.tolist() == [5, 9, 9, 9]
    write_padded(dst, torch.tensor([4, 3, 2, 1]), 9)
    assert dst.tolist() == [4, 3, 2, 1] and dst.data_ptr() == where


def test_resume_is_the_bounded_replay_of_the_prefix(arch_dir):
    ref, fast = models(arch_dir, packed=False)
    H = 128 if not ref.config.is_v41 else 64  # a multiple of every ratio, >= the window
    runner = Runner(fast, max_seqs=3, max_len=H + 16)
    ids = prompt(H + 6, 4)
    source = runner.allocate()
    runner.prefill(source, ids[:H])
    slot = runner.allocate()
    runner.resume(slot, source, H)
    seq = ReferenceSequence(ref, bounded_replay_state(ref, torch.tensor([ids[:H]])), H)
    want = seq.run(ids[H:])
    assert_close(runner.prefill(slot, ids[H:]), want, EXACT)
    # the replay and the new tokens in one forward: the same logits
    assert_close(runner.resume(runner.allocate(), source, H, ids[H:]), want, EXACT)
    token = want.argmax()
    assert_close(runner.decode([slot], token.view(1))[0], seq.run([int(token)]), EXACT)


def test_resume_from_a_source_up_to_the_resume_span_past_the_prefix(tiny_v4_dir):
    """V4's overlapping compressors need the raw projections of the group before the resume point: a
    prefill forward ending there writes them, and rings of `resume_span` keep them while the source moves
    on (prefill and decode) by that many tokens, and no further. A forward passing the point never
    held them."""
    ref, fast = models(tiny_v4_dir, packed=False)
    H, span = 128, 20
    runner = Runner(fast, max_seqs=3, max_len=H + 32, resume_span=span)
    ids = prompt(H + span + 1, 6)
    source, passed = runner.allocate(), runner.allocate()
    runner.prefill(source, ids[:H])
    runner.prefill(source, ids[H : H + 12])
    for token in ids[H + 12 : H + span]:
        runner.decode([source], torch.tensor([token]))
    slot = runner.allocate()
    runner.resume(slot, source, H)  # the source has moved `span` tokens on
    seq = ReferenceSequence(ref, bounded_replay_state(ref, torch.tensor([ids[:H]])), H)
    assert_close(runner.prefill(slot, ids[H : H + 5]), seq.run(ids[H : H + 5]), EXACT)
    runner.decode([source], torch.tensor([ids[H + span]]))
    with pytest.raises(ValueError, match="beyond the resume span of 20"):
        runner.resume(slot, source, H)
    runner.prefill(passed, ids[: H + 12])
    with pytest.raises(ValueError, match="inside a prefill forward"):
        runner.resume(slot, passed, H)


def test_a_slot_resumed_with_new_tokens_serves_a_hit_at_its_resume_point(tiny_v4_dir):
    """`resume` with ids runs the replay and the new tokens in one forward; its compressors start at the resume
    point H (they skip the replay), so the rings still hold the group before H and the slot serves a hit at H
    while it is within the resume span of it."""
    ref, fast = models(tiny_v4_dir, packed=False)
    H = 128
    runner = Runner(fast, max_seqs=3, max_len=H + 16, resume_span=8)
    ids = prompt(H + 6, 7)
    source = runner.allocate()
    runner.prefill(source, ids[:H])
    slot = runner.allocate()
    runner.resume(slot, source, H, ids[H : H + 6])  # past the group after H
    assert runner.resumable(slot, H)
    seq = ReferenceSequence(ref, bounded_replay_state(ref, torch.tensor([ids[:H]])), H)
    assert_close(runner.resume(runner.allocate(), slot, H, ids[H : H + 6]), seq.run(ids[H : H + 6]), EXACT)


def test_a_slot_goes_on_as_if_its_dropped_step_never_ran(arch_dir):
    """An engine runs a decode step ahead and drops it when the sequence has stopped: after `drop_last`, a slot
    continues (prefill where it stops, as a hit with replay off does, or decode) as the reference does, though
    the dropped step completed a compressor group and wrote its row."""
    ref, fast = models(arch_dir, packed=False)
    runner = Runner(fast, max_seqs=2, max_len=96)
    ids, n = prompt(72, 8), 63  # position 63 ends a group of every compressor of ratio 2 or 4
    slot, seq = runner.allocate(), ReferenceSequence(ref)
    runner.prefill(slot, ids[:n])
    seq.run(ids[:n])
    with pytest.raises(ValueError, match="not a decode step's"):
        runner.drop_last(slot)  # a prefill's position
    runner.decode([slot], torch.tensor([5]))
    runner.drop_last(slot)
    assert runner.length(slot) == n
    with pytest.raises(ValueError, match="dropped already"):
        runner.drop_last(slot)
    assert_close(runner.prefill(slot, ids[n:70]), seq.run(ids[n:70]), EXACT)
    runner.decode([slot], torch.tensor([5]))
    runner.drop_last(slot)
    assert_close(runner.decode([slot], torch.tensor([ids[70]]))[0], seq.run([ids[70]]), EXACT)


def test_a_dropped_step_counts_against_the_resume_span(tiny_v4_dir):
    """A decode step run ahead wrote the overlapping compressors' rings before it was dropped: a slot whose rings
    moved past the resume span of a boundary by that step no longer serves a hit there; one step less still does."""
    ref, fast = models(tiny_v4_dir, packed=False)
    H, span = 128, 20
    runner = Runner(fast, max_seqs=3, max_len=H + 32, resume_span=span)
    ids = prompt(H + span + 1, 10)
    source = runner.allocate()
    runner.prefill(source, ids[:H])
    for token in ids[H : H + span]:  # the last one dropped: the rings reached H + span
        runner.decode([source], torch.tensor([token]))
    runner.drop_last(source)
    assert runner.resumable(source, H)
    slot = runner.allocate()
    runner.resume(slot, source, H)
    seq = ReferenceSequence(ref, bounded_replay_state(ref, torch.tensor([ids[:H]])), H)
    assert_close(runner.prefill(slot, ids[H : H + 5]), seq.run(ids[H : H + 5]), EXACT)
    runner.decode([source], torch.tensor([ids[H + span - 1]]))
    runner.decode([source], torch.tensor([ids[H + span]]))  # dropped: the rings reached H + span + 1
    runner.drop_last(source)
    assert runner.length(source) == H + span and not runner.resumable(source, H)


def host_engram_model(path, dtype=torch.float32, device="cpu", packed: bool = False):
    """The fast model with its Engram tables kept in host memory (moved to `device` after that)."""
    model = load_model(str(path), dtype, progress=False)
    keep_engram_on_host(model)
    return make_fast(model.to(device), packed_kv=packed)


def test_engram_tables_in_host_memory_change_nothing(tiny_v41_wide_engram_dir):
    """keep_engram_on_host: the tables stay in host memory under the checkpoint's names (views of the packed
    records, left where they are by Module.to); a prefill gathers at each Engram layer, a decode step through
    the prefetch started at its entry: the logits of the device-resident tables, exactly."""
    _, fast = models(tiny_v41_wide_engram_dir, packed=False)
    host = host_engram_model(tiny_v41_wide_engram_dir)
    assert host.engram_prefetch is not None and fast.engram_prefetch is None
    embeds = [(layer.engram.embed, other.engram.embed) for layer, other in zip(host.layers, fast.layers)
              if layer.role.engram]
    assert embeds
    for embed, other in embeds:
        assert embed.weight.data_ptr() == embed.table.data.data_ptr()
        assert embed.to(torch.float64).weight.dtype == torch.float8_e4m3fn  # Module.to leaves the table
        assert torch.equal(embed.weight.view(torch.uint8), other.weight.view(torch.uint8))
        assert torch.equal(embed.scale.view(torch.uint8), other.scale.view(torch.uint8))
    assert host.state_dict().keys() == fast.state_dict().keys()
    want, fed = decode_steps(Runner(fast, max_seqs=4, max_len=96), 5)
    got, _ = decode_steps(Runner(host, max_seqs=4, max_len=96), 5, fed)
    assert torch.equal(got, want)
    assert not host.engram_prefetch.buffers[0].is_inference()  # a step outside inference mode may write them too


def test_a_prefill_takes_the_engram_rows_its_entry_prefetched(tiny_v41_wide_engram_dir, monkeypatch):
    """A prefill forward starts the host tables' prefetch at its entry and its Engram layers take those rows, with
    no gather of their own; a forward longer than the buffers a captured decode graph holds gathers at the layers.
    The logits are the device tables' either way."""
    _, fast = models(tiny_v41_wide_engram_dir, packed=False)
    host = host_engram_model(tiny_v41_wide_engram_dir)
    gathers = []
    gather = engram_prefetch.engram_gather
    monkeypatch.setattr(engram_prefetch, "engram_gather", lambda *a, **k: gathers.append(1) or gather(*a, **k))
    ids = prompt(40, 7)
    on_host, on_device = Runner(host, max_seqs=2, max_len=96), Runner(fast, max_seqs=2, max_len=96)
    slot_h, slot_d = on_host.allocate(), on_device.allocate()
    assert torch.equal(on_host.prefill(slot_h, ids[:30]), on_device.prefill(slot_d, ids[:30]))
    assert not gathers
    pre = host.engram_prefetch
    started = pre._ids[:, :, 0]
    assert pre.rows_for(0, started.clone(), pre.dtype) is None  # equal ids elsewhere are not the started ones
    assert pre.rows_for(0, started, torch.float64) is None
    pre.max_tokens = 4  # buffers planned for 4 tokens: a longer forward must not grow them for good
    assert torch.equal(on_host.prefill(slot_h, ids[30:]), on_device.prefill(slot_d, ids[30:]))
    assert len(gathers) == len(host.config.engram_layer_ids) and pre.max_tokens == 4


def test_a_state_dict_loads_into_the_host_engram_tables(tiny_v41_wide_engram_dir):
    """load_state_dict (assign=True as well) writes the rows the gathers read, and the checkpoint's names stay
    views of the table; a table of the wrong dtype is refused by name."""
    host = host_engram_model(tiny_v41_wide_engram_dir)
    name, embed = next((n, m) for n, m in host.named_modules() if isinstance(m, HostEngramEmbedding))
    g = torch.Generator().manual_seed(3)
    rows, dim = embed.weight.shape
    for assign in (False, True):
        weight = torch.randint(0, 0x7F, (rows, dim), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scale = torch.randint(120, 134, (rows, dim // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        host.load_state_dict({**host.state_dict(), f"{name}.weight": weight, f"{name}.scale": scale}, assign=assign)
        assert embed.weight.data_ptr() == embed.table.data.data_ptr()
        want = EngramEmbedding(rows, dim)
        want.weight, want.scale = (torch.nn.Parameter(t, False) for t in (weight, scale))
        ids = torch.randint(0, rows, (2, 3, 24), generator=g)
        assert torch.equal(embed(ids, torch.float32), want(ids, torch.float32))
    with pytest.raises(RuntimeError, match=f"{name}.weight: dtype torch.uint8"):
        host.load_state_dict({**host.state_dict(), f"{name}.weight": weight.view(torch.uint8)})
    with pytest.raises(RuntimeError, match=f"Unexpected key.*{name}.wieght"):
        host.load_state_dict({**host.state_dict(), f"{name}.wieght": weight})


def test_the_decode_parts_ask_inductor_for_its_deterministic_mode(tiny_v41_dir, monkeypatch):
    """Inductor applies compile options as config patches when it compiles (on a GPU: never in this suite), so the
    options must be config keys of the installed torch; the decode step's parts ask for the deterministic mode (no
    choice by timing: every process computes the same logits), the prefill's pieces do not; both ask for
    programmatic dependent launch."""
    for deterministic in (False, True):
        with torch._inductor.config.patch(compile_options("inductor", deterministic)):
            assert torch._inductor.config.deterministic is deterministic
            assert getattr(torch._inductor.config.triton, "enable_pdl", True)  # where this torch has the option
    _, fast = models(tiny_v41_dir, packed=True)
    asked = {}
    compile_ = torch.compile

    def record(fn, **kwargs):
        asked[getattr(fn, "__name__", fn)] = kwargs["options"]["deterministic"]
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", record)
    fast.compile_decode("inductor")
    assert asked == {"decode_enter": True, "decode": True, "decode_exit": True}
    fast.compile_prefill("inductor")
    pieces = ("_q_kv", "_output", "_queries", "_attn_input", "_ffn_input")
    assert {name: asked[name] for name in pieces} == dict.fromkeys(pieces, False)


def test_the_decode_block_compiles_per_layer_kind_and_batch_1_or_more(tmp_path):
    """The runner compiles the decode step's entry, block and exit with the batch dynamic (batch 1, then one
    compile for every larger padded size) and the block once per layer kind, not per layer, the kinds split by
    whether the layer's attention-site pass came from the layer before and whether it takes the next one's
    (`_next_attn_site`): 8 layers of 3 kinds (window, CSA, HCA), the first and the last a window layer, make 4
    block variants and 2 x (4 + 2) graphs. The prefill's pieces (query-KV, output, index queries, the blocks'
    two norms) compile once for the first chunk length and once with the length symbolic, shared by every layer,
    and the decode step's compile inlines them. The compiled steps' logits are the uncompiled ones'."""
    path = make_tiny_checkpoint("v4-flash", tmp_path, overrides={"num_hidden_layers": 8,
                                                                 "compress_ratios": [0] + [4, 128] * 3 + [4, 0]})
    (_, fast), (_, uncompiled) = models(path, packed=True), models(path, packed=True)
    roles = fast.config.layer_roles
    kinds = {(r.compress_ratio, r.owns_indexer, r.hash_moe) for r in roles}
    assert (len(roles), len(kinds)) == (8, 3)
    torch._dynamo.reset()
    counters.clear()
    compiled = Runner(fast, max_seqs=8, max_len=64, compile="eager")
    plain = Runner(uncompiled, max_seqs=8, max_len=64)
    slots = {r: [r.allocate() for _ in range(8)] for r in (compiled, plain)}
    for i in range(8):
        got, want = (r.prefill(slots[r][i], prompt(6 + i, i)) for r in (compiled, plain))
        assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 2 * 5
    g = torch.Generator().manual_seed(4)
    for B in (1, 2, 3, 5, 8):
        ids = torch.randint(0, 256, (B,), generator=g)
        assert torch.equal(compiled.decode(slots[compiled][:B], ids), plain.decode(slots[plain][:B], ids))
    variants = {(r.compress_ratio, r.owns_indexer, r.hash_moe, i == 0, i == len(roles) - 1) for i, r in enumerate(roles)}
    assert len(variants) == 4
    assert counters["stats"]["unique_graphs"] == 2 * 5 + 2 * (len(variants) + 2)


def test_packed_kv_formats_stay_within_one_rounding_code(tiny_v41_dir):
    ref, fast = models(tiny_v41_dir, packed=True)
    runner = Runner(fast, max_seqs=1, max_len=64)
    slot, seq = runner.allocate(), ReferenceSequence(ref)
    ids = prompt(40, 5)
    got, want = runner.prefill(slot, ids), seq.run(ids)
    assert_close(got, want, PACKED)
    token = want.argmax()
    for _ in range(4):
        got, want = runner.decode([slot], token.view(1))[0], seq.run([int(token)])
        assert_close(got, want, PACKED)
        assert got.argmax() == want.argmax()
        token = want.argmax()
    # the cache holds the released formats: 528 / 288 / 68 bytes per window row, entry, index key
    state = runner.state
    row = lambda rows: rows.data[0, 0].nbytes + rows.scale[0, 0].nbytes
    assert row(state.windows[0]) == 528 * ref.config.head_dim // 512
    source = next(iter(state.compressed))
    assert row(state.compressed[source]) == 288 * ref.config.head_dim // 512
    assert row(state.index_keys[source]) == 68 * ref.config.index_head_dim // 128


def test_runner_rejects_what_it_cannot_serve(tiny_v41_dir):
    _, fast = models(tiny_v41_dir, packed=False)
    runner = Runner(fast, max_seqs=2, max_len=16)
    a = runner.allocate()
    with pytest.raises(ValueError, match="no prompt"):
        runner.decode([a], torch.tensor([1]))
    with pytest.raises(ValueError, match="max_len"):
        runner.prefill(a, list(range(17)))
    with pytest.raises(ValueError, match="image tokens"):  # checked on the host ids, before anything is written
        runner.prefill(a, [1, 2, fast.config.image_token_id])
    V = fast.config.vocab_size
    for ids, message in (([1, -1], "token id -1 is outside the vocabulary"), ([], "empty prompt"),
                         (torch.tensor([1.0, 2.0]), "must be integers")):
        with pytest.raises(ValueError, match=message):
            runner.prefill(a, ids)
    assert runner.length(a) == 0
    runner.prefill(a, [1, 2])
    for ids, message in ((torch.tensor([V + 1]), f"outside the vocabulary of {V}"),
                         (torch.tensor([1.5]), "must be integers")):
        with pytest.raises(ValueError, match=message):  # before the slot's length moves on
            runner.decode([a], ids)
    assert runner.length(a) == 2
    runner.release(a)
    a = runner.allocate()
    runner.prefill(a, list(range(16)))
    with pytest.raises(ValueError, match="full"):
        runner.decode([a], torch.tensor([1]))
    b = runner.allocate()
    with pytest.raises(OutOfSlots):
        runner.allocate()
    with pytest.raises(ValueError, match="one token id per slot"):
        runner.decode([a], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="each slot once"):  # two rows would write one slot's positions
        runner.decode([b, b], torch.tensor([1, 2]))
    runner.release(b)
    # a call naming a slot no sequence owns (released, free, out of range) would read or write it unnoticed
    for call in (lambda: runner.decode([b], torch.tensor([1])), lambda: runner.decode([2], torch.tensor([1])),
                 lambda: runner.prefill(b, [1]), lambda: runner.prefill(-1, [1]), lambda: runner.restore(b, a, 8),
                 lambda: runner.restore(a, b, 8), lambda: runner.replay(b), lambda: runner.drop_last(b),
                 lambda: runner.release(b)):
        with pytest.raises(ValueError, match=r"slot -?\d is not allocated"):
            call()
    assert runner.length(a) == 16
    with pytest.raises(TypeError, match="FastModel"):
        Runner(load_model(str(tiny_v41_dir), progress=False))


def decode_steps(runner: Runner, steps: int = 4, fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts prefilled, then `steps` batched decode steps -> (their logits [steps, 3, vocab], the
    tokens fed [steps, 3]): `fed` when given, else greedy (the prefill's, then each step's argmax)."""
    slots = [runner.allocate() for _ in range(3)]
    tokens = torch.stack([runner.prefill(s, prompt(20 + 7 * i, i)).argmax() for i, s in enumerate(slots)])
    out, inputs = [], []
    for step in range(steps):
        if fed is not None:
            tokens = fed[step]
        inputs.append(tokens)
        out.append(runner.decode(slots, tokens).clone())
        tokens = out[-1].argmax(-1)
    return torch.stack(out), torch.stack(inputs)


def reference_steps(ref, fed: torch.Tensor) -> torch.Tensor:
    """decode_steps' requests through the reference model, fed the tokens `fed` [steps, 3]."""
    seqs = [ReferenceSequence(ref) for _ in range(3)]
    for i, seq in enumerate(seqs):
        seq.run(prompt(20 + 7 * i, i))
    return torch.stack([torch.stack([seq.run([int(t)]) for seq, t in zip(seqs, step)]) for step in fed])


def test_candidate_consumers_score_only_a_narrow_pool(tiny_v41_dir, monkeypatch):
    """Where a V4.1 candidate pool holds at most half the entries (FastIndexer.narrow_pool), its consumers score
    only the pool's blocks, in prefill and in batched decode over several slots (the blocks addressed in the flat
    layout of every slot's keys): the same logits as scoring every entry under the pool's mask."""
    from dsv4.fast import model as fast_model

    calls = []
    topk = fast_model.mqa_index_topk
    monkeypatch.setattr(fast_model, "mqa_index_topk", lambda *a, **k: calls.append(a[0].shape[0]) or topk(*a, **k))
    pooled, fed = decode_steps(Runner(models(tiny_v41_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False))
    assert calls[:3] == [20, 27, 34] and 4 in calls  # prefills of 20-34 queries, decode steps of 3 rows padded to 4
    monkeypatch.setattr(FastIndexer, "narrow_pool", lambda self, width, T: False)
    masked, _ = decode_steps(Runner(models(tiny_v41_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 4, fed)
    assert torch.equal(pooled, masked)


def test_a_v41_layer_takes_the_next_layers_attention_site_pass_but_before_an_engram_layer(tiny_v41_dir, monkeypatch):
    """V4.1's decode step hands a layer's FFN post the next layer's attention-site pass (one mhc_post_partial for
    the two), except before an Engram layer (its rows join the streams first) and after the last: of the tiny
    model's 8 layers 1 and 3 are Engram layers, so 5 of its 7 boundaries fuse, and a step launches
    mhc_post_partial 13 times (8 between a layer's attention and FFN sites, 5 boundaries). The logits are bit for
    bit those of every layer taking its own pass."""
    calls = []
    post_partial = model_module.mhc_post_partial
    monkeypatch.setattr(model_module, "mhc_post_partial",
                        lambda *a, **k: calls.append(a[0].shape[0]) or post_partial(*a, **k))
    fast = models(tiny_v41_dir, packed=True)[1]
    assert [i for i, layer in enumerate(fast.layers) if layer.role.engram] == [1, 3] and len(fast.layers) == 8
    fused, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    assert len(calls) == 2 * 13
    monkeypatch.setattr(model_module.FastModel, "_next_attn_site", lambda self, i: None)
    calls.clear()
    unfused = models(tiny_v41_dir, packed=True)[1]
    apart, _ = decode_steps(Runner(unfused, max_seqs=4, max_len=128, compile=False), 2, fed)
    assert len(calls) == 2 * 8
    assert torch.equal(fused, apart)


def test_a_v4_decode_step_takes_each_sites_partial_sums_in_the_post_before_it(tiny_v4_dir, monkeypatch):
    """V4's decode step runs every post but the last with the next site's partial sums (`mhc_post_sums`, within a
    layer and across layers: V4 has no Engram layer) and finishes that site alone (`mhc_pre_finish`), so mhc_pre
    runs once a step (the first layer's attention site). The logits are those of the step with mhc_post and
    mhc_pre at every site (the launches before) up to the fp32 order of the partial sums."""
    calls = Counter()
    for name in ("mhc_post_sums", "mhc_pre", "mhc_pre_finish"):
        op = getattr(model_module, name)
        monkeypatch.setattr(model_module, name, lambda *a, op=op, name=name, **k: calls.update([name]) or op(*a, **k))
    fast = models(tiny_v4_dir, packed=True)[1]
    L = len(fast.layers)
    paired, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    # two steps; mhc_pre also at every site of the three prompts' prefills (one chunk each)
    assert calls == Counter(mhc_post_sums=2 * (2 * L - 1), mhc_pre=3 * 2 * L + 2, mhc_pre_finish=2 * (2 * L - 1))

    # the sites as before: mhc_post, then mhc_pre
    def post_then_pre(self, f, h, site, coefficients, next_site, squares=False, start_next=False):
        h = model_module.mhc_post(f, h, *coefficients)
        c = self.config
        x, _, post, comb = model_module.mhc_pre(h, *next_site, None, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        return h, x, (post, comb), None

    monkeypatch.setattr(model_module.FastBlock, "decode_post_partial", post_then_pre)
    apart, _ = decode_steps(Runner(models(tiny_v4_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2,
                            fed)
    # the mHC kernel tests' fp32 tolerance (test_mhc_kernel.py: 1e-5 of the scale): the partial sums' order moves
    # the coefficients by a few fp32 ulps, and the logits by as little (1.7e-6 of 3.7 here; the fast step's
    # distance from the reference is ~1e-3)
    assert (paired - apart).abs().max() <= 1e-5 * apart.abs().max()


def test_a_batch_1_decode_step_sums_the_moes_slots_in_the_ffn_post(arch_dir, monkeypatch):
    """At one token the MoE hands its slots (`FastMoE.slots`) to the FFN site's post, which sums them: the fused
    post (V4.1's `mhc_post_partial`, V4's `mhc_post_sums`) wherever that post takes the next site's pass, and
    V4.1's `mhc_post_finish` elsewhere; the attention sites' posts take the attention's output as before; the
    logits are those of the module's own sum."""
    seen = Counter()
    for name in ("mhc_post_partial", "mhc_post_sums", "mhc_post_finish"):
        op = getattr(model_module, name)
        monkeypatch.setattr(model_module, name, lambda f, *a, op=op, **k: seen.update([f.dim()]) or op(f, *a, **k))
    ref, fast = models(arch_dir, packed=False)
    runner = Runner(fast, max_seqs=1, max_len=64, compile=False)
    slot, seq = runner.allocate(), ReferenceSequence(ref)
    token = runner.prefill(slot, prompt(20, 5)).argmax()
    seq.run(prompt(20, 5))
    seen.clear()  # the decode step's calls alone
    got = runner.decode([slot], token[None])[0]
    layers = len(fast.layers)
    fused = sum(fast._next_attn_site(i) is not None for i in range(layers))
    assert fused and seen == Counter({3: layers if fast.config.is_v41 else fused, 2: layers})
    assert_close(got, seq.run([int(token)]), EXACT)


def test_a_decode_step_writes_each_packed_row_in_one_op(arch_dir, monkeypatch):
    """A packed store's rows go through `dsv4::window_write`, one call a store and step holding every row of the
    (padded) batch: V4.1's window rows (kv_norm, RoPE, FP8) in every layer, its compressed entries (NVFP4) where a
    layer compresses, and both architectures' index keys (MXFP4; V4's Hadamard-transformed) where a layer makes them.
    The logits are those of the rows written as before (the op's twin: window_rows, the reference's hadamard,
    quant_write), up to the norm's fp32 sum order. Without packed formats the step stores the rows as before."""
    calls = []
    write = model_module.window_write

    def counted(kv, *args, start_successor=False):  # (rows, format, transformed)
        calls.append((kv.shape[0], *(args[9:] + ("fp8", False)[len(args) - 9:])))
        write(kv, *args, start_successor=start_successor)

    monkeypatch.setattr(model_module, "window_write", counted)
    fast = models(arch_dir, packed=True)[1]
    fused, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    roles, v41 = fast.config.layer_roles, fast.config.is_v41
    want = Counter({(4, "mxfp4", not v41): 2 * sum(role.owns_index_keys for role in roles)})  # the batch-4 bucket
    if v41:
        want[4, "fp8", False] = 2 * len(roles)
        want[4, "nvfp4", False] = 2 * sum(role.owns_compressor for role in roles)
    assert min(want.values()) > 0 and Counter(calls) == want
    monkeypatch.setattr(model_module, "window_write", lambda *a, start_successor=False: window_write_twin(*a))
    apart, _ = decode_steps(Runner(models(arch_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2, fed)
    assert (fused - apart).abs().max() <= 1e-5 * apart.abs().max()  # as the mHC pairing's test above
    monkeypatch.setattr(model_module, "window_write", counted)
    calls.clear()
    decode_steps(Runner(models(arch_dir, packed=False)[1], max_seqs=4, max_len=128, compile=False), 1)
    assert calls == []


def test_a_v4_decode_step_writes_each_rounded_window_row_and_entry_in_one_op(tiny_v4_dir, monkeypatch):
    """V4's window rows (kv_norm, RoPE, the FP8 round trip of the unrotated channels) go through
    `dsv4::window_write_rounded`, one call a layer and step, and so do its compressed entries (the compressor's norm,
    RoPE at the group's position, the same rounding), one more call a compressing layer; the logits are those of
    the rows written as before (the op's twin: window_rows, fake_quant_fp8, an index write), up to the norm's fp32
    sum order. Without quant_sim the step stores the rows as they are, as before."""
    calls = []
    write = model_module.window_write_rounded
    monkeypatch.setattr(model_module, "window_write_rounded", lambda kv, *a: calls.append(kv.shape[0]) or write(kv, *a))
    fast = models(tiny_v4_dir, packed=True)[1]
    fused, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    writes = len(fast.layers) + sum(role.owns_compressor for role in fast.config.layer_roles)
    assert writes > len(fast.layers) and len(calls) == 2 * writes and set(calls) == {4}  # 3 rows, the batch-4 bucket
    monkeypatch.setattr(model_module, "window_write_rounded", window_write_rounded_twin)
    apart, _ = decode_steps(Runner(models(tiny_v4_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2,
                            fed)
    assert (fused - apart).abs().max() <= 1e-5 * apart.abs().max()  # as the mHC pairing's test above
    monkeypatch.setattr(model_module, "window_write_rounded", lambda kv, *a: calls.append(kv.shape[0]) or write(kv, *a))
    calls.clear()
    plain = models(tiny_v4_dir, packed=True)[1]
    plain.set_quant_sim(False)
    decode_steps(Runner(plain, max_seqs=4, max_len=128, compile=False), 1)
    assert calls == []


def test_a_v4_decode_step_makes_each_layers_query_heads_in_one_op(tiny_v4_dir, monkeypatch):
    """V4's decode queries (each head RMS-normed, then rotated) come from `dsv4::query_heads`, one call a layer and
    step holding every row of the batch; the logits are those of the queries made by its twin (the reference's
    head_rms_norm and apply_rope), up to the heads' fp32 sums of squares."""
    calls = []
    op = model_module.query_heads
    monkeypatch.setattr(model_module, "query_heads", lambda q, *a: calls.append((q.shape[0], a[-1])) or op(q, *a))
    fast = models(tiny_v4_dir, packed=True)[1]
    fused, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    assert calls == [(4, True)] * (2 * len(fast.layers))  # 3 rows, the batch-4 bucket
    monkeypatch.setattr(model_module, "query_heads", query_heads_twin)
    apart, _ = decode_steps(Runner(models(tiny_v4_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2,
                            fed)
    assert (fused - apart).abs().max() <= 1e-5 * apart.abs().max()  # as the mHC pairing's test above


def test_a_decode_step_pools_each_compressor_in_one_op(arch_dir, monkeypatch):
    """Every compressor of ratio above 1 takes its token into its ring and pools its group in `dsv4::compressor_pool`,
    one call a compressor and step holding every row of the batch (V4's ratio-4 and ratio-128 ones, its indexers'
    ratio-4 ones; V4.1's ratio-2 ones); the logits are those of the torch ops before it (the op's twin), up to the
    softmax's fp32 sums."""
    calls = []
    op = model_module.compressor_pool

    def counted(kv, *args):  # (rows, ratio, overlapping)
        calls.append((kv.shape[0], args[-3], args[-2]))
        return op(kv, *args)

    monkeypatch.setattr(model_module, "compressor_pool", counted)
    fast = models(arch_dir, packed=True)[1]
    pooled, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    want = Counter()
    for role in fast.config.layer_roles:
        r = role.compress_ratio
        if role.owns_compressor and r > 1:
            want[4, r, overlaps(fast.config, r)] += 2  # 3 rows, the batch-4 bucket; two steps
        if role.owns_index_keys and not fast.config.is_v41:
            want[4, 4, True] += 2  # V4's indexer compressor
    assert sum(want.values()) > 0 and Counter(calls) == want
    monkeypatch.setattr(model_module, "compressor_pool", compressor_pool_twin)
    apart, _ = decode_steps(Runner(models(arch_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2, fed)
    assert (pooled - apart).abs().max() <= 1e-5 * apart.abs().max()  # as the mHC pairing's test above


def test_an_indexers_picks_become_store_rows_once_for_every_layer_reading_them(arch_dir, monkeypatch):
    """A decode step turns an indexer's top-k into rows of the compressed store (`_global_ids`) in the indexer's
    layer, and the layers reading that top-k attend to those rows as handed over: one call a step in each layer
    that owns an indexer, none in a reader (V4.1's) or an HCA layer (V4's: `StepRows.visible_rows`); the logits
    stay the reference's."""
    calls = Counter()
    global_ids = model_module.FastAttention._global_ids

    def counted(attn, *args):
        calls[attn.role.layer_id] += 1
        return global_ids(attn, *args)

    monkeypatch.setattr(model_module.FastAttention, "_global_ids", counted)
    ref, fast = models(arch_dir, packed=False)
    got, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    roles = [r for r in fast.config.layer_roles if r.compress_ratio]
    readers = [r for r in roles if not r.owns_indexer and r.index_source is not None]
    assert dict(calls) == {r.layer_id: 2 for r in roles if r.owns_indexer}
    assert readers if fast.config.is_v41 else any(r.attention_kind == "hca" for r in roles)
    assert_close(got, reference_steps(ref, fed), EXACT)


def test_a_decode_steps_rope_tables_are_every_layers_own(arch_dir):
    """The step's entry computes the RoPE tables once for each rotation (`StepRows.cos_sin`) and for each ratio's
    compressed entries (`StepRows.entry_cos_sin`); every layer's own rotary gives those of its rotation at the
    step's positions, bit for bit (a compressed layer's and a window layer's, whose thetas differ), and a
    compressing layer's those of its entries."""
    fast = models(arch_dir, packed=True)[1]
    runner = Runner(fast, max_seqs=2, max_len=256, compile=False)
    slots = torch.tensor([runner.allocate(), runner.allocate()])
    runner.state.lengths[slots] = torch.tensor([11, 130])  # the step's positions
    *_, pos, rows, _ = fast.decode_enter(torch.tensor([5, 7]), slots, runner.state)
    assert set(rows.cos_sin) == {False, True}  # the tiny configs have both kinds of layer
    for layer in fast.layers:
        cos, sin = layer.attn.rotary.cos_sin(pos)
        got_cos, got_sin = rows.cos_sin[layer.attn.rotation]
        assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)
    thetas = {rotation: rotary.theta for rotation, rotary in
              ((layer.attn.rotation, layer.attn.rotary) for layer in fast.layers)}
    assert thetas[True] != thetas[False] or fast.config.rope_theta == fast.config.compress_rope_theta
    # a compressing layer's entries rotate at the first position of the group a token would complete (0 before it)
    first = {1: [11, 130], 2: [10, 128], 4: [8, 124], 128: [0, 0]}  # by ratio, at positions 11 and 130
    ratios = {layer.attn.role.compress_ratio for layer in fast.layers if layer.attn.role.owns_compressor}
    assert set(rows.entry_cos_sin) == ratios and ratios
    for layer in fast.layers:
        if layer.attn.role.owns_compressor:
            r = layer.attn.role.compress_ratio
            cos, sin = layer.attn.rotary.cos_sin(torch.tensor(first[r]))
            got_cos, got_sin = rows.entry_cos_sin[r]
            assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)


def test_a_decode_steps_index_ends_and_visible_rows_are_every_layers_own(arch_dir):
    """The step's entry makes each indexer ratio's visible ends in the flat index keys (`StepRows.index_ends`) and
    each HCA ratio's visible store rows (`StepRows.visible_rows`) once; they are what each such layer's own buffers
    give (its keys' and its store's rows a slot, its capacity)."""
    fast = models(arch_dir, packed=True)[1]
    runner = Runner(fast, max_seqs=2, max_len=256, compile=False)
    slots = torch.tensor([runner.allocate(), runner.allocate()])
    runner.state.lengths[slots] = torch.tensor([11, 130])  # the step's positions
    *_, pos, rows, _ = fast.decode_enter(torch.tensor([5, 7]), slots, runner.state)
    checked = 0
    for role in fast.config.layer_roles:
        view, r = runner.state.layer_slots[role.layer_id], role.compress_ratio
        visible = (pos + 1) // max(r, 1)
        if role.owns_indexer:
            assert torch.equal(rows.index_ends[r], (slots * view.index_keys.data.shape[1] + visible).int())
            checked += 1
        if role.attention_kind == "hca":
            entries = torch.arange(view.capacity)
            want = torch.where(entries < visible[:, None], slots[:, None] * view.store.data.shape[1] + entries, -1)
            assert torch.equal(rows.visible_rows[r], want.int())
            checked += 1
    assert checked


def test_a_decode_step_makes_each_indexers_queries_in_one_op(arch_dir, monkeypatch):
    """With packed index keys every indexer's decode queries (RoPE, V4's Hadamard transform, MXFP4 rounding, head
    weights) come from `dsv4::indexer_query`, one call a layer and step, Hadamard-transformed for V4 alone, and so do
    the prefill's (FastIndexer._query_heads: one call a layer and prompt, a position a row) and the prefill's index
    keys (FastIndexer._key_codes: one head a row, one call a key owner and prompt, its completed groups); the logits
    are those of the queries and keys made by its twin (the reference's functions), bit for bit."""
    calls = []
    op = model_module.indexer_query
    monkeypatch.setattr(model_module, "indexer_query",
                        lambda *a: calls.append((a[0].shape[0], a[1].shape[1], a[5])) or op(*a))
    fast = models(arch_dir, packed=True)[1]
    roles = fast.config.layer_roles
    heads, indexers = fast.config.index_n_heads, sum(role.owns_indexer for role in roles)
    fused, fed = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 2)
    hadamard = not fast.config.is_v41
    prompts = (20, 27, 34)  # decode_steps' prompts, each in a slot of its own
    queries = [(n, heads, hadamard) for n in prompts for _ in range(indexers)]
    keys = [(n // role.compress_ratio, 1, hadamard) for n in prompts for role in roles if role.owns_index_keys]
    steps = [(4, heads, hadamard)] * (2 * indexers)  # its 3 rows padded to the runner's 4
    assert indexers and keys
    assert [c for c in calls if c[1] == heads] == queries + steps
    assert sorted(c for c in calls if c[1] == 1) == sorted(keys)
    monkeypatch.setattr(model_module, "indexer_query", indexer_query_twin)
    apart, _ = decode_steps(Runner(models(arch_dir, packed=True)[1], max_seqs=4, max_len=128, compile=False), 2, fed)
    assert torch.equal(fused, apart)


def test_compiled_decode_step_and_prefill_trace_without_graph_breaks_and_change_nothing(tiny_v41_dir):
    """torch.compile traces the decode step's parts and the prefill's pieces without a graph break (every kernel
    op has a fake), and the traced graphs compute what the eager model does, bit for bit (aot_eager: the host's
    inductor cannot compile float8_e8m0fnu scales; on a GPU inductor compiles it, see the gpu test)."""
    (_, fast), (_, uncompiled) = models(tiny_v41_dir, packed=True), models(tiny_v41_dir, packed=True)
    eager, _ = decode_steps(Runner(uncompiled, max_seqs=4, max_len=128, compile=False))
    counters.clear()
    traced, _ = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile="aot_eager"))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(traced, eager)


def resumed_steps(runner: Runner, steps: int = 3) -> torch.Tensor:
    """A 64-token prompt prefilled, a second slot resumed from it at 64 (the bounded replay as a decode step of
    the window's rows), 5 new tokens prefilled, then `steps` greedy decode steps -> the logits [1 + steps,
    vocab]."""
    H, ids = 64, prompt(69, 11)
    source = runner.allocate()
    runner.prefill(source, ids[:H])
    slot = runner.allocate()
    runner.resume(slot, source, H)
    out = [runner.prefill(slot, ids[H:]).clone()]
    for _ in range(steps):
        out.append(runner.decode([slot], out[-1].argmax().view(1))[0].clone())
    return torch.stack(out)


def test_the_replay_step_traces_without_graph_breaks_and_changes_nothing(tiny_v41_dir):
    """The bounded replay's variant of the decode step (no compressors, no logits, positions from the window
    start) compiles like the decode step: traced whole, and bit for bit what the eager step computes."""
    (_, fast), (_, uncompiled) = models(tiny_v41_dir, packed=True), models(tiny_v41_dir, packed=True)
    eager = resumed_steps(Runner(uncompiled, max_seqs=3, max_len=80, compile=False))
    counters.clear()
    traced = resumed_steps(Runner(fast, max_seqs=3, max_len=80, compile="aot_eager"))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(traced, eager)


def test_only_a_restored_slot_is_replayed(tiny_v41_dir):
    _, fast = models(tiny_v41_dir, packed=False)
    runner = Runner(fast, max_seqs=2, max_len=80)
    source = runner.allocate()
    runner.prefill(source, prompt(64, 3))
    with pytest.raises(ValueError, match="no restored prefix"):
        runner.replay(source)
    slot = runner.allocate()
    runner.restore(slot, source, 64)
    runner.replay(slot)
    with pytest.raises(ValueError, match="no restored prefix"):  # its window is rebuilt already
        runner.replay(slot)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_replay_graph_changes_nothing(tiny_v41_dir):
    """A resume's bounded replay replayed from its CUDA graph and run eagerly (both compiled): bit-identical."""
    _, fast = models(tiny_v41_dir, packed=True, dtype=torch.bfloat16, device="cuda")
    out = {graphs: resumed_steps(Runner(fast, max_seqs=3, max_len=80, cuda_graphs=graphs)) for graphs in (False, True)}
    assert torch.equal(out[False], out[True])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_change_nothing(arch_dir):
    """The same requests with the compiled decode steps replayed from CUDA graphs and run eagerly (V4.1 and V4):
    bit-identical. Compiled against uncompiled: inductor sums some reductions in another order, and in
    bf16 a one-ulp difference can flip a routing or top-k choice of this tiny random model, so the two
    are not equal; both must then be as close to the exact (float32, rounding-free) reference as each
    other, on the same tokens."""
    _, fast = models(arch_dir, packed=False, dtype=torch.bfloat16, device="cuda")
    ref = load_model(str(arch_dir), torch.float32, progress=False).cuda()
    ref.set_quant_sim(False, activations=False)
    outputs = {graphs: decode_steps(Runner(fast, max_seqs=4, max_len=128, cuda_graphs=graphs), 8) for graphs in (False, True)}
    assert torch.equal(outputs[False][0], outputs[True][0])
    compiled, fed = outputs[True]
    _, plain = models(arch_dir, packed=False, dtype=torch.bfloat16, device="cuda")  # compile_prefill works in place
    uncompiled, _ = decode_steps(Runner(plain, max_seqs=4, max_len=128, compile=False), 8, fed)
    want = reference_steps(ref, fed)
    err_compiled, err_uncompiled = ((x - want).abs().max().item() for x in (compiled, uncompiled))
    assert err_compiled <= 2 * err_uncompiled, f"compiled {err_compiled:.3g} vs uncompiled {err_uncompiled:.3g}"


def test_warm_up_compiles_the_prefill_for_every_chunk_length_before_serving(tiny_v4_dir):
    """An engine's start-up (Runner.warm_up) compiles the prefill's pieces for one token and for the length as a
    symbol, so no request's prefill waits for a compile, whatever its length."""
    _, fast = models(tiny_v4_dir, packed=True)
    runner = Runner(fast, max_seqs=2, max_len=64, compile="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    runner.warm_up(2)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    for n in (1, 7, 40, 2):
        slot = runner.allocate()
        runner.prefill(slot, prompt(n, n))
        runner.prefill(slot, prompt(5, n))  # and on a filled slot
        runner.release(slot)
    assert counters["stats"]["unique_graphs"] == compiled
    Runner(fast, max_seqs=1, max_len=2, compile="aot_eager").warm_up(1)  # slots shorter than the warm-up's prefills


def fp32_linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.fp32 and m.fmt == "dense"]


def test_the_fp32_output_linears_become_fast_linears_that_compute_the_reference_off_the_gpu(tiny_v4_dir):
    ref, fast = models(tiny_v4_dir, packed=True)
    linears = fp32_linears(fast)
    assert len(linears) == len(fp32_linears(ref)) > 0 and all(isinstance(m, FastLinear) for m in linears)
    x = torch.randn(5, linears[0].in_features)
    assert torch.equal(linears[0](x), Linear.forward(linears[0], x))


def test_the_attention_linears_reading_one_input_run_as_one_gemm_per_output_dtype(arch_dir):
    """make_fast concatenates the attention's linears that read x, and those that read the query latent, one
    GEMM per output dtype: each linear's weight becomes a view of its GEMM's rows (the checkpoint's values under
    its name), and the GEMM gives every linear its own output, in its own dtype."""
    ref, fast = models(arch_dir, packed=True)
    grouped = set()
    for block, ref_block in zip(fast.layers, ref.layers):
        modules, ref_modules = dict(block.attn.named_modules()), dict(ref_block.attn.named_modules())
        for group in (block.attn.on_x, block.attn.on_qr):
            x = torch.randn(3, modules[group.names[0]].in_features)
            outs = group(x)
            for names, _, fp32, weight, _ in group.parts:
                for name in names:
                    lin = modules[name]
                    assert lin.fp32 == fp32
                    assert lin.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
                    assert torch.equal(lin.weight, ref_modules[name].dequantized_weight().to(lin.weight.dtype))
                    assert outs[name].dtype == lin(x).dtype
                    assert_close(outs[name], lin(x), EXACT)
            assert sorted(outs) == sorted(group.names)
            grouped.update(group.names)
    assert {"compressor.wgate", "indexer.weights_proj", "indexer.wq_b"} <= grouped


def prefill_two(runner: Runner, ref) -> tuple[list[int], list[ReferenceSequence], torch.Tensor]:
    """Two sequences' prompts through the runner and the reference: their slots, the reference sequences and the
    reference's greedy next tokens [2]."""
    slots, seqs = [runner.allocate() for _ in range(2)], [ReferenceSequence(ref) for _ in range(2)]
    tokens = torch.stack([(runner.prefill(s, prompt(30 + i, i)), seq.run(prompt(30 + i, i)))[1].argmax()
                          for i, (s, seq) in enumerate(zip(slots, seqs))])
    return slots, seqs, tokens


def fp8_copies(fast) -> list[tuple[torch.Tensor, Fp8Copy]]:
    """(bf16 copy, FP8 copy of the same rows) of every attention weight a batch-1 decode step reads as FP8."""
    return [pair for block in fast.layers for pair in block.attn.fp8_pairs()]


def test_a_batch_1_decode_reads_the_attention_weights_as_stored(arch_dir, monkeypatch):
    """make_fast(fp8_decode=True) keeps the attention's FP8 weights as stored beside the dequantized copies (the
    query latent's part, x's where all its linears are FP8, wo_a and wo_b), holding the same values. A decode step
    of one sequence reads them, the parts of x and of the query latent with their RMSNorms (attn_norm, q_norm)
    applied in the GEMV (V4.1's query heads rotated there too; V4.1's attn_norm by the squares the FFN post before
    handed on, where that post took the layer's attention-site pass), and equals the reference; a batch of two reads
    the bf16 copies."""
    ref, fast = models(arch_dir, packed=False, fp8_decode=True)
    pairs = fp8_copies(fast)
    assert len(pairs) >= 3 * len(fast.layers)  # wq_b's part, wo_a and wo_b in every layer
    for weight, stored in pairs:
        assert stored.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(dequantize_fp8(stored.weight, stored.scale, stored.block).to(weight.dtype), weight)
    assert fp8_copies(models(arch_dir, packed=False)[1]) == []  # off the GPU, by default none are kept

    rows, normed, rotated, squared = [], [], [], []
    monkeypatch.setattr(Fp8Copy, "__call__", lambda self, x, *a, _call=Fp8Copy.__call__, **k: rows.append(x.shape[0])
                        or normed.append(k.get("norm") is not None) or rotated.append(k.get("rope") is not None)
                        or squared.append(k.get("squares") is not None) or _call(self, x, *a, **k))
    runner = Runner(fast, max_seqs=2, max_len=96, compile=False)
    slots, seqs, tokens = prefill_two(runner, ref)
    assert rows == []  # the prefill reads the bf16 copies
    for _ in range(3):
        got, want = runner.decode(slots[:1], tokens[:1])[0], seqs[0].run([int(tokens[0])])
        assert_close(got, want, EXACT)
        assert got.argmax() == want.argmax()
        tokens[0] = want.argmax()
    assert rows == [1] * 3 * len(pairs)
    inputs = [stored for block in fast.layers for *_, stored in block.attn.on_x.parts + block.attn.on_qr.parts]
    assert sum(normed) == 3 * sum(stored is not None for stored in inputs) >= 3 * len(fast.layers)
    assert sum(rotated) == (3 * len(fast.layers) if fast.config.is_v41 else 0)  # wq_b's part, each step and layer
    # x's stored parts in the layers whose x the FFN post before made (it took their attention-site pass)
    handed = sum(stored is not None for i in range(1, len(fast.layers)) if fast._next_attn_site(i - 1) is not None
                 for *_, stored in fast.layers[i].attn.on_x.parts)
    assert sum(squared) == (3 * handed if fast.config.is_v41 else 0) and (handed or not fast.config.is_v41)
    rows.clear()
    runner.decode(slots, tokens)
    assert rows == []


def test_a_batch_1_decode_reads_the_shared_experts_as_stored(arch_dir, monkeypatch):
    """make_fast(fp8_decode=True) also keeps each MoE's shared expert as stored, its scales laid out a row and 32
    elements (`fp8_rows`), holding the bf16 copy's values; w1 and w3 view that copy (no second one). A decode step
    of one sequence hands them to the gather op; a batch of two takes the other path, which reads the bf16 copy."""
    ref, fast = models(arch_dir, packed=False, fp8_decode=True)
    for block in fast.layers:
        pairs = block.ffn.fp8_pairs()
        assert [w.shape for w, _ in pairs] == [block.ffn.stacked[n].shape for n in ("shared13", "shared2")]
        for weight, stored in pairs:
            assert stored.weight.dtype == torch.float8_e4m3fn and stored.block == (1, 32)
            assert torch.equal(dequantize_fp8(stored.weight, stored.scale, stored.block).to(weight.dtype), weight)
        sh, stacked = block.ffn.shared_experts, block.ffn.stacked["shared13"]
        assert sh.w1.weight.data_ptr() == stacked.data_ptr() and sh.w3.weight.data_ptr() > stacked.data_ptr()
    assert all(block.ffn.fp8_pairs() == [] for block in models(arch_dir, packed=False)[1].layers)

    passed = []
    gather = model_module.moe_gather_slots
    monkeypatch.setattr(model_module, "moe_gather_slots", lambda *a: passed.append(len(a) - 11) or gather(*a))
    runner = Runner(fast, max_seqs=2, max_len=96, compile=False)
    slots, seqs, tokens = prefill_two(runner, ref)
    passed.clear()  # a prefill's last chunk of one token may decode through the gather op too
    got, want = runner.decode(slots[:1], tokens[:1])[0], seqs[0].run([int(tokens[0])])
    assert_close(got, want, EXACT)
    assert passed == [4] * len(fast.layers)  # the codes and exponents of shared13 and of shared2
    passed.clear()
    runner.decode(slots, tokens)
    assert passed == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_1_decode_from_fp8_weights_on_cuda_is_as_close_to_the_reference(tiny_v41_dir):
    """On the GPU (compiled, CUDA graphs, the FP8 GEMV kernel) one sequence's greedy decode from the stored FP8
    weights and from the bf16 copies: the same sums up to fp32 order, so both as close to the exact (float32,
    rounding-free) reference as each other on the same tokens."""
    ref = load_model(str(tiny_v41_dir), torch.float32, progress=False).cuda()
    ref.set_quant_sim(False, activations=False)

    def greedy(fp8: bool, fed: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """8 decode steps of one sequence -> (logits [8, vocab], the tokens fed: `fed`, else greedy)."""
        _, fast = models(tiny_v41_dir, packed=False, dtype=torch.bfloat16, device="cuda", fp8_decode=fp8)
        assert bool(fp8_copies(fast)) == fp8
        runner = Runner(fast, max_seqs=2, max_len=128)
        slot = runner.allocate()
        token, tokens, out = int(runner.prefill(slot, prompt(40, 7)).argmax()), [], []
        for step in range(8):
            tokens.append(fed[step] if fed else token)
            out.append(runner.decode([slot], torch.tensor([tokens[-1]]))[0].clone())
            token = int(out[-1].argmax())
        return torch.stack(out), tokens

    from_fp8, fed = greedy(True)
    from_bf16, _ = greedy(False, fed)
    seq = ReferenceSequence(ref)
    seq.run(prompt(40, 7))
    want = torch.stack([seq.run([t]) for t in fed])
    err_fp8, err_bf16 = ((x - want).abs().max().item() for x in (from_fp8, from_bf16))
    assert err_fp8 <= 2 * err_bf16, f"FP8 weights {err_fp8:.3g} vs bf16 copies {err_bf16:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_output_linears_on_bf16_operands_are_the_fp32_gemm_to_summation_order():
    """The compressors' projections on the GPU multiply bf16 operands into an fp32 accumulator (no fp32 copies):
    the reference's fp32 GEMM of the same values, but for the order of the fp32 sums."""
    g = torch.Generator().manual_seed(0)
    lin = FastLinear(512, 96, fp32=True, dtype=torch.bfloat16)
    lin.weight.data = torch.randn(96, 512, generator=g).to(torch.bfloat16)
    lin = lin.cuda()
    x = torch.randn(2, 300, 512, generator=g).to(torch.bfloat16).cuda()
    got, want = lin(x), Linear.forward(lin, x)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (2, 300, 96)
    assert_close(got, want, EXACT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_model_on_cuda_refuses_float32(tiny_v41_dir):
    """Its kernels take bf16 operands: a float32 fast model on the GPU would not compute in float32."""
    with pytest.raises(ValueError, match="computes in bfloat16"):
        make_fast(load_model(str(tiny_v41_dir), torch.float32, progress=False).cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_captures_its_decode_graphs_before_serving(tiny_v41_dir):
    """No request's step waits for a compile and capture: the graphs of every batch size up to max_num_seqs
    (padded to a captured size) exist once the engine is built."""
    llm = LLM(tiny_v41_dir, impl="fast", max_num_seqs=3, max_model_len=128, kv_cache_memory=2**26)
    runner = llm.kv.runner
    assert runner.state.max_seqs > 4 and sorted(runner._graphs) == [1, 2, 4]
    llm.generate([[5] * 10, [6] * 7, [7] * 12], SamplingParams(max_tokens=4, ignore_eos=True))
    assert sorted(runner._graphs) == [1, 2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_step_is_queued_while_the_device_is_busy(tiny_v41_dir):
    """Runner.decode neither copies from pageable memory nor reads the device (either waits for the queue to
    drain), so the host prepares the next step while the device runs the last: with ids from the host and
    from the device, its calls return long before a spin queued ahead of them ends."""
    _, fast = models(tiny_v41_dir, packed=True, dtype=torch.bfloat16, device="cuda")
    runner = Runner(fast, max_seqs=2, max_len=128)
    slots = [runner.allocate() for _ in range(2)]
    for slot in slots:
        runner.prefill(slot, [5, 6, 7])
    runner.decode(slots, torch.tensor([1, 2]))  # compile and capture
    torch.cuda.synchronize()
    spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin[0].record()
    torch.cuda._sleep(10**9)  # ~0.5 s of clock cycles
    spin[1].record()
    # a synchronizing call through torch raises here, naming itself; one below torch (the driver) shows in the times
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = time.perf_counter()
        logits = runner.decode(slots, torch.tensor([3, 4]))
        host_ids_ms = (time.perf_counter() - start) * 1e3
        runner.decode(slots, logits.argmax(-1))
        host_ms = (time.perf_counter() - start) * 1e3
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert host_ms < spin[0].elapsed_time(spin[1]) / 4, (
        f"{host_ms:.1f} ms on the host ({host_ids_ms:.1f} for the step with host ids)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engram_prefetch_from_host_memory_through_cuda_graphs(tiny_v41_wide_engram_dir):
    """Host-resident Engram tables on the GPU: the prefetch's side stream and events are captured in the decode
    graph (graphs on and off: the same logits) and run between the compiled parts, which trace without a break
    (a prefetch call inside them once left each layer's block to a frame of its own and, past dynamo's compile
    limit, to eager mode); the rows are the device-resident tables' (uncompiled, the same logits)."""
    host = host_engram_model(tiny_v41_wide_engram_dir, torch.bfloat16, "cuda", packed=True)
    assert host.layers[1].engram.embed.weight.device.type == "cpu" and host.engram_prefetch.cuda
    counters.clear()
    outputs = {graphs: decode_steps(Runner(host, max_seqs=4, max_len=128, cuda_graphs=graphs), 8) for graphs in (False, True)}
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(outputs[False][0], outputs[True][0])
    _, fast = models(tiny_v41_wide_engram_dir, packed=True, dtype=torch.bfloat16, device="cuda")
    fed = outputs[True][1]
    want, _ = decode_steps(Runner(fast, max_seqs=4, max_len=128, compile=False), 8, fed)
    host = host_engram_model(tiny_v41_wide_engram_dir, torch.bfloat16, "cuda", packed=True)  # not compiled
    got, _ = decode_steps(Runner(host, max_seqs=4, max_len=128, compile=False), 8, fed)
    assert torch.equal(got, want)
