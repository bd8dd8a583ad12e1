"""dsv4::moe_experts_mxfp4 / dsv4::moe_mxfp4_with_shared / dsv4::moe_gather_slots against their twin and the
reference MoE module.

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before dsv4 imports by
tests/conftest.py); the `gpu` tests run them compiled at V4.1 shapes (D 5120, I 2304, E 384, k 6).

Tolerances:
- twin vs reference `MoE` (quant_sim=False, fp32): 1e-6 relative to the output's max (only the summation
  order of the stacked w1/w3 GEMM and of the expert sum can differ).
- kernel vs twin, fp32 activations: 1e-5 relative to the output's max (fp32 summation order only).
- kernel vs twin, bf16 activations: g, u, h and each expert's output are rounded to bf16 on both sides, so a
  different fp32 summation order can move one rounding across a bf16 tie: allowed 2^-7 relative to the
  output's max in any element (one bf16 ulp of a term), while the median error must stay below 1e-6.
"""

from __future__ import annotations

import pytest
import torch

# tests/conftest.py chooses the Triton interpreter (no GPU) before any triton import
pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4.config import Dsv4Config
from dsv4.fast.kernels import moe_experts as M
from dsv4.quant import dequantize_fp8, quantize_fp8, quantize_mxfp4
from dsv4.reference.linear import Linear
from dsv4.reference.moe import MoE

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

_QCFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_TINY = {
    "model_family": "deepseek_v41", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 32, "q_lora_rank": 64, "o_groups": 2,
    "o_lora_rank": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "sliding_window": 8, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1], "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 5, 7], "candidate_source_layer_id": 5, "candidate_topk_blocks": 2,
    "candidate_block_size": 4, "index_n_heads": 2, "index_head_dim": 64, "index_topk": 4, "engram_layer_ids": [],
    "engram_num_embeddings": [], "quantization_config": _QCFG, "dspark_target_layer_ids": [],
    "num_nextn_predict_layers": 0,
}


def examples(n: int) -> int:
    return min(n, settings.default.max_examples)


def rand_experts(E, D, I, seed, device="cpu", wscale=0.5):
    """Stacked MXFP4 experts (quantized from Gaussian weights) and a dense shared expert (fp32 values that are
    FP8 x 2^k, exact in bf16 too)."""
    g = torch.Generator().manual_seed(seed)
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * wscale / D**0.5)
    w2, s2 = quantize_mxfp4(torch.randn(E, D, I, generator=g) * wscale / I**0.5)
    sh13 = quantize_fp8(torch.randn(2 * I, D, generator=g) * wscale / D**0.5, (32, 32))
    sh2 = quantize_fp8(torch.randn(D, I, generator=g) * wscale / I**0.5, (32, 32))
    sh13 = dequantize_fp8(*sh13, (32, 32))
    sh2 = dequantize_fp8(*sh2, (32, 32))
    to = lambda t: t.to(device)
    return to(w13), to(s13), to(w2), to(s2), to(sh13), to(sh2)


def rel_err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def check_close(y, ref, dtype):
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    if dtype == torch.float32:
        assert rel_err(y, ref) <= 1e-5
    else:
        scale = ref.abs().max().clamp(min=1e-30)
        err = (y - ref).abs() / scale
        assert err.max().item() <= 2**-7
        assert err.median().item() <= 1e-6


# ------------------------------------------------------------------------------------------------ twin


def _tiny_moe(E, k, D, I, limit, seed):
    c = Dsv4Config(**{**_TINY, "hidden_size": D, "moe_intermediate_size": I, "n_routed_experts": E,
                      "num_experts_per_tok": k, "swiglu_limit": limit})
    m = MoE(c, c.layer_roles[0], torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, Linear):
                mod.quant_sim = False
                w = torch.randn(mod.out_features, mod.in_features, generator=g) * 2 / mod.in_features**0.5
                if mod.fmt == "fp4":
                    q, s = quantize_mxfp4(w)
                    mod.weight.copy_(q.view(torch.int8))
                    mod.scale.copy_(s)
                elif mod.fmt == "fp8":
                    q, s = quantize_fp8(w, mod.block)
                    mod.weight.copy_(q)
                    mod.scale.copy_(s)
                else:
                    mod.weight.copy_(w)
        m.gate.weight.copy_(torch.randn(E, D, generator=g))
        m.gate.bias.copy_(torch.randn(E, generator=g) * 0.1)
    return m


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_twin_and_kernel_match_reference_moe(limit):
    """The twin (stacked tensors, dsv4.quant dequantization) equals MoE.forward (quant_sim=False, fp32); the
    fused op with the shared expert equals it too, on both paths."""
    E, k, D, I, N = 6, 3, 96, 64, 9
    m = _tiny_moe(E, k, D, I, limit, seed=11)
    st_ = M.stack_expert_weights(m, shared_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, N, D, generator=g) * 3
    input_ids = torch.randint(0, 64, (1, N), generator=g)
    with torch.no_grad():
        ref = m(x, input_ids)[0]
        weights, ids = m.gate(x[0], input_ids[0])
    if limit > 0:  # the clamp is active
        h = torch.nn.functional.linear(x[0], m.experts[0].w3.dequantized_weight())
        assert (h.abs() > limit).any()
    args = (x[0], ids, weights, st_["w13"], st_["s13"], st_["w2"], st_["s2"])
    twin = M.moe_experts_twin(*args, st_["limit"], st_["shared13"], st_["shared2"])
    assert rel_err(twin, ref) <= 1e-6
    for path in ("gather", "grouped", "gather_tc"):
        y = M.moe_mxfp4_with_shared(*args, st_["shared13"], st_["shared2"], st_["limit"], path)
        assert rel_err(y, ref) <= 1e-5, path


# ------------------------------------------------------------------------------------------------ kernel


@settings(max_examples=examples(24), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.integers(3, 8),
    k=st.integers(1, 3),
    D=st.sampled_from([64, 96, 128]),
    I=st.sampled_from([64, 96, 128]),
    N=st.integers(1, 40),
    path=st.sampled_from(["gather", "gather_tc", "grouped"]),
    shared=st.booleans(),
    bf16=st.booleans(),
    limit=st.sampled_from([0.0, 1.0]),
    hot=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_twin(E, k, D, I, N, path, shared, bf16, limit, hot, seed):
    """Random small shapes, each path forced, limit on (activations large enough that it bites) and off. Expert
    E-1 never gets a token; with few experts ids repeat across tokens, and `hot` gives every token expert 0 (one
    gather_tc chunk, one grouped tile run serve them all)."""
    # the interpreter pays per program: ~1 s a token on the gather path (one program per token and slot), whose
    # tokens never meet, so a few of them cover it
    N = min(N, {"gather": 5, "gather_tc": 16, "grouped": N}[path])
    k = min(k, E - 1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(N, D, generator=g) * 4).to(dtype)
    if hot:
        first = torch.zeros(1, dtype=torch.int64)
        ids = torch.stack([torch.cat([first, 1 + torch.randperm(E - 2, generator=g)[: k - 1]]) for _ in range(N)])
    else:
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    s13u, s2u = s13.view(torch.uint8), s2.view(torch.uint8)
    if shared:
        sh13, sh2 = sh13.to(dtype), sh2.to(dtype)
        ref = M.moe_experts_twin(x, ids, weights, w13, s13u, w2, s2u, limit, sh13, sh2)
        y = M.moe_mxfp4_with_shared(x, ids, weights, w13, s13, w2, s2, sh13, sh2, limit, path)
    else:
        ref = M.moe_experts_twin(x, ids, weights, w13, s13u, w2, s2u, limit)
        y = M.moe_experts_mxfp4(x, ids, weights, w13, s13, w2, s2, limit, path)
    check_close(y, ref, dtype)


@pytest.mark.parametrize("bn_down", [16, 256])
def test_grouped_down_tile_of_its_own(bn_down):
    """The grouped down kernel at an output tile other than the up kernel's (`BND`; 64 here): narrower, and wider
    than D = 128, so its one column tile is half masked. A grid counted in the up kernel's tile would leave columns
    of the output unwritten."""
    E, k, D, I, N = 5, 2, 128, 96, 24
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 13)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(N, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    sh13, sh2 = sh13.bfloat16(), sh2.bfloat16()
    y = M.moe_triton(x, ids, weights, w13, s13, w2, s2, 1.0, sh13, sh2, path="grouped", cfg={"BND": bn_down})
    check_close(y, M.moe_experts_twin(x, ids, weights, w13, s13, w2, s2, 1.0, sh13, sh2), torch.bfloat16)


def test_gather_tc_chunks():
    """More than 16 token-slots of one expert (20 tokens: the shared expert and a hot one, and a token that lists
    an expert twice) are served in chunks of 16, each led by its first token-slot."""
    E, k, D, I, N = 6, 3, 64, 64, 20
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(N, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    ids[:, 0] = 2
    ids[5, 1] = 2  # token 5 lists expert 2 twice
    weights = torch.rand(N, k, generator=g)
    sh13, sh2 = sh13.bfloat16(), sh2.bfloat16()
    y = M.moe_mxfp4_with_shared(x, ids, weights, w13, s13, w2, s2, sh13, sh2, 1.0, "gather_tc")
    check_close(y, M.moe_experts_twin(x, ids, weights, w13, s13, w2, s2, 1.0, sh13, sh2), torch.bfloat16)


@pytest.mark.parametrize("K, offset, bk", [(256, 0, 128), (192, 0, 128), (256, 1, 128), (384, 0, 256)])
def test_gather_whole_k_steps(K, offset, bk):
    """The gather kernels at bk-wide K steps: where the step divides the row (256 in steps of 128) and the scales sit
    4-byte aligned they read the scales as int32 words, four groups each, and drop the K masks; a partial last step
    (192) or scales one byte off a word (offset 1) take the byte loads, except in the down kernel where the rest is
    a whole step of its own (384 in steps of 256: 128 apart, `down_tail`). Each 32-group's weights carry their own
    power of two (2^-3 .. 2^3), so a group read with a neighbour's scale, or a word's bytes in the wrong order, is
    off by a factor of 2 or more."""
    E, k, N = 4, 2, 2
    g = torch.Generator().manual_seed(K + offset)

    def grouped_weights(rows, cols):  # [E, rows, cols], 32-element groups of random powers of two
        spread = 2.0 ** torch.randint(-3, 4, (E, rows, cols // 32, 1), generator=g)
        return (torch.randn(E, rows, cols // 32, 32, generator=g) * spread).view(E, rows, cols) / cols**0.5

    w13, s13 = quantize_mxfp4(grouped_weights(2 * K, K))
    w2, s2 = quantize_mxfp4(grouped_weights(K, K))
    if offset:  # the same scales one byte into a buffer
        padded = torch.cat([torch.zeros(offset, dtype=torch.uint8), s13.view(torch.uint8).flatten()])
        s13 = padded[offset:].view(s13.shape)
    x = torch.randn(N, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    assert M._even_k(K, bk, s13) == (K == 256 and offset == 0)
    assert M.down_tail(K, bk, s2) == (128 if K == 384 else 0)
    y = M.moe_triton(x, ids, weights, w13, s13, w2, s2, 0.0, path="gather", cfg={"BK": bk})
    check_close(y, M.moe_experts_twin(x, ids, weights, w13, s13.view(torch.uint8), w2, s2.view(torch.uint8), 0.0),
                torch.float32)


@pytest.mark.parametrize("bk, bkd", [(256, 128), (128, 256)])
def test_gather_down_kernel_takes_its_own_k_step(bk, bkd, monkeypatch):
    """A config's BKD sets the down kernel's K step apart from the up kernel's BK (what `bench/moe_experts.py`
    sweeps at one token: 512 up, 256 down): each kernel tests its own step for the EVEN path, and the slots match
    the twin's."""
    E, k, D, I, N = 4, 2, 256, 256, 1
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 17)
    g = torch.Generator().manual_seed(17)
    x = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    args = (ids, weights, w13, s13.view(torch.uint8), w2, s2.view(torch.uint8))
    steps = []
    even_k = M._even_k
    monkeypatch.setattr(M, "_even_k", lambda K, BK, scales: steps.append(BK) or even_k(K, BK, scales))
    out = M._gather(x, M.activation_planes(x), *args, sh13, sh2, 1.0, True,
                    {**M._cfg(x, N, "gather"), "BK": bk, "BKD": bkd})
    assert steps == [bk, bk, bkd, bkd]  # up: the routed and the shared scales, then down's
    check_close(out, M.moe_slots_twin(x, *args, 1.0, sh13, sh2), torch.float32)


def test_clamp_active_and_paths_agree():
    """Large activations: the clamp changes the result (against limit 0), and gather == grouped == gather_tc ==
    twin."""
    E, k, D, I, N = 5, 2, 64, 64, 11
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 5, wscale=2.0)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(N, D, generator=g) * 8
    ids = torch.randint(0, E - 1, (N, k), generator=g)
    ids[:, 0] = 2  # every token shares expert 2
    weights = torch.rand(N, k, generator=g)
    ys = [M.moe_mxfp4_with_shared(x, ids, weights, w13, s13, w2, s2, sh13, sh2, 1.0, p)
          for p in ("gather", "grouped", "gather_tc")]
    ref = M.moe_experts_twin(x, ids, weights, w13, s13, w2, s2, 1.0, sh13, sh2)
    unclamped = M.moe_experts_twin(x, ids, weights, w13, s13, w2, s2, 0.0, sh13, sh2)
    assert rel_err(unclamped, ref) > 1e-2
    for y in ys:
        assert rel_err(y, ref) <= 1e-5
    for y in ys[1:]:
        assert rel_err(ys[0], y) <= 1e-5


@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_gather_slots_are_the_fused_ops_terms(N, bf16):
    """moe_gather_slots (the planes made by the caller) gives each slot's output as the slot twin does, the
    shared expert last, and their sum is the fused op's y on the gather path: the same kernels, the same sum."""
    E, k, D, I = 6, 3, 64, 64
    dtype = torch.bfloat16 if bf16 else torch.float32
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 21)
    sh13, sh2 = sh13.to(dtype), sh2.to(dtype)
    g = torch.Generator().manual_seed(22)
    x = (torch.randn(N, D, generator=g) * 4).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    args = (ids, weights, w13, s13, w2, s2, sh13, sh2, 1.0)
    slots = M.moe_gather_slots(x, M.activation_planes(x), *args)
    twin = M.moe_slots_twin(x, ids, weights, w13, s13.view(torch.uint8), w2, s2.view(torch.uint8), 1.0, sh13, sh2)
    assert slots.shape == (N, k + 1, D)
    for j in range(k + 1):
        check_close(slots[:, j], twin[:, j], dtype)
    assert torch.equal(slots.sum(dim=1), M.moe_mxfp4_with_shared(x, *args, "gather"))
    with pytest.raises(ValueError, match="planes must be"):
        M.moe_gather_slots(x, M.activation_planes(x).bfloat16(), *args)


@pytest.mark.parametrize("K, block, bk", [(64, (32, 32), 64), (256, (32, 32), 128), (256, (128, 128), 128),
                                          (256, (64, 128), 256), (384, (128, 128), 256)])
@pytest.mark.parametrize("bf16", [False, True])
def test_gather_slots_read_the_shared_expert_as_stored(K, block, bk, bf16):
    """moe_gather_slots with the shared expert's FP8 rows (`fp8_rows`: codes and a scale per row and 32 elements)
    gives the shared slot of the dense rows they hold, and leaves the routed slots as they were, bit for bit; at
    K steps that divide the rows (256) the scales come as words and the K masks go (the EVEN path), and the down
    kernel's rows of 384 in steps of 256 end in a whole step of 128 (`down_tail`). Each weight
    block carries its own power of two (2^-3 .. 2^3), so a row or group read with another block's scale is off
    by a factor of 2 or more."""
    E, k, N = 4, 2, 1
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(K + block[0] + bk)

    def blocked(rows, cols):  # an FP8 linear whose blocks span 2^-3 .. 2^3
        spread = 2.0 ** torch.randint(-3, 4, (rows // block[0], 1, cols // block[1], 1), generator=g)
        w = torch.randn(rows // block[0], block[0], cols // block[1], block[1], generator=g) * spread
        return quantize_fp8(w.view(rows, cols) / cols**0.5, block)

    w13, s13, w2, s2, _, _ = rand_experts(E, K, K, 31)
    (q13, e13), (q2, e2) = blocked(2 * K, K), blocked(K, K)
    sh13, sh2 = (dequantize_fp8(q, e, block).to(dtype) for q, e in ((q13, e13), (q2, e2)))
    rows13, rows2 = M.fp8_rows(q13, e13, block), M.fp8_rows(q2, e2, block)
    for (codes, exps), dense in ((rows13, sh13), (rows2, sh2)):  # the same values, a scale per row and group
        values = dequantize_fp8(codes.view(torch.float8_e4m3fn), exps.view(torch.float8_e8m0fnu), (32,))
        assert torch.equal(values, dense.float())
    x = (torch.randn(N, K, generator=g) * 4).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    args = (ids, weights, w13, s13.view(torch.uint8), w2, s2.view(torch.uint8))
    dense = M._gather(x, M.activation_planes(x), *args, sh13, sh2, 1.0, True, {**M._cfg(x, N, "gather"), "BK": bk})
    stored = M._gather(x, M.activation_planes(x), *args, sh13, sh2, 1.0, True, {**M._cfg(x, N, "gather"), "BK": bk},
                       (*rows13, *rows2))
    assert M._even_k(K, bk, rows13[1]) == (K == 256)
    assert M.down_tail(K, bk, s2, rows2[1]) == (128 if K == 384 else 0)
    assert torch.equal(stored[:, :k], dense[:, :k])
    check_close(stored[:, k], M.moe_slots_twin(x, *args, 1.0, sh13, sh2)[:, k], dtype)
    if bk == 64:  # the op, at its own tiles
        op = M.moe_gather_slots(x, M.activation_planes(x), *args, sh13, sh2, 1.0, *rows13, *rows2)
        assert torch.equal(op, stored)


def test_fp8_rows_of_a_view_at_an_odd_offset_are_read_as_words():
    """A shared expert's FP8 weight viewing a checkpoint's bytes at an offset that is no multiple of 8 (as a tiny
    bf16 checkpoint's w2 did: the gather op failed to view its codes as 8-byte words): fp8_rows gives codes the
    kernels can read as words, the same bytes."""
    q, e = quantize_fp8(torch.randn(64, 64), (32, 32))
    raw = torch.zeros(1 + q.numel(), dtype=torch.uint8)
    raw[1:] = q.view(torch.uint8).flatten()
    view = raw[1:].view(64, 64).view(torch.float8_e4m3fn)  # storage offset 1
    codes, exps = M.fp8_rows(view, e, (32, 32))
    assert torch.equal(codes, q.view(torch.uint8)) and codes.view(torch.int64).shape == (64, 8)
    assert torch.equal(exps, M.fp8_rows(q, e, (32, 32))[1])


def test_gather_slots_refuse_partial_or_misshapen_fp8_rows():
    E, k, D, I = 4, 2, 64, 64
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 5)
    x = torch.randn(1, D)
    args = (x, M.activation_planes(x), torch.tensor([[0, 1]]), torch.ones(1, k), w13, s13, w2, s2, sh13, sh2, 1.0)
    (q13, e13), (q2, e2) = (M.fp8_rows(*quantize_fp8(w, (32, 32)), (32, 32)) for w in (sh13, sh2))
    with pytest.raises(ValueError, match="all four"):
        M.moe_gather_slots(*args, q13, e13, q2)
    with pytest.raises(ValueError, match="shapes"):
        M.moe_gather_slots(*args, q13, e13, q2, e2[:, :1])
    with pytest.raises(ValueError, match="bk % 32"):
        M.fp8_rows(*quantize_fp8(sh2, (32, 16)), (32, 16))


def test_tile_table():
    """Tiles cover each expert's sorted rows exactly once, never straddle experts; padding tiles are -1."""
    g = torch.Generator().manual_seed(0)
    E, BM = 7, 4
    ids = torch.randint(0, E, (13, 3), generator=g)
    ids[ids == 5] = 6  # expert 5 empty
    order, te, r0, r1 = M.tile_table(ids, E, BM)
    flat = ids.flatten()[order]
    assert torch.equal(flat, flat.sort().values)
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for e, a, b in zip(te.tolist(), r0.tolist(), r1.tolist()):
        if e < 0:
            continue
        rows = torch.arange(a, min(a + BM, b))
        assert len(rows) > 0 and (flat[rows] == e).all()
        seen[rows] += 1
    assert (seen == 1).all()
    assert te.numel() == -(-flat.numel() // BM) + min(E + 1, flat.numel())


def test_stacking_refuses_scales_the_tensor_core_decode_cannot_hold():
    m = _tiny_moe(4, 2, 64, 64, 0.0, seed=2)
    with torch.no_grad():
        m.experts[1].w2.scale.view(torch.uint8)[0, 0] = 127 + M.MAX_SCALE_EXP + 1
    with pytest.raises(ValueError, match=f"2\\^{M.MAX_SCALE_EXP + 1}"):
        M.stack_expert_weights(m)
    with torch.no_grad():
        m.experts[1].w2.scale.view(torch.uint8)[0, 0] = 127 + M.MAX_SCALE_EXP
    M.stack_expert_weights(m)  # the largest exact one loads


def test_fake_and_auto():
    from torch._subclasses.fake_tensor import FakeTensorMode

    E, D, I, N, k = 4, 64, 64, 3, 2
    w13, s13, w2, s2, sh13, sh2 = rand_experts(E, D, I, 1)
    x = torch.randn(N, D).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]])
    wts = torch.rand(N, k)
    y = M.moe_experts_mxfp4(x, ids, wts, w13, s13, w2, s2, 10.0)
    check_close(y, M.moe_experts_twin(x, ids, wts, w13, s13, w2, s2, 10.0), torch.bfloat16)
    real = (ids, wts, w13, s13, w2, s2, sh13.bfloat16(), sh2.bfloat16())
    planes = M.activation_planes(x)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fargs = [mode.from_tensor(t) for t in real]
        out = torch.ops.dsv4.moe_mxfp4_with_shared(fx, *fargs, 10.0)
        assert out.shape == (N, D) and out.dtype == torch.float32
        slots = torch.ops.dsv4.moe_gather_slots(fx, mode.from_tensor(planes), *fargs, 10.0)
        assert slots.shape == (N, k + 1, D) and slots.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ GPU

V41 = {"D": 5120, "I": 2304, "E": 384, "k": 6}


def _v41_inputs(N, seed=0):
    E, D, I, k = V41["E"], V41["D"], V41["I"], V41["k"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), generator=g, device="cuda", dtype=torch.uint8)
    s13 = torch.randint(118, 123, (E, 2 * I, D // 32), generator=g, device="cuda", dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, D, I // 2), generator=g, device="cuda", dtype=torch.uint8)
    s2 = torch.randint(118, 123, (E, D, I // 32), generator=g, device="cuda", dtype=torch.uint8)
    sh13 = (torch.randn(2 * I, D, generator=g, device="cuda") / D**0.5).bfloat16()
    sh2 = (torch.randn(D, I, generator=g, device="cuda") / I**0.5).bfloat16()
    x = torch.randn(N, D, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(N)])
    ids[:, 0] = 7  # a shared hot expert
    wts = torch.rand(N, k, generator=g, device="cuda")
    return x, ids, wts, w13, s13, w2, s2, sh13, sh2


@gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 8, 64])
@pytest.mark.parametrize("path", ["gather", "grouped", "gather_tc"])
def test_gpu_v41_shapes(N, path):
    """bf16 on the GPU; tolerance as for bf16 above (2^-7 of the max in any element, median <= 1e-6 would be
    too tight for tensor-core summation order over K = 5120: median <= 1e-4)."""
    x, ids, wts, w13, s13, w2, s2, sh13, sh2 = _v41_inputs(N)
    y = M.moe_mxfp4_with_shared(x, ids, wts, w13, s13, w2, s2, sh13, sh2, 10.0, path)
    ref = M.moe_experts_twin(x, ids, wts, w13, s13, w2, s2, 10.0, sh13, sh2)
    scale = ref.abs().max()
    err = (y - ref).abs() / scale
    assert err.max().item() <= 2**-7 and err.median().item() <= 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 2])
def test_gpu_gather_slots_sum_to_the_fused_op(N):
    """The decode step's form at V4.1 shapes: the slots, summed, are the fused op's gather path bit for bit."""
    x, ids, wts, w13, s13, w2, s2, sh13, sh2 = _v41_inputs(N, seed=3)
    args = (ids, wts, w13, s13, w2, s2, sh13, sh2, 10.0)
    slots = M.moe_gather_slots(x, M.activation_planes(x), *args)
    assert torch.equal(slots.sum(dim=1), M.moe_mxfp4_with_shared(x, *args, "gather"))


@gpu
@needs_cuda
def test_gpu_gather_slots_read_the_shared_expert_as_stored():
    """The batch-1 decode step's form at V4.1 shapes with the shared expert's FP8 rows (V4.1's 32 x 32 blocks): the
    routed slots bit for bit those of the dense run, the shared slot the twin's on the same values (bf16 tolerance
    as in test_gpu_v41_shapes)."""
    x, ids, wts, w13, s13, w2, s2, _, _ = _v41_inputs(1, seed=4)
    g = torch.Generator().manual_seed(4)
    D, I = V41["D"], V41["I"]
    stored = [quantize_fp8(torch.randn(rows, cols, generator=g) / cols**0.5, (32, 32)) for rows, cols in
              ((2 * I, D), (D, I))]
    sh13, sh2 = (dequantize_fp8(q, e, (32, 32)).bfloat16().cuda() for q, e in stored)
    rows = [t.cuda() for q, e in stored for t in M.fp8_rows(q, e, (32, 32))]
    args = (ids, wts, w13, s13, w2, s2, sh13, sh2, 10.0)
    dense = M.moe_gather_slots(x, M.activation_planes(x), *args)
    fp8 = M.moe_gather_slots(x, M.activation_planes(x), *args, *rows)
    assert torch.equal(fp8[:, :-1], dense[:, :-1])
    ref = M.moe_slots_twin(x, ids, wts, w13, s13, w2, s2, 10.0, sh13, sh2)[:, -1]
    err = (fp8[:, -1] - ref).abs() / ref.abs().max()
    assert err.max().item() <= 2**-7 and err.median().item() <= 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("path", ["gather", "grouped", "gather_tc"])
def test_gpu_cuda_graph(path):
    """Every path captures in a CUDA graph (no host syncs) and replays with new ids in place."""
    N = 64 if path == "grouped" else 8
    x, ids, wts, w13, s13, w2, s2, sh13, sh2 = _v41_inputs(N, seed=1)
    run = lambda: M.moe_mxfp4_with_shared(x, ids, wts, w13, s13, w2, s2, sh13, sh2, 10.0, path)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    x2, ids2, wts2 = _v41_inputs(N, seed=2)[:3]
    x.copy_(x2), ids.copy_(ids2), wts.copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    ref = M.moe_experts_twin(x, ids, wts, w13, s13, w2, s2, 10.0, sh13, sh2)
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= 2**-7
