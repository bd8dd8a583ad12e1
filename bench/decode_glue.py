"""Which Python code launches torch operators in the compiled batch-1 decode step: the operators that run eagerly
inside a custom op's wrapper (padding, gathers, slot tables around a Triton kernel) or between compiled regions,
each a launch of its own that inductor cannot fuse. Counts per (operator, innermost dsv4 frames or custom op),
from torch.profiler's Python call tree over one step of the compiled decode (outside the CUDA graph, so the
operators have their callers); operators that launch nothing (on a GPU: no device time under them; on the CPU:
views, empty) are left out.

    python bench/decode_glue.py --arch v41 --layers 4 --context 8192   # H200
    python bench/decode_glue.py --smoke                                # tiny widths on the CPU (the twins' ops)
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def add_arguments(p):
    p.add_argument("--arch", default="v41", choices=["v41", "v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=8192)


ARGS = common.parse_args(__doc__, add_arguments, whole_model=True)

import torch
from full_width import bench_setup, build_random_model, prefill_chunks, random_ids
from torch.profiler import ProfilerActivity, profile

from dsv4.fast.model import make_fast
from dsv4.fast.runner import Runner

NO_LAUNCH = {  # operators that only make views or allocate
    "view",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "select",
    "slice",
    "alias",
    "detach",
    "detach_",
    "empty",
    "empty_strided",
    "lift_fresh",
    "expand",
    "reshape",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "resolve_conj",
    "resolve_neg",
    "_unsafe_view",
    "split",
    "split_with_sizes",
    "narrow",
    "unbind",
    "is_nonzero",
    "item",
    "_local_scalar_dense",
}


def launches(ev, device: torch.device) -> bool:
    """Whether an operator launched work: on a GPU, device time under it (a cast to the dtype a tensor has
    already launches nothing); on the CPU, by name."""
    if device.type == "cuda":
        return ev.device_time_total > 0
    return ev.name[len("aten::") :] not in NO_LAUNCH


def caller(ev) -> str | None:
    """The innermost dsv4 frames (or custom op) above a top-level aten operator; None for one nested in another
    aten operator (its parent is counted)."""
    frames, p = [], ev.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return None
        if "dsv4" in p.name and "site-packages" not in p.name:
            frames.append(p.name.split("dsv4/")[-1])
        p = p.cpu_parent
    return " < ".join(frames[:3])


def main():
    device, config = bench_setup(ARGS.arch, ARGS.layers, ARGS.smoke)
    context = 128 if ARGS.smoke else ARGS.context
    fast = make_fast(build_random_model(config, device, torch.bfloat16, seed=0))
    runner = Runner(fast, max_seqs=2, max_len=context + 64, compile=True)
    slot = runner.allocate()
    prefill_chunks(runner, slot, random_ids(config, context), 2048)
    next_ids, slot_ids = random_ids(config, 1).to(device), torch.tensor([slot], device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        runner.step(next_ids, slot_ids, runner.state)  # compile
        with profile(activities=activities, with_stack=True) as prof:
            runner.step(next_ids, slot_ids, runner.state)
            if device.type == "cuda":
                torch.cuda.synchronize()
    counts = Counter()
    for ev in prof.events():
        if ev.name.startswith("aten::") and launches(ev, device):
            where = caller(ev)
            if where is not None:
                counts[(ev.name, where)] += 1
    rows = [{"op": op, "calls": n, "where": where} for (op, where), n in counts.most_common()]
    result = {**common.metadata(str(device)), "arch": ARGS.arch, "layers": ARGS.layers, "context": context, "ops": rows}
    print(common.write_result(f"decode-glue-{ARGS.arch}", ARGS.smoke, result))
    for r in rows:
        print(f"{r['calls']:4d}  {r['op']:24s} {r['where']}")


if __name__ == "__main__":
    main()
