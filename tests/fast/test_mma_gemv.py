"""bench/mma_gemv.py's tensor-core GEMV without a GPU: its word decode in the PTX emulator, and its PTX step's mma
and accumulator adds replayed for every lane of a warp with m16n8k16's fragment layout written out, on `b_layout`'s
activations, against a float64 reference. A wrong B slot, pair order, operand or accumulator in the PTX text moves a
product into the wrong group's column or K position, or drops it, and fails these."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench` as a package

from ptx_emulator import run

from bench import mma_gemv as G
from dsv4.quant import E2M1_VALUES, dequantize_mxfp4

E2M1 = E2M1_VALUES.double().numpy()


def step_program(chains: int) -> list[tuple]:
    """The step's mma and add lines in order, on accumulator chains (row pair letter, index): ("mma", A registers
    (row letter + index), B tile elements, D's chain, C's chain or None for zeros) and ("add", into, from), the
    latter once a chain pair though the PTX adds four registers each."""
    chain = lambda reg: (reg[0], int(reg[1:]) // 4)
    out, adds = [], []
    for line in G.mma_step_ptx(chains).splitlines():
        if line.startswith("mma."):
            d, a, b, c = (x.replace(" ", "").split(",") for x in re.findall(r"\{([^}]*)\}", line))
            out.append(("mma", a, [int(x[1:]) - G.B for x in b], chain(d[0]),
                        None if c[0].startswith("0f") else chain(c[0])))
        elif line.startswith("add.f32"):
            dst, first, src = line.rstrip(";").replace(",", "").split()[1:]
            assert dst == first
            adds.append((dst, src))
    for dst, src in adds:  # a chain added into another: all four registers, once
        if int(dst[1:]) == 0:
            assert [(f"{dst[0]}{q}", f"{src[0]}{int(src[1:]) + q}") in adds for q in range(4)] == [True] * 4
            out.append(("add", chain(dst), chain(src)))
    return out


def f16_pair(bits: int) -> tuple[float, float]:
    halves = np.array([bits & 0xFFFF, bits >> 16 & 0xFFFF], dtype=np.uint16).view(np.float16)
    return float(halves[0]), float(halves[1])


@functools.cache
def decoded(word: int) -> list[tuple[float, float]]:
    """A word's four f16x2 registers by `_DECODE` itself, in the PTX emulator."""
    ptx = "\n".join(s.format(w="$4", r0="$0", r1="$1", r2="$2", r3="$3") for s in G._DECODE)
    return [f16_pair(r) for r in run(ptx, "=r,=r,=r,=r,r", [word])]


def test_decode_gives_the_pairs_in_pairs_order():
    """`_DECODE`'s registers hold PAIRS' codes (values e2m1 / 64), which `b_layout` pairs the activations by."""
    rng = np.random.default_rng(0)
    for word in rng.integers(0, 2**32, 200).tolist():
        want = [(E2M1[word >> 4 * p & 15] / 64, E2M1[word >> 4 * q & 15] / 64) for p, q in G.PAIRS]
        assert decoded(word) == want


def lane_sums(words: np.ndarray, scales: np.ndarray, pairs: np.ndarray, exps: np.ndarray, chains: int) -> np.ndarray:
    """y [64] of one program: every lane (g, t) of both warps holds words 4t..4t+3 of rows 16i + 8w + g; each mma
    gathers A and B from the 32 lanes by the fragment layout (a0: row g, k 2t, 2t+1; a1: row g + 8; a2 / a3: k + 8;
    b0: k 2t, 2t+1, column g; b1: k + 8), and the lanes t < 2 scale columns 2t, 2t+1 by those groups' weight and
    activation scales."""
    y = np.zeros(64)
    program = step_program(chains)
    for w in range(2):
        for s in range(words.shape[1] // 16):
            acc = {}
            for op in program:
                if op[0] == "add":
                    acc[op[1]] = acc[op[1]] + acc[op[2]]
                    continue
                _, a_regs, b_elems, d, c = op
                A, B = np.zeros((16, 16)), np.zeros((16, 8))
                for g in range(8):
                    for t in range(4):
                        for n, reg in enumerate(a_regs):
                            i, j, k = G.ROWS.index(reg[0]), int(reg[1:]) // 4, int(reg[1:]) % 4
                            word = int(words[16 * i + 8 * w + g, 16 * s + 4 * t + j]) & 0xFFFFFFFF
                            row, col = g + 8 * (n % 2), 2 * t + 8 * (n // 2)
                            A[row, col:col + 2] = decoded(word)[k]
                        for n, elem in enumerate(b_elems):  # the lane's tile element (row rep i, column j)
                            k0, i, j = 2 * t + 8 * n, elem // 4, elem % 4  # ... loaded where g == t
                            pair = f16_pair(int(pairs[16 * s + 4 * t + i, j]) & 0xFFFFFFFF) if g == t else (0, 0)
                            B[k0:k0 + 2, g] = pair
                acc[d] = (0 if c is None else acc[c]) + A @ B
            for letter, rows in (("d", (0, 1)), ("e", (2, 3))):
                D = acc[(letter, 0)]
                for g in range(8):
                    for half, i in enumerate(rows):
                        row = 16 * i + 8 * w + g
                        for n in range(4):  # columns 0..3 sit in lanes t = 0, 1 (2t, 2t + 1)
                            factor = 2.0 ** (int(scales[row, 4 * s + n]) + int(exps[4 * s + n]) - 254)
                            y[row] += D[g + 8 * half, n] * factor
    return y * 64


@pytest.mark.parametrize("seed, chains", [(0, 1), (1, 1), (0, 2)])
def test_lanes_replay_the_reference(seed, chains):
    rng = np.random.default_rng(seed)
    K = 256
    words = rng.integers(-2**31, 2**31 - 1, (64, K // 8)).astype(np.int32)
    scales = rng.integers(118, 136, (64, K // 32)).astype(np.uint8)
    # bf16 numbers 2^-8 .. 2^9 (exact in f16 once a group is scaled), one group all zero
    a = torch.from_numpy(rng.uniform(1, 2, K) * rng.choice([-1, 1], K) * np.exp2(rng.integers(-8, 9, K)))
    a = a.bfloat16().double()
    a[32:64] = 0
    w = dequantize_mxfp4(torch.from_numpy(words).view(torch.uint8), torch.from_numpy(scales).view(torch.float8_e8m0fnu))
    ref = w.double().numpy() @ a.double().numpy()
    pairs, exps = G.b_layout(a)
    got = lane_sums(words, scales, pairs.numpy(), exps.numpy(), chains)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("bk", [512, 256])
def test_cuda_core_loop_on_tiled_weights(bk):
    """The CUDA-core loop on tiled words and scales (`_tiled_words`, what `tiled` lays out at 16 rows and bk / 8
    words a step) under the interpreter, against the float64 reference: a tile's rows, steps or scale words read
    from the wrong place of the tiled layout move products to the wrong row or scale them by another group's
    power of two."""
    R, K = 64, 2 * bk
    g = torch.Generator().manual_seed(bk)
    words = torch.randint(-2**31, 2**31 - 1, (R, K // 8), dtype=torch.int32, generator=g)
    scales = torch.randint(118, 136, (R, K // 32), dtype=torch.uint8, generator=g)
    a = torch.randn(K, generator=g).bfloat16().float()
    ref = dequantize_mxfp4(words.view(torch.uint8), scales.view(torch.float8_e8m0fnu)).double() @ a.double()
    y = torch.empty(R)
    G.gemv_cores(G.tiled(words, 16, bk // 8), G.tiled(scales, 16, bk // 32), G.activation_planes(a[None]), y, bk,
                 tiled_kw=K // 8)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
