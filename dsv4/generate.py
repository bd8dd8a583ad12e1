"""`python -m dsv4.generate`: generate text with a DeepSeek-V4 / V4.1 model through the dsv4 engine.

With no `--model` it runs the embedded default: a tiny V4.1-architecture model created
deterministically in the real on-disk format (FP8/FP4 tensors, byte-level tokenizer, Engram tables)
and cached on disk after first use. `--chat` holds a multi-turn conversation whose turns reuse the
previous turns' prefix from the cache. Bad input ends in a one-line error, not a traceback.

    python -m dsv4.generate --prompt "Hello" --max-new-tokens 32
    echo "Hello" | python -m dsv4.generate --model /path/to/DeepSeek-V4-Flash --temperature 0.7 --seed 1
    python -m dsv4.generate --chat < conversation.txt          # one user turn per line
    python -m dsv4.generate --impl fast --prompt "Hello"       # the kernels and the fast runner
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dsv4.config import ConfigError
from dsv4.engine.llm import FAST_MAX_MODEL_LEN, IMPLS, LLM

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
    p.add_argument("--impl", choices=IMPLS, default="reference",
                   help="reference: the readable model; fast: the kernels and batched slots (GPU when present)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default float32 (fast on a GPU: bfloat16)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + new tokens (default: the model's context; "
                   f"fast: at most {FAST_MAX_MODEL_LEN})")
    p.add_argument("--no-quant-sim", action="store_true", help="full precision instead of the official FP8/FP4 steps")
    p.add_argument("--no-swa-bounded-replay", action="store_true",
                   help="cache sliding windows with prefixes instead of replaying the last window on a hit")
    p.add_argument("--enforce-eager", action="store_true",
                   help="fast: no torch.compile or CUDA graphs (starts at once; slower steps)")
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


def build_engine(args: argparse.Namespace) -> LLM:
    dtype = getattr(torch, args.dtype) if args.dtype else None
    # one sequence at a time (a prompt, or a chat's turns): the fast engine captures the batch-1 graph only
    return LLM(args.model, impl=args.impl, swa_bounded_replay=not args.no_swa_bounded_replay, dtype=dtype,
               quant_sim=not args.no_quant_sim, max_model_len=args.max_model_len, max_num_seqs=1,
               progress=not args.quiet, enforce_eager=args.enforce_eager)


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


class ChatFormat:
    """Turns of a conversation as token ids that only ever grow, so every turn extends the previous
    prompt exactly and hits the prefix cache.

    With the checkpoint's chat template (tokenizer_config.json `chat_template`, rendered with jinja2
    as transformers does) each turn encodes just the text the template adds for it; without one, a
    DeepSeek-style `<｜User｜>...<｜Assistant｜>` turn format is used.
    """

    def __init__(self, llm):
        self.llm = llm
        self.template = _chat_template(llm.model_dir)
        self.messages: list[dict] = []
        self.rendered = ""
        bos = llm.config.bos_token_id
        self.ids: list[int] = [] if bos is None or self.template is not None else [bos]

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.llm.tokenizer.id_to_token(token_id)

    def _render(self, generation_prompt: bool) -> str:
        eos = self.llm.eos[0] if self.llm.eos else None
        return self.template.render(messages=self.messages, add_generation_prompt=generation_prompt,
                                    bos_token=self._token(self.llm.config.bos_token_id), eos_token=self._token(eos))

    def add_user(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        if self.template is None:
            self.ids += prompt_ids(self.llm, f"{USER}{text}{ASSISTANT}")
            return self.ids
        rendered = self._render(generation_prompt=True)
        if not rendered.startswith(self.rendered):
            raise UsageError("the chat template re-renders earlier turns differently; cannot extend the prompt")
        self.ids += self.llm.tokenizer.encode(rendered[len(self.rendered):], add_special_tokens=False).ids
        self.rendered = rendered
        return self.ids

    def add_reply(self, reply: list[int]) -> None:
        self.ids += reply
        text = self.llm.decode([t for t in reply if t not in self.llm.eos]) or ""
        self.messages.append({"role": "assistant", "content": text})
        if self.template is not None:
            self.rendered = self._render(generation_prompt=False)


def _chat_template(model_dir):
    """The checkpoint's jinja chat template, or None."""
    import json

    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def chat(llm, args: argparse.Namespace) -> None:
    """One user turn per line of standard input; each reply streams, then a prefix-cache report."""
    conversation = ChatFormat(llm)
    for turn, line in enumerate(sys.stdin, start=1):
        if not line.strip():
            continue
        ids = list(conversation.add_user(line.strip()))  # a copy: add_reply extends the conversation's ids
        reply = stream(llm, ids, args, session="chat")
        conversation.add_reply(reply)
        print(f"[turn {turn}: {llm.last_num_cached_tokens} of {len(ids)} prompt tokens from the prefix cache]",
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
