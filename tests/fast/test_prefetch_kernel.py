"""dsv4::l2_prefetch: a hint that changes no tensor, whose one effect is its `done` word.

Its twin does nothing (off CUDA, the interpreter included: it runs no inline PTX), so the CPU tests hold the op's
checks and that it leaves everything as it was; the `gpu` tests run the kernel on tensors of awkward sizes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd

from dsv4.fast.kernels.prefetch import LINE_BYTES, l2_prefetch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tensors(a_bytes: int, b_bytes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(DEVICE) for n in (a_bytes, b_bytes))
    return a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)


@settings(max_examples=12, deadline=None)
@given(a_bytes=st.integers(0, 3 << 17), b_bytes=st.integers(0, 3 << 17), nbytes=st.integers(0, 1 << 19))
def test_a_prefetch_changes_nothing_but_its_done_word(a_bytes, b_bytes, nbytes):
    """Any split of nbytes over a and b (a first; nbytes past both, or short of one line, included) leaves both
    tensors and `after` as they were; on CUDA the launch writes done = 0 wherever it asks for a line."""
    a, b = tensors(a_bytes, b_bytes)
    after = torch.randn(1, 8, device=DEVICE)
    keep = [t.clone() for t in (a, b, after)]
    done = torch.full((1,), 7, dtype=torch.int32, device=DEVICE)
    l2_prefetch(a, b, nbytes, after, done)
    assert all(torch.equal(t.view(torch.uint8) if t.dtype != after.dtype else t, k.view(torch.uint8)
                           if k.dtype != after.dtype else k) for t, k in zip((a, b, after), keep))
    asked = min(nbytes, a_bytes) // LINE_BYTES + min(nbytes - min(nbytes, a_bytes) // LINE_BYTES * LINE_BYTES,
                                                       b_bytes) // LINE_BYTES
    assert done.item() == (0 if DEVICE == "cuda" and asked else 7)


def test_bad_arguments_fail_clearly():
    a, b = tensors(1024, 256)
    after = torch.zeros(1, device=DEVICE)
    done = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        l2_prefetch(a, b, -1, after, done)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(a.view(32, 32).t(), b, 64, after, done)
    with pytest.raises(ValueError, match=r"done must be \[1\] int32"):
        l2_prefetch(a, b, 64, after, done.long())


def test_the_op_stays_in_a_compiled_graph_that_reads_nothing_it_returns():
    """A compiled graph drops an op whose outputs nothing reads unless it has an effect: the prefetch's write of
    `done` keeps it in the graph AOTAutograd hands the compiler (the one inductor compiles)."""
    a, b = tensors(4096, 0)
    done = torch.full((1,), 7, dtype=torch.int32, device=DEVICE)
    forward_ops = []

    def capture(gm, _):
        forward_ops.extend(n.format_node() for n in gm.graph.nodes)  # auto_functionalized names the op it calls
        return gm

    def f(x):
        y = x.sin()
        l2_prefetch(a, b, 4096, y, done)
        return y.cos()

    x = torch.randn(4, device=DEVICE)
    assert torch.equal(torch.compile(f, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x), f(x))
    assert any("l2_prefetch" in op for op in forward_ops), forward_ops
