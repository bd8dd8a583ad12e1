"""`python -m dsv4.generate`: generate text with a DeepSeek-V4 / V4.1 model through the dsv4 engine.

With no `--model` it runs the embedded default: a tiny V4.1-architecture model created
deterministically in the real on-disk format (FP8/FP4 tensors, byte-level tokenizer, Engram tables)
and cached on disk after first use. `--chat` holds a multi-turn conversation whose turns reuse the
previous turns' prefix from the cache. Bad input ends in a one-line error, not a traceback.

    python -m dsv4.generate --prompt "Hello" --max-new-tokens 32
    echo "Hello" | python -m dsv4.generate --model /path/to/DeepSeek-V4-Flash --temperature 0.7 --seed 1
    python -m dsv4.generate --chat < conversation.txt          # one user turn per line
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dsv4.config import ConfigError

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


class UsageError(ValueError):
    """Bad command-line input, reported as one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv4.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--prompt", help="prompt text (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="multi-turn chat: one user turn per line of standard input")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("reference",), default="reference")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-quant-sim", action="store_true", help="full precision instead of the official FP8/FP4 steps")
    p.add_argument("--no-swa-bounded-replay", action="store_true",
                   help="cache sliding windows with prefixes instead of replaying the last window on a hit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    from dsv4.engine.request import SamplingParams

    try:
        SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        flag = str(e).split()[0].replace("max_tokens", "max-new-tokens").replace("_", "-")
        raise UsageError(f"--{flag} {str(e).split(' ', 1)[1]}") from None


def sampling(args: argparse.Namespace):
    from dsv4.engine.request import SamplingParams

    return SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def build_engine(args: argparse.Namespace):
    from dsv4.engine.llm import LLM

    dtype = getattr(torch, args.dtype)
    return LLM(args.model, impl=args.impl, swa_bounded_replay=not args.no_swa_bounded_replay, dtype=dtype,
               quant_sim=not args.no_quant_sim, progress=not args.quiet)


def prompt_ids(llm, text: str) -> list[int]:
    if not text.strip():
        raise UsageError("the prompt is empty")
    if llm.tokenizer is not None:
        return llm.encode(text)
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError("this checkpoint has no tokenizer.json: give the prompt as token ids") from None


def stream(llm, ids: list[int], args: argparse.Namespace, session: str | None = None) -> list[int]:
    """Print the continuation as it is sampled; return its token ids."""
    out: list[int] = []
    shown = ""
    start = time.perf_counter()
    first = None
    for _, token in llm.stream([ids], sampling(args), [session]):
        first = first or time.perf_counter()
        out.append(token)
        text = llm.decode(out) if llm.tokenizer is not None else " ".join(map(str, out))
        print(text[len(shown):], end="", flush=True)
        shown = text
    print()
    end = time.perf_counter()
    rate = (len(out) - 1) / (end - first) if len(out) > 1 and end > first else 0.0
    print(f"[{len(ids)} prompt tokens, {len(out)} new; time to first token {(first - start) * 1000:.1f} ms; "
          f"{rate:.1f} tokens/s]", file=sys.stderr)
    return out


def chat(llm, args: argparse.Namespace) -> None:
    """Each turn appends to the conversation as token ids, so the next turn's prompt extends the last
    one exactly and hits the prefix cache."""
    bos = llm.config.bos_token_id
    conversation: list[int] = [] if bos is None else [bos]
    for turn, line in enumerate(sys.stdin, start=1):
        if not line.strip():
            continue
        conversation += prompt_ids(llm, f"{USER}{line.strip()}{ASSISTANT}")
        reply = stream(llm, conversation, args, session="chat")
        conversation += reply
        cached = llm.last_num_cached_tokens
        print(f"[turn {turn}: {cached} of {len(conversation) - len(reply)} prompt tokens from the prefix cache]",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
        llm = build_engine(args)
        if args.chat:
            chat(llm, args)
        else:
            ids = prompt_ids(llm, args.prompt if args.prompt is not None else sys.stdin.read())
            stream(llm, ids, args)
    except (UsageError, ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
