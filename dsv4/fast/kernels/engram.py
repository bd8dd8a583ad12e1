"""Engram kernels: the n-gram hash, and the gather + dequantization of table rows.

`dsv4::engram_hash(compressed, start, multipliers, primes, offsets, pad) -> row ids`
    compressed [B, T] int64 (DEAD = -1), multipliers [L, N], primes [L, N-1, H], offsets [L, (N-1)*H]
    -> [B, T - start, L, (N-1)*H] int64, columns in (n, head) order. Exactly equal to the twin
    `dsv4.reference.engram.engram_hash_ids` (integer work only: int64 multiply with two's-complement
    wrap, XOR, modulo made non-negative, + offset). One program per (batch row, tile of positions,
    Engram layer); each position loads its N look-backs (N <= 8), applies the padding rule (before the
    sequence start or at a DEAD token: that slot and every further one become `pad`) and rolls the hash.
    Custom op with a fake; off CUDA and outside the interpreter it computes with the twin.

`engram_gather(table, ids, out=None, dtype=bf16) -> rows [..., 256]` (one table; `gather_args` /
`launch_gather` serve up to MAX_TABLES tables in one launch, as the prefetcher does)
    table: uint8 [rows, 264] (256 e4m3 bytes then 8 e8m0 scale bytes per row, see
    `dsv4.fast.engram_prefetch.HostEngramTable`), ids int64 [...]. The Triton kernel reads the rows
    straight from wherever the table lives: device memory, or pinned host memory through unified
    addressing (the GPU issues the PCIe reads itself, so the ids never visit the host). Each row is
    read as 66 int32 words; e4m3 bytes are decoded with integer ops into fp32, times the power-of-two
    scale, then rounded to bf16 (round to nearest even, done on the bit pattern). Twin:
    `EngramEmbedding.forward` (`dequantize_fp8(...).to(dtype)`), which `engram_gather_twin` repeats
    on the same packed table. Not a custom op: it runs eagerly, on the prefetch side stream (outside
    compiled regions, as vLLM does, behind an eager break) and in the module path's Engram layers over
    host-resident tables (`HostEngramEmbedding`).
"""

from __future__ import annotations

import os

import torch

from dsv4.fast.kernels import tl, triton, use_triton
from dsv4.reference.engram import SCALE_BLOCK, engram_hash_ids

ROW_VALUES = 256  # engram_head_dim of V4.1: e4m3 bytes per row
ROW_SCALES = ROW_VALUES // SCALE_BLOCK  # e8m0 bytes per row
ROW_BYTES = ROW_VALUES + ROW_SCALES  # 264
_WORDS = ROW_BYTES // 4  # 66 int32 words per row
MAX_NGRAM = 8
_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------
# Hash


@triton.jit
def _hash_kernel(
    comp_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr,
    T, S, start, pad, stride_cb, stride_ct, L,
    N: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    layer = tl.program_id(2)
    s = tile * BS + tl.arange(0, BS)  # [BS] output positions
    s_ok = s < S
    pos = (s + start).to(tl.int64)
    cols = tl.arange(0, CP)  # [CP] (n, head) columns
    c_ok = cols < C
    col_n = cols // H  # n-gram index - 2: column group of the (n+2)-gram
    row = comp_ptr + b.to(tl.int64) * stride_cb

    alive = s_ok
    rolling = tl.zeros([BS], dtype=tl.int64)
    acc = tl.zeros([BS, CP], dtype=tl.int64)
    for k in tl.static_range(N):
        src = pos - k
        reach = alive & (src >= 0)
        tok = tl.load(row + tl.where(reach, src, 0) * stride_ct, mask=reach, other=-1)
        alive = reach & (tok != -1)
        tok = tl.where(alive, tok, pad)
        term = tok * tl.load(mult_ptr + layer * N + k)  # int64, wraps like torch
        if k == 0:
            rolling = term
        else:
            rolling = rolling ^ term
            acc = tl.where((col_n == k - 1)[None, :], rolling[:, None], acc)

    prime = tl.load(prime_ptr + layer * C + cols, mask=c_ok, other=1)  # [CP]
    off = tl.load(off_ptr + layer * C + cols, mask=c_ok, other=0)
    rem = acc % prime[None, :]
    rem = tl.where(rem < 0, rem + prime[None, :], rem)  # torch.remainder: sign of the (positive) divisor
    dst = ((b * S + s).to(tl.int64) * L + layer)[:, None] * C + cols[None, :]
    tl.store(out_ptr + dst, rem + off[None, :], mask=s_ok[:, None] & c_ok[None, :])


def _hash_shapes(compressed, start, multipliers, primes):
    B, T = compressed.shape
    L, N = multipliers.shape
    H = primes.shape[-1]
    return B, T, max(T - start, 0), L, N, H, (N - 1) * H


def engram_hash_triton(compressed, start, multipliers, primes, offsets, pad):
    B, T, S, L, N, H, C = _hash_shapes(compressed, start, multipliers, primes)
    out = torch.empty(B, S, L, C, dtype=torch.int64, device=compressed.device)
    if out.numel() == 0:
        return out
    mult = multipliers.to(torch.int64).contiguous()
    prime = primes.to(torch.int64).contiguous()
    off = offsets.to(torch.int64).contiguous()
    BS = 64 if _INTERP else 128
    BS = min(BS, triton.next_power_of_2(S))
    grid = (B, triton.cdiv(S, BS), L)
    _hash_kernel[grid](
        compressed, mult, prime, off, out, T, S, start, pad, compressed.stride(0), compressed.stride(1), L,
        N=N, C=C, CP=triton.next_power_of_2(C), H=H, BS=BS, num_warps=4,
    )
    return out


def _hash_supported(compressed, multipliers) -> bool:
    return compressed.dtype == torch.int64 and 2 <= multipliers.shape[1] <= MAX_NGRAM


@torch.library.custom_op("dsv4::engram_hash", mutates_args=())
def engram_hash(
    compressed: torch.Tensor,
    start: int,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
) -> torch.Tensor:
    """compressed [B, T] int64 -> table rows of positions start..T-1, [B, T-start, L, (N-1)*H] int64."""
    if use_triton(compressed) and _hash_supported(compressed, multipliers):
        return engram_hash_triton(compressed, start, multipliers, primes, offsets, pad)
    return engram_hash_ids(compressed, start, multipliers, primes, offsets, pad).contiguous()


@engram_hash.register_fake
def _(compressed, start, multipliers, primes, offsets, pad):
    B, _, S, L, _, _, C = _hash_shapes(compressed, start, multipliers, primes)
    return compressed.new_empty(B, S, L, C, dtype=torch.int64)


# ------------------------------------------------------------------------------------------------
# Gather + dequantize


@triton.jit
def _e4m3_to_f32(byte):
    """e4m3fn byte (int32 0..255) -> fp32, with integer ops only (exact; 0x7f/0xff are NaN).

    The sign goes in as bit 31: a float negation would lose it for zero on Triton < 3.9, which compiles
    `-x` as `0 - x` (so code 0x80, -0.0, would come out +0.0)."""
    sign = (byte >> 7) & 1
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    normal = ((exp + 120) << 23) | (man << 20)  # rebias 7 -> 127
    sub = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # subnormal: man * 2^-9 (exact)
    bits = tl.where(exp == 0, sub, normal)
    bits = tl.where((exp == 15) & (man == 7), 0x7FC00000, bits)
    return (bits | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_f32(byte):
    """e8m0 byte -> 2^(byte - 127) in fp32 (0 -> 2^-127, 255 -> NaN), as torch converts it."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    bits = tl.where(byte == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


MAX_TABLES = 4  # tables served by one launch


@triton.jit(do_not_specialize=["R"])
def _gather_kernel(
    t0, t1, t2, t3, n0, n1, n2, n3, ids_ptr, out_ptr,
    R, ids_group, ids_stride_g, ids_stride_l, out_stride_l,
    NL: tl.constexpr, BR: tl.constexpr, BF16: tl.constexpr,
):
    # t0..t3: int32 words [rows, 66] of up to four tables (NL used), n0..n3 their row counts.
    # Table l's row r: id at ids_ptr + l * ids_stride_l + (r // ids_group) * ids_stride_g + r % ids_group,
    # output at out_ptr + l * out_stride_l + r * 256. One launch covers every table (R rows each).
    # A persistent grid: program p handles row blocks p, p + P, ... of all tables (few programs leave the
    # SMs to the main stream; each keeps BR rows of PCIe reads in flight).
    g = tl.arange(0, 8)  # scale group: 32 values
    w = tl.arange(0, 8)  # word in group: 4 values
    j = tl.arange(0, 4)  # byte in word
    e = tl.arange(0, 256)
    nblk = tl.cdiv(R, BR)
    for blk in range(tl.program_id(0), NL * nblk, tl.num_programs(0)):
        layer = blk // nblk
        table = t0
        n_rows = n0
        if NL > 1:  # noqa: SIM102 (a compile-time guard around a run-time branch)
            if layer == 1:
                table = t1
                n_rows = n1
        if NL > 2:  # noqa: SIM102 (a compile-time guard around a run-time branch)
            if layer == 2:
                table = t2
                n_rows = n2
        if NL > 3:  # noqa: SIM102 (a compile-time guard around a run-time branch)
            if layer == 3:
                table = t3
                n_rows = n3
        r = (blk - layer * nblk) * BR + tl.arange(0, BR)  # [BR]
        r_ok = r < R
        r64 = r.to(tl.int64)
        l64 = layer.to(tl.int64)
        rid = tl.load(ids_ptr + l64 * ids_stride_l + (r64 // ids_group) * ids_stride_g + r64 % ids_group,
                      mask=r_ok, other=0)
        ok = r_ok & (rid >= 0) & (rid < n_rows)  # an id off the table reads nothing (rows of zeros)
        base = table + tl.where(ok, rid, 0) * 66  # int64 word offsets
        words = tl.load(base[:, None, None] + (g * 8)[None, :, None] + w[None, None, :],
                        mask=ok[:, None, None], other=0)  # [BR, 8, 8]
        sw = tl.load(base[:, None] + 64 + g[None, :] // 4, mask=ok[:, None], other=0)  # [BR, 8]
        scale = _e8m0_to_f32((sw >> ((g % 4) * 8)[None, :]) & 0xFF)  # [BR, 8]
        byte = (words[:, :, :, None] >> (j * 8)[None, None, None, :]) & 0xFF  # [BR, 8, 8, 4]
        val = _e4m3_to_f32(byte) * scale[:, :, None, None]  # exact: a power-of-two scale keeps the sign
        val = tl.reshape(val, [BR, 256])
        dst = out_ptr + l64 * out_stride_l + r64[:, None] * 256 + e[None, :]
        if BF16:
            bits = val.to(tl.int32, bitcast=True)
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
            h = tl.where(nan, (bits >> 16) | 0x40, rounded) & 0xFFFF
            tl.store(dst, h.to(tl.int16), mask=r_ok[:, None])
        else:
            tl.store(dst, val, mask=r_ok[:, None])


def _ids_layout(ids: torch.Tensor) -> tuple[int, int]:
    """(group, stride): element r of ids (row-major) sits at (r // group) * stride + r % group.

    Covers contiguous ids and a slice of the last-but-one dimension, e.g. hash_ids[:, :, layer]."""
    if ids.is_contiguous():
        return max(ids.numel(), 1), 0
    c = ids.shape[-1]
    lead = ids.shape[:-1]
    if ids.stride(-1) == 1 and ids.dim() >= 2:
        st = ids.stride(-2)
        # the leading dims must flatten with a single stride
        ok, expect = True, st
        for d in range(ids.dim() - 2, -1, -1):
            if lead[d] != 1 and ids.stride(d) != expect:
                ok = False
                break
            expect = ids.stride(d) * lead[d]
        if ok:
            return c, st
    raise ValueError("engram_gather: ids must be contiguous or a slice hash_ids[..., layer, :]")


_SM_COUNT: dict[int, int] = {}


def default_programs(device: torch.device) -> int:
    """Gather programs on a GPU: one per multiprocessor (4 warps each, so the main stream keeps most of
    every SM); under the interpreter a handful."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


GATHER_BR = 16  # rows per block


def gather_args(tables, ids, R, group, stride_g, stride_l, out, out_stride_l):
    """The kernel's arguments (everything but the grid) for tables (<= MAX_TABLES) sharing ids/out."""
    words = [t.view(torch.int32) for t in tables]  # [rows, 66]
    nl = len(words)
    if not 1 <= nl <= MAX_TABLES:
        raise ValueError(f"engram gather: 1..{MAX_TABLES} tables per launch, got {nl}")
    pad = words + [words[0]] * (MAX_TABLES - nl)
    rows = [t.shape[0] for t in tables] + [tables[0].shape[0]] * (MAX_TABLES - nl)
    flat = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    return (*pad, *rows, ids, flat, R, group, stride_g, stride_l, out_stride_l, nl, GATHER_BR,
            out.dtype == torch.bfloat16)


def gather_grid(R: int, nl: int, programs: int) -> int:
    return max(1, min(nl * triton.cdiv(R, GATHER_BR), programs))


def launch_gather(args, grid: int):
    """JIT launch on the current stream; returns Triton's compiled kernel (None under the interpreter)."""
    return _gather_kernel[(grid,)](*args, num_warps=4)


def engram_gather_triton(
    table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, programs: int | None = None
) -> torch.Tensor:
    R = ids.numel()
    try:
        group, stride = _ids_layout(ids)
    except ValueError:
        ids = ids.contiguous()
        group, stride = _ids_layout(ids)
    if R == 0:
        return out
    programs = programs or default_programs(ids.device)
    launch_gather(gather_args([table], ids, R, group, stride, 0, out, 0), gather_grid(R, 1, programs))
    return out


def engram_gather_twin(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch gather + dequant of the packed table (EngramEmbedding.forward's sequence), on ids' device."""
    from dsv4.quant import dequantize_fp8

    flat = ids.reshape(-1).to(table.device)
    rows = table.index_select(0, flat)  # [R, 264]
    values = rows[:, :ROW_VALUES].contiguous().view(torch.float8_e4m3fn)
    scales = rows[:, ROW_VALUES:].contiguous().view(torch.float8_e8m0fnu)
    deq = dequantize_fp8(values, scales, (SCALE_BLOCK,))
    return deq.to(device=ids.device, dtype=dtype).view(*ids.shape, ROW_VALUES)


def engram_gather(
    table: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    programs: int | None = None,
) -> torch.Tensor:
    """Rows `ids` [...] of a packed table uint8 [rows, 264] -> dequantized [..., 256] on ids' device.

    `out` (contiguous, numel >= ids.numel() * 256) receives the rows when given; the result is a view
    of it. The Triton kernel runs when ids are on CUDA (the table may be pinned host memory) or under
    the interpreter; otherwise the twin. `programs` caps the kernel's (persistent) grid."""
    if table.dtype != torch.uint8 or table.dim() != 2 or table.shape[1] != ROW_BYTES:
        raise ValueError(f"engram_gather: table must be uint8 [rows, {ROW_BYTES}], got {table.dtype} {list(table.shape)}")
    dtype = out.dtype if out is not None else dtype
    shape = (*ids.shape, ROW_VALUES)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=ids.device)
    else:
        out = out.view(-1)[: ids.numel() * ROW_VALUES].view(shape)
    if use_triton(ids) and dtype in (torch.bfloat16, torch.float32):
        return engram_gather_triton(table, ids, out, programs)
    out.copy_(engram_gather_twin(table, ids, dtype))
    return out
