"""bench/ab.py: a bench script run in two trees, alternating, and its results side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # ab imports bench/common as `common`

import ab

# a stand-in bench: appends its tree's name to a shared order file, writes $OUT/step.json from its tree's constant
SCRIPT = """import json, os, sys
from pathlib import Path
from mark import STEP_MS
with open(sys.argv[1], "a") as order:
    order.write(Path.cwd().name + " " + os.environ["DSV4_COMMIT"] + "\\n")
Path(os.environ["OUT"], "step.json").write_text(json.dumps(
    {"graph_step_ms": STEP_MS, "gpu": "none", "by_op": [
        {"op": "dsv4::mhc_pre", "launches": 2, "us": STEP_MS * 10, "own_us": STEP_MS * 8},
        {"op": "dsv4::mhc_post", "launches": 2, "us": STEP_MS * 10, "own_us": float("nan")}],
     "results": [{"case": "wo_a", "graph_fused_us": STEP_MS * 4, "graph_fused_GBps": 1.0}]}))
print("ran")
"""


def make_tree(path: Path, step_ms: float) -> Path:
    (path / "bench").mkdir(parents=True)
    (path / "bench" / "fake.py").write_text(SCRIPT)
    (path / "mark.py").write_text(f"STEP_MS = {step_ms}\n")  # imported through the run's PYTHONPATH
    return path


def test_runs_alternate_in_their_trees_and_results_line_up(tmp_path, monkeypatch):
    base = make_tree(tmp_path / "base", 1.5)
    (base / "COMMIT").write_text("abc1234\n")
    main = make_tree(tmp_path / "main", 1.25)
    monkeypatch.setattr(ab, "HERE", main)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("DSV4_COMMIT", "def5678")
    order = tmp_path / "order.txt"
    summary = ab.main(["--base", str(base), "--rounds", "2", "bench/fake.py", str(order)])

    assert order.read_text().split("\n")[:-1] == ["base abc1234", "main def5678"] * 2
    assert summary["commits"] == {"base": "abc1234", "main": "def5678"}
    assert summary["exit_codes"] == {"base-0": 0, "main-0": 0, "base-1": 0, "main-1": 0}
    assert summary["gpus"] == dict.fromkeys(summary["exit_codes"], "none")  # the card each run's results name
    step = summary["results"]["step.json"]
    assert step["graph_step_ms"] == {"base-0": 1.5, "main-0": 1.25, "base-1": 1.5, "main-1": 1.25}
    assert step["us dsv4::mhc_pre"]["main-1"] == 12.5
    assert step["own us dsv4::mhc_pre"]["main-1"] == 10.0
    assert "own us dsv4::mhc_post" not in step  # no replay times (NaN)
    assert step["wo_a graph_fused_us"] == {"base-0": 6.0, "main-0": 5.0, "base-1": 6.0, "main-1": 5.0}
    assert "wo_a graph_fused_GBps" not in step  # rows: their times
    assert "gpu" not in step  # numbers only
    out = tmp_path / "out" / "ab"
    assert (out / "main-1.log").read_text() == "ran\n"
    assert json.loads((out / "ab.json").read_text())["results"] == summary["results"]


def test_each_base_given_runs_before_this_tree(tmp_path, monkeypatch):
    """--base twice: both bases and this tree in each round, labelled base, base2, main."""
    first, second = make_tree(tmp_path / "first", 1.5), make_tree(tmp_path / "second", 1.0)
    (first / "COMMIT").write_text("aaa1111\n")
    (second / "COMMIT").write_text("bbb2222\n")
    monkeypatch.setattr(ab, "HERE", make_tree(tmp_path / "main", 0.5))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("DSV4_COMMIT", "ccc3333")
    order = tmp_path / "order.txt"
    summary = ab.main(["--base", str(first), "--base", str(second), "bench/fake.py", str(order)])
    assert order.read_text().split("\n")[:-1] == ["first aaa1111", "second bbb2222", "main ccc3333"]
    assert summary["commits"] == {"base": "aaa1111", "base2": "bbb2222", "main": "ccc3333"}
    assert summary["results"]["step.json"]["graph_step_ms"] == {"base-0": 1.5, "base2-0": 1.0, "main-0": 0.5}


def test_the_base_tree_is_a_commits_bench_paths(tmp_path, monkeypatch):
    """--make-base REV: the commit's dsv4, bench, tests and pyproject.toml (not its other files, not later edits)
    and the short hash in COMMIT."""
    repo = tmp_path / "repo"
    for path, text in (("dsv4/a.py", "A = 1\n"), ("bench/b.py", "B = 1\n"), ("tests/t.py", ""),
                       ("pyproject.toml", "[project]\n"), ("notes.md", "not a bench path\n")):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    (repo / "dsv4" / "a.py").write_text("A = 2\n")  # a later edit, not in the commit
    monkeypatch.setattr(ab, "HERE", repo)
    base = tmp_path / "exp" / "base"
    ab.main(["--make-base", "HEAD", "--base", str(base)])
    assert (base / "dsv4" / "a.py").read_text() == "A = 1\n" and (base / "bench" / "b.py").exists()
    assert (base / "pyproject.toml").exists() and not (base / "notes.md").exists()
    assert (base / "COMMIT").read_text().strip() == sha
