"""The decode step replayed from its compiled CUDA graphs vs run eagerly, from the same cache state (the step is
dropped between the two: `Runner.drop_last`), on full-width V4.1 layers first..last at 2048 tokens of context:
the logits' distance per batch size, and the graph step's time. At batch 1 the deterministic compiled parts round
where eager torch rounds, so a fusion that skips a rounding of the eager code shows as a distance above 0 (this
random model turns any difference into a large one: a routing or top-k choice flips). GPU only.

    python bench/compiled_vs_eager.py 2 5"""
import json
import os
import sys

import common

common.fresh_compile_caches()

import torch
from full_width import build_random_model, fill_slots, full_width_config, random_ids

from dsv4.fast.model import make_fast
from dsv4.fast.runner import Runner

first, last = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda")
fast = make_fast(build_random_model(full_width_config("v41", layers=range(first, last + 1)), dev, torch.bfloat16, seed=0))
sizes = [1, 8]
r = Runner(fast, max_seqs=8, max_len=2048 + 128, batch_sizes=sizes)
slots = fill_slots(r, 2048, 8, 2048)
ids = random_ids(fast.config, 8, torch.Generator().manual_seed(1)).to(dev)
compiled_step = r.step


def decode(graph: bool, B: int) -> torch.Tensor:
    """One step of slots[:B], then forgotten (what it wrote is rewritten by the next step at the same positions)."""
    r.cuda_graphs, r.step = (True, compiled_step) if graph else (False, fast.decode_step)
    out = r.decode(slots[:B], ids[:B]).float().clone()
    for s in slots[:B]:
        r.drop_last(s)
    return out


row = {"commit": os.environ.get("DSV4_COMMIT"), "gpu": torch.cuda.get_device_name(), "layers": [first, last],
       "command": " ".join(["python bench/compiled_vs_eager.py", *sys.argv[1:]]), "sizes": {}}
for B in sizes:
    graph, eager = decode(True, B), decode(False, B)
    r.cuda_graphs, r.step = True, compiled_step
    step_ms = common.timed(lambda B=B: r.decode(slots[:B], ids[:B]), dev, 30) * 1e3
    row["sizes"][B] = {"graph_vs_eager_max_abs_diff": float((graph - eager).abs().max()),
                       "max_abs_logit": float(eager.abs().max()),
                       "argmax_equal": bool(torch.equal(graph.argmax(-1), eager.argmax(-1))), "graph_step_ms": step_ms}
print(json.dumps(row))
with open(os.path.join(os.environ.get("OUT", "."), f"compiled-vs-eager-{first}-{last}.json"), "w") as f:
    json.dump(row, f, indent=1)
