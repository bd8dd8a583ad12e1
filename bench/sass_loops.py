"""The batch-1 decode kernels' loops in sm_90 SASS, offline (no GPU needed): each loop's instructions a step, the
global loads in it that wait on memory (`LDG`) and its asynchronous copies (`LDGSTS`, the software pipeliner's),
compiled as a batch-1 V4.1 launch specializes them (an int argument of 1 becomes a constant, a multiple of 16 is
known divisible by 16), at the tiles bench/registers.py takes from each op's own configuration.

    python bench/sass_loops.py                 # the table, and bench/results/sass_loops.json ($OUT/...)
    python bench/sass_loops.py --json          # one JSON object a kernel on stdout, nothing written
    python bench/sass_loops.py --only wo_a up  # the kernels whose name contains any of the strings (not saved)
    python bench/sass_loops.py --sass DIR      # each kernel's SASS into DIR too

A load that waits inside a loop costs a memory round trip each step unless the step's other work covers it.
Session 36 found such loads in the FP8 GEMV (its scale bytes: the pipeliner copies nothing under 4 bytes), the
gather MoE (scale bytes staged through registers) and the loops that sum split partials (a loop without a dot
is pipelined only when asked: `tl.range(..., num_stages=...)`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))

import registers as R


def loops(sass: str) -> list[dict]:
    """The loops of a kernel's SASS (a branch back to an earlier instruction closes one): instructions, loads
    that wait on memory (LDG) and asynchronous copies (LDGSTS) in each."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        back = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        start = where.get(int(back.group(1), 16)) if back else None
        if start is not None and start < i:
            ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for _, x in ins[start:i + 1]]
            out.append({"instructions": len(ops), "waiting_loads": sum(op.startswith("LDG.") for op in ops),
                        "async_copies": sum(op.startswith("LDGSTS") for op in ops)})
    return out


def kernel_row(k: R.Kernel, sass_dir: Path | None) -> dict:
    """k's loops as its batch-1 launch compiles them (its SASS into sass_dir too, if given)."""
    sass = R.cuobjdump(R.launch_compile(k)[0], "-sass")
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', k.name)}.sass").write_text(sass)
    return {"kernel": k.name, "launch_ints": k.name in R.LAUNCH_INTS, "loops": loops(sass)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object a kernel, no table, nothing written")
    p.add_argument("--only", nargs="*", default=[""], help="the kernels whose name contains any of these")
    p.add_argument("--sass", type=Path, help="a folder for each kernel's SASS")
    args = p.parse_args()
    rows = (kernel_row(k, args.sass) for k in R.kernels() if "prefill" not in k.name and any(o in k.name for o in args.only))
    show = lambda r: "  ".join(f"{lp['instructions']} ins {lp['waiting_loads']} LDG {lp['async_copies']} LDGSTS"
                               for lp in r["loops"]) or "-"
    R.report("sass_loops", rows, args.json, [("kernel", "kernel", ""), ("launch ints", "launch_ints", ""),
                                             ("loops", show, "")], save=args.only == [""])


if __name__ == "__main__":
    main()
