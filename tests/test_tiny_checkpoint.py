"""Tiny checkpoints in the real on-disk layout, the loader's checks, and the released configs.

Covers: the tiny checkpoints load and store every tensor as the release does; a quantized checkpoint and
its dequantized twin compute the same logits (quant_sim off and on); the loader rejects missing,
misshapen, mistyped, NaN and unknown tensors by name, skips vision/drafter tensors, refuses pickles;
the released config.json files parse into the right layer roles and malformed ones fail naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsv4.checkpoint import CheckpointError, _has_nan, load_into
from dsv4.config import ConfigError, Dsv4Config
from dsv4.reference.model import Dsv4Model, load_model
from dsv4.released import V4_FLASH, V41_FLASH
from dsv4.tiny import (
    EMBEDDED_DEFAULT_NAME,
    SPECIAL_TOKENS,
    byte_level_tokenizer,
    embedded_default_dir,
    make_tiny_checkpoint,
)

TINY_DIRS = ("tiny_v4_dir", "tiny_v4_dequantized_dir", "tiny_v41_dir", "tiny_v41_dequantized_dir")


def stored(model_dir) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor in a sharded checkpoint."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(model_dir / shard, "pt") as f:
            out.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()})
    assert set(out) == set(index["weight_map"]), "the index and the shards disagree"
    return out


def logits(model_dir, quant_sim: bool, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return load_model(str(model_dir), torch.float32, quant_sim, progress=False)(ids)


# ----------------------------------------------------------------------------- the tiny checkpoints
@pytest.mark.parametrize("fixture", TINY_DIRS)
def test_tiny_checkpoints_load_from_several_shards(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    model = load_model(str(model_dir), torch.float32, progress=False)
    assert not any(p.is_meta for p in model.parameters())


def test_v4_tiny_stores_tensors_as_the_release(tiny_v4_dir):
    s = stored(tiny_v4_dir)
    expected = {
        "embed.weight": ("BF16", [512, 128]),
        "head.weight": ("BF16", [512, 128]),
        "norm.weight": ("BF16", [128]),
        "hc_head_fn": ("F32", [4, 512]),
        "hc_head_scale": ("F32", [1]),
        "layers.0.hc_attn_fn": ("F32", [24, 512]),
        "layers.0.hc_ffn_base": ("F32", [24]),
        "layers.0.attn.attn_sink": ("F32", [4]),
        "layers.0.attn.kv_norm.weight": ("BF16", [128]),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", [128, 128]),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", [1, 1]),  # 128 x 128 blocks
        "layers.0.attn.wq_b.scale": ("F8_E8M0", [4, 1]),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", [128, 256]),
        "layers.0.attn.wo_a.scale": ("F8_E8M0", [1, 2]),
        "layers.0.ffn.gate.tid2eid": ("I64", [512, 2]),  # hash layer
        "layers.1.ffn.gate.bias": ("F32", [8]),
        "layers.1.ffn.gate.weight": ("BF16", [8, 128]),
        "layers.1.ffn.experts.7.w1.weight": ("I8", [128, 64]),  # MXFP4, two per byte
        "layers.1.ffn.experts.7.w1.scale": ("F8_E8M0", [128, 4]),  # one per 32 along K
        "layers.1.ffn.experts.7.w2.weight": ("I8", [128, 64]),
        "layers.1.ffn.shared_experts.w3.weight": ("F8_E4M3", [128, 128]),
        "layers.1.attn.compressor.wkv.weight": ("BF16", [256, 128]),  # CSA overlap: 2 x head_dim
        "layers.1.attn.compressor.ape": ("F32", [4, 256]),
        "layers.1.attn.compressor.norm.weight": ("BF16", [128]),
        "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", [2048, 128]),  # 16 heads x 128
        "layers.1.attn.indexer.weights_proj.weight": ("BF16", [16, 128]),
        "layers.1.attn.indexer.compressor.wgate.weight": ("BF16", [256, 128]),
        "layers.2.attn.compressor.ape": ("F32", [128, 128]),  # HCA: no overlap
    }
    assert {k: s[k] for k in expected} == expected
    assert "layers.1.ffn.gate.tid2eid" not in s and "layers.0.ffn.gate.bias" not in s
    assert not any(k.startswith(("layers.0.attn.compressor", "layers.2.attn.indexer")) for k in s)
    fp8_weights = {k.removesuffix(".weight") for k, (dtype, _) in s.items() if dtype in ("F8_E4M3", "I8")}
    assert fp8_weights == {k.removesuffix(".scale") for k in s if k.endswith(".scale")}


def test_v41_tiny_stores_tensors_as_the_release(tiny_v41_dir):
    s = stored(tiny_v41_dir)
    rows = json.loads((tiny_v41_dir / "config.json").read_text())["text_config"]["engram_num_embeddings"]
    expected = {
        "layers.2.attn.wq_a.scale": ("F8_E8M0", [4, 4]),  # 32 x 32 blocks
        "layers.1.engram.embed.weight": ("F8_E4M3", [rows[0], 64]),
        "layers.1.engram.embed.scale": ("F8_E8M0", [rows[0], 2]),
        "layers.3.engram.embed.weight": ("F8_E4M3", [rows[1], 64]),
        "layers.1.engram.wkv.weight": ("F8_E4M3", [640, 256]),  # (N-1) * H * 64 -> D * (hc + 1)
        "layers.1.engram.wkv.scale": ("F8_E8M0", [20, 8]),
        "layers.1.engram.q_weight": ("BF16", [4, 128]),
        "layers.2.attn.compressor.wgate.weight": ("BF16", [128, 128]),
        "layers.5.attn.compressor.wkv.weight": ("BF16", [128, 128]),
        "layers.2.attn.indexer.wk.weight": ("BF16", [128, 128]),
        "layers.5.attn.indexer.k_norm.weight": ("BF16", [128]),
        "layers.7.attn.indexer.wq_b.weight": ("F8_E4M3", [2048, 128]),
        "layers.0.ffn.gate.bias_vl": ("F32", [8]),
        "layers.0.ffn.experts.0.w3.weight": ("I8", [128, 64]),
    }
    assert {k: s[k] for k in expected} == expected
    absent = ("layers.5.attn.compressor.wgate", "layers.3.attn.compressor", "layers.7.attn.indexer.wk", "hc_head")
    assert not any(k.startswith(absent) or "tid2eid" in k for k in s)


@pytest.mark.parametrize("quantized, twin", [("tiny_v4_dir", "tiny_v4_dequantized_dir"),
                                             ("tiny_v41_dir", "tiny_v41_dequantized_dir")])
def test_twin_stores_dequantized_weights_in_f32(quantized, twin, request):
    q, d = stored(request.getfixturevalue(quantized)), stored(request.getfixturevalue(twin))
    for name, (dtype, shape) in q.items():
        if name.endswith(".scale") and ".engram.embed." not in name:
            assert name not in d
        elif dtype in ("F8_E4M3", "I8") and ".engram.embed." not in name:
            assert d[name] == ("F32", shape if dtype == "F8_E4M3" else [shape[0], 2 * shape[1]]), name
        else:  # everything else, the FP8 Engram tables included, is byte-for-byte the same storage
            assert d[name] == (dtype, shape), name
    raw = json.loads((request.getfixturevalue(twin) / "config.json").read_text())
    assert "quantization_config" not in raw and "expert_dtype" not in raw.get("text_config", raw)


def test_config_json_has_the_release_layout(tiny_v4_dir, tiny_v41_dir):
    v4 = json.loads((tiny_v4_dir / "config.json").read_text())
    assert v4["model_type"] == "deepseek_v4" and v4["expert_dtype"] == "fp4"
    assert len(v4["compress_ratios"]) == v4["num_hidden_layers"] + 1  # + the MTP entry
    assert v4["quantization_config"]["weight_block_size"] == [128, 128]
    v41 = json.loads((tiny_v41_dir / "config.json").read_text())
    assert v41["model_type"] == "deepseek_v41" and "text_config" in v41 and "image_token_id" in v41
    assert v41["quantization_config"]["weight_block_size"] == [32, 32]
    text = v41["text_config"]
    assert len(text["compress_ratios"]) == text["num_hidden_layers"] + text["num_nextn_predict_layers"]  # + drafter
    assert (tiny_v41_dir / "engram_layout.json").exists() and (tiny_v41_dir / "tokenizer.json").exists()


def test_same_seed_same_bytes(tiny_v4_dir, tmp_path):
    again = make_tiny_checkpoint("v4-flash", tmp_path / "again", seed=0)
    other = make_tiny_checkpoint("v4-flash", tmp_path / "other", seed=1)
    shards = sorted(p.name for p in tiny_v4_dir.glob("*.safetensors"))
    assert all((again / s).read_bytes() == (tiny_v4_dir / s).read_bytes() for s in shards)
    assert any((other / s).read_bytes() != (tiny_v4_dir / s).read_bytes() for s in shards)


@pytest.mark.parametrize("quant_sim", [False, True])
@pytest.mark.parametrize("quantized, twin", [("tiny_v4_dir", "tiny_v4_dequantized_dir"),
                                             ("tiny_v41_dir", "tiny_v41_dequantized_dir")])
def test_quantized_and_dequantized_twin_agree(quantized, twin, quant_sim, request):
    """Same weights, same activation rounding (it is structural, not a property of the storage)."""
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(0))
    a = logits(request.getfixturevalue(quantized), quant_sim, ids)
    b = logits(request.getfixturevalue(twin), quant_sim, ids)
    assert (a - b).abs().max().item() <= 1e-6 * a.abs().max().item()


def test_byte_level_tokenizer():
    tok = byte_level_tokenizer(512)
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = "The tiny model says: héllo, wörld ✓"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode(SPECIAL_TOKENS[0] + "hi").ids[0] == 0


def test_embedded_default_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    first = embedded_default_dir()
    assert first == tmp_path / EMBEDDED_DEFAULT_NAME and Dsv4Config.from_json(first).is_v41
    stamp = (first / "config.json").stat().st_mtime_ns
    assert embedded_default_dir() == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary directory left behind


def test_make_tiny_checkpoint_tool(tool, tmp_path, capsys):
    assert tool("make_tiny_checkpoint").main(["--arch", "v4-flash", "--out", str(tmp_path / "t"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "t")
    assert Dsv4Config.from_json(tmp_path / "t").num_hidden_layers == 4


# ----------------------------------------------------------------------------- the loader's checks
def load_error(model_dir) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(str(model_dir), torch.float32, progress=False)
    return str(e.value)


def test_missing_tensor_is_named(tiny_v4_dir, edited_checkpoint):
    edited = edited_checkpoint(tiny_v4_dir, {"layers.2.attn.compressor.ape": None})
    assert "missing tensor layers.2.attn.compressor.ape" in load_error(edited)


def test_misshapen_tensor_is_named(tiny_v4_dir, edited_checkpoint):
    edited = edited_checkpoint(tiny_v4_dir, {"layers.1.attn.attn_sink": torch.zeros(5)})
    assert "layers.1.attn.attn_sink: shape [5], expected [4]" in load_error(edited)


def test_wrong_dtype_is_named(tiny_v4_dir, edited_checkpoint):
    edited = edited_checkpoint(tiny_v4_dir, {"layers.0.attn.wq_a.weight": torch.zeros(128, 128, dtype=torch.bfloat16)})
    assert "layers.0.attn.wq_a.weight: dtype torch.bfloat16, expected torch.float8_e4m3fn" in load_error(edited)


@pytest.mark.parametrize("name, dtype", [("layers.3.ffn_norm.weight", torch.bfloat16),
                                         ("layers.3.attn.wo_b.weight", torch.float8_e4m3fn)])
def test_nan_is_named(tiny_v4_dir, edited_checkpoint, name, dtype):
    shape = [128] if "norm" in name else [128, 128]
    value = torch.zeros(shape)
    value.view(-1)[7] = float("nan")
    edited = edited_checkpoint(tiny_v4_dir, {name: value.to(dtype)})
    assert f"{name}: contains NaN" in load_error(edited)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("where", [0, 999, 1000, 2047])
def test_the_nan_check_goes_through_every_chunk(dtype, where):
    """The loader checks large tensors a chunk at a time (no tensor-sized temporaries): a NaN in any chunk,
    the last and a partial one included, is found, and a clean tensor passes."""
    value = torch.zeros(2048)
    assert not _has_nan(value.to(dtype), chunk=1000)
    value[where] = float("nan")
    assert _has_nan(value.to(dtype), chunk=1000)


def test_unknown_tensor_fails(tiny_v4_dir, edited_checkpoint):
    edited = edited_checkpoint(tiny_v4_dir, {"layers.1.attn.mystery.weight": torch.zeros(2)})
    assert "unexpected tensor layers.1.attn.mystery.weight" in load_error(edited)


def test_vision_and_drafter_tensors_are_skipped_and_reported(tiny_v4_dir, edited_checkpoint):
    extra = {"vision.blocks.0.weight": torch.zeros(2), "mtp.0.e_proj.weight": torch.zeros(2)}
    edited = edited_checkpoint(tiny_v4_dir, extra)
    load_model(str(edited), torch.float32, progress=False)  # V4: no drafter in the model, mtp.* skipped
    with torch.device("meta"):
        model = Dsv4Model(Dsv4Config.from_json(edited))
    report = load_into(model, edited, progress=False, skip=("mtp.",))
    assert sorted(report.skipped) == sorted(extra)


def test_pickle_only_directory_fails(tiny_v4_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_v4_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    assert "safetensors only" in load_error(tmp_path)


# ----------------------------------------------------------------------------- released configs
V4_FLASH_PREVIEW = V4_FLASH  # the 44-entry compress_ratios list
_V4_RATIOS = V4_FLASH["compress_ratios"][:-1]  # 43 layers: CSA on even layers >= 2, HCA on odd ones
V4_FLASH_DSPARK = {  # 46 entries: three drafter stages
    **V4_FLASH,
    "compress_ratios": _V4_RATIOS + [0, 0, 0],
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}


@pytest.mark.parametrize("raw", [V4_FLASH_PREVIEW, V4_FLASH_DSPARK], ids=["44-entry", "46-entry"])
def test_released_v4_flash_config(raw):
    c = Dsv4Config.from_dict(raw)
    roles = c.layer_roles
    assert c.model_family == "deepseek_v4" and len(roles) == 43
    assert c.expert_format == "fp4" and c.weight_block_size == (128, 128) and c.act_block_size == 128
    assert [r.attention_kind for r in roles[:4]] == ["window", "window", "csa", "hca"]
    assert roles[42].attention_kind == "csa" and roles[41].attention_kind == "hca"
    assert [r.hash_moe for r in roles[:4]] == [True, True, True, False]
    assert roles[3].kv_source == 3 and roles[3].index_source is None and roles[2].owns_indexer


def test_released_v41_flash_config():
    c = Dsv4Config.from_dict(V41_FLASH)
    roles = c.layer_roles
    assert c.model_family == "deepseek_v41" and len(roles) == 40 and c.image_token_id == 129264
    assert c.weight_block_size == (32, 32) and c.expert_format == "fp4" and c.rms_norm_eps == 1e-20
    assert roles[21].kv_source == 20 and roles[21].index_source == 20 and not roles[21].owns_indexer
    assert roles[24].candidate_role == "consumer" and roles[24].owns_indexer and roles[24].kv_source == 20
    assert roles[20].candidate_role == "source" and roles[20].owns_compressor and roles[20].compress_ratio == 1
    assert roles[9].kv_source == 8 and roles[9].index_source == 8 and not roles[9].owns_compressor
    assert roles[1].engram and roles[14].engram and roles[0].attention_kind == "window"
    assert c.engram_pad_id == 2 and c.has_drafter and c.dspark_target_layer_ids == [37, 38, 39]


def _v41_text(**changes) -> dict:
    return {**V41_FLASH, "text_config": {**V41_FLASH["text_config"], **changes}}


@pytest.mark.parametrize(
    "raw, field",
    [
        ({k: v for k, v in V41_FLASH.items() if k != "text_config"}, "text_config"),
        ({**V4_FLASH_PREVIEW, "compress_ratios": _V4_RATIOS[:40]}, "compress_ratios"),
        (_v41_text(kv_source_layer_ids=[1, 2, 8, 14, 20], index_source_layer_ids=[1, 2, 8, 14, 20, 24]),
         "kv_source_layer_ids"),
        ({**V4_FLASH_PREVIEW, "o_groups": 7}, "o_groups"),
        ({**V4_FLASH_PREVIEW, "model_type": "deepseek_v3"}, "model_type"),
        ({**V4_FLASH_PREVIEW, "hidden_size": "4096"}, "hidden_size"),
        ({**V4_FLASH_PREVIEW, "sliding_window": "128"}, "sliding_window"),
        ({**V4_FLASH_PREVIEW, "num_hash_layers": "3"}, "num_hash_layers"),
        ({**V4_FLASH_PREVIEW, "rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ],
    ids=["no-text_config", "short-compress_ratios", "source-without-ratio", "o_groups", "model_type",
         "str-hidden_size", "str-sliding_window", "str-num_hash_layers", "str-rms_norm_eps"],
)
def test_malformed_config_names_the_field(raw, field):
    with pytest.raises(ConfigError, match=field):
        Dsv4Config.from_dict(raw)
