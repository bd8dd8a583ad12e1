"""dsv4's reference model (quant_sim off) against transformers' DeepseekV4ForCausalLM, the independent oracle.

Random tiny V4 configs cover the three layer kinds (SWA, CSA ratio 4, HCA ratio 128), hash and routed MoE
layers, and prompt lengths on both sides of the compression boundaries (nothing compressed yet, one
entry, index_topk smaller than the visible entries). The weights are transformers' own: filled at
random, written by its `save_pretrained`, read back by dsv4. In fp32 the logits must agree to
1e-4 x max |logit| with the same argmax everywhere but at ties (see assert_logits_match).
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4.checkpoint import official_name, to_transformers_dir, transformers_name
from dsv4.reference.model import load_model

TOL = 1e-4
TIE = 1e-5
# below, at and just past the ratio-4 and ratio-128 boundaries; 300 holds two HCA entries
LENGTHS = (1, 7, 16, 127, 128, 129, 300)
KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@st.composite
def v4_configs(draw) -> DeepseekV4Config:
    n_layers = draw(st.integers(3, 5))
    ratios = draw(st.permutations([0, 4, 128])) + draw(
        st.lists(st.sampled_from([0, 4, 128]), min_size=n_layers - 3, max_size=n_layers - 3)
    )
    heads, o_groups = draw(st.sampled_from([(2, 1), (4, 2), (4, 4)]))
    return DeepseekV4Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=64,
        q_lora_rank=32,
        o_groups=o_groups,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        # an indexer score is exactly 0 (a tie) only when every head's dot product is negative; with few
        # heads such ties are common, and torch.topk (transformers) and dsv4 (lower index) break them apart
        index_n_heads=16,
        index_head_dim=32,
        index_topk=draw(st.sampled_from([1, 2, 4, 8])),
        sliding_window=draw(st.sampled_from([4, 8, 16])),
        hc_mult=draw(st.sampled_from([2, 4])),
        layer_types=[KINDS[r] for r in ratios],
        num_hash_layers=draw(st.integers(1, n_layers - 1)),  # hash and routed layers both present
        qk_rope_head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )


def fill_random(model: DeepseekV4ForCausalLM, seed: int) -> None:
    """Random weights at scales that keep the tiny model away from saturation and ties."""
    gen = torch.Generator().manual_seed(seed)
    n_experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif any(key in name for key in ("_hc.", "hc_head.", "sinks", "position_bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token id
                b.copy_(torch.rand(b.shape[0], n_experts, generator=gen).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def tensor_names(path) -> set[str]:
    with safe_open(path, "pt") as f:
        return set(f.keys())


def assert_logits_match(ref: torch.Tensor, oracle: torch.Tensor, what: str) -> None:
    """Logits within TOL x max |logit|, and the same argmax wherever the oracle's decision is not a tie at
    fp32 resolution: a top-2 gap below TIE x max |logit| (random logits do produce gaps of ~1e-7) is
    flipped by rounding alone. TIE is 10x the errors fp32 shows here, and stricter than TOL implies."""
    err, peak = (ref - oracle).abs().max().item(), oracle.abs().max().item()
    assert err <= TOL * peak, f"{what}: max abs error {err:.3e} > {TOL} x max |logit| {peak:.3e}"
    top2 = oracle.topk(2, dim=-1).values
    decided = top2[..., 0] - top2[..., 1] > TIE * peak
    flips = ((ref.argmax(-1) != oracle.argmax(-1)) & decided).sum().item()
    assert flips == 0, f"{what}: argmax differs at {flips} positions with a top-2 gap above {TIE} x max |logit|"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(config=v4_configs(), seed=st.integers(0, 2**16))
def test_reference_matches_transformers_on_transformers_checkpoints(config, seed):
    oracle = DeepseekV4ForCausalLM(config).float().eval()
    fill_random(oracle, seed)
    ids = torch.randint(0, config.vocab_size, (2, max(LENGTHS)), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as tmp:
        oracle.save_pretrained(tmp)
        ref = load_model(tmp, torch.float32, quant_sim=False, progress=False)
    with torch.inference_mode():
        for n in LENGTHS:
            expected = oracle(input_ids=ids[:, :n], use_cache=False).logits
            assert_logits_match(ref(ids[:, :n]), expected, f"{config.layer_types}, {n} tokens")


def test_compare_tool_finds_parity_on_the_official_layout(tool, tiny_v4_dir):
    """The tiny V4 checkpoint in the official FP8/FP4 layout, converted by `to_transformers_dir`."""
    report = tool("compare").compare(tiny_v4_dir, "reference", "transformers", seq_len=300, tol=TOL)
    assert report["quant_sim"] is False
    assert report["ok"], report["logits"]
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["logits"]["top1"] == 1.0


def test_compare_tool_reads_transformers_saved_dirs_directly(tool, tiny_v4_dir, tmp_path):
    hf_dir = to_transformers_dir(tiny_v4_dir, tmp_path / "hf")
    report = tool("compare").compare(hf_dir, "transformers", "reference", seq_len=130, tol=TOL)
    assert report["ok"] and report["first_divergence"] is None


def test_to_transformers_dir_writes_what_transformers_writes(tiny_v4_dir, tmp_path):
    out = to_transformers_dir(tiny_v4_dir, tmp_path / "converted")
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.save_pretrained(tmp_path / "resaved")
    assert tensor_names(out / "model.safetensors") == tensor_names(tmp_path / "resaved" / "model.safetensors")
    raw = json.loads((out / "config.json").read_text())
    assert raw["layer_types"] == [KINDS[r] for r in (0, 4, 128, 4)]
    assert raw["mlp_layer_types"] == ["hash_moe", "moe", "moe", "moe"]
    assert raw["rope_parameters"]["compress"]["attention_factor"] == 1.0


def test_transformers_name_inverts_official_name(tiny_v4_dir):
    index = json.loads((tiny_v4_dir / "model.safetensors.index.json").read_text())
    names = [n for n in index["weight_map"] if not n.endswith(".scale")]
    for name in names:
        assert official_name(transformers_name(name)) == name
    assert transformers_name("layers.3.attn.kv_norm.weight") == "model.layers.3.attn.norm.weight"
    assert transformers_name("layers.3.attn.compressor.norm.weight") == "model.layers.3.attn.compressor.norm.weight"
    assert transformers_name("hc_head_fn") == "model.hc_head.hc_fn"
    assert transformers_name("head.weight") == "head.weight"


def test_to_transformers_dir_refuses_v41(tiny_v41_dir, tmp_path):
    with pytest.raises(ValueError, match="V4.1"):
        to_transformers_dir(tiny_v41_dir, tmp_path / "out")
