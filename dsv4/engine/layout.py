"""What the KV cache stores, in which format, and how many bytes that takes, from the config alone.

Three kinds of rows are stored (MODEL.md §6):
- window rows: each layer's sliding window of post-RoPE KV, a fixed ring per sequence;
- compressed entries: one per `ratio` tokens per KV source, growing with the sequence;
- index keys: one per compressed entry of every index-key owner, growing likewise.

The packed formats are the real system's, and they hold exactly what the model produces under
`quant_sim` (the model has already rounded every stored value onto them):

| kind              | V4.1-Flash                                   | V4-Flash                                    |
|-------------------|----------------------------------------------|---------------------------------------------|
| window row        | FP8 e4m3 + ue8m0 per 32: 512 + 16 = 528 B    | FP8 nope (ue8m0 per 64) + bf16 RoPE: 584 B  |
| compressed entry  | NVFP4 (e4m3 scale per 16): 256 + 32 = 288 B  | as its window row: 584 B                    |
| index key         | MXFP4 (ue8m0 per 32): 64 + 4 = 68 B          | MXFP4 after the Hadamard rotation: 68 B     |

The dense format keeps rows in the model's dtype, for a model whose values the packed formats cannot
hold exactly (quant_sim off, or V4 in fp32, whose RoPE dims are not bf16 values).

The codecs (`*Rows`) are the one place both the byte counts and the encoding live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.config import Dsv4Config
from dsv4.quant import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    pack_fp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
)

FORMATS = ("packed", "dense")
_FP32_BYTES = 4  # compressor carries are raw fp32 projections


# ----------------------------------------------------------------------------- row codecs
@dataclass(frozen=True)
class Fp8Rows:
    """V4.1 window rows: FP8 e4m3 per element, then one ue8m0 scale per `block` elements."""

    dim: int
    block: int = 32
    storage_dtype = torch.uint8

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // self.block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., row_bytes] uint8."""
        q, scale = quantize_fp8(rows, (self.block,))
        return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """[..., row_bytes] uint8 -> [..., dim] fp32."""
        q = stored[..., : self.dim].view(torch.float8_e4m3fn)
        scale = stored[..., self.dim :].view(torch.float8_e8m0fnu)
        return dequantize_fp8(q, scale, (self.block,))


@dataclass(frozen=True)
class Fp4Rows:
    """e2m1 codes two per byte, then one scale byte per block: NVFP4 (block 16, e4m3 scales; V4.1
    compressed entries) or MXFP4 (block 32, ue8m0 scales; index keys)."""

    dim: int
    nvfp4: bool
    storage_dtype = torch.uint8

    @property
    def block(self) -> int:
        return 16 if self.nvfp4 else 32

    @property
    def row_bytes(self) -> int:
        return self.dim // 2 + self.dim // self.block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        codes, scale = _quantize_nvfp4_exact(rows, self.block) if self.nvfp4 else quantize_mxfp4(rows, self.block)
        return torch.cat((codes, scale.view(torch.uint8)), dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        codes, scale = stored[..., : self.dim // 2], stored[..., self.dim // 2 :]
        if self.nvfp4:
            return dequantize_nvfp4(codes, scale.view(torch.float8_e4m3fn), self.block)
        return dequantize_mxfp4(codes, scale.view(torch.float8_e8m0fnu), self.block)


@dataclass(frozen=True)
class Fp8RopeRows:
    """V4 entries (window rows and compressed entries alike): the non-RoPE dims in FP8 e4m3, the RoPE
    dims in bf16, then one ue8m0 scale per 64 non-RoPE dims, padded to 8 bytes (448 + 128 + 7 + 1)."""

    dim: int
    rope_dim: int
    block: int = 64
    storage_dtype = torch.uint8

    @property
    def nope(self) -> int:
        return self.dim - self.rope_dim

    @property
    def scale_bytes(self) -> int:
        return -(-(self.nope // self.block) // 8) * 8

    @property
    def row_bytes(self) -> int:
        return self.nope + 2 * self.rope_dim + self.scale_bytes

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_fp8(rows[..., : self.nope], (self.block,))
        rope = rows[..., self.nope :].to(torch.bfloat16).contiguous().view(torch.uint8)  # [..., 2 * rope_dim]
        pad = rows.new_zeros(*rows.shape[:-1], self.scale_bytes - scale.shape[-1], dtype=torch.uint8)
        return torch.cat((q.view(torch.uint8), rope, scale.view(torch.uint8), pad), dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        rope_end = self.nope + 2 * self.rope_dim
        q = stored[..., : self.nope].view(torch.float8_e4m3fn)
        rope = stored[..., self.nope : rope_end].contiguous().view(torch.bfloat16)
        scale = stored[..., rope_end : rope_end + self.nope // self.block].view(torch.float8_e8m0fnu)
        return torch.cat((dequantize_fp8(q, scale, (self.block,)), rope.float()), dim=-1)


@dataclass(frozen=True)
class DenseRows:
    """Rows kept as they come, in the model's dtype."""

    dim: int
    dtype: torch.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored


RowCodec = Fp8Rows | Fp4Rows | Fp8RopeRows | DenseRows


def row_width(codec: RowCodec) -> int:
    """Elements of `storage_dtype` per stored row."""
    return codec.row_bytes // codec.storage_dtype.itemsize


def _quantize_nvfp4_exact(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_nvfp4, made exact on every value fake_quant_nvfp4 produces.

    Requantizing such values recovers their codes and scales except in one corner of the e4m3
    subnormal range, where rounding amax / 6 is coarse: a block first scaled by 2^-8 can top out at
    code 4 (value 2^-6), for which the formula picks 2^-9 and would need code 8. Blocks that do not
    round-trip are retried with twice the scale and keep it where that is exact.
    """
    x = rows.float()
    codes, scale = quantize_nvfp4(x, block)
    lossy = _nvfp4_lossy(codes, scale.float(), x, block)
    if not lossy.any():
        return codes, scale
    doubled = scale.float() * 2
    retry = pack_fp4(e2m1_encode(x.unflatten(-1, (-1, block)) / doubled.unsqueeze(-1)).flatten(-2))
    use = lossy & ~_nvfp4_lossy(retry, doubled, x, block)  # [..., K / block]
    codes = torch.where(use.repeat_interleave(block // 2, dim=-1), retry, codes)
    return codes, torch.where(use, doubled, scale.float()).to(torch.float8_e4m3fn)


def _nvfp4_lossy(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks [..., K / block] whose decoded values differ from x (bitwise: -0.0 counts)."""
    decoded = dequantize_nvfp4(codes, scale, block)
    differs = decoded.view(torch.int32) != x.view(torch.int32)
    return differs.unflatten(-1, (-1, block)).any(-1)


# ----------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class RowCodecs:
    """The codec of each stored kind; a kind's name ("window", "compressed", "index_keys") is its field."""

    window: RowCodec
    compressed: RowCodec
    index_keys: RowCodec


def row_codecs(config: Dsv4Config, format: str = "packed", dtype: torch.dtype = torch.bfloat16) -> RowCodecs:
    if format not in FORMATS:
        raise ValueError(f"KV storage format must be one of {FORMATS}, got {format!r}")
    D, Di = config.head_dim, config.index_head_dim
    if format == "dense":
        return RowCodecs(DenseRows(D, dtype), DenseRows(D, dtype), DenseRows(Di, dtype))
    keys = Fp4Rows(Di, nvfp4=False)
    if config.is_v41:
        return RowCodecs(Fp8Rows(D), Fp4Rows(D, nvfp4=True), keys)
    entry = Fp8RopeRows(D, config.qk_rope_head_dim)
    return RowCodecs(entry, entry, keys)


def storage_format(config: Dsv4Config, dtype: torch.dtype, quant_sim: bool, format: str | None = None) -> str:
    """The KV storage format for a model: `format` checked, or (None) packed wherever that is exact.

    Packed rows reproduce the model's values only when the model rounded them onto the packed
    formats itself (quant_sim) and, for V4, computed in bf16 (its entries keep RoPE dims in bf16).
    """
    problem = None
    if not quant_sim:
        problem = "the model runs with quant_sim=False, so its KV values are not on the packed FP8/FP4 grids"
    elif not config.is_v41 and dtype != torch.bfloat16:
        problem = f"V4 packed entries keep the RoPE dims in bf16, which rounds a {dtype} model's values"
    if format is None:
        return "dense" if problem else "packed"
    if format not in FORMATS:
        raise ValueError(f"KV storage format must be one of {FORMATS}, got {format!r}")
    if format == "packed" and problem:
        raise ValueError(f"packed KV storage is not exact here: {problem}; use format='dense'")
    return format


# ----------------------------------------------------------------------------- streams and bytes
@dataclass(frozen=True)
class Stream:
    """Rows that grow with the sequence: compressed entries or index keys of one source layer, one
    row per `ratio` positions (entry g belongs to position g * ratio)."""

    kind: str  # "compressed" or "index_keys"
    source: int
    ratio: int


def kv_streams(config: Dsv4Config) -> tuple[Stream, ...]:
    streams = []
    for role in config.layer_roles:
        if role.owns_compressor:
            streams.append(Stream("compressed", role.layer_id, role.compress_ratio))
        if role.owns_index_keys:
            streams.append(Stream("index_keys", role.layer_id, role.compress_ratio))
    return tuple(streams)


def _compressors(config: Dsv4Config) -> list[tuple[int, int, bool]]:
    """(ratio, head_dim, overlapping) of every compressor: the KV sources' and V4's index-key ones."""
    out = []
    for role in config.layer_roles:
        if role.owns_compressor:
            out.append((role.compress_ratio, config.head_dim, not config.is_v41 and role.compress_ratio == 4))
        if role.owns_index_keys and not config.is_v41:  # V4 CSA layers compress their own index keys
            out.append((4, config.index_head_dim, True))
    return out


def _carry_bytes(ratio: int, dim: int, overlap: bool, at_boundary: bool) -> int:
    """Largest carry of one compressor: fp32 kv and score projections (coff * dim wide) of the
    unfinished group's tokens (< ratio; none at a group boundary) plus, when groups overlap, of the
    last finished group. A ratio-1 compressor keeps nothing."""
    if ratio == 1:
        return 0
    coff = 2 if overlap else 1
    tokens = (0 if at_boundary else ratio - 1) + (ratio if overlap else 0)
    return 2 * _FP32_BYTES * coff * dim * tokens


@dataclass(frozen=True)
class CacheLayout:
    """Bytes of the KV cache of one model configuration in one storage format (see `cache_layout`).

    Fixed per sequence: a `sliding_window`-slot ring per backbone layer (the production layout; the
    cache here keeps the `sliding_window - 1` rows before the query) and the compressor carries.
    Growing: every stream's rows, `growth_bytes_per_token` on average; a pool block of `block_size`
    tokens holds `bytes_per_block(block_size)`. A prefix-cache entry adds a snapshot per block.
    """

    codecs: RowCodecs
    streams: tuple[Stream, ...]
    window_layers: int
    drafter_layers: int
    sliding_window: int
    carry_bytes: int  # largest compressor carries of a sequence (part of fixed_bytes_per_sequence)
    boundary_carry_bytes: int  # compressor carries at a block boundary (what a snapshot keeps)

    @property
    def window_slot_bytes(self) -> int:
        return self.codecs.window.row_bytes

    @property
    def global_entry_bytes(self) -> int:
        return self.codecs.compressed.row_bytes

    @property
    def index_key_bytes(self) -> int:
        return self.codecs.index_keys.row_bytes

    @property
    def fixed_bytes_per_sequence(self) -> int:
        return self.window_layers * self.sliding_window * self.window_slot_bytes + self.carry_bytes

    @property
    def drafter_fixed_bytes(self) -> int:
        return self.drafter_layers * self.sliding_window * self.window_slot_bytes

    @property
    def growth_bytes_per_token(self) -> float:
        return sum(self.row_bytes(s.kind) / s.ratio for s in self.streams)

    def row_bytes(self, kind: str) -> int:
        return getattr(self.codecs, kind).row_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one pool block; block_size must hold whole groups of every ratio."""
        bad = sorted({s.ratio for s in self.streams if block_size % s.ratio})
        if block_size <= 0 or bad:
            raise ValueError(
                f"block_size {block_size} must be a positive multiple of every compress ratio ({bad} do not divide it)"
            )
        return sum(self.row_bytes(s.kind) * (block_size // s.ratio) for s in self.streams)

    @property
    def window_snapshot_bytes(self) -> int:
        """The windows a sequence holds at a block boundary (the rows before the next query)."""
        return self.window_layers * (self.sliding_window - 1) * self.window_slot_bytes

    def snapshot_bytes(self, swa_bounded_replay: bool) -> int:
        """Per cached block, besides the block: carries, plus the windows unless replay rebuilds them."""
        return self.boundary_carry_bytes + (0 if swa_bounded_replay else self.window_snapshot_bytes)


def cache_layout(config: Dsv4Config, format: str = "packed", dtype: torch.dtype = torch.bfloat16) -> CacheLayout:
    """The KV cache layout of `config` (packed by default; `dtype` matters only to the dense format).

    Released V4.1-Flash: 528 B window slots, 288 B global entries, 68 B index keys, 890 B/token.
    Released V4-Flash: 584 B slots and entries, 68 B index keys, 3514.25 B/token.
    """
    compressors = _compressors(config)
    return CacheLayout(
        codecs=row_codecs(config, format, dtype),
        streams=kv_streams(config),
        window_layers=config.num_hidden_layers,
        drafter_layers=config.num_nextn_predict_layers if config.has_drafter else 0,
        sliding_window=config.sliding_window,
        carry_bytes=sum(_carry_bytes(*c, at_boundary=False) for c in compressors),
        boundary_carry_bytes=sum(_carry_bytes(*c, at_boundary=True) for c in compressors),
    )
