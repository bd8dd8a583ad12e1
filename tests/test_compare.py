"""tools/compare.py: zero error between identical implementations; a perturbed weight is located."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open


def test_identical_implementations_report_zero_error(tool, tiny_v4_dir):
    report = tool("compare").compare(tiny_v4_dir, "reference", "reference", seq_len=40)
    assert report["quant_sim"] is True  # no transformers side: the official precision steps stay on
    assert all(row["max_abs"] == 0 and row["cos"] == pytest.approx(1) for row in report["layers"])
    assert report["logits"]["max_abs"] == 0 and report["logits"]["kl"] == 0 and report["logits"]["top1"] == 1
    assert report["first_divergence"] is None and report["ok"]


def test_quantized_against_its_twin_exits_zero(tool, tiny_v4_dir, tiny_v4_dequantized_dir, capsys):
    argv = ["--model", str(tiny_v4_dir), "--model-b", str(tiny_v4_dequantized_dir), "--a", "reference",
            "--b", "reference", "--prompt-ids", "5,17,300,2,9", "--first-divergence"]
    assert tool("compare").main(argv) == 0
    out = capsys.readouterr().out
    assert "first divergence: none" in out and out.rstrip().endswith("OK")


def perturbed(edited_checkpoint, model_dir, name: str, where: slice):
    """A copy of model_dir with a visible random change to `where` of the F32 tensor `name`."""
    shard = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(model_dir / shard, "pt") as f:
        value = f.get_tensor(name)
    value[where] += 0.1 * torch.randn(value[where].shape, generator=torch.Generator().manual_seed(0))
    return edited_checkpoint(model_dir, {name: value})


@pytest.mark.parametrize(
    "twin, name, where, layer, module",
    [
        ("tiny_v4_dequantized_dir", "layers.2.ffn.shared_experts.w2.weight", slice(None), 2, "ffn"),
        ("tiny_v4_dequantized_dir", "layers.1.attn.wo_b.weight", slice(None), 1, "attn"),
        # hc base = [pre (hc) | post (hc) | comb (hc * hc)]: pre collapses the ffn input, post/comb mix after it
        ("tiny_v4_dequantized_dir", "layers.3.hc_ffn_base", slice(0, 4), 3, "ffn input"),
        ("tiny_v4_dequantized_dir", "layers.3.hc_ffn_base", slice(4, None), 3, "mhc"),
        ("tiny_v41_dequantized_dir", "layers.3.engram.wkv.weight", slice(None), 3, "engram"),
    ],
)
def test_perturbed_weight_names_the_first_divergent_layer(
    tool, edited_checkpoint, request, capsys, twin, name, where, layer, module
):
    model_dir = request.getfixturevalue(twin)
    changed = perturbed(edited_checkpoint, model_dir, name, where)
    compare = tool("compare")
    report = compare.compare(model_dir, "reference", "reference", model_b=changed, seq_len=40)
    assert report["first_divergence"]["layer"] == layer and report["first_divergence"]["module"] == module
    assert all(row["max_abs"] == 0 for row in report["layers"][:layer])
    assert not report["ok"]
    argv = ["--model", str(model_dir), "--model-b", str(changed), "--b", "reference", "--seq-len", "40",
            "--first-divergence"]
    assert compare.main(argv) == 1
    assert f"first divergence: layer {layer} ({module})" in capsys.readouterr().out


def test_impossible_comparison_is_one_line(tool, tiny_v41_dir, capsys):
    assert tool("compare").main(["--model", str(tiny_v41_dir), "--b", "transformers"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "V4.1" in err and err.count("\n") == 1


def test_decoder_replay_on_vs_off_is_reported(tool, tiny_v41_dir):
    """V4.1 decoder replay: the encoder layers agree exactly, the divergence starts at the first
    decoder layer, and it is measured over the positions the replay computes (the last window)."""
    from dsv4.config import Dsv4Config

    config = Dsv4Config.from_json(tiny_v41_dir)
    report = tool("compare").compare(tiny_v41_dir, "reference", "reference-replay", seq_len=3 * config.sliding_window)
    start = config.decoder_start
    assert all(row["max_abs"] == 0 for row in report["layers"][:start])
    assert report["first_divergence"]["layer"] == start
    assert report["logits"]["max_abs"] > 0 and not report["ok"]
    short = tool("compare").compare(tiny_v41_dir, "reference", "reference-replay", seq_len=config.sliding_window)
    assert short["ok"] and short["logits"]["max_abs"] == 0  # a prompt within one window replays everything


@pytest.mark.usefixtures("kernel_twins")
@pytest.mark.parametrize("model", ["tiny_v4_dir", "tiny_v41_dir"])
def test_fast_against_the_reference(tool, request, model):
    """The fast model as a side (off the GPU: its kernels' twins), rounding-free by default: every layer and
    the logits agree to float32 summation order."""
    report = tool("compare").compare(request.getfixturevalue(model), "reference", "fast", seq_len=40)
    assert report["quant_sim"] is False
    assert all(row["rel"] <= 1e-5 for row in report["layers"]), [row["rel"] for row in report["layers"]]
    assert report["logits"]["top1"] == 1 and report["logits"]["rel"] <= 1e-5
    assert report["first_divergence"] is None and report["ok"]


@pytest.mark.usefixtures("kernel_twins")
def test_fast_side_with_a_perturbed_weight_is_located(tool, edited_checkpoint, tiny_v4_dir):
    """The fast side's layer states are recorded as the reference's are: a change to one layer's stream
    mixing (hc base past pre: post and comb) is named there."""
    changed = perturbed(edited_checkpoint, tiny_v4_dir, "layers.3.hc_ffn_base", slice(4, None))
    report = tool("compare").compare(tiny_v4_dir, "reference", "fast", model_b=changed, seq_len=40)
    assert report["first_divergence"]["layer"] == 3 and report["first_divergence"]["module"] == "mhc"
    assert not report["ok"]
