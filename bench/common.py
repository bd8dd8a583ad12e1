"""What every kernel benchmark in bench/ does the same way: arguments, timing, metadata, outputs, tables.

A script uses it like this (the order matters: TRITON_INTERPRET must be set before a kernel module is imported,
so this module imports neither torch nor triton at load time):

    import common                                   # bench/ is sys.path[0] when run as `python bench/x.py`
    ARGS = common.parse_args(__doc__, add_arguments)  # --smoke sets TRITON_INTERPRET=1
    import torch                                    # then the kernels
    ...
    result = {**common.metadata(device), ...}       # command, gpu, torch, triton, commit
    path = common.write_result("x", ARGS.smoke, result)  # $OUT/x.json, else bench/results/x.json; x-smoke.json
    common.save_figure(path.with_suffix(".png"), draw)
    common.print_table(columns, rows)

The commit (`commit` in every result): the environment variable DSV4_COMMIT when set (set it when launching on the
device machine, whose copy of the tree may carry a stale .git: `DSV4_COMMIT=$(git rev-parse HEAD) ...`); else
`git rev-parse HEAD` of this checkout, with "-dirty" when tracked files are modified; else "unknown".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `dsv4` importable without installing it (the device machine's tree)

CPU_NAME = "cpu (Triton interpreter)"


def parse_args(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
               argv: Sequence[str] | None = None, whole_model: bool = False) -> argparse.Namespace:
    """The script's arguments: --smoke plus whatever `add_arguments(parser)` adds; the help text is `doc`.

    With --smoke, sets TRITON_INTERPRET=1 (0 for a `whole_model` bench: whole models under the interpreter take
    hours, so their smoke runs check the script with the kernels' twins), so call this before importing any
    kernel module."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "0" if whole_model else "1"
    return args


def bench_device(smoke: bool) -> str:
    """Where a kernel bench runs: the CPU for --smoke (under the interpreter), else CUDA, or exit saying so."""
    import torch

    if smoke:
        return "cpu"
    if not torch.cuda.is_available():
        sys.exit(f"bench/{Path(sys.argv[0]).name} needs CUDA (or --smoke)")
    return "cuda"


def fresh_compile_caches() -> None:
    """Point inductor's and Triton's caches at a new empty directory, so this process compiles what its code
    says (a run of another tree cannot serve it). Call before torch is imported."""
    import tempfile

    cache = tempfile.mkdtemp()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")


def git_commit() -> str:
    """$DSV4_COMMIT when set (the launcher knows what it sent); else HEAD of this checkout (+ "-dirty" if
    tracked files differ); else "unknown". The device machine's copy of the tree may carry a stale .git."""
    if os.environ.get("DSV4_COMMIT"):
        return os.environ["DSV4_COMMIT"]
    if (ROOT / ".git").exists():  # not a parent's repository
        try:
            git = ["git", "-C", str(ROOT)]
            sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, check=True).stdout
            return sha.strip() + ("-dirty" if dirty.strip() else "")
        except (OSError, subprocess.CalledProcessError):
            return "unknown"
    return "unknown"


def metadata(device: str) -> dict[str, Any]:
    """The run's identity for the result JSON: command, gpu, torch, triton, commit."""
    import torch
    import triton

    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else CPU_NAME,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
    }


def time_calls(fns: Sequence[Callable[[], Any]], reps: int, *, graph: bool = True, cuda: bool = True,
               warmup: int = 3) -> float:
    """Microseconds per call: the median over `reps` samples of (time to run every fn in `fns` once) / len(fns).

    Every fn runs once first (compiles, warms the allocator). `cuda`: time with CUDA events; else (the CPU smoke
    runs) with the host clock. `graph` (CUDA only): the fns are captured, in order, into one CUDA graph (after a
    run on a side stream) and each sample is one replay: device time without launch gaps, and with fns that
    rotate over input sets, inputs that come from memory rather than L2. Then `warmup` untimed runs. A capture
    that fails raises; the caller decides whether eager timing is an acceptable substitute."""
    for f in fns:
        f()
    if not cuda:
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            for f in fns:
                f()
            samples.append((time.perf_counter() - t) * 1e6 / len(fns))
        return statistics.median(samples)

    import torch

    def run():
        for f in fns:
            f()

    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # allocations for the graph's pool, off the capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(samples)


def synchronizer(device) -> Callable[[], None]:
    """What waits for `device` to finish its queued work (nothing to wait for on the host)."""
    import torch

    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def timed(fn: Callable[[], Any], device, reps: int = 1) -> float:
    """Seconds per call of a long call (a model step, a prefill): host clock around synchronized calls,
    after one untimed call."""
    sync = synchronizer(device)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def timer(device) -> Callable[[Callable[[], Any], int], float]:
    """`timed` bound to `device`: timer(device)(fn, reps) -> seconds per call (what full_width.decode_rows takes)."""
    return lambda fn, reps: timed(fn, device, reps)


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted), the rooflines' bandwidth; NaN off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return float("nan")
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = time_calls([lambda: b.copy_(a)], 20, graph=False)
    return 2 * a.numel() / (us * 1e-6)


def own_times(spans: Sequence[tuple[float, float]]) -> list[float]:
    """Kernels of one stream in launch order, each (start, end) -> the time each ran once every kernel before it had
    ended. A kernel launched with PDL starts while the one before finishes and waits for it inside, so its span
    holds that wait; what is left is its own time on the critical path (a start after the last end counts from the
    start: the gap before it is nobody's)."""
    out, last_end = [], float("-inf")
    for start, end in spans:
        out.append(max(0.0, end - max(start, last_end)))
        last_end = max(last_end, end)
    return out


def _kernel_key(name: str) -> str:
    """What `spans_of_run` compares of a kernel's name: inductor's kernels are all one."""
    return "triton_" if name.startswith("triton_") else name


def spans_of_run(kernels: Sequence[tuple[str, float, float]], names: Sequence[str]) -> list[tuple[float, float]] | None:
    """Device kernels (name, start, end) and the names of a run of launches in order -> the (start, end) of the
    first stretch of kernels, in start order, named exactly so (a graph replay's among the copies around it); None
    if there is none. Memory copies and sets that no launch names are passed over, also inside the stretch: a
    graph can hold copy nodes that the eagerly profiled step lists no launch for (their time falls to the gaps).
    Inductor's kernels match one another whatever their names: the same kernel can be named after other fused ops
    in another compile of the step (`triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0` profiled,
    `triton_red_fused__to_copy_add_dense_gemv_mean_mul_pow_rsqrt_0` replayed)."""
    names = [_kernel_key(n) for n in names]
    launched = set(names)
    keyed = sorted(((_kernel_key(name), start, end) for name, start, end in kernels), key=lambda k: k[1])
    ordered = [k for k in keyed if k[0] in launched or not k[0].startswith(("Memcpy", "Memset"))]
    seen = [k[0] for k in ordered]
    first = next((i for i in range(len(seen) - len(names) + 1) if seen[i : i + len(names)] == names), None)
    if not names or first is None:
        return None
    return [(start, end) for _, start, end in ordered[first : first + len(names)]]


def result_path(name: str, smoke: bool, suffix: str = ".json") -> Path:
    """$OUT/<name>.json if OUT is set, else bench/results/<name>.json; <name>-smoke.json with --smoke.
    The folder is created."""
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{name}{'-smoke' if smoke else ''}{suffix}"


def write_result(name: str, smoke: bool, result: dict) -> Path:
    """Write `result` as JSON to result_path(name, smoke); returns the path."""
    path = result_path(name, smoke)
    path.write_text(json.dumps(result, indent=1))
    return path


def grouped_log_bars(ax, groups: Sequence[str], series: dict[str, Sequence[float]]) -> None:
    """Bars of each series side by side within each group, on a log scale, with a legend."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))], values, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), groups)
    ax.legend()


def replot(result_json: str, plot: Callable[[dict, Path], None]) -> None:
    """Redraw a result's PNG (beside its JSON) from the JSON alone: `plot(result, png_path)`."""
    path = Path(result_json)
    plot(json.loads(path.read_text()), path.with_suffix(".png"))


def save_figure(path: Path, draw: Callable[[Any, Any], None], ncols: int = 2,
                figsize: tuple[float, float] = (11, 4)) -> bool:
    """A row of `ncols` plots, filled in by draw(fig, axes), saved as a PNG at `path`; False (and nothing written)
    when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    draw(fig, axes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


Column = tuple[str, "str | Callable[[Any], Any]", str]


def print_table(columns: Sequence[Column], rows: Sequence[Any]) -> None:
    """Print `rows` as right-aligned columns. A column is (header, get, spec): the cell is format(value, spec),
    where value is row[get] for a key, get(row) for a callable; a None or missing value prints as "-". Each column is as
    wide as its header or its widest cell."""
    cells = []
    for row in rows:
        line = []
        for _, get, spec in columns:
            value = get(row) if callable(get) else row.get(get)
            line.append("-" if value is None else format(value, spec))
        cells.append(line)
    widths = [max([len(h), *(len(line[i]) for line in cells)]) for i, (h, _, _) in enumerate(columns)]
    for line in [[h for h, _, _ in columns], *cells]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def write_timed_result(name: str, device: str, smoke: bool, started: float, reps: int, checks: dict[Any, dict],
                       results: list[dict], **extra: Any) -> tuple[dict, Path]:
    """A kernel bench's JSON (metadata, `extra`: its shapes and more, how it timed, its checks and rows) written
    by write_result -> (the dict, its path)."""
    result = {
        "bench": name,
        **metadata(device),
        **extra,
        "timing": "CUDA events, median of reps samples; each sample = R calls on rotating inputs, per call",
        "reps": reps,
        "wall_s": round(time.time() - started, 1),
        "checks": checks,
        "results": results,
    }
    return result, write_result(name, smoke, result)


def print_summary(gpu: str, checks: dict[Any, dict], path: Path, wall_s: float, key: str = "N=") -> None:
    """"correctness on <gpu>: N=1 ok, N=8 FAIL, ..." (checks keyed by token count, or what `key` names, each
    with an "ok") and where the results went."""
    print(f"\ncorrectness on {gpu}: " + ", ".join(f"{key}{n} {'ok' if c['ok'] else 'FAIL'}" for n, c in checks.items()))
    print(f"results: {path}  ({wall_s} s)")


def exit_if_failed(checks: dict[Any, dict]) -> None:
    """Exit with status 1, printing the checks, unless every check has "ok"."""
    if not all(c["ok"] for c in checks.values()):
        print("CORRECTNESS FAILED: " + json.dumps(checks))
        sys.exit(1)


# ------------------------------------------------------------------------------------------------------------------
# A fused kernel against its unfused baseline (mhc, moe_routing): rows keyed {mode}_fused_us, {mode}_<baseline>_us,
# {mode}_speedup, {mode}_fused_GBps (and {mode}_<baseline>_GBps when the baseline's bytes are given).


def modes(device: str) -> list[str]:
    """The timing modes on this device: "graph" (CUDA graph replay) and "eager" on CUDA, "eager" on the CPU."""
    return ["eager"] if device == "cpu" else ["graph", "eager"]


def time_fused_vs_baseline(row: dict, calls: Callable[[bool], list], reps: int, device: str, baseline: str,
                           fused_bytes: float, baseline_bytes: float | None = None, eager_sets: int = 4) -> None:
    """Fill `row` with the timings of calls(True) (fused) and calls(False) (baseline) in every mode. Graph mode
    rotates over all the input sets calls() returns; eager only over the first `eager_sets` (launch overhead
    dominates there and L2 hardly matters, and it keeps the host time short)."""
    for mode in modes(device):
        fused, base = calls(True), calls(False)
        n = len(fused) if mode == "graph" else min(len(fused), eager_sets)
        tf = time_calls(fused[:n], reps, graph=mode == "graph", cuda=device == "cuda")
        tb = time_calls(base[:n], reps, graph=mode == "graph", cuda=device == "cuda")
        row[f"{mode}_fused_us"], row[f"{mode}_{baseline}_us"] = tf, tb
        row[f"{mode}_speedup"] = tb / tf
        row[f"{mode}_fused_GBps"] = fused_bytes / tf / 1e3
        if baseline_bytes is not None:
            row[f"{mode}_{baseline}_GBps"] = baseline_bytes / tb / 1e3


def print_fused_vs_baseline(results: list[dict], device: str, baseline: str) -> None:
    """The table of time_fused_vs_baseline rows: graph mode first on CUDA, then eager."""
    print()
    columns: list[Column] = [("case", "case", ""), ("N", "N", "d")]
    for i, mode in enumerate(modes(device)):
        columns += [(f"{mode} fused us", f"{mode}_fused_us", ".2f"), (f"{baseline} us", f"{mode}_{baseline}_us", ".2f"),
                    ("speedup", f"{mode}_speedup", ".2f")]
        if i == 0:
            columns.append(("fused GB/s", f"{mode}_fused_GBps", ".1f"))
            if results and f"{mode}_{baseline}_GBps" in results[0]:
                columns.append((f"{baseline} GB/s", f"{mode}_{baseline}_GBps", ".1f"))
    print_table(columns, results)


def finish_fused_vs_baseline(name: str, device: str, smoke: bool, started: float, reps: int, checks: dict[Any, dict],
                             results: list[dict], baseline: str, plot: Callable[[dict, Path], None],
                             **extra: Any) -> None:
    """The end of a fused-vs-baseline bench: its result written (write_timed_result, `extra` in it) with its PNG
    (`plot(result, png path)`), the checks' summary and the table printed; exit 1 unless every check passed."""
    meta, path = write_timed_result(name, device, smoke, started, reps, checks, results, **extra)
    plot(meta, path.with_suffix(".png"))
    print_summary(meta["gpu"], checks, path, meta["wall_s"], key="")
    print_fused_vs_baseline(results, device, baseline)
    exit_if_failed(checks)


def plot_by_case(label: str, baseline: str) -> Callable[[dict, Path], None]:
    """plot(result, png path) for a fused-vs-baseline result whose rows have a case: us per call and speedup
    against N, a line per case (`plot_fused_vs_baseline`), titled with `label`, the GPU and the commit."""
    def plot(result: dict, path: Path) -> None:
        device = "cpu" if result["gpu"].startswith("cpu") else "cuda"
        cases = list(dict.fromkeys(r["case"] for r in result["results"]))
        title = f"{label}, {result['gpu']}, {result['commit'][:7]}"
        save_figure(path, lambda fig, axes: plot_fused_vs_baseline(axes, result["results"], device, baseline, cases,
                                                                   title, 1.0))
    return plot


def plot_fused_vs_baseline(axes, results: list[dict], device: str, baseline: str, cases: Sequence[str], title: str,
                           speedup_goal: float) -> None:
    """Left: us per call of fused and baseline against N (log-log); right: the speedup, with the goal dotted."""
    mode = modes(device)[0]
    for case in cases:
        rows = [r for r in results if r["case"] == case]
        ns = [r["N"] for r in rows]
        (line,) = axes[0].plot(ns, [r[f"{mode}_fused_us"] for r in rows], "o-", label=f"{case} fused")
        axes[0].plot(ns, [r[f"{mode}_{baseline}_us"] for r in rows], "x--", color=line.get_color(),
                     label=f"{case} {baseline}")
        axes[1].plot(ns, [r[f"{mode}_speedup"] for r in rows], "o-", label=case)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens N", ylabel=f"us per call ({mode})", title=title)
    axes[1].set(xscale="log", xlabel="tokens N", ylabel=f"speedup over {baseline}", title=f"fused / {baseline}")
    axes[1].axhline(speedup_goal, color="gray", ls=":")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
