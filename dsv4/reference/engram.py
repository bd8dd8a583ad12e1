"""Engram: a hashed n-gram lookup added to the residual stream before some V4.1 layers.

Each token's last 2..N (normalized) token ids are hashed, per n-gram size and per hash head, into a
bucket of a huge FP8 table; the gathered rows are projected to a key per residual stream and one shared
value, and a scalar gate per stream (key against the stream itself) decides how much value to add.

The pieces, in pipeline order:
  * `compressed_token_map`: tokenizer ids -> ids of a normalized token space (case, accents and
    whitespace folded), so "The" and " the" hash alike.
  * `EngramLayout`: the frozen hashing constants (multipliers, primes, row offsets), kept in a JSON file
    by `load_or_create_layout`; the primes are pure arithmetic and re-derived on every load, the
    multipliers come from numpy's generator once and are then read from the file.
  * `EngramHasher.hash_ids`: token ids -> table row ids, [B, S, n_engram_layers, (N-1) * H].
  * `EngramEmbedding`: gathers and dequantizes only the requested rows of one table.
  * `Engram`: the gated update of one layer's residual streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dsv4.config import Dsv4Config
from dsv4.quant import dequantize_fp8
from dsv4.reference.linear import Linear

# Conventional name of the layout file, next to the checkpoint it describes.
LAYOUT_FILENAME = "engram_layout.json"
LAYOUT_FORMAT = "dsv4.engram_layout"
LAYOUT_VERSION = 1
# Rows of the Engram tables carry one ue8m0 scale per 32 values.
SCALE_BLOCK = 32
# Compressed id of a token that hashes as nothing (an image token): it blocks every look-back.
DEAD = -1
_INT64_MAX = 2**63 - 1
# Deterministic Miller-Rabin witnesses: correct for every n < 3.3e24, hence for all 64-bit integers.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


# ----------------------------------------------------------------------------- compressed token map
def engram_normalizer():
    """The normalizer that folds tokens into the compressed space.

    The sentinel U+E000 protects a whitespace-only token: it becomes one space instead of being
    stripped to "", so all whitespace tokens share one compressed id apart from the empty ones.
    """
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(),
            normalizers.Replace("\ue000", " "),
        ]
    )


def token_keys(tokenizer) -> list[str]:
    """The compressed-space key of every token id (added tokens included).

    `tokenizer` is a `tokenizers.Tokenizer` or a transformers fast tokenizer (its backend is used).
    A token decoding to U+FFFD is a partial UTF-8 sequence: its text says nothing, so its raw token
    string is the key. A token normalizing to "" keeps its own text, so such tokens do not merge.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    normalizer = engram_normalizer()
    keys = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            keys.append(backend.id_to_token(token_id))
        else:
            keys.append(normalizer.normalize_str(text) or text)
    return keys


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> compressed id (equal keys share one, numbered by first appearance), and the count."""
    first_id: dict[str, int] = {}
    lookup = [first_id.setdefault(key, len(first_id)) for key in token_keys(tokenizer)]
    return lookup, len(first_id)


def token_map_sha256(token_map: Sequence[int]) -> str:
    """Digest of a token map (as little-endian int64), recorded in the layout file."""
    return hashlib.sha256(np.asarray(token_map, dtype="<i8").tobytes()).hexdigest()


def count_compressed_ids(token_map: Sequence[int]) -> int:
    """Distinct compressed ids, DEAD markers excluded."""
    return len({int(c) for c in token_map if c != DEAD})


# ----------------------------------------------------------------------------- hashing constants
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality for any n < 2**64."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    return all(_passes_round(n, a, d, s) for a in _MR_BASES)


def _passes_round(n: int, a: int, d: int, s: int) -> bool:
    """One Miller-Rabin round: True when witness a does not prove n = d * 2**s + 1 composite."""
    x = pow(a, d, n)
    if x in (1, n - 1):
        return True
    for _ in range(s - 1):
        x = x * x % n
        if x == n - 1:
            return True
    return False


def _next_unused_prime(above: int, used: set[int]) -> int:
    candidate = above + 1
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def engram_primes(n_layers: int, vocab_size: int, max_ngram: int, n_heads: int) -> list[list[list[int]]]:
    """Bucket counts [n_layers][max_ngram - 1][n_heads].

    Every (layer, n-gram size) restarts its search just above vocab_size - 1, and no prime is used
    twice anywhere, so each head of each table hashes modulo its own prime.
    """
    used: set[int] = set()
    primes = []
    for _ in range(n_layers):
        layer = []
        for _ in range(2, max_ngram + 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current = _next_unused_prime(current, used)
                used.add(current)
                heads.append(current)
            layer.append(heads)
        primes.append(layer)
    return primes


def row_offsets(layer_primes: Sequence[Sequence[int]]) -> list[int]:
    """First table row of each (n, head) bucket range: exclusive cumulative sum of the primes."""
    flat = [p for heads in layer_primes for p in heads]
    return [sum(flat[:i]) for i in range(len(flat))]


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Every multiplier stays below this, so compressed id * multiplier fits in int64."""
    return _INT64_MAX // compressed_vocab_size


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> list[int]:
    """Odd per-shift multipliers of one layer, drawn from numpy's generator seeded by the layer id."""
    high = max(1, multiplier_bound(compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(low=0, high=high, size=(max_ngram,), dtype=np.int64)
    return [int(x) * 2 + 1 for x in draws]


def _multipliers_sha256(multipliers: Sequence[Sequence[int]]) -> str:
    """Integrity digest of the multipliers: they cannot be re-derived on load, so edits must show."""
    return hashlib.sha256(json.dumps([list(m) for m in multipliers]).encode()).hexdigest()


# ----------------------------------------------------------------------------- the layout file
@dataclass(frozen=True)
class EngramLayout:
    """Frozen hashing constants of every Engram layer of a model.

    multipliers [n_layers][N], primes [n_layers][N-1][H], offsets [n_layers][(N-1)*H] (column order
    (n, head)); the rows of layer i's table are sum(primes[i]).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    vocab_size: int
    compressed_vocab_size: int
    pad_id: int
    token_map_sha256: str
    multipliers: tuple[tuple[int, ...], ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @property
    def table_rows(self) -> list[int]:
        return [sum(sum(heads) for heads in layer) for layer in self.primes]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["multipliers_sha256"] = _multipliers_sha256(self.multipliers)
        return {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, **d}


def _config_fields(config: Dsv4Config) -> dict:
    """The layout fields a config fixes."""
    return {
        "layer_ids": tuple(config.engram_layer_ids),
        "max_ngram_size": config.engram_max_ngram_size,
        "n_heads": config.engram_n_heads,
        "vocab_size": config.engram_vocab_size,
        "compressed_vocab_size": config.engram_compressed_vocab_size,
        "pad_id": config.engram_pad_id,
    }


def _arithmetic_fields(config: Dsv4Config) -> dict:
    """Primes and offsets: pure functions of the config, recomputed on every load."""
    primes = engram_primes(
        len(config.engram_layer_ids), config.engram_vocab_size, config.engram_max_ngram_size, config.engram_n_heads
    )
    return {
        "primes": _freeze(primes),
        "offsets": _freeze([row_offsets(layer) for layer in primes]),
    }


def _freeze(nested):
    """Nested lists (as JSON gives them) -> nested tuples, so layouts compare and hash by value."""
    return tuple(_freeze(x) for x in nested) if isinstance(nested, (list, tuple)) else nested


def compute_layout(config: Dsv4Config, token_map: Sequence[int]) -> EngramLayout:
    """A fresh layout; the only place numpy's generator is consulted."""
    _check_token_map(config, token_map)
    arithmetic = _arithmetic_fields(config)
    _check_table_rows(config, arithmetic["primes"])
    multipliers = [
        hash_multipliers(layer_id, config.engram_compressed_vocab_size, config.engram_max_ngram_size)
        for layer_id in config.engram_layer_ids
    ]
    return EngramLayout(
        **_config_fields(config),
        token_map_sha256=token_map_sha256(token_map),
        multipliers=_freeze(multipliers),
        **arithmetic,
    )


def load_or_create_layout(path: str | Path, config: Dsv4Config, token_map: Sequence[int]) -> EngramLayout:
    """Read the layout file at `path`, or compute and write it when absent.

    Keep it next to the checkpoint (conventionally `<model dir>/LAYOUT_FILENAME`), so the hash a
    table was trained with travels with the table.

    An existing file must agree with the config, the token map and the re-derived primes and
    offsets; its multipliers are taken as given (numpy's stream may change across versions) but
    checked for oddness, range and their recorded digest. Raises ValueError naming the first
    mismatching field.
    """
    path = Path(path)
    if not path.exists():
        layout = compute_layout(config, token_map)
        _write_json_atomically(path, layout.to_json())
        return layout
    _check_token_map(config, token_map)
    arithmetic = _arithmetic_fields(config)
    _check_table_rows(config, arithmetic["primes"])
    raw = json.loads(path.read_text())
    _check_header(path, raw)
    expected = {**_config_fields(config), "token_map_sha256": token_map_sha256(token_map), **arithmetic}
    for name, value in expected.items():
        if _freeze(raw.get(name)) != value:
            raise ValueError(f"engram layout {path}: field {name} is {raw.get(name)!r}, expected {value!r}")
    multipliers = _freeze(raw.get("multipliers"))
    _check_multipliers(path, raw, multipliers, config)
    return EngramLayout(**expected, multipliers=multipliers)


def _check_token_map(config: Dsv4Config, token_map: Sequence[int]) -> None:
    n = count_compressed_ids(token_map)
    if n != config.engram_compressed_vocab_size:
        raise ValueError(
            f"the token map has {n} compressed ids but config field engram_compressed_vocab_size is "
            f"{config.engram_compressed_vocab_size}: the tokenizer does not belong to this model"
        )
    if not 0 <= config.engram_pad_id < len(token_map):
        raise ValueError(f"config field engram_pad_id {config.engram_pad_id} is outside the token map")


def _check_table_rows(config: Dsv4Config, primes) -> None:
    """The tables must have exactly the rows the hash can address, or row ids would miss or overrun."""
    rows = [sum(sum(heads) for heads in layer) for layer in primes]
    if rows != list(config.engram_num_embeddings):
        raise ValueError(
            f"config field engram_num_embeddings is {config.engram_num_embeddings}, but the engram "
            f"hash constants give tables of {rows} rows"
        )


def _check_header(path: Path, raw: dict) -> None:
    if raw.get("format") != LAYOUT_FORMAT or raw.get("version") != LAYOUT_VERSION:
        raise ValueError(
            f"engram layout {path}: field format/version is {raw.get('format')!r}/{raw.get('version')!r}, "
            f"expected {LAYOUT_FORMAT!r}/{LAYOUT_VERSION}"
        )


def _check_multipliers(path: Path, raw: dict, multipliers, config: Dsv4Config) -> None:
    bound = multiplier_bound(config.engram_compressed_vocab_size)
    shape_ok = (
        isinstance(multipliers, tuple)
        and len(multipliers) == len(config.engram_layer_ids)
        and all(isinstance(m, tuple) and len(m) == config.engram_max_ngram_size for m in multipliers)
    )
    values_ok = shape_ok and all(
        isinstance(x, int) and 0 < x < bound and x % 2 == 1 for m in multipliers for x in m
    )
    if not values_ok:
        raise ValueError(
            f"engram layout {path}: field multipliers must be [n_layers][max_ngram_size] odd ints in "
            f"(0, {bound}), got {raw.get('multipliers')!r}"
        )
    if raw.get("multipliers_sha256") != _multipliers_sha256(multipliers):
        raise ValueError(f"engram layout {path}: field multipliers does not match its multipliers_sha256")


def _write_json_atomically(path: Path, payload: dict) -> None:
    """Write via a temporary file and rename, so a concurrent reader never sees half a layout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- hashing
def ngram_tokens(compressed: torch.Tensor, start: int, max_ngram: int, pad: int) -> torch.Tensor:
    """Look-back windows of the positions start..T-1: [B, T] -> [B, T - start, max_ngram].

    Column `shift` holds the compressed id at position p - shift. A look-back before the sequence
    start or onto a DEAD token turns that slot and every further one into `pad`: an n-gram never
    reaches across an image span.
    """
    positions = torch.arange(start, compressed.shape[1], device=compressed.device)  # [S]
    shifts = torch.arange(max_ngram, device=compressed.device)  # [N]
    source = positions[:, None] - shifts[None, :]  # [S, N]
    window = compressed[:, source.clamp_min(0)]  # [B, S, N]
    reachable = (source >= 0) & (window != DEAD)  # [B, S, N]
    alive = reachable.long().cumprod(-1).bool()  # [B, S, N]
    return torch.where(alive, window, torch.full_like(window, pad))


def engram_hash_ids(
    compressed: torch.Tensor,
    start: int,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
) -> torch.Tensor:
    """Table rows of the positions start..T-1 from the full compressed history.

    compressed [B, T] int64 (DEAD = -1); multipliers [L, N]; primes [L, N-1, H]; offsets [L, (N-1)*H]
    -> [B, T - start, L, (N-1)*H] int64, columns in (n, head) order.
    The multipliers are bounded so every product fits in int64; XOR keeps the hash non-negative.
    """
    max_ngram = multipliers.shape[1]
    tokens = ngram_tokens(compressed, start, max_ngram, pad)  # [B, S, N]
    terms = tokens[:, :, None, :] * multipliers  # [B, S, L, N]
    rolling, hashes = terms[..., 0], []
    for n in range(1, max_ngram):
        rolling = rolling ^ terms[..., n]  # hash of the (n + 1)-gram, [B, S, L]
        hashes.append(rolling)
    per_ngram = torch.stack(hashes, dim=-1)  # [B, S, L, N-1]
    buckets = torch.remainder(per_ngram[..., None], primes)  # [B, S, L, N-1, H]
    return buckets.flatten(-2) + offsets  # [B, S, L, (N-1)*H]


class EngramHasher(nn.Module):
    """Token ids -> Engram table rows for every Engram layer; no parameters, no checkpoint keys.

    The constants are non-persistent buffers so `.to(device)` moves them and state dicts ignore them.
    """

    def __init__(self, layout: EngramLayout, token_map: Sequence[int]):
        super().__init__()
        if token_map_sha256(token_map) != layout.token_map_sha256:
            raise ValueError("the token map does not match the engram layout's token_map_sha256")
        self.register_buffer("token_map", torch.tensor(list(token_map), dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.tensor(layout.multipliers, dtype=torch.int64), persistent=False)
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(layout.offsets, dtype=torch.int64), persistent=False)
        self.pad = int(token_map[layout.pad_id])

    def compress(self, ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> compressed ids [B, T], DEAD where token_mask is False."""
        compressed = self.token_map[ids]
        if token_mask is None:
            return compressed
        return compressed.masked_fill(~token_mask, DEAD)

    def hash_ids(
        self, ids_history: torch.Tensor, start: int, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows for positions start..T-1 of ids_history [B, T] -> [B, T - start, n_layers, (N-1)*H].

        Prefill passes start=0; incremental decode passes the history it has (at least the last N-1
        tokens before `start` are needed) and the index of the first new token.
        """
        compressed = self.compress(ids_history, token_mask)  # [B, T]
        return engram_hash_ids(compressed, start, self.multipliers, self.primes, self.offsets, self.pad)


# ----------------------------------------------------------------------------- the layer
class EngramEmbedding(nn.Module):
    """One FP8 Engram table: e4m3 rows with one ue8m0 scale per 32 values.

    Only requested rows are ever read: the released tables are ~98 GB and arrive memory-mapped.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        if embedding_dim % SCALE_BLOCK:
            raise ValueError(f"engram_head_dim {embedding_dim} is not a multiple of {SCALE_BLOCK}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=torch.float8_e4m3fn), False)
        self.scale = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim // SCALE_BLOCK, dtype=torch.float8_e8m0fnu), False
        )

    def forward(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """row_ids [...] -> dequantized rows [..., embedding_dim] in `dtype`, on row_ids' device.

        The gather runs where the table lives (a table too large for the accelerator may stay in
        host memory) and only the gathered rows travel.
        """
        flat = row_ids.reshape(-1).to(self.weight.device)  # [R]
        values = self.weight.index_select(0, flat)  # [R, dim]
        scales = self.scale.index_select(0, flat)  # [R, dim / 32]
        rows = dequantize_fp8(values, scales, (SCALE_BLOCK,))  # [R, dim] fp32
        return rows.to(device=row_ids.device, dtype=dtype).view(*row_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _wkv_storage(config: Dsv4Config, dtype: torch.dtype | None) -> dict:
    """Linear storage arguments of `wkv`: FP8 blocks in a quantized checkpoint, else the model dtype."""
    if config.quantization_config:
        return {"fmt": "fp8", "block": config.weight_block_size}
    return {"fmt": "dense", "dtype": dtype}


class Engram(nn.Module):
    """The Engram update of one layer's residual streams h [B, S, hc, D].

    The looked-up rows give one key per stream and a shared value; each stream adds the value scaled
    by a sigmoid gate on the (normalized) agreement between itself and its key.
    """

    def __init__(self, config: Dsv4Config, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        index = config.engram_layer_ids.index(layer_id)
        self.hc, self.dim, self.eps = config.hc_mult, config.hidden_size, config.rms_norm_eps
        n_columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.embed = EngramEmbedding(config.engram_num_embeddings[index], config.engram_head_dim)
        self.wkv = Linear(
            n_columns * config.engram_head_dim,
            self.dim * (self.hc + 1),
            act_block=config.act_block_size,
            **_wkv_storage(config, dtype),
        )
        self.q_weight = nn.Parameter(torch.empty(self.hc, self.dim, dtype=dtype), False)
        self.k_weight = nn.Parameter(torch.empty(self.hc, self.dim, dtype=dtype), False)

    def gate(self, hf: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Per-stream gate from fp32 streams and keys [B, S, hc, D] -> [B, S, hc].

        The dot of the two RMS-normalized vectors is signed-square-rooted to tame its range before
        the sigmoid; q_weight and k_weight only ever act through their product.
        """
        w = self.q_weight.float() * self.k_weight.float()  # [hc, D]
        rstd = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (hf * w * key).sum(-1) * rstd * self.dim**-0.5  # [B, S, hc]
        return torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))

    def forward(
        self, h: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h [B, S, hc, D], hash_ids [B, S, (N-1)*H] (this layer's rows), token_mask [B, S] -> h'."""
        return self.mix(h, self.embed(hash_ids, h.dtype), token_mask)

    def mix(self, h: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, S, hc, D] and the looked-up rows [B, S, (N-1)*H, head_dim] (in h's dtype) -> h'."""
        b, s = h.shape[:2]
        e = rows.flatten(-2)  # [B, S, (N-1)*H*head_dim]
        key, value = self.wkv(e).split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().view(b, s, self.hc, self.dim)  # [B, S, hc, D]
        hf = h.float()
        gate = self.gate(hf, key)  # [B, S, hc]
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask[..., None], 0.0)
        return (hf + gate[..., None] * value.float()[:, :, None, :]).to(h.dtype)
