"""Shared test set-up: tiny checkpoints built once per session, checkpoint editing, the tools as modules,
the fast model's kernel twins, a CI hypothesis profile, one torch thread.

`CI=1` (or `--hypothesis-profile=ci`) selects the "ci" profile: no deadline (shared CI machines stall),
derandomized (a failure reproduces on every run), few examples.
"""

from __future__ import annotations

import os

import torch

# Kernel tests run under Triton's interpreter without a GPU. The choice is made when triton.language
# is first imported (dsv4.hf pulls it in through torch._dynamo), so it must come before any dsv4 import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil
import sys
from pathlib import Path

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dsv4.tiny import make_tiny_checkpoint  # noqa: E402

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=10)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    # The test models are tiny: intra-op threads buy nothing, and on a shared machine OpenMP workers
    # spinning for a busy core slow every op by an order of magnitude. An explicit OMP_NUM_THREADS wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


@pytest.fixture
def graph_replay():
    """fn(*args) captured in a CUDA graph and replayed once -> what the capture returned, as the replay left it."""
    def run(fn, *args):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        return out

    return run


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("v4-flash", tmp_path_factory.mktemp("tiny-v4"))


@pytest.fixture(scope="session")
def tiny_v4_dequantized_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("v4-flash", tmp_path_factory.mktemp("tiny-v4-dequantized"), dequantized=True)


@pytest.fixture(scope="session")
def tiny_v41_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("v41-flash", tmp_path_factory.mktemp("tiny-v41"))


@pytest.fixture(scope="session")
def tiny_v41_wide_engram_dir(tmp_path_factory) -> Path:
    """The tiny V4.1 with Engram rows of the released width (256 values): what host-resident tables hold."""
    return make_tiny_checkpoint("v41-flash", tmp_path_factory.mktemp("tiny-v41-wide-engram"),
                                overrides={"engram_head_dim": 256})


@pytest.fixture(scope="session")
def tiny_v41_dequantized_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("v41-flash", tmp_path_factory.mktemp("tiny-v41-dequantized"), dequantized=True)


@pytest.fixture(scope="module", params=["v41", "v4"])
def arch_dir(request, tiny_v41_dir, tiny_v4_dir) -> Path:
    """Each tiny checkpoint in turn."""
    return tiny_v41_dir if request.param == "v41" else tiny_v4_dir


@pytest.fixture
def kernel_twins(monkeypatch):
    """The fast model off the GPU computes with its kernels' reference twins: the Triton interpreter
    (on for the kernel tests) would take minutes per forward, and the kernel tests cover the kernels
    against the same twins."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="session")
def tool():
    """tool(name) -> tools/<name>.py as a module (tools/ is not a package)."""

    def load(name: str):
        module_name = f"dsv4_tools_{name}"
        if module_name not in sys.modules:  # dataclasses look their module up in sys.modules
            path = Path(__file__).parents[1] / "tools" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(module_name, path)
            sys.modules[module_name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module_name])
        return sys.modules[module_name]

    return load


@pytest.fixture
def edited_checkpoint(tmp_path):
    """edit(src, changes) -> a copy of checkpoint `src` with tensors replaced, added (name -> tensor)
    or removed (name -> None); the index follows, and new tensors go into the first shard."""

    def edit(src: Path, changes: dict[str, torch.Tensor | None]) -> Path:
        dst = tmp_path / f"edited-{sum(1 for _ in tmp_path.iterdir())}"
        shutil.copytree(src, dst)
        index_path = dst / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        first_shard = min(weight_map.values())
        for shard in sorted({weight_map.get(name, first_shard) for name in changes}):
            tensors = {k: v.clone() for k, v in load_file(dst / shard).items()}
            for name, value in changes.items():
                if weight_map.get(name, first_shard) != shard:
                    continue
                if value is None:
                    del tensors[name], weight_map[name]
                else:
                    tensors[name], weight_map[name] = value.contiguous(), shard
            save_file(tensors, dst / shard)
        index_path.write_text(json.dumps(index))
        return dst

    return edit
