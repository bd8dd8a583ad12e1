"""bench/full_width.py: full-width random models for GPU benchmarks, checked on the CPU at shrunk widths.

The shrunk configs run the same code path as the full-width ones (the same layer sets, roles, storage
formats and block sizes); only the widths come from `SHRINK`. Full-width configs are checked on the meta
device (shapes, dtypes, bytes), never materialized here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `bench` as a package

from bench.full_width import (
    RELEASED,
    build_random_model,
    fill_in_chunks,
    full_width_config,
    full_width_layers,
    idle_gaps,
    layer_bytes,
    layer_rows,
    main,
    released_estimate,
    released_numbers,
    role_kind,
    split_by_layer,
    transformers_model,
)
from dsv4.checkpoint import _fit, _slots, load_into
from dsv4.config import Dsv4Config
from dsv4.reference.engram import engram_primes
from dsv4.reference.model import Dsv4Model
from dsv4.tiny import random_tensors

# Tiny widths (the tiny checkpoints' own): every quantized linear's input is a multiple of V4's 128-wide
# activation blocks, head_dim - rope = 64 fits V4's 64-wide KV blocks; 16 indexer heads avoid score ties.
SHRINK = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 4,
    "sliding_window": 16,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
}


def shrunk(arch: str, n_layers: int) -> Dsv4Config:
    overrides = dict(SHRINK)
    if arch == "v4":  # V4.1-only fields
        overrides.pop("candidate_topk_blocks"), overrides.pop("candidate_block_size")
    return full_width_config(arch, n_layers, overrides)


def random_ids(config: Dsv4Config, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------- configs
def _released_roles(arch: str):
    raw = RELEASED[arch]
    return Dsv4Config.from_dict(raw).layer_roles


@pytest.mark.parametrize("arch, n", [("v41", n) for n in range(1, 9)] + [("v4", n) for n in range(1, 7)] + [("v41", 40), ("v4", 43)])
def test_cut_config_keeps_the_released_roles(arch, n):
    """Each kept layer has its released role, with layer ids renumbered (Engram and drafter removed)."""
    config = full_width_config(arch, n)
    kept = full_width_layers(arch, n)
    released = _released_roles(arch)
    assert config.num_hidden_layers == n == len(kept) and len(config.compress_ratios) == n
    assert config.num_nextn_predict_layers == 0 and not config.has_drafter and not config.engram_layer_ids
    old = dict(enumerate(kept))
    for role in config.layer_roles:
        want = released[old[role.layer_id]]
        assert role.compress_ratio == want.compress_ratio
        assert (old.get(role.kv_source), old.get(role.index_source)) == (want.kv_source, want.index_source)
        for flag in ("owns_compressor", "owns_indexer", "owns_index_keys", "candidate_role", "hash_moe"):
            assert getattr(role, flag) == getattr(want, flag), (role, want)
        assert not role.engram


def test_chosen_layer_sets():
    assert full_width_layers("v41", 4) == [2, 20, 21, 24]
    assert full_width_layers("v41", 6) == [0, 2, 3, 20, 21, 24]
    assert full_width_layers("v4", 4) == [0, 2, 4, 5]
    assert full_width_layers("v4", 6) == [0, 1, 2, 3, 4, 5]
    kinds = [r.attention_kind for r in full_width_config("v4", 3).layer_roles]
    assert kinds == ["window", "csa", "hca"]
    roles = full_width_config("v41", 4).layer_roles
    assert roles[0].owns_compressor and roles[0].compress_ratio == 2  # encoder KV source
    assert roles[1].candidate_role == "source" and roles[1].compress_ratio == 1  # decoder KV source
    assert roles[2].kv_source == 1 and not roles[2].owns_indexer  # a reader of the shared KV
    assert roles[3].candidate_role == "consumer" and roles[3].owns_indexer
    assert full_width_config("v41", 4).decoder_start == 2
    with pytest.raises(ValueError, match="n_layers"):
        full_width_layers("v4", 44)


def test_full_width_config_has_the_released_widths():
    v41, v4 = full_width_config("v41", 4), full_width_config("v4", 4)
    assert (v41.hidden_size, v41.n_routed_experts, v41.moe_intermediate_size, v41.q_lora_rank) == (5120, 384, 2304, 1280)
    assert (v41.index_n_heads, v41.weight_block_size, v41.rms_norm_eps, v41.vocab_size) == (32, (32, 32), 1e-20, 129280)
    assert (v4.hidden_size, v4.n_routed_experts, v4.moe_intermediate_size, v4.q_lora_rank) == (4096, 256, 2048, 1024)
    assert (v4.index_n_heads, v4.weight_block_size, v4.rms_norm_eps, v4.num_hash_layers) == (64, (128, 128), 1e-6, 2)
    assert v41.expert_format == v4.expert_format == "fp4"
    explicit = full_width_config("v41", layers=[20, 21, 22, 23])
    assert [r.compress_ratio for r in explicit.layer_roles] == [1, 1, 1, 1]


def test_full_width_shapes_are_the_checkpoints(tmp_path):
    """MODEL.md section 9 shapes and dtypes, on the meta device (nothing allocated)."""
    expect = {
        "v41": {
            "layers.0.attn.wq_a.weight": (torch.float8_e4m3fn, [1280, 5120]),
            "layers.0.attn.wq_a.scale": (torch.float8_e8m0fnu, [40, 160]),
            "layers.0.attn.indexer.wq_b.scale": (torch.float8_e8m0fnu, [128, 40]),
            "layers.0.attn.indexer.wk.weight": (torch.bfloat16, [128, 512]),
            "layers.0.attn.compressor.wgate.weight": (torch.bfloat16, [512, 5120]),
            "layers.1.attn.compressor.wkv.weight": (torch.bfloat16, [512, 5120]),
            "layers.0.attn.attn_sink": (torch.float32, [64]),
            "layers.0.ffn.experts.383.w1.weight": (torch.int8, [2304, 2560]),
            "layers.0.ffn.experts.0.w2.scale": (torch.float8_e8m0fnu, [5120, 72]),
            "layers.0.ffn.gate.bias_vl": (torch.float32, [384]),
            "layers.0.hc_ffn_fn": (torch.float32, [24, 20480]),
        },
        "v4": {
            "layers.0.attn.wq_a.scale": (torch.float8_e8m0fnu, [8, 32]),
            "layers.0.attn.wo_b.scale": (torch.float8_e8m0fnu, [32, 64]),
            "layers.0.ffn.gate.tid2eid": (torch.int64, [129280, 6]),
            "layers.2.ffn.gate.bias": (torch.float32, [256]),
            "layers.1.attn.indexer.compressor.ape": (torch.float32, [4, 256]),
            "layers.3.attn.compressor.ape": (torch.float32, [128, 512]),
            "layers.1.ffn.experts.0.w2.weight": (torch.int8, [4096, 1024]),
            "layers.1.ffn.shared_experts.w1.scale": (torch.float8_e8m0fnu, [16, 32]),
            "hc_head_fn": (torch.float32, [4, 16384]),
        },
    }
    for arch, tensors in expect.items():
        slots = _slots(build_random_model(full_width_config(arch, 4), "meta"))
        got = {k: (slots[k][2].dtype, list(slots[k][2].shape)) for k in tensors}
        assert got == tensors


def test_layer_bytes_full_width():
    rows = layer_bytes(build_random_model(full_width_config("v41", 4), "meta"))
    assert all(r["routed_experts"] == 384 * 3 * 2304 * 5120 * 17 // 32 for r in rows)  # 4 bits + e8m0 / 32
    assert all(r["shared_expert"] == 3 * 2304 * 5120 * (1 + 1 / 1024) for r in rows)  # FP8 + 32x32 scales
    assert all(r["mhc"] == 2 * (24 * 20480 + 24 + 3) * 4 for r in rows)
    assert rows[2]["attention"] < rows[1]["attention"]  # a reader owns no compressor and no indexer
    assert all(r["total"] == sum(r[k] for k in ("attention", "routed_experts", "shared_expert", "gate", "mhc", "norms"))
               for r in rows)


def test_cli_prints_bytes_per_layer(capsys):
    assert main(["--arch", "v41", "--layers", "4", "--device", "meta"]) == 0
    out = capsys.readouterr().out
    assert "routed experts MB" in out and "7219.4" in out and "cand-consumer" in out


# ----------------------------------------------------------------------------------------------- built models
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_built_model_is_what_the_loader_expects(arch, tmp_path):
    """Every tensor of the built model passes load_into's checks for its config: written out and loaded into
    a fresh meta model, nothing is missing, unexpected, misshapen or mistyped, and the values come back."""
    from safetensors.torch import save_file

    config = shrunk(arch, 4)
    model = build_random_model(config, "cpu", torch.float32, seed=1)
    built = {name: t for name, (_, _, t, _) in _slots(model).items()}
    with torch.device("meta"):
        fresh = Dsv4Model(config, torch.float32)
    expected = _slots(fresh)
    assert built.keys() == expected.keys()
    for name, t in built.items():
        assert t.device.type == "cpu" and (t.dtype, t.shape) == (expected[name][2].dtype, expected[name][2].shape), name
        _fit(name, t, expected[name][2])
    save_file({k: v.contiguous() for k, v in built.items()}, str(tmp_path / "model.safetensors"))
    report = load_into(fresh, tmp_path, progress=False)
    assert report.loaded == len(expected)
    assert all(torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, _raw(fresh, n)) for n, t in built.items())
    # the formats are the release's: FP8 linears, MXFP4 experts, fp32 mHC, int64 hash tables on V4
    assert built["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert built["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert built["layers.0.hc_attn_fn"].dtype == torch.float32
    if arch == "v4":
        table = built["layers.0.ffn.gate.tid2eid"]
        assert table.dtype == torch.int64 and bool((table >= 0).all() and (table < 8).all())
        assert bool((table.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts per token


def _raw(model, name):
    t = _slots(model)[name][2]
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_values_are_the_tiny_generators():
    """On the CPU, the built model holds exactly `dsv4.tiny.random_tensors` (as the loader converts them)."""
    config = shrunk("v4", 3)
    model = build_random_model(config, "cpu", seed=5)
    with torch.device("meta"):
        meta = Dsv4Model(config)
    slots = _slots(meta)
    for name, t in random_tensors(meta, 5).items():
        got = _slots(model)[name][2]
        want = _fit(name, t, slots[name][2])
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want), name
    again = build_random_model(config, "cpu", seed=5)
    assert torch.equal(again.layers[1].ffn.experts[3].w2.weight, model.layers[1].ffn.experts[3].w2.weight)


@pytest.mark.parametrize("arch", ["v41", "v4"])
@pytest.mark.parametrize("quant_sim", [True, False])
def test_forward_runs(arch, quant_sim):
    config = shrunk(arch, 6)
    model = build_random_model(config, "cpu")
    model.set_quant_sim(quant_sim)
    with torch.inference_mode():
        logits = model(random_ids(config, 40))
    assert logits.shape == (2, 40, config.vocab_size) and logits.dtype == torch.float32
    assert bool(logits.isfinite().all()) and logits.std() > 0


def test_a_cut_can_keep_its_engram_lookups_with_smaller_tables():
    """engram_vocab_size keeps the kept Engram layers (released layer 1, first in this cut) with tables of exactly
    the rows the hash addresses at that bucket count; the built model hashes over a synthetic token map, and its
    lookup moves the output."""
    overrides = {**SHRINK, "engram_compressed_vocab_size": 256}
    config = full_width_config("v41", layers=[1, 2, 20], overrides=overrides, engram_vocab_size=1000)
    assert config.engram_layer_ids == [0] and [r.engram for r in config.layer_roles] == [True, False, False]
    primes = engram_primes(1, 1000, config.engram_max_ngram_size, config.engram_n_heads)
    assert config.engram_num_embeddings == [sum(map(sum, primes[0]))]
    assert 24 * 1000 < config.engram_num_embeddings[0] < 24 * 1100
    model = build_random_model(config, "cpu")
    assert model.layers[0].engram.embed.weight.shape == (config.engram_num_embeddings[0], 256)
    ids = random_ids(config, 12)
    with torch.inference_mode():
        logits = model(ids)
        model.layers[0].engram.embed.scale.view(torch.uint8).fill_(0)  # every row scaled to 2^-127
        without = model(ids)
    assert bool(logits.isfinite().all()) and not torch.equal(logits, without)
    with pytest.raises(ValueError, match="V4 has no Engram"):
        full_width_config("v4", 2, engram_vocab_size=1000)
    with pytest.raises(ValueError, match="none of the kept layers"):
        full_width_config("v41", layers=[2, 20], engram_vocab_size=1000)


def test_transformers_model_matches_the_reference():
    """Same weights in transformers' DeepseekV4ForCausalLM: the parity tests' tolerance, in fp32, quant_sim off.
    The layers are window + hash MoE, CSA + hash MoE, CSA, HCA; 300 tokens hold two HCA entries."""
    from test_transformers_parity import assert_logits_match

    config = shrunk("v4", 4)
    model = build_random_model(config, "cpu", torch.float32, seed=2)
    model.set_quant_sim(False)
    hf = transformers_model(model, torch.float32)
    assert hf.config._attn_implementation == "eager"
    assert hf.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 128, 128)
    ids = random_ids(config, 300, seed=3)
    with torch.inference_mode():
        for n in (7, 130, 300):
            assert_logits_match(model(ids[:, :n]), hf(input_ids=ids[:, :n], use_cache=False).logits, f"{n} tokens")


def test_transformers_model_is_bf16_by_default_and_refuses_v41():
    model = build_random_model(shrunk("v4", 2), "cpu")
    hf = transformers_model(model)
    assert hf.model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16
    # the FP8 / MXFP4 values are exact in bf16: the same weights, not a rounding of them
    w = model.layers[1].ffn.experts[5].w2.dequantized_weight()
    assert torch.equal(hf.model.layers[1].mlp.experts.down_proj[5].float(), w)
    with pytest.raises(ValueError, match="V4.1"):
        transformers_model(build_random_model(shrunk("v41", 2), "cpu"))


def measured_layers(arch: str, n: int, us_of_kind) -> list[dict]:
    """profile_decode's by_layer rows for the cut of n layers: each layer `us_of_kind(kind)` microseconds, 1 MB."""
    kinds = [role_kind(r) for r in full_width_config(arch, n).layer_roles]
    return [{"kind": k, "us": us_of_kind(k), "bytes": 10**6} for k in kinds]


def test_released_estimate_weighs_each_kind_by_its_released_layers():
    """V4.1-Flash's 40 layers: 30 read both their KV and their top-k from other layers (15 at ratio 2, 15 at
    ratio 1); the 6-layer cut measures one layer of every kind."""
    sharer = lambda k: 100.0 if k.endswith("kv<- idx<-") else 0.0
    est = released_estimate("v41", measured_layers("v41", 6, sharer), 50.0, 7, bw=1e12)
    assert est["layers"] == 40 and est["step_ms"] == pytest.approx((30 * 100 + 50) / 1e3)
    assert est["bytes"] == pytest.approx(7 + 40 * 10**6)
    assert est["roofline"] == pytest.approx(est["floor_ms"] / est["step_ms"])
    assert est["engram_layers_left_out"] == [1, 14]
    # two measured layers of one kind count at their mean
    rows = measured_layers("v41", 6, lambda k: 0.0) + [{"kind": "window", "us": 10.0, "bytes": 10**6}]
    assert released_estimate("v41", rows, 0.0, 0, bw=1e12)["step_ms"] == pytest.approx(2 * 5.0 / 1e3)


def test_released_estimate_names_the_kinds_nothing_measured():
    """The 4-layer cut of V4.1 has no window-only layer and no ratio-2 reader; V4's 4-layer cut has every kind."""
    est = released_estimate("v41", measured_layers("v41", 4, lambda k: 1.0), 0.0, 0, bw=1e12)
    assert est == {"missing_kinds": ["csa r2 kv<- idx<-", "window"]}
    assert released_estimate("v4", measured_layers("v4", 4, lambda k: 1.0), 0.0, 0, bw=1e12)["layers"] == 43


def test_released_numbers_come_up_where_every_kind_was_measured():
    """A profile's released-depth estimates as top-level numbers: own times and spans each where complete."""
    complete = released_estimate("v4", measured_layers("v4", 4, lambda k: 2.0), 10.0, 0, bw=1e12)
    partial = released_estimate("v41", measured_layers("v41", 4, lambda k: 2.0), 10.0, 0, bw=1e12)
    both = released_numbers({"by_layer": {"estimate": complete}, "by_layer_own": {"estimate": complete}})
    assert both == {"released_ms_own": complete["step_ms"], "released_roofline_own": complete["roofline"],
                    "released_ms_spans": complete["step_ms"], "released_roofline_spans": complete["roofline"]}
    assert complete["step_ms"] == pytest.approx((43 * 2.0 + 10.0) / 1e3)
    assert released_numbers({"by_layer": {"estimate": partial}, "by_layer_own": {"estimate": partial}}) == {}
    assert released_numbers({"by_layer": None}) == {}  # a batch above 1: no layer rows
    assert set(released_numbers({"by_layer": {"estimate": complete}})) == {"released_ms_spans",
                                                                            "released_roofline_spans"}


def test_layer_rows_sum_the_times_they_are_asked_for():
    """A layer's time: its launches' times alone by default, their own times in the graph replay with "own_us"."""
    roles = full_width_config("v4", 2).layer_roles
    fast = SimpleNamespace(layers=[SimpleNamespace(role=r) for r in roles])
    runs = [[{"us": 3.0, "own_us": 2.0}, {"us": 4.0, "own_us": 1.5}], [{"us": 5.0, "own_us": 5.0}]]
    alone = layer_rows(fast, runs, [10, 20], [0, 2])
    own = layer_rows(fast, runs, [10, 20], [0, 2], 2.0, key="own_us")
    assert [r["us"] for r in alone] == [7.0, 5.0] and [r["us"] for r in own] == [7.0, 10.0]
    assert [r["kind"] for r in own] == [role_kind(r) for r in roles] and [r["launches"] for r in own] == [2, 1]


def launch(kernel: str, region: str | None = None) -> dict:
    """A `launches` row of profile_decode: the kernel, its time alone, the ops it was launched under."""
    ops = f"{kernel} < ## Call CompiledFxGraph x ## < Torch-Compiled Region: {region}" if region else f"{kernel} < dsv4::op"
    return {"kernel": kernel, "us": 1.0, "ops": ops}


def test_split_by_layer_cuts_after_each_layers_second_post():
    entry = [launch("triton_poi_fused_embedding_0", "3/1"), launch("triton_poi_fused_copy_1", "3/1")]
    layer = lambda post: [launch("_pre_partial_kernel", "4/0"), launch("_attn_kernel"), launch(post),
                          launch("_gather_up_kernel"), launch(post)]
    layers = [layer("_post_partial_kernel"), layer("_post_kernel"), layer("_post_finish_kernel")]
    leave = [launch("triton_red_fused_norm_0", "5/0"), launch("nvjet_head")]
    steps = entry + [r for run in layers for r in run] + leave
    assert split_by_layer(steps, 3) == (entry, layers, leave)
    assert split_by_layer(steps, 2) is None  # three layers' posts
    assert split_by_layer(steps[:-3], 3) is None  # the last layer's second post missing
    eager = [dict(r, ops=r["kernel"]) for r in steps]  # uncompiled: the entry's kernels go with the first layer
    got_entry, runs, _ = split_by_layer(eager, 3)
    assert got_entry == [] and len(runs[0]) == len(entry) + len(layers[0])


def test_idle_gaps_finds_where_the_device_waited():
    """The device's idle stretches between its work (kernels and copies merged in start order: a kernel running
    inside another's span leaves no gap), longest first, each with the work around it and the host ops that
    launched the work after it."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, kernels=(), parent=None):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               kernels=list(kernels), cpu_parent=parent)

    a, b, c = event("gemm", 0, 10), event("copy", 4, 8), event("norm", 30, 35)
    d, e, f = event("Memcpy HtoD (Pageable -> Device)", 36, 37), event("attn", 40, 41), event("norm", 50, 52)
    kernel = lambda name: SimpleNamespace(name=name)  # what an op lists: names, no times
    forward = event("L0.forward", 0, 60, cpu)
    ops = [forward, event("aten::mean", 25, 26, cpu, [kernel("norm")], forward),
           event("aten::copy_", 35, 36, cpu, [kernel(d.name)], forward),
           event("aten::rsqrt", 45, 46, cpu, [kernel("norm")], event("L1.forward", 44, 60, cpu))]
    got = idle_gaps(SimpleNamespace(events=lambda: [f, e, c, a, d, b, *ops]), 2)
    assert got["idle_us"] == 20 + 1 + 3 + 9 and got["gaps"] == 4
    assert got["longest"] == [  # the second "norm" run is the second launch's
        {"us": 20, "before": "gemm", "after": "norm", "launched_by": "aten::mean < L0.forward"},
        {"us": 9, "before": "attn", "after": "norm", "launched_by": "aten::rsqrt < L1.forward"},
    ]


def test_fill_in_chunks_halves_the_chunk_until_it_fits():
    tried, freed = [], []

    def prefill(chunk):
        tried.append(chunk)
        if chunk > 2048:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert fill_in_chunks(prefill, 16384, lambda: freed.append(1)) == 2048
    assert tried == [8192, 4096, 2048] and len(freed) == 2
    with pytest.raises(torch.OutOfMemoryError):
        fill_in_chunks(prefill, 16384, smallest=4096)
