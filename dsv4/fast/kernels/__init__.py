"""Triton kernels, one file per family. `use_triton(t)` decides where a kernel runs.

A kernel runs in Triton on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (the tests run
the kernels that way at small shapes); anywhere else the op computes with its reference twin.

The kernel modules take `triton`, `tl` and `libdevice` from here, `to_bf16` (a rounding every kernel family uses),
and `pdl` / `wait_for_predecessor` for the
decode step's kernels launched with programmatic dependent launch. Where triton is not installed (a CPU-only torch
build brings none) they are stand-ins: the modules still import (`@triton.jit` returns the function,
any `tl.<name>` is a placeholder), `use_triton` is False everywhere, and every op runs its twin, so
`impl="fast"` works on such a machine.
"""

from __future__ import annotations

import functools
import os

import torch


class _TritonStandIn:
    """triton / triton.language where triton is missing: enough for the kernels' definitions to run."""

    def __getattr__(self, name: str) -> _TritonStandIn:
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # @triton.jit
            return args[0]
        return self  # @triton.jit(...), tl.constexpr(value)


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    triton = tl = libdevice = TensorDescriptor = _TritonStandIn()


def triton_importable() -> bool:
    return not isinstance(triton, _TritonStandIn)


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for tensors like `t`: on CUDA, or on CPU under the Triton interpreter."""
    if not triton_importable():
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def pdl(t: torch.Tensor) -> bool:
    """Launch a kernel on `t`'s device with programmatic dependent launch (Hopper on): the GPU may start it while
    the kernel before it in the stream finishes, its programs scheduled and waiting in `wait_for_predecessor`, so
    the gap between two launches (in a CUDA graph too) overlaps the predecessor's tail. Not under the interpreter."""
    return t.is_cuda and triton_importable() and _hopper_or_later(t.device.index or 0)


def use_tma(t: torch.Tensor) -> bool:
    """Whether tiles of `t` can be read through bulk tensor copies (`TensorDescriptor` loads: the TMA engine of
    sm_90 on, one instruction a tile where pointer loads issue a copy per 16 bytes a thread); under the interpreter
    too, so that the tests run that form on the CPU."""
    if not use_triton(t):
        return False
    return not t.is_cuda or _hopper_or_later(t.device.index or 0)


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    """Asked at every launch of an eager step; a device's capability does not change."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """A PDL-launched kernel's first step: wait until the kernel before it has finished and its writes are
    visible (griddepcontrol.wait), before reading anything it may have written."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_successor(START: tl.constexpr):
    """Let the PDL-launched kernel after this one start now (griddepcontrol.launch_dependents): once every program
    of this kernel has passed here, the successor's programs are scheduled beside this kernel's last ones and run
    up to their own `wait_for_predecessor`; without it the successor starts as this kernel's programs exit. Right
    after this kernel's own wait, where its successor has work that reads nothing this kernel writes (the fused
    mHC posts' `settled`). Not everywhere: session 31 measured every kernel starting its successor early 77 us
    slower a 4-layer step."""
    if START:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def to_bf16(x, INTERP: tl.constexpr):
    """fp32 -> bf16, round to nearest even. The interpreter's cast truncates, so there the rounding is done
    on the bits (finite x only) and the cast only drops zeros."""
    if INTERP:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)
