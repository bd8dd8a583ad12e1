"""One bench script run in two source trees on one device, alternating: a change measured beside its base in one
run, the way every speed claim here is made.

Make the base tree here, from a commit (exp/ is not ignored, so the device call carries it):

    python bench/ab.py --make-base 6f3da54          # exp/base: dsv4, bench, tests, pyproject.toml and COMMIT

then on the device:

    python bench/ab.py --base exp/base --rounds 2 bench/profile_decode.py --arch v41 --layers 4 --context 8192 \\
        --compile --top 40

The runs go base, this tree, base, this tree, ... (`--rounds` pairs), so a drift of the machine shows in both
columns. `--base` given more than once (`--base exp/base --base exp/base2`, each made with `--make-base REV --base
PATH`) runs each base in turn before this tree, labelled base, base2, ...: two changes told apart in one call. Each
run is `python <script> <args>` in its tree (working directory and PYTHONPATH), with OUT set to
<out>/<label>-<round> for its result files and DSV4_COMMIT to the tree's commit (the base's COMMIT file; this
tree's $DSV4_COMMIT, else `git rev-parse`), its output in <out>/<label>-<round>.log; <out> is $OUT/ab (out/ab
without OUT). Last, for each JSON result every run wrote, a table of its top-level numbers and its `by_op`
microseconds (bench/profile_decode.py's), one column a run, and <out>/ab.json with the same, each run's exit
status and the GPU its results name; the exit status is 1 if a run failed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import common

HERE = Path(__file__).resolve().parents[1]


def tree_commit(tree: Path) -> str:
    """The base's COMMIT file, or for this tree $DSV4_COMMIT / git (common.git_commit)."""
    if tree.resolve() == HERE:
        return common.git_commit()
    marker = tree / "COMMIT"
    return marker.read_text().strip() if marker.exists() else "unknown"


TREE_PATHS = ("dsv4", "bench", "tests", "pyproject.toml")  # what a bench run needs of a tree


def make_base(rev: str, base: Path) -> Path:
    """base <- TREE_PATHS at commit rev of this checkout (`git archive`), and its short hash in base/COMMIT."""
    git = ["git", "-C", str(HERE)]
    sha = subprocess.run([*git, "rev-parse", "--short", rev], capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run([*git, "archive", "--format=tar", sha, *TREE_PATHS], capture_output=True, check=True)
    base.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(base, filter="data")
    (base / "COMMIT").write_text(sha + "\n")
    return base


def run(tree: Path, script: str, args: list[str], out: Path, label: str) -> tuple[Path, int]:
    """`python script args` in tree: its results under out/label, its output in out/label.log; and its exit
    status."""
    results = out / label
    results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OUT": str(results), "DSV4_COMMIT": tree_commit(tree),
           "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    with open(out / f"{label}.log", "w") as log:
        code = subprocess.run([sys.executable, script, *args], check=False, cwd=tree, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    print(f"{label}: exit {code}, {out / f'{label}.log'}", flush=True)
    return results, code


def numbers(result: dict) -> dict[str, float]:
    """A result's top-level numbers, its by_op microseconds alone and own in the graph replay where measured
    (bench/profile_decode.py) and the `*_us` times of its `results` rows (the kernel benches'), each row named by
    its case or N, by name."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    row = {k: v for k, v in result.items() if number(v)}
    row.update({f"us {op['op']}": op["us"] for op in result.get("by_op", [])})
    row.update({f"own us {op['op']}": op["own_us"] for op in result.get("by_op", [])
                if number(op.get("own_us")) and op["own_us"] == op["own_us"]})  # NaN: no replay times
    for i, r in enumerate(result.get("results", [])):
        name = r.get("case", r.get("N", i))
        row.update({f"{name} {k}": v for k, v in r.items() if k.endswith("_us") and number(v)})
    return row


def gpus(runs: dict[str, Path]) -> dict[str, str | None]:
    """{run label: the GPU its result JSONs name (`gpu`), None where none does}: each number's card beside it."""
    named = lambda results: {json.loads(p.read_text()).get("gpu") for p in sorted(results.glob("*.json"))} - {None}
    return {label: ", ".join(sorted(named(results))) or None for label, results in runs.items()}


def compare(runs: dict[str, Path]) -> dict[str, dict[str, dict[str, float]]]:
    """{result name: {metric: {run label: value}}} over the JSON results every run wrote."""
    names = set.intersection(*({p.name for p in results.glob("*.json")} for results in runs.values()))
    table = {}
    for name in sorted(names):
        per_run = {label: numbers(json.loads((results / name).read_text())) for label, results in runs.items()}
        metrics = dict.fromkeys(m for row in per_run.values() for m in row)
        table[name] = {m: {label: row.get(m) for label, row in per_run.items()} for m in metrics}
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, action="append",
                   help="a base source tree (default exp/base); given again, each further base runs too, in order")
    p.add_argument("--make-base", metavar="REV", help="only make the base tree from commit REV")
    p.add_argument("--rounds", type=int, default=1, help="base / this tree pairs")
    p.add_argument("script", nargs="?", help="the bench script, relative to a tree's root")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    bases = a.base or [HERE / "exp" / "base"]
    if a.make_base:
        print(f"base tree: {make_base(a.make_base, bases[0])}")
        return {}
    if a.script is None:
        p.error("a bench script to run (or --make-base REV)")
    out = Path(os.environ.get("OUT", HERE / "out")) / "ab"
    trees = {("base" if i == 0 else f"base{i + 1}"): tree for i, tree in enumerate(bases)} | {"main": HERE}
    runs, codes = {}, {}
    for r in range(a.rounds):
        for label, tree in trees.items():
            runs[f"{label}-{r}"], codes[f"{label}-{r}"] = run(tree, a.script, a.args, out, f"{label}-{r}")
    table = compare(runs)
    for name, metrics in table.items():
        print(f"\n{name}")
        common.print_table([("metric", "metric", "")] + [(label, label, ".3f") for label in runs],
                           [{"metric": m, **vals} for m, vals in metrics.items()])
    summary = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "script": a.script,
               "args": a.args, "commits": {label: tree_commit(tree) for label, tree in trees.items()},
               "exit_codes": codes, "gpus": gpus(runs), "results": table}
    (out / "ab.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(1 if any(main().get("exit_codes", {}).values()) else 0)
