"""Can the batch-1 MoE GEMV get past the CUDA cores' issue rate? An MXFP4 GEMV whose multiply-adds run on the
tensor cores (`mma.sync` m16n8k16, f16 operands, fp32 accumulation) against the gather up kernel's own K loop
(`moe_experts._up_sums`) over the same bytes, at V4.1 widths.

    python bench/mma_gemv.py          # GPU: both checked against a float64 reference, then the table
    python bench/mma_gemv.py --sass   # offline (no GPU): both loops' sm_90 SASS instructions a step

Why: the gather kernels decode each int32 word of eight e2m1 codes on the CUDA cores (the integer moves, four
e4m3-pair conversions, eight f16 -> f32 widenings, eight FMAs): sm_90 SASS of the batch-1 up loop runs 1021
instructions a step for 32 words a thread (session 58), about one warp instruction per 4 bytes of weights. At four
warp instructions a clock per SM, 132 SMs and ~1.98 GHz that issues ~4.2 TB/s at best, the H200's copy rate, so
the loop is held by its issue slots (the up kernel read 99.5 MB in 34 us on the H200 in session 56: 68% of the
copy rate). Here the FMAs and widenings go to the tensor cores: what stays on the CUDA cores is the integer decode,
the e4m3-pair conversions and the loads.

How: a program of 2 warps takes 64 rows; Triton lays a [64, 16] int32 tile of words out as 4 words a thread
(`sizePerThread [1, 4]`, `threadsPerWarp [8, 4]`), so lane (g, t) holds words 4t .. 4t + 3 of a step (its 32-element
scale group t) of rows g + 8w + 16i, i = 0..3. Each word's codes become four f16x2 pairs (values e2m1 / 64, exact):
(c0, c2), (c4, c6), (c1, c3), (c5, c7). One mma takes half a word of two rows from every lane, so its 16 K positions
span the four lanes t, four scale groups; B's column n holds the activations of group n only (zero for the lanes t
!= n), so D[m, n] is row m's sum over group n, and the lanes t < 2 scale their columns 2t, 2t + 1 by their groups'
e8m0 scales in two FMAs. Activations are given as f16 pairs in that order (`b_layout`), loaded where g == t (zero
elsewhere: masked loads). The activations come as f16 numbers scaled by a power of two a 32-element group (so bf16
values of any range fit), the exponent undone with the weights' scale in the FMAs. `tests/fast/test_mma_gemv.py`
replays the lanes' arithmetic in numpy (the mma's fragment layout written out) against the reference; that Triton
hands the asm a thread's 16 words in this order only a GPU run's error tells. Offline (`--sass`, Triton 3.8): the
mma loop 327 instructions a step for 16 words a thread (20.4 a word; 337 with two chains), the gather up kernel's
1021 for 32 (31.9).
Measured (session 58, H100, `dev/mma-gemv-873265f-h100-s58.json`): right (2-3e-7 of the largest |y| against float64)
but slower: the up size 74.4 us at best (3 stages; 2 stages 86.2, K split in 2 / 4: 78.6 / 80.9) against the
CUDA-core loop's 40.7 (72% of the copy rate), the down size 39.7 (split 2) against 23.1. Splitting K (twice the
programs) did not help, so neither bytes in flight nor occupancy hold it; each program's 40 steps take ~1.9 us each,
far above the step's issue time (~330 instructions a warp) and its mma chains (two chains of 8). Not found yet. The
table since times `chains` 2 too (each row pair's 8 mma dealt between two accumulators: in the SASS ptxas runs the
step's chains one after the other, 16 dependent mma a step); what it does not try is the mma swapped for integer ops
on the same registers, which would tell the tensor pipe from the rest.
Session 59 (H100, `dev/mma-gemv-573ee1c-h100-s59.json`): half lines cost, but they are not the main cause. One tile
is 16 words, 64 bytes of a row, half its 128-byte line; `halves` 2 reads both tiles of a line in one step (96
registers, no spills): up 84.0 -> 74.9 us (chains 2: 69.9, K split 2: 69.5), down 46.6 -> 40.5; the CUDA-core loop
at BK 128 (half lines) 40.3 -> 55.2 up, 22.8 -> 27.8 down. The `alu` rows, each mma swapped for CUDA-core ops on its
registers (offline 375 instructions a step against 327; wrong sums, timing only), run nearly as slowly (up 64.7 us
against 74.9, down 40.6 against 40.5 at halves 2): the tensor pipe does not hold the loop; its loads do, or the
64-row tile. Session 60 (H100, `dev/mma-gemv-f00b22f-h100-s60.json`; `--probes` times that table again): a step's
scale words in one load 74.8 -> 64.5 us, the weights tiled 56.8, a 32-row program on tiled weights 55.7 (down 32.5);
b's tile unmasked 327 us; `alu` again about as fast as the mma. The CUDA-core loop: 40.4 us at BK 256, 35.9-37.2 at
the gather's own BK 512. So the mma form stays 1.38x slower and is dropped for the gather. The default table now
times two of its forms (`halves` 2 and its best) beside the CUDA-core loop's variants: the rows asked of the L2 1-4
steps ahead (slower: 39.1-51.6 us at BK 512) and tiled words and scales (`_tiled_words`: 35.5 at BK 512, 1-2%;
`dev/mma-gemv-cores-{ahead-51d3055,tiled-49c888b}-h100-s60.json`).
JSON: $OUT/mma_gemv.json if OUT is set, else bench/results/mma_gemv.json; `--sass` prints only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ and the repository root on sys.path: `dsv4` importable uninstalled)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4.fast.kernels.moe_experts import (  # noqa: E402
    _WORD_DOT_UNIT, _gemv_words, _group_dots, _group_exponents, _up_sums, activation_planes)

# one int32 word of eight codes (low nibble first) -> f16x2 pairs {r0..r3}: (c0, c2), (c4, c6), (c1, c3), (c5, c7),
# through e4m3 bytes as `moe_experts._WORD_DOT_PTX` makes them (value e2m1 / 64)
_DECODE = [
    "shl.b32 t, {w}, 4;", "and.b32 t, t, 0x80808080;", "shl.b32 u, {w}, 2;", "and.b32 u, u, 0x1C1C1C1C;",
    "or.b32 l, t, u;",  # codes 0, 2, 4, 6
    "and.b32 t, {w}, 0x80808080;", "shr.b32 u, {w}, 2;", "and.b32 u, u, 0x1C1C1C1C;", "or.b32 h, t, u;",  # 1, 3, 5, 7
    "mov.b32 {{x0, x1}}, l;", "mov.b32 {{x2, x3}}, h;",
    "cvt.rn.f16x2.e4m3x2 {r0}, x0;", "cvt.rn.f16x2.e4m3x2 {r1}, x1;",
    "cvt.rn.f16x2.e4m3x2 {r2}, x2;", "cvt.rn.f16x2.e4m3x2 {r3}, x3;",
]
PAIRS = ((0, 2), (4, 6), (1, 3), (5, 7))  # the codes of each f16x2 pair a word decodes to, in `_DECODE`'s order
ROWS = "PQRS"  # a lane's four rows (i = 0..3); mma 0 takes P and Q, mma 1 R and S
# operand numbers: 16 sums out, 16 sums in, 16 words, 16 scale words, 16 shifts, 16 activation exponent words (all
# one value), 16 B pairs (one each a tile element)
OUT, SUM, WORD, SCALE, SHIFT, EXP, B = 0, 16, 32, 48, 64, 80, 96


@functools.cache
def mma_step_ptx(chains: int = 1, alu: bool = False) -> str:
    """One K step of a lane (16 tile elements: rows P, Q, R, S x words 0..3): decode, 16 mma, scale, sum. Element
    (row i, word j) of the sums carries row i's running sum at j = 0 (zeros at 1..3); of B, mma (word i, half j // 2)'s
    b0 (j even) or b1 (j odd), as the kernel loads them. `chains`: accumulators a row pair, its 8 mma dealt among
    them in turn and their sums added before the scales (1: one chain of 8 dependent mma; ptxas runs the two row
    pairs' chains one after the other). `alu`: each mma swapped for integer and fp32 ops on the CUDA cores that read
    its A and B registers and write its accumulators (wrong sums, for timing only: the tensor pipe's share)."""
    ptx = ["{", ".reg .b32 t, u, l, h, s0, f0, f1, a0, a1, k;", ".reg .b16 x0, x1, x2, x3;",
           ".reg .b32 " + ", ".join(f"{r}<16>" for r in ROWS) + ";", f".reg .f32 d<{4 * chains}>, e<{4 * chains}>;"]
    for i, row in enumerate(ROWS):
        for j in range(4):
            ptx += [s.format(w=f"${WORD + 4 * i + j}", r0=f"{row}{4 * j}", r1=f"{row}{4 * j + 1}",
                             r2=f"{row}{4 * j + 2}", r3=f"{row}{4 * j + 3}") for s in _DECODE]
    for top, low, d in (("P", "Q", "d"), ("R", "S", "e")):
        for n, (j, half) in enumerate((j, half) for j in range(4) for half in range(2)):
            a = [f"{top}{4 * j + 2 * half}", f"{low}{4 * j + 2 * half}", f"{top}{4 * j + 2 * half + 1}",
                 f"{low}{4 * j + 2 * half + 1}"]
            b = [f"${B + 4 * j + 2 * half}", f"${B + 4 * j + 2 * half + 1}"]
            acc = "{" + ", ".join(f"{d}{4 * (n % chains) + q}" for q in range(4)) + "}"
            c = "{0f00000000, 0f00000000, 0f00000000, 0f00000000}" if n < chains else acc
            if alu:
                ptx += [f"xor.b32 k, {a[0] if q == 0 else 'k'}, {x};" for q, x in enumerate(a[1:] + b)]
                ptx += [f"add.f32 {x}, {y}, k;" for x, y in zip(acc[1:-1].split(", "), c[1:-1].split(", "))]
            else:
                ptx.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {acc}, {{{', '.join(a)}}}, "
                           f"{{{', '.join(b)}}}, {c};")
        ptx += [f"add.f32 {d}{q}, {d}{q}, {d}{4 * k + q};" for k in range(1, chains) for q in range(4)]
    ptx += [f"shr.b32 s0, ${EXP}, ${SHIFT};", "shl.b32 a0, s0, 23;", "and.b32 a0, a0, 0x7F800000;",
            "shl.b32 a1, s0, 15;", "and.b32 a1, a1, 0x7F800000;"]  # the activations' factors of columns 2t, 2t + 1
    for i, (d, col) in enumerate((("d", 0), ("d", 2), ("e", 0), ("e", 2))):  # rows P, Q (d) and R, S (e)
        ptx += [f"shr.b32 s0, ${SCALE + 4 * i}, ${SHIFT};",  # scale bytes 2t, 2t + 1 (0 past the word)
                "shl.b32 f0, s0, 23;", "and.b32 f0, f0, 0x7F800000;", "shl.b32 f1, s0, 15;",
                "and.b32 f1, f1, 0x7F800000;", "mul.f32 f0, f0, a0;", "mul.f32 f1, f1, a1;",
                f"fma.rn.f32 ${OUT + 4 * i}, {d}{col}, f0, ${SUM + 4 * i};",
                f"fma.rn.f32 ${OUT + 4 * i}, {d}{col + 1}, f1, ${OUT + 4 * i};"]
        ptx += [f"mov.f32 ${OUT + 4 * i + j}, 0f00000000;" for j in (1, 2, 3)]
    return "\n".join(ptx + ["}"])


_STEP_OPERANDS = tl.constexpr(",".join(["=f"] * 16 + ["f"] * 16 + ["r"] * 80))


@triton.jit
def _gemv_mma_kernel(w_ptr, s_ptr, b_ptr, e_ptr, y_ptr, R, KW, STEPS, STAGES: tl.constexpr,
                     STEP_PTX: tl.constexpr, HALVES: tl.constexpr, B_MASK: tl.constexpr = True,
                     SCALES_ONCE: tl.constexpr = False, TILED: tl.constexpr = False, BR: tl.constexpr = 64):
    """Program (row tile, K split): y[split, r] = the split's sum over K of e2m1 codes x scales x activations / 64.
    w int32 words [R, KW]; s the e8m0 scales as int32 words [R, KW / 16]; b, e `b_layout`'s pairs [KW, 4] and
    exponents (as int32 words [KW / 16]); STEP_PTX `mma_step_ptx`'s. A step reads HALVES tiles of 16 words a row
    (64 bytes; 2: a row's whole 128-byte line at once, as the CUDA-core loop at BK 256 does) and runs the PTX on
    each. Two probes of the loads' share: B_MASK False loads all of b's tile (wrong sums: timing only); SCALES_ONCE
    (HALVES 2) reads a row's two scale words of a step in one 8-byte load. TILED: w laid out as [R / BR, KW / 16,
    BR, 16] (`tiled`), a tile in one run: a warp's load takes 512 contiguous bytes, not 8 rows' 64. BR: rows a
    program, 32 a warp (BR 32: one warp, lane (g, t)'s rows g + 8i, the same four a thread)."""
    NW: tl.constexpr = 16  # words a row a tile: four scale groups
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    split = tl.program_id(1)
    per = STEPS // tl.num_programs(1)
    c = tl.arange(0, NW)
    r = tl.arange(0, BR)
    # element (row rep i = r // (BR / 4), column 4t + j) of lane group g = r % 8: pair j of word 4t + i where g == t
    b_slot = (r // (BR // 4) * 4)[:, None] + (c // 4 * 16 + c % 4)[None, :]
    b_live = (r % 8)[:, None] == (c // 4)[None, :]
    shift = (c // 4 * 16)[None, :] + tl.zeros((BR, NW), tl.int32)  # lane t: its columns' scale bytes 2t, 2t + 1
    acc = tl.zeros((BR, NW), tl.float32)
    for s in tl.range(split * per, split * per + per, num_stages=STAGES):
        for h in tl.static_range(HALVES):
            q = s * HALVES + h  # the tile's 16 words
            if TILED:
                w = tl.load(w_ptr + ((tl.program_id(0) * (KW // NW) + q) * BR + r[:, None]) * NW + c[None, :])
            else:
                w = tl.load(w_ptr + rows[:, None] * KW + q * NW + c[None, :])
            if SCALES_ONCE:
                if h == 0:
                    both = tl.load(s_ptr.to(tl.pointer_type(tl.int64)) + rows * (KW // 32) + s)
                sw = (both >> (32 * h)).to(tl.int32)
            else:
                sw = tl.load(s_ptr + rows * (KW // 16) + q)
            b = tl.load(b_ptr + q * (4 * NW) + b_slot, mask=b_live if B_MASK else None, other=0 if B_MASK else None)
            ea = tl.load(e_ptr + q) + tl.zeros((BR, NW), tl.int32)
            acc = tl.inline_asm_elementwise(STEP_PTX, _STEP_OPERANDS,
                                            [acc, w, sw[:, None] + tl.zeros((BR, NW), tl.int32), shift, ea, b],
                                            dtype=tl.float32, is_pure=True, pack=16)
    tl.store(y_ptr + split * R + rows, tl.sum(acc, axis=1))


def b_layout(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations a [K] (bf16 numbers) -> (pairs [K / 8, 4] int32, exponents [K / 32] uint8): each 32-element
    group scaled by a power of two that puts its largest magnitude in [2^14, 2^15) (f16, subnormals included, then
    holds every bf16 value from 2^-31 of it up exactly), each word's eight as the f16x2 pairs `PAIRS` names; the
    exponent byte is 127 plus the power of two that undoes the scaling."""
    groups = a.float().view(-1, 32)
    largest = groups.abs().amax(1)
    top = torch.frexp(largest)[1] - 1  # floor(log2(largest)); 0 for an all-zero group
    shift = torch.where(largest > 0, 14 - top, torch.zeros_like(top))
    scaled = (groups * torch.pow(2.0, shift.float())[:, None]).view(-1, 8)
    order = [k for pair in PAIRS for k in pair]
    pairs = scaled[:, order].to(torch.float16).contiguous().view(torch.int32)
    return pairs, (127 - shift).to(torch.uint8)


def gemv_mma(words, scales, b, y, stages: int = 3, chains: int = 1, halves: int = 1, alu: bool = False,
             b_mask: bool = True, scales_once: bool = False, tiled: bool = False, rows: int = 64) -> None:
    """y [splits, R] = each K split's sum of words' codes x scales x activations / 64: words int32 [R, K / 8],
    scales uint8 e8m0 [R, K / 32], b = b_layout(activations); `halves` tiles of 16 words a row a step; `alu`,
    `b_mask`, `scales_once` as `mma_step_ptx` and the kernel name them; `tiled`: words given as
    `tiled(words, rows)`; `rows` a program (64 or 32)."""
    if scales_once and halves != 2:
        raise ValueError("gemv_mma: scales_once reads a step's two scale words, so it needs halves 2")
    R, KW = scales.shape[0], scales.shape[1] * 4
    pairs, exps = b
    _gemv_mma_kernel[(R // rows, y.shape[0])](words, scales.view(torch.int32), pairs, exps.view(torch.int32), y, R, KW,
                                            KW // (16 * halves), STAGES=stages, STEP_PTX=mma_step_ptx(chains, alu),
                                            HALVES=halves, B_MASK=b_mask, SCALES_ONCE=scales_once,
                                            TILED=tiled, BR=rows, num_warps=rows // 32)


def tiled(words: torch.Tensor, rows: int = 64, width: int = 16) -> torch.Tensor:
    """Words (or scale bytes) [R, KW] as a kernel's tiles in reading order, [R / rows, KW / width, rows, width]: a
    program's step in one run of memory (as a load-time repacking of the experts' weights would lay them out)."""
    R, KW = words.shape
    return words.view(R // rows, rows, KW // width, width).transpose(1, 2).contiguous()


def sass_counts() -> list[dict]:
    """The mma loop's and the gather up kernel's batch-1 loop in sm_90 SASS (Triton's own ptxas; no GPU):
    instructions a step and a word."""
    import registers as R
    from sass_loops import kernel_row

    mma = [R.Kernel(f"mma GEMV, {c} chain(s) a row pair", _gemv_mma_kernel,
                    {"w_ptr": "*i32", "s_ptr": "*i32", "b_ptr": "*i32", "e_ptr": "*i32"},
                    {"STAGES": 3, "STEP_PTX": mma_step_ptx(c), "HALVES": 1, "B_MASK": True,
                     "SCALES_ONCE": False, "TILED": False, "BR": 64}, 2, 3) for c in (1, 2)]
    up = next(k for k in R.moe_kernels() if k.name == "moe gather up")
    rows = []
    up_words = 2 * up.constexprs["BI"] * up.constexprs["BK"] // 8 // 64  # g and u rows x words a step / threads
    for k, words in [(k, 64 * 16 // 64) for k in mma] + [(up, up_words)]:
        step = kernel_row(k, None)["loops"][0]["instructions"]  # the K loop (the up kernel's routed experts')
        rows.append({"kernel": k.name, "instructions_a_step": step, "words_a_thread": words,
                     "instructions_a_word": step / words})
    return rows


def check_and_time(configs: list[dict], cores: list[tuple[int, int]], sets: int = 4) -> dict:
    """Both GEMVs at V4.1's up (7 slots x w1 and w3 rows of 2304, K 5120: 88 MB) and down (7 x 5120 rows, K 2304:
    44 MB) sizes: the largest error against a float64 reference (relative to the largest |y|), and the time of one
    call, over `sets` weight sets in turn (more bytes than the L2 holds, as the step's layers are). configs: the
    mma kernel's `gemv_mma` keywords and `split` (K splits, 1 if absent); an alu or unmasked-b row's error is
    meaningless."""
    from dsv4.quant import dequantize_mxfp4

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = common.copy_bandwidth(dev)
    result = {**common.metadata("cuda"), "copy_bandwidth": bw, "weight_sets": sets, "rows": []}
    for R_, K, shape in ((7 * 2 * 2304, 5120, "up"), (7 * 5120, 2304, "down")):
        words = [torch.randint(-2**31, 2**31 - 1, (R_, K // 8), dtype=torch.int32, device=dev, generator=gen)
                 for _ in range(sets)]
        scales = [torch.randint(118, 136, (R_, K // 32), dtype=torch.uint8, device=dev, generator=gen)
                  for _ in range(sets)]
        # bf16 activations over 2^-12 .. 2^12: f16 could not hold them without the groups' scaling
        a = (torch.randn(K, device=dev, generator=gen) * torch.exp2(torch.randint(-12, 13, (K,), device=dev,
                                                                                 generator=gen))).bfloat16().float()
        w = dequantize_mxfp4(words[0].view(torch.uint8), scales[0].view(torch.float8_e8m0fnu))  # exact in fp32
        ref = w.double() @ a.double()
        del w
        nbytes = words[0].numel() * 4 + scales[0].numel()
        b, planes = b_layout(a), activation_planes(a[None])
        cases = {}
        tiled_words = {n: [tiled(w, n) for w in words] for n in {c.get("rows", 64) for c in configs if c.get("tiled")}}
        for config in configs:
            kw = {k: v for k, v in config.items() if k != "split"}
            split = config.get("split", 1)
            if (K // (128 * kw.get("halves", 1))) % split == 0:
                y = torch.empty(split, R_, device=dev)
                name = "mma " + " ".join(f"{k} {v:d}" for k, v in config.items())
                given = tiled_words[kw.get("rows", 64)] if kw.get("tiled") else words
                cases[name] = ([functools.partial(gemv_mma, given[n], scales[n], b, y, **kw) for n in range(sets)],
                               lambda y=y: y.sum(0) * 64)
        # 128: a row's 64 bytes a step, as the mma loop's one tile; 512 the gather's own at one row
        for bk, ahead in cores:
            if K % bk == 0:
                y = torch.empty(R_, device=dev)
                cases[f"CUDA cores (_up_sums, BK {bk}" + (f", L2 {ahead} ahead)" if ahead else ")")] = (
                    [lambda n=n, y=y, bk=bk, a=ahead: gemv_cores(words[n], scales[n], planes, y, bk, a)
                     for n in range(sets)], lambda y=y: y)
        for bk in (512, 256):  # the tiled form of the same loop
            if K % bk == 0:
                y = torch.empty(R_, device=dev)
                tw = [(tiled(w, 16, bk // 8), tiled(s, 16, bk // 32)) for w, s in zip(words, scales)]
                cases[f"CUDA cores (tiled, BK {bk})"] = (
                    [lambda n=n, y=y, bk=bk, tw=tw: gemv_cores(*tw[n], planes, y, bk, tiled_kw=K // 8)
                     for n in range(sets)], lambda y=y: y)
        width = max(map(len, cases))  # a column as wide as the longest config name
        for name, (calls, total) in cases.items():
            calls[0]()
            err = ((total().double() - ref).abs().max() / ref.abs().max()).item()
            us = common.time_calls(calls, 20, graph=True)
            row = {"shape": shape, "rows": R_, "K": K, "kernel": name, "us": us, "bytes": nbytes,
                   "of_copy_rate": nbytes / (us * 1e-6) / bw, "max_rel_err": err}
            result["rows"].append(row)
            print(f"{shape:4s} {name:{width}s} {us:7.1f} us  {100 * row['of_copy_rate']:5.1f}% of the copy rate  "
                  f"error {err:.1e}")
    return result


@triton.jit
def _ask_l2(lines):
    """Ask the L2 for the 128-byte lines at the pointers `lines` (a hint: nothing waits for them)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _up_sums_probe(w_ptr, s_ptr, rows_g, rows_u, imask, D, planes, BK: tl.constexpr, STAGES: tl.constexpr,
                   AHEAD: tl.constexpr, TILED: tl.constexpr, INTERP: tl.constexpr):
    """`_up_sums` (EVEN_K, MXFP4) in one of two probe forms. AHEAD > 0: each step asks the L2 for its rows' bytes
    AHEAD steps on (their lines, clamped to the last step), so the bytes in flight grow past the async copies'
    STAGES without shared memory. TILED: words and scales tiled (`_tiled_words`)."""
    part_g = tl.zeros((rows_g.shape[0], BK // 32), dtype=tl.float32)
    part_u = tl.zeros((rows_g.shape[0], BK // 32), dtype=tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        if AHEAD > 0:
            ahead = tl.minimum(k0 + AHEAD * BK, D - BK) // 8  # word column
            for line in tl.static_range(BK // 256):  # a row's step spans BK / 2 bytes: BK / 256 lines
                _ask_l2(w_ptr + rows_g * (D // 8) + ahead + 32 * line)
                _ask_l2(w_ptr + rows_u * (D // 8) + ahead + 32 * line)
        if TILED:
            part_g = _tiled_words(part_g, w_ptr, s_ptr, rows_g, k0, D // 8, planes, BK // 8, INTERP)
            part_u = _tiled_words(part_u, w_ptr, s_ptr, rows_u, k0, D // 8, planes, BK // 8, INTERP)
        else:
            part_g = _gemv_words(part_g, w_ptr, s_ptr, rows_g, imask, D // 8, D // 32, planes, k0, BK // 8, INTERP,
                                 True, False)
            part_u = _gemv_words(part_u, w_ptr, s_ptr, rows_u, imask, D // 8, D // 32, planes, k0, BK // 8, INTERP,
                                 True, False)
    return tl.sum(part_g, axis=1) * _WORD_DOT_UNIT, tl.sum(part_u, axis=1) * _WORD_DOT_UNIT


@triton.jit
def _tiled_words(acc, w_ptr, s_ptr, rows64, k0, KW, planes, NW: tl.constexpr, INTERP: tl.constexpr):
    """`_gemv_words` (EVEN, MXFP4) on tiled words and scales (`tiled`, 16 rows, NW words and NW / 4 scale bytes a
    row a step): a 16-row tile's step is one run of 64 NW bytes (and its scales one of 4 NW), not 16 runs of 4 NW
    bytes a row apart."""
    step = k0 // (8 * NW)
    tile, r = rows64 // 16, rows64 % 16
    first = tl.multiple_of(tile * (16 * KW) + step * (16 * NW) + r * NW, 16)  # the row's first word of the step
    w = tl.load(w_ptr + first[:, None] + tl.arange(0, NW)[None, :])  # [R, NW] int32
    part = _group_dots(w, planes, KW, k0 // 8 + tl.arange(0, NW), True, False, INTERP)
    scale_word = (tile * (16 * KW // 4) + step * (16 * NW // 4) + r * (NW // 4)) // 4  # the row's first scale word
    e = _group_exponents(s_ptr, scale_word, r >= 0, 4, 0, NW // 4, True)  # the words from scale_word on, every row
    return acc + part * (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_cores_kernel(w_ptr, s_ptr, xp_ptr, y_ptr, R2, D, BK: tl.constexpr, STAGES: tl.constexpr,
                       AHEAD: tl.constexpr = 0, TILED: tl.constexpr = False, INTERP: tl.constexpr = False):
    """The gather up kernel's routed loop (`_up_sums`, 16 + 16 rows) on rows i and R2 + i, or with AHEAD > 0 or
    TILED its probe forms (`_up_sums_probe`; INTERP: their word products as the interpreter runs them)."""
    i = tl.program_id(0) * 16 + tl.arange(0, 16)
    imask = i < R2
    if AHEAD > 0 or TILED:
        g, u = _up_sums_probe(w_ptr, s_ptr, i.to(tl.int64), i.to(tl.int64) + R2, imask, D, xp_ptr, BK, STAGES, AHEAD,
                              TILED, INTERP)
    else:
        g, u = _up_sums(w_ptr, s_ptr, i.to(tl.int64), i.to(tl.int64) + R2, imask, D, xp_ptr, BK, STAGES, False,
                        True, False)
    tl.store(y_ptr + i, g, mask=imask)
    tl.store(y_ptr + R2 + i, u, mask=imask)


def gemv_cores(words, scales, planes, y, bk: int = 256, ahead: int = 0, tiled_kw: int = 0) -> None:
    """y [R] = the same sums by the CUDA-core loop, at the batch-1 gather's 2 warps and two stages (the gather's
    own K step at one row is 512; 256 and 128 divide both K too). ahead: steps the rows are asked of the L2 ahead
    (0: not asked). tiled_kw: words and scales given tiled (`tiled`, 16 rows, bk / 8 words), rows of tiled_kw
    words."""
    R, KW = (words.shape[0] * words.shape[2], tiled_kw) if tiled_kw else words.shape
    _gemv_cores_kernel[(R // 32,)](words, scales, planes, y, R // 2, KW * 8, BK=bk, STAGES=2, AHEAD=ahead,
                                   TILED=bool(tiled_kw), INTERP=not words.is_cuda, num_warps=2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", action="store_true", help="offline: the loops' SASS instruction counts only")
    p.add_argument("--probes", action="store_true", help="the mma loop's every probe (sessions 58-60), not its best")
    args = p.parse_args(argv)
    counts = sass_counts()
    for row in counts:
        print(f"{row['kernel']}: {row['instructions_a_step']} instructions a step, "
              f"{row['instructions_a_word']:.1f} a word")
    if args.sass:
        return
    lean = {"halves": 2, "scales_once": True}
    probes = [{"halves": 1}, {"halves": 2}, {"halves": 2, "chains": 2}, {"halves": 2, "split": 2}, lean,
              {**lean, "stages": 4}, {"halves": 2, "b_mask": False}, {**lean, "b_mask": False}, {**lean, "alu": True},
              {**lean, "alu": True, "b_mask": False}, {"halves": 1, "tiled": True}, {**lean, "tiled": True},
              {**lean, "tiled": True, "chains": 2}, {**lean, "tiled": True, "alu": True}, {**lean, "rows": 32},
              {**lean, "rows": 32, "tiled": True}]
    mma = probes if args.probes else [{"halves": 2}, {**lean, "rows": 32, "tiled": True}]
    cores = [(512, 0), (512, 1), (512, 2), (512, 4), (256, 0), (256, 2), (256, 4), (128, 0)]
    result = check_and_time(mma, cores)
    result["sass"] = counts
    print(common.write_result("mma_gemv", False, result))


if __name__ == "__main__":
    main()
