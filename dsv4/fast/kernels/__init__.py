"""Triton kernels, one file per family. `use_triton(t)` decides where a kernel runs.

A kernel runs in Triton on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (the tests run
the kernels that way at small shapes); anywhere else the op computes with its reference twin.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for tensors like `t`: on CUDA, or on CPU under the Triton interpreter."""
    if not triton_importable():
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
