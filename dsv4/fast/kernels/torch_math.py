"""Elementwise math as torch's CUDA kernels compute it, for kernels whose results must match their twins there.

torch's CUDA kernels call libdevice's expf and log1pf; a Triton kernel calling the same functions gets the same
values. The interpreter has no libdevice: with `ACCURATE` off, Triton's exp and a log1p built from log stand in
(numpy's exp there is exact).
"""

from __future__ import annotations

from dsv4.fast.kernels import libdevice, tl, triton


@triton.jit
def exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log1p(t, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log1p(t)
    else:
        u = 1.0 + t  # log1p from log: exact to a few ulp where u rounds (Goldberg)
        return tl.where(u == 1.0, t, tl.log(u) * (t / tl.where(u == 1.0, 1.0, u - 1.0)))
