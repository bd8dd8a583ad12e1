"""The batch-1 decode step's kernels compile for sm_90 without register spills (bench/registers.py: offline, with
the installed Triton's ptxas), except those the table marks with a reason; their weight-streaming K loops copy
the weights asynchronously (bench/sass_loops.py)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the test extras install Triton on Linux x86-64 only (pyproject.toml)")
if platform.system() != "Linux" or platform.machine() != "x86_64":
    pytest.skip("the sm_90 compile needs the ptxas that only Triton's Linux x86-64 wheels bundle",
                allow_module_level=True)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "registers.py"
LOOPS = BENCH.with_name("sass_loops.py")


def test_the_decode_kernels_compile_for_sm90_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, str(BENCH), "--json"], check=False, capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    names = {r["kernel"] for r in rows}
    assert {"mhc_pre partial", "moe gather up", "moe gather down", "fp8_gemv wo_b", "sparse_attn_fp4"} <= names
    for r in rows:
        assert 0 < r["registers"] <= 255, r
        if not r["spills_ok"]:  # a stack without spills is a local array (Triton 3.9 gives the NVFP4 quant 8 bytes)
            assert r["spills"] == 0, f"{r['kernel']} spills: {r}"


def test_the_decode_gemvs_copy_their_weights_asynchronously():
    """bench/sass_loops.py reads the loops of the compiled kernels: the FP8 GEMV's and the gather MoE's K loops
    stream their weights as the software pipeliner's asynchronous copies (LDGSTS); a change that makes them
    loads waiting on memory (as loading the FP8 GEMV's scales two steps ahead did) fails here."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    least = {"fp8_gemv wo_a": 2, "moe gather up": 8}  # asynchronous copies a K step at the least
    out = subprocess.run([sys.executable, str(LOOPS), "--json", "--only", *least], check=False, capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["kernel"]: r for r in map(json.loads, filter(lambda line: line.startswith("{"), out.stdout.splitlines()))}
    for name, copies in least.items():
        assert name in rows and rows[name]["launch_ints"], rows
        k_loop = max(rows[name]["loops"], key=lambda lp: lp["instructions"])
        assert k_loop["instructions"] > 50 and k_loop["async_copies"] >= copies, rows[name]
