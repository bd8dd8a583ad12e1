"""Weights asked of the L2 ahead of the GEMV that reads them, while latency-bound kernels run.

`dsv4::l2_prefetch(a, b, nbytes, after, done) -> ()`
    asks the L2 for the first `nbytes` of a's bytes and then of b's (b may be empty), with the eviction
    priority "evict last", so that a GEMV reading them later finds them there. `after`: any tensor the
    prefetch must follow (the op reads nothing of it: the argument only orders the launch after its producer
    in a compiled graph). `done` [1] int32: written 0 by the launch, the op's one effect that a compiled
    graph cannot drop (an op without one would be removed as unused).

Why: in the batch-1 decode step a layer spends some 100 us in kernels that stream almost nothing (the
indexer's selection, the attention, mHC, routing) between its weight-streaming GEMVs, and the memory waits
while they run. A prefetch is a hint: nothing waits for the bytes and nothing changes in any tensor, so the
twin (every device but CUDA, the interpreter included, which runs no inline PTX) launches nothing.
"""

from __future__ import annotations

import torch

from dsv4.fast.kernels import tl, triton, triton_importable

__all__ = ["LINE_BYTES", "l2_prefetch"]

LINE_BYTES = 128  # what a prefetch asks for: one L2 line
_LINE = tl.constexpr(LINE_BYTES)  # the kernel's copy (a kernel reads only constexpr globals)
_LINES = 512  # lines a program asks for (64 KiB)


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_lines, b_ptr, b_lines, done_ptr, LINES: tl.constexpr):
    """Programs up to a's cover a's lines, the rest b's; no register waits for a line, so a program ends as soon
    as it has asked for its lines."""
    pid = tl.program_id(0)
    a_programs = tl.cdiv(a_lines, LINES)
    in_a = pid < a_programs
    first = tl.where(in_a, pid, pid - a_programs) * LINES
    n_lines = tl.where(in_a, a_lines, b_lines)
    base = tl.where(in_a, a_ptr, b_ptr)
    line = tl.minimum(first + tl.arange(0, LINES), n_lines - 1).to(tl.int64)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [base + line * _LINE], dtype=tl.int32, is_pure=False, pack=1)
    if pid == 0:
        tl.store(done_ptr, 0)


def _lines(t: torch.Tensor, nbytes: int) -> int:
    return min(nbytes, t.numel() * t.element_size()) // LINE_BYTES


def _launch(a: torch.Tensor, b: torch.Tensor, nbytes: int, done: torch.Tensor) -> None:
    a_lines = _lines(a, nbytes)
    b_lines = _lines(b, nbytes - a_lines * LINE_BYTES)
    programs = triton.cdiv(a_lines, _LINES) + triton.cdiv(b_lines, _LINES)
    if programs:
        _l2_prefetch_kernel[(programs,)](a.view(torch.uint8), a_lines, b.view(torch.uint8), b_lines, done,
                                         LINES=_LINES, num_warps=4)


def _check(a: torch.Tensor, b: torch.Tensor, nbytes: int, done: torch.Tensor) -> None:
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("l2_prefetch: a and b must be contiguous (their first bytes are asked for)")
    if nbytes < 0:
        raise ValueError(f"l2_prefetch: nbytes must be >= 0, got {nbytes}")
    if done.shape != (1,) or done.dtype != torch.int32:
        raise ValueError(f"l2_prefetch: done must be [1] int32, got {tuple(done.shape)} {done.dtype}")


@torch.library.custom_op("dsv4::l2_prefetch", mutates_args=("done",))
def l2_prefetch(a: torch.Tensor, b: torch.Tensor, nbytes: int, after: torch.Tensor, done: torch.Tensor) -> None:
    """The first nbytes of a, then of b, asked of the L2 (CUDA; elsewhere nothing), after `after`'s producer."""
    _check(a, b, nbytes, done)
    if a.is_cuda and triton_importable():
        _launch(a, b, nbytes, done)


@l2_prefetch.register_fake
def _(a, b, nbytes, after, done):
    return None
