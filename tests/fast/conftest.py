"""Kernel tests run on the GPU when there is one, else on the CPU under Triton's interpreter.

The interpreter is chosen when a kernel is defined, so the variable is set before any kernel module
is imported (this file loads before the tests in this folder).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
