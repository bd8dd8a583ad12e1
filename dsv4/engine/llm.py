"""The offline engine: `LLM(model=...).generate(prompts, SamplingParams(...), session_ids=...)`.

One engine step asks the scheduler for work (decode tokens and prefill chunks under a token budget),
runs every piece through the model with that request's cache, samples where a piece ends on the
last known token, and registers completed blocks with the prefix cache. Prefix hits restore the
cached global KV; with SWA bounded replay (the default) the hit's last window is recomputed to rebuild
the sliding windows, with it off the windows come from the cache and a hit reproduces a cold run.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from dsv4.engine.request import Request, RequestOutput, SamplingParams
from dsv4.engine.scheduler import Scheduler, Work
from dsv4.sampling import sample

IMPLS = ("reference",)


class LLM:
    """Args:
        model: checkpoint directory or Hugging Face repo id; None runs the embedded tiny V4.1 model.
        impl: "reference" (the readable model; "fast" arrives with the fast runner).
        swa_bounded_replay: on a prefix hit recompute only the last window (default, as DeepSeek and
            vLLM); off caches the windows with the prefix and reproduces the cold run exactly.
        enable_prefix_caching: reuse cached prefixes across requests and turns.
        dtype: compute dtype; quant_sim: the official FP8/FP4 precision steps (the packed KV formats
            store exactly what they produce).
        kv_cache_memory: bytes of paged KV blocks; None takes `kv_cache_fraction` of the memory
            available after loading (device memory on a GPU, host memory otherwise).
        block_size: tokens per block (default: one window, rounded up to the compression ratios).
        max_num_batched_tokens / max_num_seqs: the scheduler's budget per step.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        impl: str = "reference",
        swa_bounded_replay: bool = True,
        enable_prefix_caching: bool = True,
        dtype: torch.dtype = torch.float32,
        quant_sim: bool = True,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float = 0.5,
        block_size: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        progress: bool = False,
    ):
        from dsv4.checkpoint import resolve_model_dir
        from dsv4.engine.prefix_cache import KVManager
        from dsv4.reference.model import load_model

        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if model is None:
            from dsv4.tiny import embedded_default_dir

            model = embedded_default_dir()
        self.model_dir = resolve_model_dir(model)
        self.model = load_model(str(self.model_dir), dtype, quant_sim, progress)
        self.config = self.model.config
        self.tokenizer = _tokenizer(self.model_dir)
        eos = self.config.eos_token_id
        self.eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        self.kv = KVManager(
            self.model,
            memory_bytes=kv_cache_memory or int(kv_cache_fraction * available_memory(self.model.embed.weight.device)),
            block_size=block_size or default_block_size(self.config),
            swa_bounded_replay=swa_bounded_replay,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs)
        self._ids = itertools.count()
        self.last_num_cached_tokens = 0  # of the last streamed request, for the CLI's chat report

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        session_ids: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        requests = self._submit(prompts, sampling_params, session_ids)
        for _ in self._run():
            pass
        return [r.to_output(self._text(r)) for r in requests]

    def stream(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        session_ids: str | Sequence[str | None] | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yield (prompt index, token id) as tokens are sampled."""
        requests = self._submit(prompts, sampling_params, session_ids)
        index = {id(r): i for i, r in enumerate(requests)}
        for req, token in self._run():
            yield index[id(req)], token
        self.last_num_cached_tokens = requests[-1].num_cached_tokens

    def end_session(self, session_id: str) -> None:
        """The session is over: its cached blocks become ordinary LRU candidates."""
        self.kv.unpin(session_id)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompts as token ids")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    # ------------------------------------------------------------------ engine loop
    def _submit(self, prompts, sampling_params, session_ids) -> list[Request]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = [p or SamplingParams() for p in _broadcast(sampling_params, len(prompts), "sampling_params")]
        sessions = _broadcast(session_ids, len(prompts), "session_ids")
        requests = []
        for prompt, sp, session in zip(prompts, params, sessions):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._check_prompt(ids, sp)
            if session is not None:
                self.kv.pin(session)  # a session's latest blocks stay warm for its next turn
            req = Request(str(next(self._ids)), ids, sp, self.eos, prompt if isinstance(prompt, str) else None, session)
            self.scheduler.add(req)
            requests.append(req)
        return requests

    def _check_prompt(self, ids: list[int], sp: SamplingParams) -> None:
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.config.vocab_size}")
        limit = self.config.max_position_embeddings
        if len(ids) + sp.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the context of {limit}")

    def _run(self) -> Iterator[tuple[Request, int]]:
        while self.scheduler.has_work:
            for work in self.scheduler.schedule():
                token = self._execute(work)
                if token is not None:
                    yield work.request, token

    @torch.inference_mode()
    def _execute(self, work: Work) -> int | None:
        from dsv4.engine.pool import OutOfBlocks

        req = work.request
        if req.cache is None:  # preempted earlier in this step
            return None
        ids = torch.tensor([req.token_ids[work.start : work.end]])
        try:
            hidden = self.model.hidden_states(ids, cache=req.cache, start_pos=work.start)
        except OutOfBlocks:
            if len(self.scheduler.running) == 1:
                raise RuntimeError(f"request {req.request_id} needs more KV memory than the engine has") from None
            self.scheduler.running.remove(req)
            self.scheduler.running.append(req)  # make it the newest, then give its memory back
            self.scheduler.preempt_newest()
            return None
        if work.replay:
            req.replay_from = None
            return None
        req.computed = work.end
        self.kv.commit(req.cache, req.computed)
        if not work.samples:
            return None
        logits = self.model.logits(hidden[:, -1])
        image = self.config.image_token_id if self.config.is_v41 else None
        if image is not None and image < logits.shape[-1]:
            logits[..., image] = float("-inf")  # image input is not supported: never emit an image token
        sp = req.params
        token = int(sample(logits, sp.temperature, sp.top_k, sp.top_p, req.generator))
        req.append(token)
        if req.finished:
            self.scheduler.finish(req)
        return token

    def _text(self, req: Request) -> str | None:
        return self.decode(req.output_ids)


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool: free device memory on CUDA, available host memory otherwise."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # platforms without these sysconf names
        return 1 << 30


def default_block_size(config) -> int:
    """One sliding window of tokens, rounded up to a multiple of every compression ratio."""
    lcm = math.lcm(1, *(r for r in config.compress_ratios[: config.num_hidden_layers] if r))
    return -(-config.sliding_window // lcm) * lcm


def _broadcast(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _tokenizer(model_dir: Path):
    file = model_dir / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
