"""The decode step compiled per part (entry, one block per layer kind, exit: FastModel.compile_decode) vs compiled
whole (torch.compile of decode_step, the old way), each in its own process with empty inductor and Triton caches:
compile + capture time per batch size, step time, and the logits, compared with those of every earlier run over the
same layers that it finds in $OUT (a run's name: mode and the optional label). V4.1 full width, released layers
first..last. GPU only.

    python bench/decode_compile.py regional 2 11 && python bench/decode_compile.py whole 2 11
    python bench/decode_compile.py regional 2 11 a && python bench/decode_compile.py regional 2 11 b   # run to run

(Run at 28f77e3 as exp/regional_vs_whole.py, the name its results in bench/results/dev/decode-compile-*.json give;
the decode tokens were drawn from the prompt's generator then.)"""
import json
import os
import sys
import time

import common

common.fresh_compile_caches()

import torch
from full_width import build_random_model, fill_slots, full_width_config, random_ids
from safetensors.torch import load_file, save_file

from dsv4.fast.model import compile_options, make_fast
from dsv4.fast.runner import Runner

mode, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
name = "-".join([mode, *sys.argv[4:5]])
dev = torch.device("cuda")
cfg = full_width_config("v41", layers=range(first, last + 1))
fast = make_fast(build_random_model(cfg, dev, torch.bfloat16, seed=0))
ctx, sizes = 2048, [1, 8]
g = torch.Generator().manual_seed(1)
steps = [random_ids(fast.config, 8, g).to(dev) for _ in range(4)]
r = Runner(fast, max_seqs=8, max_len=ctx + 128, batch_sizes=sizes)
if mode == "whole":
    r.step = torch.compile(fast.decode_step, dynamic=None, options=compile_options("inductor", deterministic=True))
slots = fill_slots(r, ctx, 8, 2048)
row = {"commit": os.environ.get("DSV4_COMMIT"), "gpu": torch.cuda.get_device_name(), "run": name,
       "layers": [first, last], "command": " ".join(["python bench/decode_compile.py", *sys.argv[1:]]), "capture_s": {}}
for b in sizes:
    t = time.perf_counter()
    r.capture(b)  # compiles and captures size b (the smaller ones are done)
    torch.cuda.synchronize()
    row["capture_s"][b] = time.perf_counter() - t
logits = {b: r.decode(slots[:b], steps[0][:b]).cpu() for b in sizes}
row["step_ms"] = {b: common.timed(lambda b=b: r.decode(slots[:b], steps[2][:b]), dev, 30) * 1e3 for b in sizes}
out_dir = os.environ.get("OUT", ".")
suffix = f"-{first}-{last}.safetensors"
row["vs"] = {}
for f in sorted(os.listdir(out_dir)):  # earlier runs over these layers
    if f.startswith("decode-compile-") and f.endswith(suffix):
        theirs = {int(b): t for b, t in load_file(os.path.join(out_dir, f)).items()}
        row["vs"][f[len("decode-compile-") : -len(suffix)]] = {
            b: {"max_abs_diff": float((logits[b] - theirs[b]).abs().max()),
                "argmax_equal": bool(torch.equal(logits[b].argmax(-1), theirs[b].argmax(-1)))} for b in sizes}
save_file({str(b): t for b, t in logits.items()}, os.path.join(out_dir, f"decode-compile-{name}{suffix}"))
print(json.dumps(row))
with open(os.path.join(out_dir, f"decode-compile-{name}-{first}-{last}.json"), "w") as f:
    json.dump(row, f, indent=1)
