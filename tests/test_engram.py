"""Tests for dsv4.reference.engram: token map, hashing constants, layout file, hashing, the layer.

Hash ids in the known-sequence tests are derived by hand in the comments (small primes, small odd
multipliers), so a reader can re-check them without trusting the code under test.
"""

import dataclasses
import functools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.config import Dsv4Config
from dsv4.quant import dequantize_fp8, quantize_fp8
from dsv4.reference.engram import (
    DEAD,
    Engram,
    EngramEmbedding,
    EngramHasher,
    EngramLayout,
    compressed_token_map,
    compute_layout,
    engram_primes,
    hash_multipliers,
    is_prime,
    load_or_create_layout,
    ngram_tokens,
    row_offsets,
    token_keys,
    token_map_sha256,
)

FAST = settings(max_examples=150, deadline=None)
INT64_MAX = 2**63 - 1

# A 6-token vocabulary folded into 5 compressed ids; the pad token (id 2) compresses to 4.
TOKEN_MAP = [3, 0, 4, 1, 2, 0]
PAD = 4

# V = 10, N = 3, H = 2, two engram layers. Primes above 9: 11 13 17 19 23 29 31 37 ...
#   layer 0, n=2: 11, 13            (search from 9)
#   layer 0, n=3: 17, 19            (restart from 9; 11 and 13 are taken)
#   layer 1, n=2: 23, 29            (restart from 9; 11..19 taken)
#   layer 1, n=3: 31, 37
# offsets = exclusive cumulative sums in (n, head) order:
#   layer 0: 0, 11, 11+13=24, 24+17=41          rows 41+19 = 60
#   layer 1: 0, 23, 23+29=52, 52+31=83          rows 83+37 = 120
SMALL_PRIMES = [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]
SMALL_OFFSETS = [[0, 11, 24, 41], [0, 23, 52, 83]]
SMALL_ROWS = [60, 120]
# Hand-chosen odd multipliers (m[0], m[1], m[2]) per layer.
SMALL_MULTIPLIERS = [[1, 3, 5], [7, 9, 3]]


def small_config(**changes) -> Dsv4Config:
    fields = dict(
        num_hidden_layers=2,
        compress_ratios=[0, 0],
        kv_source_layer_ids=[],
        index_source_layer_ids=[],
        candidate_source_layer_id=-1,
        hidden_size=64,
        hc_mult=4,
        rms_norm_eps=1e-6,
        engram_layer_ids=[0, 1],
        engram_num_embeddings=SMALL_ROWS,
        engram_max_ngram_size=3,
        engram_vocab_size=10,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_pad_id=2,
        engram_compressed_vocab_size=5,
        num_nextn_predict_layers=0,  # no DSpark drafter in these two-layer models
    )
    fields.update(changes)
    return Dsv4Config(**fields)


def small_hasher(multipliers=SMALL_MULTIPLIERS) -> EngramHasher:
    layout = EngramLayout(
        layer_ids=(0, 1),
        max_ngram_size=3,
        n_heads=2,
        vocab_size=10,
        compressed_vocab_size=5,
        pad_id=2,
        token_map_sha256=token_map_sha256(TOKEN_MAP),
        multipliers=tuple(tuple(m) for m in multipliers),
        primes=tuple(tuple(tuple(h) for h in layer) for layer in SMALL_PRIMES),
        offsets=tuple(tuple(o) for o in SMALL_OFFSETS),
    )
    return EngramHasher(layout, TOKEN_MAP)


# ----------------------------------------------------------------------------- hashing by hand
def test_hash_ids_by_hand():
    # ids [1, 3, 5, 0] -> compressed [0, 1, 0, 3]; look-back windows (shift 0, 1, 2), pad = 4:
    #   p0: [0, 4, 4]   (all look-backs cross the start)
    #   p1: [1, 0, 4]   (shift 2 crosses the start)
    #   p2: [0, 1, 0]
    #   p3: [3, 0, 1]
    # layer 0, m = (1, 3, 5), primes (11, 13 | 17, 19), offsets (0, 11, 24, 41):
    #   p0: terms 0, 12, 20: r2 = 0^12 = 12, r3 = 12^20 = 0b01100^0b10100 = 0b11000 = 24
    #       12%11=1, 12%13=12, 24%17=7, 24%19=5       -> [1, 23, 31, 46]
    #   p1: terms 1, 0, 20: r2 = 1, r3 = 1^20 = 21
    #       1, 1, 21%17=4, 21%19=2                     -> [1, 12, 28, 43]
    #   p2: terms 0, 3, 0: r2 = 3, r3 = 3               -> [3, 14, 27, 44]
    #   p3: terms 3, 0, 5: r2 = 3, r3 = 3^5 = 6         -> [3, 14, 30, 47]
    # layer 1, m = (7, 9, 3), primes (23, 29 | 31, 37), offsets (0, 23, 52, 83):
    #   p0: terms 0, 36, 12: r2 = 36, r3 = 0b100100^0b001100 = 0b101000 = 40
    #       36%23=13, 36%29=7, 40%31=9, 40%37=3        -> [13, 30, 61, 86]
    #   p1: terms 7, 0, 12: r2 = 7, r3 = 0b0111^0b1100 = 0b1011 = 11
    #                                                   -> [7, 30, 63, 94]
    #   p2: terms 0, 9, 0: r2 = 9, r3 = 9               -> [9, 32, 61, 92]
    #   p3: terms 21, 0, 3: r2 = 21, r3 = 0b10101^0b00011 = 0b10110 = 22
    #                                                   -> [21, 44, 74, 105]
    expected = torch.tensor(
        [
            [[1, 23, 31, 46], [13, 30, 61, 86]],
            [[1, 12, 28, 43], [7, 30, 63, 94]],
            [[3, 14, 27, 44], [9, 32, 61, 92]],
            [[3, 14, 30, 47], [21, 44, 74, 105]],
        ]
    )
    out = small_hasher().hash_ids(torch.tensor([[1, 3, 5, 0]]), start=0)
    assert out.dtype == torch.int64 and out.shape == (1, 4, 2, 4)
    assert torch.equal(out[0], expected)


def test_dead_token_blocks_look_back():
    # ids [1, 3, 5, 0, 4], position 2 masked -> compressed [0, 1, DEAD, 3, 2]; windows:
    #   p2: [4, 4, 4]  (the dead token itself and everything behind it pad)
    #   p3: [3, 4, 4]  (shift 1 hits the dead token: shifts 1 and 2 pad)
    #   p4: [2, 3, 4]  (shift 2 hits the dead token)
    # layer 0, m = (1, 3, 5):
    #   p2: terms 4, 12, 20: r2 = 0b00100^0b01100 = 8, r3 = 0b01000^0b10100 = 0b11100 = 28
    #       8, 8, 28%17=11, 28%19=9                     -> [8, 19, 35, 50]
    #   p3: terms 3, 12, 20: r2 = 0b0011^0b1100 = 15, r3 = 0b01111^0b10100 = 0b11011 = 27
    #       15%11=4, 15%13=2, 27%17=10, 27%19=8         -> [4, 13, 34, 49]
    #   p4: terms 2, 9, 20: r2 = 0b0010^0b1001 = 0b1011 = 11, r3 = 0b01011^0b10100 = 0b11111 = 31
    #       11%11=0, 11%13=11, 31%17=14, 31%19=12       -> [0, 22, 38, 53]
    # layer 1, m = (7, 9, 3), p3: terms 21, 36, 12: r2 = 0b010101^0b100100 = 0b110001 = 49,
    #   r3 = 0b110001^0b001100 = 0b111101 = 61; 49%23=3, 49%29=20, 61%31=30, 61%37=24
    #                                                   -> [3, 43, 82, 107]
    ids = torch.tensor([[1, 3, 5, 0, 4]])
    mask = torch.tensor([[True, True, False, True, True]])
    out = small_hasher().hash_ids(ids, start=0, token_mask=mask)[0]  # [S, L, 4]
    assert out[0, 0].tolist() == [1, 23, 31, 46]  # before the dead token: unchanged
    assert out[1, 0].tolist() == [1, 12, 28, 43]
    assert out[2, 0].tolist() == [8, 19, 35, 50]
    assert out[3, 0].tolist() == [4, 13, 34, 49]
    assert out[4, 0].tolist() == [0, 22, 38, 53]
    assert out[3, 1].tolist() == [3, 43, 82, 107]


def test_ngram_tokens_padding_rules():
    compressed = torch.tensor([[5, 6, DEAD, 7, 8, 9]])
    windows = ngram_tokens(compressed, start=0, max_ngram=4, pad=0)[0]
    assert windows.tolist() == [
        [5, 0, 0, 0],  # position 0: every look-back crosses the start
        [6, 5, 0, 0],  # position 1: shifts >= 2 cross the start
        [0, 0, 0, 0],  # the dead token
        [7, 0, 0, 0],
        [8, 7, 0, 0],
        [9, 8, 7, 0],
    ]


def test_incremental_hash_matches_prefill():
    hasher = small_hasher()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(TOKEN_MAP), (3, 9), generator=gen)
    mask = torch.rand(3, 9, generator=gen) > 0.2
    full = hasher.hash_ids(ids, 0, mask)
    for start in (1, 5, 8, 9):
        assert torch.equal(hasher.hash_ids(ids, start, mask), full[:, start:])
    # decode only needs the last N-1 tokens of history before the new one
    assert torch.equal(hasher.hash_ids(ids[:, 6:], 2, mask[:, 6:]), full[:, 8:])


def test_hash_ids_stay_inside_each_bucket_range():
    hasher = small_hasher(multipliers=[hash_multipliers(L, 5, 3) for L in (0, 1)])
    ids = torch.randint(0, len(TOKEN_MAP), (4, 50), generator=torch.Generator().manual_seed(1))
    out = hasher.hash_ids(ids, 0)  # [B, S, L, (N-1)*H]
    for layer in range(2):
        starts = torch.tensor(SMALL_OFFSETS[layer])
        sizes = torch.tensor([p for heads in SMALL_PRIMES[layer] for p in heads])
        col = out[:, :, layer]
        assert ((col >= starts) & (col < starts + sizes)).all()


def test_hasher_rejects_foreign_token_map():
    layout = dataclasses.replace(compute_layout(small_config(), TOKEN_MAP), token_map_sha256="0" * 64)
    with pytest.raises(ValueError, match="token_map_sha256"):
        EngramHasher(layout, TOKEN_MAP)


# ----------------------------------------------------------------------------- primes and multipliers
@functools.cache
def sieve(limit: int) -> list[bool]:
    flags = [True] * (limit + 1)
    flags[0] = flags[1] = False
    for i in range(2, math.isqrt(limit) + 1):
        if flags[i]:
            flags[i * i :: i] = [False] * len(flags[i * i :: i])
    return flags


def test_is_prime_exhaustive_small_range():
    flags = sieve(200_000)
    assert all(is_prime(n) == flags[n] for n in range(20_000))
    assert not is_prime(-7)


@FAST
@given(st.integers(0, 200_000))
def test_is_prime_matches_sieve(n):
    assert is_prime(n) == sieve(200_000)[n]


def test_is_prime_large_and_pseudoprimes():
    assert is_prime(2**61 - 1)
    assert is_prime(18446744073709551557)  # the largest prime below 2**64
    assert not is_prime((2**31 - 1) ** 2)  # square of a prime, near 2**62
    assert not is_prime(561) and not is_prime(41041)  # Carmichael numbers
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7
    assert not is_prime(3825123056546413051)  # strong pseudoprime to bases 2 .. 23


def test_small_primes_and_offsets_by_hand():
    assert engram_primes(2, 10, 3, 2) == SMALL_PRIMES
    assert [row_offsets(layer) for layer in SMALL_PRIMES] == SMALL_OFFSETS
    # N = 4, one layer: n=2 -> 11, 13; n=3 -> 17, 19; n=4 -> 23, 29
    assert engram_primes(1, 10, 4, 2) == [[[11, 13], [17, 19], [23, 29]]]


@FAST
@given(st.integers(1, 3), st.integers(2, 2000), st.integers(2, 4), st.integers(1, 4))
def test_prime_search_rules(n_layers, vocab, max_ngram, heads):
    flags = sieve(200_000)
    primes = engram_primes(n_layers, vocab, max_ngram, heads)
    flat = [p for layer in primes for heads_ in layer for p in heads_]
    assert len(flat) == len(set(flat)) == n_layers * (max_ngram - 1) * heads
    used: set[int] = set()
    for layer in primes:
        assert len(layer) == max_ngram - 1
        for heads_ in layer:
            current = vocab - 1  # every (layer, n) restarts here
            for p in heads_:
                smallest = next(q for q in range(current + 1, len(flags)) if flags[q] and q not in used)
                assert p == smallest
                used.add(p)
                current = p


def test_multipliers_match_numpy_and_bounds():
    compressed = 99092
    for layer in (1, 14):
        got = hash_multipliers(layer, compressed, 4)
        rng = np.random.default_rng(10007 * layer)
        expected = rng.integers(0, (INT64_MAX // compressed) // 2, size=4, dtype=np.int64) * 2 + 1
        assert got == [int(x) for x in expected]
        assert all(m % 2 == 1 and 0 < m < INT64_MAX // compressed for m in got)


def test_released_table_sizes():
    primes = engram_primes(2, 16_000_000, 4, 8)
    assert [sum(p for heads in layer for p in heads) for layer in primes] == [384_006_168, 384_016_682]
    assert all(p > 15_999_999 for layer in primes for heads in layer for p in heads)


def test_released_config_layout():
    config = Dsv4Config()
    layout = compute_layout(config, list(range(config.engram_compressed_vocab_size)))
    assert layout.table_rows == config.engram_num_embeddings
    assert layout.layer_ids == (1, 14)
    assert len(layout.offsets[0]) == 24 and layout.offsets[0][0] == 0


# ----------------------------------------------------------------------------- the layout file
def test_layout_file_round_trip(tmp_path):
    path = tmp_path / "sub" / "engram_layout.json"
    config = small_config()
    created = load_or_create_layout(path, config, TOKEN_MAP)
    assert path.exists()
    raw = json.loads(path.read_text())
    assert raw["format"] == "dsv4.engram_layout" and raw["version"] == 1
    assert raw["primes"] == SMALL_PRIMES and raw["offsets"] == SMALL_OFFSETS
    assert raw["multipliers"] == [hash_multipliers(L, 5, 3) for L in (0, 1)]
    assert load_or_create_layout(path, config, TOKEN_MAP) == created
    assert created.table_rows == SMALL_ROWS


def test_layout_multipliers_come_from_the_file(tmp_path):
    path = tmp_path / "engram_layout.json"
    config = small_config()
    frozen = dataclasses.replace(compute_layout(config, TOKEN_MAP), multipliers=((1, 3, 5), (7, 9, 3)))
    path.write_text(json.dumps(frozen.to_json()))
    assert load_or_create_layout(path, config, TOKEN_MAP).multipliers == ((1, 3, 5), (7, 9, 3))


def edited(path, field, edit):
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "field, edit",
    [
        ("multipliers", lambda r: r["multipliers"][0].__setitem__(1, r["multipliers"][0][1] + 2)),
        ("multipliers", lambda r: r["multipliers"][1].__setitem__(0, 4)),  # even
        ("multipliers", lambda r: r["multipliers"][1].pop()),
        ("primes", lambda r: r["primes"][0][1].__setitem__(0, 23)),
        ("offsets", lambda r: r["offsets"][1].__setitem__(2, 53)),
        ("vocab_size", lambda r: r.__setitem__("vocab_size", 11)),
        ("layer_ids", lambda r: r.__setitem__("layer_ids", [0, 2])),
        ("token_map_sha256", lambda r: r.__setitem__("token_map_sha256", "0" * 64)),
        ("format", lambda r: r.__setitem__("version", 2)),
    ],
)
def test_layout_file_edits_are_caught(tmp_path, field, edit):
    path = tmp_path / "engram_layout.json"
    load_or_create_layout(path, small_config(), TOKEN_MAP)
    edited(path, field, edit)
    with pytest.raises(ValueError, match=field):
        load_or_create_layout(path, small_config(), TOKEN_MAP)


def test_layout_config_mismatches(tmp_path):
    path = tmp_path / "engram_layout.json"
    load_or_create_layout(path, small_config(), TOKEN_MAP)
    with pytest.raises(ValueError, match="n_heads"):
        # three heads need other table rows in the config, so fix those up to reach the field check
        # (H = 3: layer 0 takes 11 13 17 | 19 23 29, layer 1 takes 31 37 41 | 43 47 53)
        rows = [11 + 13 + 17 + 19 + 23 + 29, 31 + 37 + 41 + 43 + 47 + 53]
        three = small_config(engram_n_heads=3, engram_num_embeddings=rows)
        load_or_create_layout(path, three, TOKEN_MAP)
    with pytest.raises(ValueError, match="token_map_sha256"):
        load_or_create_layout(path, small_config(), [3, 0, 4, 1, 2, 1])  # same count, other map


@pytest.mark.parametrize("exists", [False, True])
def test_layout_compressed_vocab_mismatch(tmp_path, exists):
    path = tmp_path / "engram_layout.json"
    if exists:
        load_or_create_layout(path, small_config(), TOKEN_MAP)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        load_or_create_layout(path, small_config(engram_compressed_vocab_size=6), TOKEN_MAP)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        load_or_create_layout(path, small_config(), [0, 1, 2, 3, 0, 1])  # only 4 compressed ids


def test_layout_table_rows_mismatch(tmp_path):
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        load_or_create_layout(tmp_path / "l.json", small_config(engram_num_embeddings=[60, 121]), TOKEN_MAP)


# ----------------------------------------------------------------------------- compressed token map
def byte_level(text: str) -> str:
    """GPT-2's byte -> printable character table applied to text's UTF-8 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode())


def tiny_byte_level_tokenizer() -> Tokenizer:
    tokens = [
        byte_level("The"),  # 0
        byte_level("the"),  # 1
        byte_level(" THE"),  # 2
        byte_level(" "),  # 3
        byte_level("\t"),  # 4
        byte_level("  "),  # 5
        byte_level("\n"),  # 6
        chr(0xC3),  # 7: lone lead byte of a 2-byte sequence
        chr(0xE2),  # 8: lone lead byte of a 3-byte sequence
        byte_level("\u0301"),  # 9: combining acute accent, normalizes to ""
        byte_level("\u0300"),  # 10: combining grave accent, normalizes to ""
        byte_level("Ã"),  # 11: the whole character U+00C3
    ]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>"])  # 12
    return tok


def test_token_keys_and_map():
    tok = tiny_byte_level_tokenizer()
    keys = token_keys(tok)
    assert keys[:3] == ["the"] * 3
    assert keys[3:7] == [" "] * 4  # the sentinel keeps whitespace-only tokens from becoming ""
    assert keys[7:9] == ["Ã", "â"]  # partial UTF-8: keyed by the raw token string
    assert keys[9:11] == ["\u0301", "\u0300"]  # normalize to "": keyed by their own text
    assert keys[11] == "a" and keys[12] == "<pad>"
    lookup, count = compressed_token_map(tok)
    assert lookup == [0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 5, 6, 7]
    assert count == 8


def test_token_map_accepts_transformers_fast_tokenizer():
    tok = tiny_byte_level_tokenizer()
    assert compressed_token_map(SimpleNamespace(backend_tokenizer=tok)) == compressed_token_map(tok)


# ----------------------------------------------------------------------------- the embedding table
def quantized_table(rows: int, dim: int, seed: int = 0):
    values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 3
    return quantize_fp8(values, (32,))


def table_module(q, s) -> EngramEmbedding:
    emb = EngramEmbedding(q.shape[0], q.shape[1])
    emb.weight = torch.nn.Parameter(q, requires_grad=False)
    emb.scale = torch.nn.Parameter(s, requires_grad=False)
    return emb


def test_embedding_gathers_and_dequantizes_exactly():
    q, s = quantized_table(100, 64)
    # per block of 32: value * scale, written out independently of the module
    full = (q.float().view(100, 2, 32) * s.float()[..., None]).view(100, 64)
    ids = torch.tensor([[3, 99, 0], [3, 17, 42]])
    emb = table_module(q, s)
    out = emb(ids, torch.float32)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    assert torch.equal(out, full[ids])
    assert torch.equal(emb(ids, torch.bfloat16), full[ids].to(torch.bfloat16))


class OutputSizes(TorchDispatchMode):
    """Records the element count of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_embedding_never_touches_the_whole_table():
    q, s = quantized_table(4096, 64)
    emb = table_module(q, s)
    with OutputSizes() as record:
        emb(torch.tensor([5, 4000]), torch.bfloat16)
    assert record.sizes and max(record.sizes) <= 2 * 64


@pytest.mark.parametrize("reader", ["safe_open", "load_file"])
def test_embedding_from_safetensors(tmp_path, reader):
    q, s = quantized_table(300, 32, seed=3)
    path = tmp_path / "engram.safetensors"
    save_file({"layers.1.engram.embed.weight": q, "layers.1.engram.embed.scale": s}, str(path))
    if reader == "safe_open":
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    else:
        tensors = load_file(str(path))
    emb = EngramEmbedding(300, 32)
    emb.load_state_dict({k.removeprefix("layers.1.engram.embed."): v for k, v in tensors.items()}, assign=True)
    ids = torch.tensor([299, 0, 7, 7])
    assert torch.equal(emb(ids, torch.float32), dequantize_fp8(q, s, (32,))[ids])


# ----------------------------------------------------------------------------- the Engram layer
def random_engram(config: Dsv4Config, layer_id: int = 1, seed: int = 0) -> Engram:
    gen = torch.Generator().manual_seed(seed)
    engram = Engram(config, layer_id, dtype=torch.bfloat16)
    rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer_id)]
    table = quantize_fp8(torch.randn(rows, config.engram_head_dim, generator=gen), (32,))
    wkv = torch.randn(engram.wkv.out_features, engram.wkv.in_features, generator=gen) * 0.05
    state = {
        "embed.weight": table[0],
        "embed.scale": table[1],
        "q_weight": torch.randn(config.hc_mult, config.hidden_size, generator=gen).bfloat16(),
        "k_weight": torch.randn(config.hc_mult, config.hidden_size, generator=gen).bfloat16(),
    }
    if engram.wkv.fmt == "fp8":
        state["wkv.weight"], state["wkv.scale"] = quantize_fp8(wkv, config.weight_block_size)
    else:
        state["wkv.weight"] = wkv.bfloat16()
    engram.load_state_dict(state, assign=True)
    return engram


def engram_inputs(config: Dsv4Config, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, config.hc_mult, config.hidden_size, generator=gen).bfloat16()
    hash_ids = torch.randint(0, SMALL_ROWS[1], (2, 5, 4), generator=gen)
    return h, hash_ids


def direct_engram(engram: Engram, config: Dsv4Config, h, hash_ids):
    """The Engram update recomputed from its definition with explicit normalized vectors."""
    d, hc = config.hidden_size, config.hc_mult
    table = dequantize_fp8(engram.embed.weight, engram.embed.scale, (32,))
    e = table[hash_ids].to(h.dtype).flatten(-2)
    kv = engram.wkv(e)
    key = kv[..., : hc * d].float().unflatten(-1, (hc, d))
    value = kv[..., hc * d :].float()
    hf = h.float()
    eps = config.rms_norm_eps
    h_unit = hf / torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    k_unit = key / torch.sqrt(key.pow(2).mean(-1, keepdim=True) + eps)
    w = engram.q_weight.float() * engram.k_weight.float()
    dot = (h_unit * k_unit * w).sum(-1) / math.sqrt(d)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    return (hf + gate.unsqueeze(-1) * value.unsqueeze(2)).to(h.dtype)


@pytest.mark.parametrize("quantized", [True, False])
def test_engram_forward_matches_definition(quantized):
    config = small_config() if quantized else small_config(quantization_config=None)
    engram = random_engram(config)
    assert engram.wkv.fmt == ("fp8" if quantized else "dense")
    h, hash_ids = engram_inputs(config)
    out = engram(h, hash_ids)
    assert out.shape == h.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), direct_engram(engram, config, h, hash_ids).float(), rtol=0, atol=0.02)
    assert not torch.equal(out, h)


def test_masked_tokens_pass_through_unchanged():
    config = small_config()
    engram = random_engram(config)
    h, hash_ids = engram_inputs(config)
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, True, True]])
    out = engram(h, hash_ids, mask)
    assert torch.equal(out[~mask], h[~mask])
    assert torch.equal(out[mask], engram(h, hash_ids)[mask])


def test_zero_value_weights_leave_streams_unchanged():
    config = small_config()
    engram = random_engram(config)
    # the last hidden_size rows of wkv produce the value: zero them
    engram.wkv.weight.data[-config.hidden_size :] = torch.zeros(config.hidden_size, engram.wkv.in_features).to(
        torch.float8_e4m3fn
    )
    h, hash_ids = engram_inputs(config)
    assert torch.equal(engram(h, hash_ids), h)


def test_engram_builds_on_meta_with_checkpoint_names():
    config = small_config()
    with torch.device("meta"):
        engram = Engram(config, 0, dtype=torch.bfloat16)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in engram.named_parameters()}
    assert shapes == {
        "embed.weight": ((60, 32), torch.float8_e4m3fn),
        "embed.scale": ((60, 1), torch.float8_e8m0fnu),
        # in = (N-1) * H * head_dim = 2 * 2 * 32; out = hidden * (hc + 1) = 64 * 5; blocks of 32 x 32
        "wkv.weight": ((320, 128), torch.float8_e4m3fn),
        "wkv.scale": ((10, 4), torch.float8_e8m0fnu),
        "q_weight": ((4, 64), torch.bfloat16),
        "k_weight": ((4, 64), torch.bfloat16),
    }
    assert all(p.is_meta and not p.requires_grad for p in engram.parameters())
