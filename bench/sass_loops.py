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

_ATTN = {"stride_hn": R.HC * R.D, "stride_hk": R.D, "stride_xn": R.D}
# the int arguments a batch-1 V4.1 decode step launches each kernel with (an argument a kernel does not take is
# ignored; one not listed is compiled unspecialized): 80 mHC partials (D / 64), 40 gate partials (D / 128), 20
# attention splits (window + top-k tiles of 32)
LAUNCH_INTS = {
    "mhc_pre partial": {"N": 1, "D": R.D, "steps_per_prog": 1, "stride_wn": R.HC, **_ATTN},
    "mhc_pre finish": {"N": 1, "D": R.D, "n_split": 80, "d_per_prog": R.D, **_ATTN},
    "mhc_post finish": {"N": 1, "D": R.D, "n_split": 80},
    "mhc_post partial": {"N": 1, "D": R.D, "n_split": 80},
    "moe gate GEMM": {"N": 1, "E": R.EXPERTS, "D": R.D, "steps_per_prog": 1, "stride_xn": R.D, "stride_we": R.D},
    "moe route": {"N": 1, "E": R.EXPERTS, "n_split": 40, "stride_split": R.EXPERTS, "stride_ln": R.EXPERTS},
    **{f"moe gather {part}{tokens}": {"D": R.D, "I": R.I, "E": R.EXPERTS}
       for part in ("up", "down") for tokens in ("", f" ({R.moe_experts.GATHER_MAX_N} tokens)")},
    "sparse_attn combine": {"H": R.H, "n_splits": 20},
    **{f"fp8_gemv {name}": {"M": 1, "N": N, "K": K, "KW": K // 4, "KS": K // 32, "block_n": 32,
                            "G": G}
       for name, N, K, G in R.FP8_GEMV_SHAPES},
    **{f"dense_gemv {name}": {"M": 1, "N": N, "K": K} for name, N, K, _ in R.DENSE_GEMV_SHAPES},
}


def launch_compile(k: R.Kernel):
    """k compiled as its batch-1 launch specializes it (`LAUNCH_INTS`)."""
    ints = LAUNCH_INTS.get(k.name, {})
    sig, constexprs, attrs = R.signature(k), dict(k.constexprs), R.launch_attrs(k)
    for i, p in enumerate(k.fn.params):
        value = ints.get(p.name)
        if value == 1:
            sig[p.name], constexprs[p.name] = "constexpr", 1
        elif value is not None and value % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return R.compile_sm90(k, sig, constexprs, attrs)[0]


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
    sass = R.cuobjdump(launch_compile(k), "-sass")
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', k.name)}.sass").write_text(sass)
    return {"kernel": k.name, "launch_ints": k.name in LAUNCH_INTS, "loops": loops(sass)}


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
