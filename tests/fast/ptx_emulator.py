"""A small PTX emulator for the kernels' inline assembly (`tl.inline_asm_elementwise` snippets), so the CPU tests
check what the interpreter cannot run: the bit manipulation, the conversions and which `$n` operand is which.

`run(ptx, constraints, inputs)` executes one snippet on 32-bit register values as Triton binds them: `$0 ..` the
outputs (constraints starting with "="), then the inputs in order; it returns the outputs' bit patterns. Only the
instructions the snippets use are known (an unknown one raises), each to its PTX ISA definition:

    shl / shr / and / or / xor .b32, mov.b32 (also packing and unpacking {lo, hi} halves),
    prmt.b32 (default mode), cvt.rn.f16x2.e4m3x2, cvt.f32.f16, mul.f32, mul.rn.f32, fma.rn.f32, fma.rn.bf16x2

fp32 arithmetic rounds once, to nearest even, from the exact value (fractions); bf16x2 likewise per half.
"""

from __future__ import annotations

import re
import struct
from fractions import Fraction

import torch

MASK32 = 0xFFFFFFFF


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK32))[0]


def _round_to(value: Fraction, mantissa_bits: int, min_exp: int) -> float:
    """value rounded to nearest even with `mantissa_bits` significant bits (implicit one included) and subnormals
    below 2^min_exp; the result as a Python float (exact for fp32 and bf16 results). No overflow handling: the
    snippets' values stay far inside the range."""
    if value == 0:
        return 0.0
    sign = -1 if value < 0 else 1
    mag = abs(value)
    exp = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** exp > mag:
        exp -= 1
    ulp = Fraction(2) ** (max(exp, min_exp) - mantissa_bits + 1)
    q, r = divmod(mag, ulp)
    if r * 2 > ulp or (r * 2 == ulp and q % 2 == 1):
        q += 1
    return sign * float(q * ulp)


def round_f32(value: Fraction) -> int:
    return f32_bits(_round_to(value, 24, -126))


def round_bf16(value: Fraction) -> int:
    return f32_bits(_round_to(value, 8, -126)) >> 16


def bf16_value(bits16: int) -> Fraction:
    return Fraction(f32_value((bits16 & 0xFFFF) << 16))


def f16_value(bits16: int) -> float:
    return torch.tensor([bits16 & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16).item()


def e4m3_to_f16_bits(byte: int) -> int:
    h = torch.tensor([byte & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    return h.view(torch.int16).item() & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:  # sign mode: the selected byte's top bit, replicated
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _operands(text: str) -> list[str]:
    """'{a, b}, c, 0x1F' -> ['{a, b}', 'c', '0x1F']."""
    return [t.strip() for t in re.findall(r"\{[^}]*\}|[^,]+", text)]


def run(ptx: str, constraints: str, inputs: list[int]) -> list[int]:
    """Execute `ptx` with its operands bound as `constraints` says; inputs are 32-bit patterns."""
    kinds = constraints.split(",")
    n_out = sum(k.startswith("=") for k in kinds)
    if len(inputs) != len(kinds) - n_out:
        raise ValueError(f"{len(kinds) - n_out} inputs expected, got {len(inputs)}")
    regs: dict[str, int] = {f"${n_out + i}": v & MASK32 for i, v in enumerate(inputs)}

    def get(name: str) -> int:
        if re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", name):
            return int(name, 0) & MASK32
        if name not in regs:
            raise KeyError(f"register {name} read before it is written")
        return regs[name]

    for line in ptx.splitlines():
        line = line.split("//")[0].strip().rstrip(";").strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        ops = _operands(rest)
        d, src = ops[0], ops[1:]
        if op == "mov.b32" and d.startswith("{"):  # unpack a 32-bit value into two 16-bit halves, low first
            lo, hi = _operands(d[1:-1])
            v = get(src[0])
            regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            continue
        if op == "mov.b32" and src[0].startswith("{"):
            lo, hi = _operands(src[0][1:-1])
            regs[d] = (get(lo) & 0xFFFF) | (get(hi) & 0xFFFF) << 16
            continue
        v = [get(s) for s in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK32 if v[1] < 32 else 0
        elif op in ("shr.b32", "shr.u32"):
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte to the low half
            r = e4m3_to_f16_bits(v[0] & 0xFF) | e4m3_to_f16_bits((v[0] >> 8) & 0xFF) << 16
        elif op == "cvt.f32.f16":
            r = f32_bits(f16_value(v[0]))
        elif op in ("mul.f32", "mul.rn.f32"):
            r = round_f32(Fraction(f32_value(v[0])) * Fraction(f32_value(v[1])))
        elif op == "fma.rn.f32":
            r = round_f32(Fraction(f32_value(v[0])) * Fraction(f32_value(v[1])) + Fraction(f32_value(v[2])))
        elif op == "fma.rn.bf16x2":
            r = 0
            for half in (0, 16):
                a, b, c = (bf16_value(x >> half) for x in v)
                r |= round_bf16(a * b + c) << half
        else:
            raise ValueError(f"PTX instruction {op!r}: the emulator knows only the instructions its docstring lists")
        regs[d] = r & MASK32
    return [get(f"${i}") for i in range(n_out)]
