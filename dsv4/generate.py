"""`python -m dsv4.generate`: generate text with a DeepSeek-V4 / V4.1 model.

With no `--model` it runs the embedded default: a tiny V4.1-architecture model created
deterministically in the real on-disk format (FP8/FP4 tensors, byte-level tokenizer, Engram tables)
and cached on disk after first use. Bad input ends in a one-line error, not a traceback.

    python -m dsv4.generate --prompt "Hello" --max-new-tokens 32
    echo "Hello" | python -m dsv4.generate --model /path/to/DeepSeek-V4-Flash --temperature 0.7 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dsv4.config import ConfigError
from dsv4.sampling import sample


class UsageError(ValueError):
    """Bad command-line input, reported as one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv4.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--prompt", help="prompt text (default: read standard input)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("reference",), default="reference")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--no-quant-sim", action="store_true", help="full precision instead of the official FP8/FP4 steps")
    p.add_argument("--decoder-replay", action="store_true", help="V4.1: run decoder layers over the last window only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")


def load(args: argparse.Namespace):
    from tokenizers import Tokenizer

    from dsv4.checkpoint import resolve_model_dir
    from dsv4.reference.model import load_model

    if args.model is None:
        from dsv4.tiny import embedded_default_dir

        model_dir = embedded_default_dir()
    else:
        model_dir = resolve_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    model = load_model(str(model_dir), dtype, not args.no_quant_sim, not args.quiet, args.decoder_replay)
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
    return model, tokenizer


def encode_prompt(args: argparse.Namespace, tokenizer, max_len: int) -> list[int]:
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt is empty")
    if tokenizer is None:
        try:
            ids = [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise UsageError("this checkpoint has no tokenizer.json: give the prompt as token ids") from None
    else:
        ids = tokenizer.encode(text).ids
    if len(ids) + args.max_new_tokens > max_len:
        raise UsageError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the context of {max_len} tokens")
    return ids


@torch.inference_mode()
def generate(model, ids: list[int], args: argparse.Namespace) -> tuple[list[int], float, float]:
    """Greedy or sampled continuation; returns new ids, time to first token and decode tokens/s.

    The reference model recomputes the whole sequence at each step: it defines the semantics.
    """
    generator = torch.Generator().manual_seed(args.seed)
    eos = model.config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    seq = torch.tensor([ids])
    out: list[int] = []
    start = time.perf_counter()
    ttft = 0.0
    for _ in range(args.max_new_tokens):
        logits = model.logits(model.hidden_states(seq)[:, -1])
        token = sample(logits, args.temperature, args.top_k, args.top_p, generator)
        if not out:
            ttft = time.perf_counter() - start
        out.append(int(token))
        if out[-1] in stop:
            break
        seq = torch.cat((seq, token.view(1, 1)), dim=1)
    rest = time.perf_counter() - start - ttft
    return out, ttft, (len(out) - 1) / rest if len(out) > 1 and rest > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
        model, tokenizer = load(args)
        ids = encode_prompt(args, tokenizer, model.config.max_position_embeddings)
        new, ttft, tps = generate(model, ids, args)
    except (UsageError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
    print(text)
    print(f"[{len(ids)} prompt tokens, {len(new)} new; time to first token {ttft * 1000:.1f} ms; "
          f"{tps:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
