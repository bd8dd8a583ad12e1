"""The DSpark drafter (V4.1 `mtp.*`): names, wiring and the draft it returns."""

import pytest
import torch

from dsv4.config import Dsv4Config
from dsv4.reference.model import Dsv4Model


def tiny_drafter_config(**overrides) -> Dsv4Config:
    fields = dict(
        model_family="deepseek_v41", vocab_size=64, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=32, q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=8, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0],
        kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5,
        candidate_topk_blocks=2, candidate_block_size=4, index_n_heads=2, index_head_dim=64, index_topk=4,
        engram_layer_ids=[], engram_num_embeddings=[], quantization_config=None, num_nextn_predict_layers=2,
        dspark_block_size=3, dspark_noise_token_id=63, dspark_target_layer_ids=[6, 7], dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, image_token_id=None,
    )
    return Dsv4Config(**{**fields, **overrides})


def random_model(config: Dsv4Config, seed: int = 0) -> Dsv4Model:
    model = Dsv4Model(config, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point:
            p.data.normal_(0, 0.3 if ("hc_" in name or "sink" in name) else 0.05, generator=g)
            if name.endswith("norm.weight"):
                p.data.add_(1.0)
    model.set_quant_sim(False)
    return model


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_drafter_config())


def test_drafter_names_follow_the_checkpoint(model):
    names = set(model.state_dict())
    for expected in (
        "mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.0.attn.wkv.weight", "mtp.0.ffn.experts.3.w2.weight",
        "mtp.1.norm.weight", "mtp.1.markov_head.embed.weight", "mtp.1.markov_head.head.weight",
        "mtp.1.confidence_head.proj.weight", "mtp.1.hc_ffn_fn",
    ):
        assert expected in names
    assert "mtp.0.norm.weight" not in names and "mtp.1.main_proj.weight" not in names
    assert model.mtp[0].main_proj.in_features == 2 * 64  # two target layers
    assert len(model.mtp[0].ffn.experts) == 4 and model.mtp[0].ffn.gate.topk == 2


def test_draft_shapes_and_greedy_chain(model):
    ids = torch.randint(0, 63, (2, 20), generator=torch.Generator().manual_seed(1))
    tokens, logits, confidence = model.draft(ids, ids[:, -1])
    assert tokens.shape == (2, 4) and logits.shape == (2, 3, 64) and confidence.shape == (2, 3)
    assert torch.equal(tokens[:, 0], ids[:, -1])
    # greedy: each drafted token is the argmax of its position's (Markov-biased) logits
    assert torch.equal(tokens[:, 1:], logits.argmax(-1))


def test_draft_reads_the_inputs_of_the_target_layers(model):
    """Target layers 6 and 7 feed their *inputs*: layer 7's own weights cannot change the draft, layer 6's can."""
    ids = torch.randint(0, 63, (1, 12), generator=torch.Generator().manual_seed(2))
    _, base, _ = model.draft(ids, ids[:, -1])
    for layer, should_change in ((7, False), (6, True)):
        changed = random_model(tiny_drafter_config())
        changed.layers[layer].attn.wq_a.weight.data.mul_(3.0)
        changed.layers[layer].ffn.shared_experts.w2.weight.data.mul_(3.0)
        _, logits, _ = changed.draft(ids, ids[:, -1])
        assert (not torch.allclose(logits, base)) == should_change


def test_draft_sees_only_the_last_window_of_the_main_context(model):
    """The drafter's attention reads main_x only over the last `sliding_window` positions."""
    from dsv4.reference.drafter import DraftContext

    stage = model.mtp[0]
    x = torch.randn(1, 3, 64)
    main_x = torch.randn(1, 20, 64)
    positions = torch.arange(20, 23)
    out = stage.attn(x, positions, DraftContext(main_x, torch.arange(20)))
    edited = main_x.clone()
    edited[:, :12] = torch.randn(1, 12, 64)  # outside the last 8 positions
    assert torch.equal(out, stage.attn(x, positions, DraftContext(edited, torch.arange(20))))
    edited[:, -1] += 1.0
    assert not torch.allclose(out, stage.attn(x, positions, DraftContext(edited, torch.arange(20))))


def test_model_without_drafter_refuses_to_draft():
    m = random_model(tiny_drafter_config(num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1]))
    assert not hasattr(m, "mtp")
    with pytest.raises(ValueError, match="drafter"):
        m.draft(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, dtype=torch.long))
