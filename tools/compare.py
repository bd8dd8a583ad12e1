"""Compare two implementations (or two checkpoints) of a DeepSeek-V4 / V4.1 model, layer by layer.

    python tools/compare.py --model DIR --a reference --b transformers --first-divergence
    python tools/compare.py --model DIR --model-b TWIN_DIR --a reference --b reference --quant-sim
    python tools/compare.py --model DIR --a reference --b fast --first-divergence   # GPU: bf16, the kernels

Both sides run the same prompt (`--prompt-ids 1,2,3`, or `--seq-len N --seed S` random ids). Printed per
layer (the residual streams after each block) and for the final logits: max abs error, relative error
(max abs error / max |a|), cosine; for the logits also top-1 agreement and KL(a || b) of the softmaxes.
`--first-divergence` names the first layer whose relative error exceeds `--tol`, and what inside it
diverges first: a sublayer (engram, attn, ffn), the input handed to one ("ffn input": the mHC collapse
and norm before it), or "mhc" when only the stream mixing differs. The exit status is 1 when the final
logits differ by more than tol * max |logit|, 2 when the comparison cannot run.

Implementations are a table name -> loader (`IMPLEMENTATIONS`); a loader takes (model_dir, dtype,
quant_sim) and returns a function from input ids to a `Trace`. `compare(...)` is the importable core.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from dsv4.checkpoint import resolve_model_dir, to_transformers_dir
from dsv4.config import Dsv4Config


@dataclass
class Trace:
    """What one forward pass exposes for comparison (all fp32).

    blocks[i]: "out" -> the residual streams after block i [B, S, hc, D], plus, in the order the block
    runs its sublayers, each one's input ("attn.in") and output ("attn"): "engram" [B, S, hc, D],
    "attn" and "ffn" [B, S, D].
    logits: [B, S, V].
    """

    blocks: list[dict[str, torch.Tensor]]
    logits: torch.Tensor


Runner = Callable[[torch.Tensor], Trace]


# ----------------------------------------------------------------------------- recording
def _store(record: dict, label: str, module: nn.Module, args: tuple, output) -> None:
    """Forward hook: keep a module's output (a tuple's first element) and, for a sublayer, its input."""
    out = output[0] if isinstance(output, tuple) else output
    if label != "out" and args:
        record[f"{label}.in"] = args[0].detach().float()
    record[label] = out.detach().float()


@contextmanager
def _recording(blocks: list[dict[str, nn.Module]]) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Per block, the outputs of its named submodules during the forward passes inside the context."""
    records = [{} for _ in blocks]
    handles = [
        module.register_forward_hook(partial(_store, record, label))
        for record, modules in zip(records, blocks)
        for label, module in modules.items()
    ]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------- implementations
def _dsv4_runner(model) -> Runner:
    """Layer states of a dsv4 model (reference or fast) through `hidden_states`' layer hook, on the host."""
    device = model.embed.weight.device
    sublayers = [
        {label: getattr(block, label) for label in ("engram", "attn", "ffn") if hasattr(block, label)}
        for block in model.layers
    ]

    def run(ids: torch.Tensor) -> Trace:
        with _recording(sublayers) as records:
            def keep(layer_id: int, h: torch.Tensor) -> None:
                records[layer_id]["out"] = h.detach().float()

            logits = model.logits(model.hidden_states(ids.to(device), keep))
        records = [{label: t.cpu() for label, t in record.items()} for record in records]
        return Trace(records, logits.float().cpu())

    return run


def load_reference(model_dir: Path, dtype: torch.dtype, quant_sim: bool, decoder_replay: bool = False) -> Runner:
    """dsv4's reference model. With decoder_replay (V4.1), the decoder layers and the logits cover only the
    prompt's last window."""
    from dsv4.reference.model import load_model

    return _dsv4_runner(load_model(str(model_dir), dtype, quant_sim, progress=False, decoder_replay=decoder_replay))


def load_fast(model_dir: Path, dtype: torch.dtype, quant_sim: bool) -> Runner:
    """dsv4's fast model: on a GPU its kernels (bfloat16 only), elsewhere the kernels' reference twins.
    quant_sim keeps its caches in the released packed formats; its linears never round their activations
    to FP8 (the reference's quant_sim does), so the like-for-like comparison with the reference is the
    rounding-free one, quant_sim off (the default when fast is a side)."""
    from dsv4.checkpoint import to_device
    from dsv4.engine.llm import default_device
    from dsv4.fast.model import make_fast
    from dsv4.reference.model import load_model

    model = to_device(load_model(str(model_dir), dtype, quant_sim, progress=False), default_device("fast"))
    return _dsv4_runner(make_fast(model, packed_kv=quant_sim))


def _is_transformers_dir(model_dir: Path) -> bool:
    """A directory written by transformers' DeepseekV4 `save_pretrained` (its config has layer_types)."""
    return "layer_types" in json.loads((model_dir / "config.json").read_text())


def load_transformers(model_dir: Path, dtype: torch.dtype, quant_sim: bool) -> Runner:
    """transformers' DeepseekV4ForCausalLM (V4 only; it has no FP8 simulation, so quant_sim is moot).

    An official-format directory is first written out dequantized, with transformers' names.
    """
    from transformers import DeepseekV4ForCausalLM

    with tempfile.TemporaryDirectory(prefix="dsv4-compare-") as tmp:
        hf_dir = model_dir if _is_transformers_dir(model_dir) else to_transformers_dir(model_dir, tmp)
        model = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    blocks = [{"out": layer, "attn": layer.self_attn, "ffn": layer.mlp} for layer in model.model.layers]

    def run(ids: torch.Tensor) -> Trace:
        with _recording(blocks) as records:
            logits = model(input_ids=ids, use_cache=False).logits
        return Trace(records, logits.float())

    return run


IMPLEMENTATIONS: dict[str, Callable[[Path, torch.dtype, bool], Runner]] = {
    "reference": load_reference,
    "reference-replay": functools.partial(load_reference, decoder_replay=True),
    "transformers": load_transformers,
    "fast": load_fast,
}


# ----------------------------------------------------------------------------- metrics
def _common_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align [B, S, ...] tensors on their last positions: decoder replay computes only the prompt's
    last window, so the positions both sides have are the trailing ones."""
    n = min(a.shape[1], b.shape[1])
    return a[:, a.shape[1] - n :], b[:, b.shape[1] - n :]


def tensor_metrics(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """max abs error, relative error (max abs error / max |a|) and cosine, in float64, over the
    positions both sides computed."""
    a, b = _common_rows(a, b)
    a, b = a.double().flatten(), b.double().flatten()
    err, peak = (a - b).abs().max().item(), a.abs().max().item()
    norms = a.norm() * b.norm()
    cos = (a @ b / norms).item() if norms > 0 else float(torch.equal(a, b))
    rel = err / peak if peak > 0 else (0.0 if err == 0 else float("inf"))
    return {"max_abs": err, "rel": rel, "cos": cos}


def logit_metrics(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """tensor_metrics plus top-1 agreement and mean KL(softmax a || softmax b) over positions."""
    a, b = _common_rows(a, b)
    la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    kl = (la.exp() * (la - lb)).sum(-1).mean().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    return {**tensor_metrics(a, b), "top1": top1, "kl": kl}


def layer_metrics(a: Trace, b: Trace) -> list[dict]:
    """Per block: the streams' metrics and, under "sublayers", those of each sublayer both sides record."""
    rows = []
    for i, (ra, rb) in enumerate(zip(a.blocks, b.blocks)):
        subs = {label: tensor_metrics(ra[label], rb[label]) for label in ra if label != "out" and label in rb}
        rows.append({"layer": i, **tensor_metrics(ra["out"], rb["out"]), "sublayers": subs})
    return rows


def _exceeds(rel: float, tol: float) -> bool:
    return not rel <= tol  # a NaN error diverges too


def first_divergence(layers: list[dict], tol: float) -> dict | None:
    """The first layer whose streams' relative error exceeds tol, and what inside it diverges first:
    a sublayer ("attn"), the input it was handed ("attn input": the mHC collapse and norm before it),
    or, when every sublayer agrees, "mhc" (the streams were mixed differently)."""
    for row in layers:
        if _exceeds(row["rel"], tol):
            label = next((label for label, m in row["sublayers"].items() if _exceeds(m["rel"], tol)), "mhc")
            return {"layer": row["layer"], "module": label.replace(".in", " input"), "rel": row["rel"]}
    return None


# ----------------------------------------------------------------------------- the comparison
def random_prompt(config: Dsv4Config, seq_len: int, seed: int) -> torch.Tensor:
    """[1, seq_len] uniform token ids; V4.1 image tokens (not text input) become EOS."""
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    if config.is_v41 and config.image_token_id is not None:
        ids[ids == config.image_token_id] = config.eos_token_id
    return ids


@torch.inference_mode()
def compare(
    model: str | Path,
    a: str = "reference",
    b: str = "transformers",
    *,
    model_b: str | Path | None = None,
    prompt_ids: list[int] | None = None,
    seq_len: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    quant_sim: bool | None = None,
    tol: float = 1e-4,
) -> dict:
    """Run implementation `a` on `model` and `b` on `model_b` (default: the same directory) and report.

    quant_sim defaults to off when transformers is one side (it has no FP8 simulation) or fast is (it rounds
    no activations), else on.
    The report's "ok" is False when the final logits' max abs error exceeds tol * max |logit of a|.
    """
    for name in (a, b):
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {name!r}; known: {sorted(IMPLEMENTATIONS)}")
    dir_a = resolve_model_dir(model)
    dir_b = resolve_model_dir(model_b) if model_b is not None else dir_a
    if quant_sim is None:
        quant_sim = not {"transformers", "fast"} & {a, b}
    config = Dsv4Config.from_json(dir_a)
    ids = torch.tensor([prompt_ids]) if prompt_ids is not None else random_prompt(config, seq_len, seed)
    # one model in memory at a time: each runner (and its model) is dropped after its pass
    trace_a = IMPLEMENTATIONS[a](dir_a, dtype, quant_sim)(ids)
    trace_b = IMPLEMENTATIONS[b](dir_b, dtype, quant_sim)(ids)
    layers = layer_metrics(trace_a, trace_b)
    logits = logit_metrics(trace_a.logits, trace_b.logits)
    return {
        "a": a,
        "b": b,
        "model": str(dir_a),
        "model_b": str(dir_b),
        "seq_len": ids.shape[1],
        "dtype": str(dtype).removeprefix("torch."),
        "quant_sim": quant_sim,
        "tol": tol,
        "layers": layers,
        "logits": logits,
        "first_divergence": first_divergence(layers, tol),
        "ok": logits["max_abs"] <= tol * trace_a.logits.abs().max().item(),
    }


# ----------------------------------------------------------------------------- command line
def format_report(report: dict, show_divergence: bool) -> str:
    lines = [
        f"{report['a']} ({report['model']}) vs {report['b']} ({report['model_b']}): "
        f"{report['seq_len']} tokens, {report['dtype']}, quant_sim={report['quant_sim']}",
        f"{'layer':>6} {'max_abs':>10} {'rel':>10} {'cos':>12}",
    ]
    for row in report["layers"]:
        lines.append(f"{row['layer']:>6} {row['max_abs']:>10.3e} {row['rel']:>10.3e} {row['cos']:>12.9f}")
    m = report["logits"]
    lines.append(
        f"{'logits':>6} {m['max_abs']:>10.3e} {m['rel']:>10.3e} {m['cos']:>12.9f}"
        f"   top1 {m['top1']:.4f}   KL(a||b) {m['kl']:.3e}"
    )
    if show_divergence:
        d = report["first_divergence"]
        lines.append(
            f"first divergence: layer {d['layer']} ({d['module']}), rel {d['rel']:.3e} > tol {report['tol']:g}"
            if d
            else f"first divergence: none (every layer within rel tol {report['tol']:g})"
        )
    lines.append("OK" if report["ok"] else f"FAIL: logits differ by more than {report['tol']:g} x max |logit|")
    return "\n".join(lines)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (or Hugging Face repo id)")
    p.add_argument("--model-b", help="checkpoint for side b (default: --model)")
    p.add_argument("--a", default="reference", choices=sorted(IMPLEMENTATIONS))
    p.add_argument("--b", default="transformers", choices=sorted(IMPLEMENTATIONS))
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    prompt.add_argument("--seq-len", type=int, default=64, help="length of a random prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--quant-sim",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the official FP8/FP4 precision steps in dsv4 (default: off against transformers or fast, else on)",
    )
    p.add_argument("--first-divergence", action="store_true", help="name the first divergent layer and sublayer")
    p.add_argument("--tol", type=float, default=1e-4, help="relative tolerance (of max |a|)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = compare(
            args.model,
            args.a,
            args.b,
            model_b=args.model_b,
            prompt_ids=args.prompt_ids,
            seq_len=args.seq_len,
            seed=args.seed,
            dtype=getattr(torch, args.dtype),
            quant_sim=args.quant_sim,
            tol=args.tol,
        )
    except (ValueError, FileNotFoundError) as e:  # bad checkpoint, config or pairing: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report, args.first_divergence))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
