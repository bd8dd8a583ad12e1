"""The kernels' inline PTX run in a PTX emulator (`ptx_emulator.py`) against what each snippet's interpreter branch
computes. On the GPU the snippets run and the interpreter branches do not; under the Triton interpreter it is the
other way round, so without this a wrong mask, selector or `$n` operand would show only in a GPU test.

Each snippet is bound as its kernel binds it (the module's operand constraints), on random inputs covering every
code. Activations are bf16 values, as the kernels get them: their products with the decoded weights are exact, so
the emulated fp32 sums must equal the interpreter branch's sums bit for bit (zeros of either sign compare equal).
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

pytest.importorskip("triton")

import torch
from ptx_emulator import bf16_value, f32_bits, f32_value, round_bf16, round_f32, run

from dsv4.fast.kernels import fp8_gemv as G
from dsv4.fast.kernels import moe_experts as M
from dsv4.fast.kernels import rope as R
from dsv4.quant import E2M1_VALUES


def e2m1(code: int) -> Fraction:
    return Fraction(E2M1_VALUES[code & 15].item())


def e4m3(byte: int) -> Fraction:
    """An e4m3fn byte's value (no NaN bytes are drawn)."""
    return Fraction(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).item())


def bf16_activation(rng: random.Random) -> int:
    """fp32 bits of a random bf16 value over a wide range, zeros included."""
    if rng.random() < 0.05:
        return 0x80000000 if rng.random() < 0.5 else 0
    return rng.getrandbits(1) << 31 | rng.randint(60, 190) << 23 | rng.getrandbits(7) << 16


def fp32_sum_in_order(start: Fraction | None, terms: list[Fraction]) -> int:
    """start + terms[0] + terms[1] + ..., each addition rounded to fp32 (start None: begin with terms[0] rounded)."""
    s = f32_value(round_f32(terms[0] if start is None else start + terms[0]))
    for t in terms[1:]:
        s = f32_value(round_f32(Fraction(s) + t))
    return f32_bits(s)


def assert_same_float(got_bits: int, want_bits: int) -> None:
    assert f32_value(got_bits) == f32_value(want_bits), (hex(got_bits), hex(want_bits))


@pytest.mark.parametrize("seed", range(4))
def test_word_dot_ptx_is_its_interpreter_branch(seed):
    """moe_experts' `_word_dot`: eight e2m1 codes (low nibble first) against eight activations, / 64, in K order."""
    rng = random.Random(seed)
    for trial in range(200):
        codes = list(range(8)) if trial % 2 else list(range(8, 16))  # every code, either sign
        rng.shuffle(codes)
        codes = codes if trial < 100 else [rng.randrange(16) for _ in range(8)]
        word = sum(c << (4 * j) for j, c in enumerate(codes))
        acts = [bf16_activation(rng) for _ in range(8)]
        (got,) = run(M._WORD_DOT_PTX.value, M._WORD_DOT_OPERANDS.value, [word, *acts])
        terms = [e2m1(c) * Fraction(f32_value(a)) / int(M._WORD_DOT_UNIT.value) for c, a in zip(codes, acts)]
        assert_same_float(got, fp32_sum_in_order(None, terms))


@pytest.mark.parametrize("seed", range(4))
def test_dot4_ptx_is_its_interpreter_branch(seed):
    """fp8_gemv's `_dot4`: acc + four e4m3 bytes (lowest first) times four activations, in position order."""
    rng = random.Random(seed)
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    for _ in range(200):
        bytes_ = [rng.choice(finite) for _ in range(4)]
        word = sum(b << (8 * j) for j, b in enumerate(bytes_))
        acc, *acts = (bf16_activation(rng) for _ in range(5))
        (got,) = run(G._DOT4_PTX.value, G._DOT4_OPERANDS.value, [acc, word, *acts])
        terms = [e4m3(b) * Fraction(f32_value(a)) for b, a in zip(bytes_, acts)]
        assert_same_float(got, fp32_sum_in_order(Fraction(f32_value(acc)), terms))


@pytest.mark.parametrize("seed", range(4))
def test_e2m1_bf16_ptx_is_its_interpreter_branch(seed):
    """moe_experts' `_e2m1_quads` (pack 2): two int16 words of four codes and their bf16 scales -> the four K
    phases as bf16 pairs, each code times its word's scale exactly, over the scales the decode keeps exact."""
    rng = random.Random(seed)
    for trial in range(200):
        words = [rng.getrandbits(16) for _ in range(2)]
        if trial < 16:  # every code in each phase of word 0
            words[0] = sum(((trial + k) % 16) << (4 * k) for k in range(4))
        exps = [rng.choice([1, 2, 127, 127 + M.MAX_SCALE_EXP, rng.randint(1, 127 + M.MAX_SCALE_EXP)]) for _ in range(2)]
        scales = [e << 7 for e in exps]  # bf16 bits of 2^(e - 127)
        q = words[0] | words[1] << 16
        s = scales[0] | scales[1] << 16
        phases = run(M._E2M1_BF16_PTX.value, M._E2M1_BF16_OPERANDS.value, [q, s])
        for k, pair in enumerate(phases):
            for half, (word, scale) in enumerate(zip(words, scales)):
                want = e2m1((word >> (4 * k)) & 15) * bf16_value(scale)
                assert bf16_value(pair >> (16 * half)) == bf16_value(round_bf16(want)) == want, (trial, k, half)


@pytest.mark.parametrize("seed", range(4))
def test_rounded_product_ptx_is_its_interpreter_branch(seed):
    """rope's `_product`: one fp32 product rounded to nearest even (the interpreter's numpy multiply), over
    products that round, and that fall to subnormals and zero (none overflow: the emulator has no infinities)."""
    rng = random.Random(seed)
    for _ in range(400):
        a, b = (rng.getrandbits(1) << 31 | rng.randint(*exps) << 23 | rng.getrandbits(23) for exps in ((40, 190),
                                                                                                      (64, 160)))
        (got,) = run(R._ROUNDED_PRODUCT.value, "=f,f,f", [a, b])
        want = torch.tensor([f32_value(a)]) * torch.tensor([f32_value(b)])
        assert_same_float(got, f32_bits(want.item()))
