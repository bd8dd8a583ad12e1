"""KV cache layout: the released models' bytes (MODEL.md §6), the packed codecs' exact round trip on
every value the model stores, and which storage format is exact for which model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4
from dsv4.config import Dsv4Config
from dsv4.engine.layout import Fp4Rows, cache_layout, row_codecs, storage_format
from dsv4.quant import dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4
from dsv4.reference.attention import Attention
from dsv4.reference.indexer import Indexer

# MODEL.md §2.1, the DSpark-era V4-Flash config.json: the fields the cache depends on
V4_FLASH = {
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0],
}


def v4_flash() -> Dsv4Config:
    return Dsv4Config.from_dict(V4_FLASH)


# ----------------------------------------------------------------------------- released bytes
def test_v41_flash_bytes():
    layout = dsv4.cache_layout(Dsv4Config())
    assert (layout.window_slot_bytes, layout.global_entry_bytes, layout.index_key_bytes) == (528, 288, 68)
    assert layout.growth_bytes_per_token == 890  # 3 x (288 + 68) / 2 + (288 + 68) / 1
    carries = 3 * 2 * 4 * 512  # ratio-2 sources: one pending token's fp32 kv and score; ratio 1 keeps none
    assert layout.fixed_bytes_per_sequence == 40 * 128 * 528 + carries
    assert layout.drafter_fixed_bytes == 3 * 128 * 528
    assert layout.boundary_carry_bytes == 0
    assert layout.bytes_per_block(256) == 256 * 890


def test_v4_flash_bytes():
    layout = cache_layout(v4_flash())
    assert (layout.window_slot_bytes, layout.global_entry_bytes, layout.index_key_bytes) == (584, 584, 68)
    assert layout.growth_bytes_per_token == 21 * (584 + 68) / 4 + 20 * 584 / 128 == 3514.25
    fp32_kv_and_score = 2 * 4
    csa = (3 + 4) * fp32_kv_and_score * 2 * 512  # 3 pending + 4 overlapped tokens, two halves
    csa_index = (3 + 4) * fp32_kv_and_score * 2 * 128  # the indexer's own overlapping compressor
    hca = 127 * fp32_kv_and_score * 512
    assert layout.fixed_bytes_per_sequence == 43 * 128 * 584 + 21 * (csa + csa_index) + 20 * hca
    assert layout.drafter_fixed_bytes == 0
    assert layout.boundary_carry_bytes == 21 * 4 * fp32_kv_and_score * 2 * (512 + 128)
    assert layout.bytes_per_block(256) == 256 * 3514.25


def test_block_size_must_hold_whole_groups():
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        cache_layout(v4_flash()).bytes_per_block(64)  # HCA pools 128 tokens
    assert cache_layout(Dsv4Config()).bytes_per_block(2) == 2 * 890


def test_dense_format_bytes_follow_the_dtype():
    layout = cache_layout(Dsv4Config(), "dense", torch.float32)
    assert (layout.window_slot_bytes, layout.global_entry_bytes, layout.index_key_bytes) == (2048, 2048, 512)


# ----------------------------------------------------------------------------- codecs
def model_quantizers(config: Dsv4Config, dtype: torch.dtype) -> dict:
    """The model's own rounding of each stored kind (the attention's and indexer's quant_sim steps)."""
    attn = SimpleNamespace(quant_sim=True, is_v41=config.is_v41, rope_dim=config.qk_rope_head_dim)
    attn._fake_fp8 = lambda x, block: Attention._fake_fp8(attn, x, block)
    attn._fake_nvfp4 = lambda x, block: Attention._fake_nvfp4(attn, x, block)
    attn._window_quant = lambda kv: Attention._window_quant(attn, kv)
    indexer = SimpleNamespace(quant_sim=True, is_v41=config.is_v41)
    indexer._fake_mxfp4 = lambda t: Indexer._fake_mxfp4(indexer, t)
    return {
        "window": lambda x: Attention._window_quant(attn, x.to(dtype)),
        "compressed": lambda x: Attention._compressed_quant(attn, x.to(dtype)),
        "index_keys": lambda x: Indexer._fp4(indexer, x.to(dtype)),
    }


def rows_at_many_scales(seed: int, n: int, dim: int) -> torch.Tensor:
    """Rows whose magnitudes span 2^-14..2^8 (block scales deep into the subnormal e4m3 range), with
    exact and negative zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * 2.0 ** torch.randint(-14, 9, (n, 1), generator=gen).float()
    x[torch.rand(n, dim, generator=gen) < 0.05] = 0.0
    x[torch.rand(n, dim, generator=gen) < 0.05] = -0.0
    return x


@pytest.mark.parametrize(
    "config, dtype", [(Dsv4Config(), torch.float32), (Dsv4Config(), torch.bfloat16), (v4_flash(), torch.bfloat16)]
)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_packed_rows_round_trip_exactly(config, dtype, seed):
    codecs = row_codecs(config, "packed", dtype)
    for kind, quantize in model_quantizers(config, dtype).items():
        codec = getattr(codecs, kind)
        dim = config.index_head_dim if kind == "index_keys" else config.head_dim
        stored = quantize(rows_at_many_scales(seed, 64, dim))
        packed = codec.encode(stored)
        assert packed.dtype == torch.uint8 and packed.shape == (64, codec.row_bytes)
        assert same_bits(codec.decode(packed).to(dtype), stored), kind


def test_nvfp4_requantization_corner():
    """A block whose amax / 6 rounds up to the e4m3 subnormal 2^-8 can top out at code 4 (2^-6);
    quantizing that again picks the scale 2^-9 and saturates. The codec keeps such blocks exact."""
    stored = fake_quant_nvfp4(torch.linspace(-1, 1, 16) * 9.6 * 2.0**-9)  # amax / 6 = 1.6 * 2^-9
    assert stored.abs().max() == 2.0**-6
    assert not torch.equal(dequantize_nvfp4(*quantize_nvfp4(stored, 16), 16), stored)
    codec = Fp4Rows(16, nvfp4=True)
    assert same_bits(codec.decode(codec.encode(stored)), stored)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from 0.0)."""
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# ----------------------------------------------------------------------------- format choice
def test_storage_format_is_packed_only_where_exact():
    v41, v4 = Dsv4Config(), v4_flash()
    assert storage_format(v41, torch.float32, quant_sim=True) == "packed"
    assert storage_format(v4, torch.bfloat16, quant_sim=True) == "packed"
    assert storage_format(v4, torch.float32, quant_sim=True) == "dense"
    assert storage_format(v41, torch.float32, quant_sim=False) == "dense"
    with pytest.raises(ValueError, match="RoPE dims in bf16"):
        storage_format(v4, torch.float32, True, "packed")
    with pytest.raises(ValueError, match="quant_sim=False"):
        storage_format(v41, torch.bfloat16, False, "packed")
    with pytest.raises(ValueError, match="must be one of"):
        storage_format(v41, torch.bfloat16, True, "fp8")
