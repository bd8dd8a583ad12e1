"""transformers integration: registration, from_pretrained on transformers-saved dirs, generate, save round trip."""

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM

import dsv4
from dsv4 import Dsv4ForCausalLM
from dsv4.checkpoint import HOST_ALIGNMENT, to_device
from dsv4.reference.model import load_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers DeepseekV4 model (SWA, CSA, HCA; one hash layer) saved by transformers itself.

    16 indexer heads: a score is exactly 0 (a tie) only when every head's dot product is negative,
    and top-k ties are broken differently by torch.topk and by dsv4 (lower index first)."""
    torch.manual_seed(0)
    config = DeepseekV4Config(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=64,
        qk_rope_head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, sliding_window=8,
        compress_ratios=[0, 4, 128], index_n_heads=16, index_head_dim=64, index_topk=2,
    )
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if ("hc" in name or "sinks" in name) else 0.05)
            if name.endswith("norm.weight"):
                p.add_(1.0)
        for name, b in model.named_buffers():
            if "tid2eid" in name:
                b.copy_(torch.randint(0, 4, b.shape))
    out = tmp_path_factory.mktemp("hf_v4")
    model.save_pretrained(out)
    return out


def test_import_twice_keeps_registration():
    importlib.reload(dsv4)
    dsv4.register()
    assert AutoConfig.for_model("dsv4").__class__.__name__ == "Dsv4Config"


def test_logits_match_transformers(hf_dir):
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(3))
    ours = Dsv4ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, quant_sim=False, progress=False)
    theirs = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_generate_and_save_round_trip(hf_dir, tmp_path):
    model = Dsv4ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, quant_sim=False, progress=False)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 14) and torch.equal(out[:, :10], ids)
    # greedy generate continues with the argmax of the full-sequence logits
    assert int(out[0, 10]) == int(model(ids).logits[0, -1].argmax())
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32, quant_sim=False, progress=False)
    assert isinstance(again, Dsv4ForCausalLM)
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert '"model_type": "dsv4"' in (tmp_path / "config.json").read_text()


def _misaligned(model: torch.nn.Module, offset_bytes: int) -> torch.nn.Module:
    """Every tensor of `model` moved to a view `offset_bytes` past a 64-byte boundary, as a memory map
    of a safetensors file leaves them."""
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                if t is None:
                    continue
                raw = torch.empty(t.numel() * t.element_size() + 64, dtype=torch.uint8)
                start = offset_bytes - offset_bytes % t.element_size()
                view = raw[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t)
                store[attr] = torch.nn.Parameter(view, requires_grad=False) if attr in module._parameters else view
    return model


def test_host_placement_makes_logits_independent_of_file_offsets(hf_dir):
    """The same weights at two file offsets: once placed by `to_device`, every tensor sits on a
    64-byte boundary and the logits are bit-identical (CPU GEMMs round with an operand's alignment)."""
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    out = []
    for offset in (0, 4):
        model = _misaligned(load_model(str(hf_dir), torch.float32, False, progress=False), offset)
        model = to_device(model, "cpu")
        assert all(t.data_ptr() % HOST_ALIGNMENT == 0 for t in [*model.parameters(), *model.buffers()])
        with torch.inference_mode():
            out.append(model(ids))
    assert torch.equal(out[0], out[1])


def test_padded_batches_are_rejected(hf_dir):
    model = Dsv4ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, progress=False)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="padded"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_unknown_impl_and_path_fail_clearly(hf_dir):
    with pytest.raises(ValueError, match="impl"):
        Dsv4ForCausalLM.from_pretrained(hf_dir, impl="nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Dsv4ForCausalLM.from_pretrained("/no/such/dir")


def test_tiny_v41_checkpoint_loads_runs_and_generates(tiny_v41_dir):
    """The V4.1 architecture in the real on-disk layout (FP8/FP4, Engram, DSpark drafter) through the
    transformers entry point: forward, generate, and the drafter's tensors loaded, not skipped."""
    model = Dsv4ForCausalLM.from_pretrained(tiny_v41_dir, torch_dtype=torch.float32, progress=False)
    assert not [n for n in model.model.load_report.skipped if n.startswith("mtp.")]
    ids = torch.randint(3, 500, (1, 21), generator=torch.Generator().manual_seed(5))
    logits = model(ids).logits
    assert logits.shape == (1, 21, model.config.vocab_size) and torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert int(out[0, 21]) == int(logits[0, -1].argmax())
    tokens, draft_logits, confidence = model.model.draft(ids, out[:, 21])
    assert tokens.shape == (1, model.config.dspark_block_size + 1) and torch.isfinite(confidence).all()


@pytest.mark.usefixtures("kernel_twins")
def test_fast_impl_logits_match_the_reference(arch_dir):
    """impl="fast" (on the host: the kernels' reference twins) computes the reference's function:
    rounding-free (fp32, quant_sim off) the logits agree to float32 summation order (1e-5 of the largest)
    and greedy generation picks the same tokens. With the packed KV formats on, a value a hair from an
    FP8/FP4 rounding boundary can land on the other side of it in another summation order: V4.1 stays
    within 5e-2 of the reference with the same formats (and unrounded activations, as the fast model
    runs); on V4 such a flip also changes which entries the lightning indexer's top-k picks (a near
    tie), moving that position's logits by a third, so V4 is compared rounding-free only."""
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(6))
    load = dict(dtype=torch.float32, device="cpu", progress=False)
    ref = Dsv4ForCausalLM.from_pretrained(arch_dir, quant_sim=False, **load)
    fast = Dsv4ForCausalLM.from_pretrained(arch_dir, quant_sim=False, impl="fast", **load)
    with torch.no_grad():
        a, b = fast(ids).logits, ref(ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert torch.equal(fast.generate(ids[:1], max_new_tokens=3, do_sample=False),
                       ref.generate(ids[:1], max_new_tokens=3, do_sample=False))
    if ref.model.config.is_v41:
        packed = Dsv4ForCausalLM.from_pretrained(arch_dir, impl="fast", **load)
        ref.model.set_quant_sim(True, activations=False)
        with torch.no_grad():
            a, b = packed(ids).logits, ref(ids).logits
        assert (a - b).abs().max() <= 5e-2 * b.abs().max()


@pytest.mark.usefixtures("kernel_twins")
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_ids_outside_the_vocabulary_are_named(tiny_v41_dir, impl):
    model = Dsv4ForCausalLM.from_pretrained(tiny_v41_dir, torch_dtype=torch.float32, progress=False, impl=impl)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {V + 1} is outside the vocabulary of {V}"):
        model(torch.tensor([[1, 2, V + 1]]))


def test_fast_impl_needs_loaded_weights(hf_dir):
    config = Dsv4ForCausalLM.from_pretrained(hf_dir, progress=False).config
    with pytest.raises(ValueError, match="from_pretrained"):
        Dsv4ForCausalLM(config, impl="fast")
