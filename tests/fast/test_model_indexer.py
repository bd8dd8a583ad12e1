"""The fast model's module-path indexer (prefill, replay) against the reference Indexer: the same inputs, the
same picks and candidate pools.

FastIndexer scores the keys by the MQA kernel in their MXFP4 form and selects by the radix select; here the
kernels run as their torch twins (the `kernel_twins` fixture; the kernels against the twins:
test_indexer_kernel.py, test_topk_kernel.py), in fp32, where the twins compute what the reference does, so
the picks must be equal. That the cache's decoded keys encode back to the same values:
tests/test_quant.py::test_mxfp4_grid_inputs_roundtrip_exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4.fast.kernels.indexer import candidate_mask
from dsv4.fast.model import FastIndexer
from dsv4.quant import fake_quant_mxfp4
from dsv4.reference.indexer import hadamard
from dsv4.reference.model import load_model

pytestmark = pytest.mark.usefixtures("kernel_twins")


def indexer_layers(path) -> list:
    model = load_model(str(path), torch.float32, progress=False)
    model.set_quant_sim(True, activations=False)
    return [layer.attn for layer in model.layers if layer.role.owns_indexer]


def inputs(attn, S: int, T: int, start: int, seed: int):
    """x, qr, MXFP4-valued keys [1, T, d] (as the cache holds them), positions start.. of a chunk."""
    g = torch.Generator().manual_seed(seed)
    ix = attn.indexer
    x = torch.randn(1, S, attn.wq_a.in_features, generator=g)
    qr = torch.randn(1, S, attn.wq_b.in_features, generator=g)
    keys = torch.randn(1, T, ix.head_dim, generator=g)
    keys = fake_quant_mxfp4(keys if ix.is_v41 else hadamard(keys))
    return x, qr, keys, torch.arange(start, start + S)


@pytest.mark.parametrize("S, start", [(1, 40), (7, 0), (16, 21), (33, 90)])
def test_the_module_path_indexer_picks_what_the_reference_does(arch_dir, S, start):
    for attn in indexer_layers(arch_dir):
        r = attn.role.compress_ratio
        T = (start + S) // r  # the entries the chunk's last query sees (0 for a short first chunk)
        fast = copy.deepcopy(attn.indexer)
        fast.__class__ = FastIndexer
        x, qr, keys, positions = inputs(attn, S, T, start, seed=S + start)
        pools = {}
        if attn.role.candidate_role == "consumer":  # a candidate source's pool over the same entries, in each form
            for ix in (attn.indexer, fast):
                _, pools[ix] = copy.deepcopy(ix)(x, qr, keys, positions, attn.rotary, r, select_candidates=True)
        for select in (False, True) if attn.role.candidate_role else (False,):
            want = attn.indexer(x, qr, keys, positions, attn.rotary, r, None if select else pools.get(attn.indexer),
                                select)
            got = fast(x, qr, keys, positions, attn.rotary, r, None if select else pools.get(fast), select)
            assert torch.equal(got[0], want[0]), f"layer {attn.role.layer_id}: picks differ"
            assert (got[1] is None) == (want[1] is None)
            if want[1] is not None:  # the fast pool lists the kept blocks; as a mask, the reference's
                mask = candidate_mask(got[1], T, fast.candidate_block_size)
                assert torch.equal(mask, want[1]), f"layer {attn.role.layer_id}: candidate pools differ"


def test_the_picks_do_not_depend_on_how_many_queries_are_scored_at_once(arch_dir):
    """Indexer.forward forms the fp32 scores for as many queries at a time as fit `score_bytes`: groups of 3
    queries pick, and pool, what one group of all 33 does, in the reference and the fast indexer alike."""
    S, start = 33, 90
    for attn in indexer_layers(arch_dir):
        r = attn.role.compress_ratio
        T = (start + S) // r
        x, qr, keys, positions = inputs(attn, S, T, start, seed=5)
        for cls in (type(attn.indexer), FastIndexer):
            ix = copy.deepcopy(attn.indexer)
            ix.__class__ = cls
            pool = None
            if attn.role.candidate_role == "consumer":
                _, pool = copy.deepcopy(ix)(x, qr, keys, positions, attn.rotary, r, select_candidates=True)
            for select in (False, True) if attn.role.candidate_role else (False,):
                args = (x, qr, keys, positions, attn.rotary, r, None if select else pool, select)
                whole = ix(*args)
                ix.score_bytes, calls = 3 * 4 * T, []
                step = "_scores" if pool is None or select else "_top_in_pool"  # the call made once per group
                method = getattr(ix, step)
                setattr(ix, step, lambda *a, f=method, seen=calls: seen.append(a[0].shape[1]) or f(*a))
                grouped = ix(*args)
                delattr(ix, step)
                ix.score_bytes = 1 << 30
                assert calls == [3] * 11
                assert torch.equal(grouped[0], whole[0]), f"layer {attn.role.layer_id}: picks differ"
                assert (grouped[1] is None) == (whole[1] is None) == (not select)
                if select:
                    assert torch.equal(grouped[1], whole[1]), f"layer {attn.role.layer_id}: candidate pools differ"
