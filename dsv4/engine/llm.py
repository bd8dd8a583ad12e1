"""The offline engine: `LLM(model=...).generate(prompts, SamplingParams(...), session_ids=...)`.

One engine step asks the scheduler for work (decode tokens and prefill chunks under a token budget),
runs it through the model with each request's cache (an executor per implementation: the reference
model over paged KV blocks, or the fast runner over sequence slots with the step's decodes batched),
samples where a piece ends on the last known token, and commits what was computed to the prefix cache.
While every running request decodes and none waits, the fast engine launches each decode step
before it reads the tokens of the one before (the device never waits for the host's turn between steps),
and drops the step run ahead for a request that stopped.
Prefix hits restore the cached global KV; with SWA bounded replay (the default) the hit's last window is
recomputed to rebuild the sliding windows, with it off the windows come from the cache and a hit
reproduces a cold run.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsv4.checkpoint import to_device
from dsv4.engine.executor import FastExecutor, ReferenceExecutor
from dsv4.engine.request import Request, RequestOutput, SamplingParams
from dsv4.engine.scheduler import Scheduler, Work
from dsv4.sampling import sample

if TYPE_CHECKING:
    from dsv4.reference.model import Dsv4Model

IMPLS = ("reference", "fast")
FAST_MAX_MODEL_LEN = 8192  # the fast engine's default slot length, at most the model's context
FAST_BATCHED_TOKENS, REFERENCE_BATCHED_TOKENS = 8192, 512  # default scheduler budgets per step (see LLM)
HOST_SLOTS = 4  # the fast engine's default slot count without a GPU


class LLM:
    """Args:
        model: checkpoint directory or Hugging Face repo id; None runs the embedded tiny V4.1 model; or a
            loaded `Dsv4Model` (no tokenizer: prompts as token ids), used as it is (its dtype; moved to
            `device`), e.g. the benchmarks' random full-width models.
        impl: "reference" (the readable model over paged KV blocks, on the host) or "fast" (the kernels
            of `dsv4.fast` over the fast runner's sequence slots, on the GPU when there is one: every
            engine step's decodes run as one batched step, a CUDA graph per batch size).
        swa_bounded_replay: on a prefix hit recompute only the last window (default, as DeepSeek and
            vLLM); off caches the windows with the prefix and reproduces the cold run exactly.
        enable_prefix_caching: reuse cached prefixes across requests and turns ("reference": cached
            blocks; "fast": retained slots, see `dsv4.engine.slot_cache`).
        device: where "fast" runs (default: the GPU when there is one); "reference" runs on the host.
        dtype: compute dtype (default float32; "fast" on a GPU: bfloat16, its kernels' operand type).
        quant_sim: the official FP8/FP4 precision steps (the packed KV formats store exactly what they
            produce); "fast" keeps the packed KV and indexer formats but not the FP8 rounding of
            activations (see `dsv4.fast.model.make_fast`).
        kv_cache_memory: bytes of KV storage ("reference": paged blocks; "fast": slots of max_model_len
            tokens each); None takes `kv_cache_fraction` of the memory available after loading (device
            memory on a GPU, host memory otherwise), except "fast" without a GPU: 4 slots (there the
            kernels' reference twins scan every slot's index keys each step).
        block_size: tokens per block, the granularity of prefix hits (default: one window, rounded up to
            the compression ratios).
        max_model_len: the longest prompt + max_tokens served (default: the model's context; "fast":
            at most 8192, as every slot holds that many tokens).
        max_num_batched_tokens / max_num_seqs: the scheduler's budget per step. max_num_batched_tokens defaults
            to 8192 for "fast" (vLLM's offline default; a fast slot's whole prompt in one forward): a forward of a
            few hundred tokens already reads nearly every routed expert's weights (256 or 384 experts, 6 per
            token), and the grouped expert kernel's time per token falls as the forward grows (H200, V4.1 widths,
            per layer: 4.2 us at 2048 tokens, 2.7 us at 8192; BENCHMARKS.md); 512 for "reference", whose dense
            masks grow with the chunk. "fast" on a GPU compiles and captures the decode graph of every batch size
            up to max_num_seqs when it is built (each padded up to a power of two), and compiles the prefill for
            every chunk length, so no request's step waits for a compile.
        enforce_eager: "fast" without torch.compile and CUDA graphs (vLLM's flag): the kernels run from eager
            PyTorch, so the engine starts at once instead of compiling and capturing first (minutes for a large
            model), at the cost of the launch overhead in every decode step. For debugging and quick runs.
        engram_tables: "device" (default) or "host": "fast" keeps V4.1's Engram tables in pinned host memory
            (THP where the OS allows) and its forwards prefetch their rows on a side stream, for
            checkpoints whose tables (V4.1-Flash: 2 x 98 GB) the GPU cannot hold (see
            `dsv4.fast.engram_prefetch`).
    """

    def __init__(
        self,
        model: str | Path | Dsv4Model | None = None,
        impl: str = "reference",
        swa_bounded_replay: bool = True,
        enable_prefix_caching: bool = True,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        quant_sim: bool = True,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float = 0.5,
        block_size: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 64,
        progress: bool = False,
        enforce_eager: bool = False,
        engram_tables: str = "device",
    ):
        from dsv4.checkpoint import resolve_model_dir
        from dsv4.reference.model import Dsv4Model, load_model

        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if model is None:
            from dsv4.tiny import embedded_default_dir

            model = embedded_default_dir()
        self.impl, self.device = impl, torch.device(device) if device else default_device(impl)
        if impl == "reference" and self.device.type != "cpu":
            raise ValueError(f"impl='reference' runs on the host, not on {self.device}: device is for impl='fast'")
        if engram_tables not in ("device", "host") or (engram_tables == "host" and impl != "fast"):
            raise ValueError(f"engram_tables is 'device' or, for impl='fast', 'host'; got {engram_tables!r}")
        if isinstance(model, Dsv4Model):
            self.model_dir = None
            self.model = _placed(model, self.device, engram_tables)
            self.model.set_quant_sim(quant_sim)
        else:
            self.model_dir = resolve_model_dir(model)
            dtype = dtype or default_dtype(impl, self.device)
            self.model = _placed(load_model(str(self.model_dir), dtype, quant_sim, progress), self.device, engram_tables)
        self.config = self.model.config
        self.max_model_len = _max_model_len(self.config, impl, max_model_len)
        self.tokenizer = _tokenizer(self.model_dir)
        eos = self.config.eos_token_id
        self.eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        block_size = block_size or default_block_size(self.config)
        if impl == "fast":
            self.kv = self._slots(quant_sim, kv_cache_memory, kv_cache_fraction, block_size, swa_bounded_replay,
                                  enable_prefix_caching, enforce_eager)
        else:
            from dsv4.engine.prefix_cache import KVManager

            memory = self._memory(kv_cache_memory, kv_cache_fraction)
            self.kv = KVManager(self.model, memory, block_size, swa_bounded_replay, enable_prefix_caching)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = FAST_BATCHED_TOKENS if impl == "fast" else REFERENCE_BATCHED_TOKENS
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs)
        if impl == "fast":  # compiles and captures before serving, not in some request's step
            self.kv.runner.warm_up(max_num_seqs, replay=swa_bounded_replay and enable_prefix_caching)
        self.executor = FastExecutor(self.kv) if impl == "fast" else ReferenceExecutor(self.model, self.scheduler)
        self._ids = itertools.count()
        self.last_num_cached_tokens = 0  # of the last streamed request, for the CLI's chat report
        self._runs = 0  # engine loops started: a loop a later one took over stops when resumed
        self._in_flight: list[Work] = []  # decode steps run ahead by a loop left at a yield (a stream not read on)

    def _slots(self, quant_sim, memory, fraction, block_size, replay, prefix_caching, eager):
        """The fast model (in place of the reference one) on its device, and its runner's slots as the KV
        manager."""
        from dsv4.engine.slot_cache import SlotKV
        from dsv4.fast.model import make_fast
        from dsv4.fast.runner import Runner

        self.model = make_fast(self.model, packed_kv=quant_sim)
        # the rings keep a block past a retained slot's end, so it serves hits at its last block boundary
        options = {"resume_span": block_size} | ({"compile": False, "cuda_graphs": False} if eager else {})
        if memory is None and self.device.type != "cuda":
            # the kernels' host twins read every slot's index keys each step: more slots cost time
            runner = Runner(self.model, HOST_SLOTS, self.max_model_len, **options)
        else:
            runner = Runner.for_memory(self.model, self._memory(memory, fraction), self.max_model_len, **options)
        return SlotKV(runner, block_size, replay, prefix_caching)

    def _memory(self, requested: int | None, fraction: float) -> int:
        """KV bytes: as requested, or `fraction` of the memory available now."""
        return requested or int(fraction * available_memory(self.device))

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
        """Yield (prompt index, token id) as tokens are sampled. Requests of an earlier stream left unfinished run to
        completion alongside (their tokens are not yielded here)."""
        requests = self._submit(prompts, sampling_params, session_ids)
        index = {id(r): i for i, r in enumerate(requests)}
        for req, token in self._run():
            if id(req) in index:
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
                self.kv.pin(session)  # a session's latest blocks (slot) stay warm for its next turn
            text = prompt if isinstance(prompt, str) else None
            req = Request(str(next(self._ids)), ids, sp, self.eos, text, session, self.device)
            self.scheduler.add(req)
            requests.append(req)
        return requests

    def _check_prompt(self, ids: list[int], sp: SamplingParams) -> None:
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.config.vocab_size}")
        limit = self.max_model_len
        if len(ids) + sp.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the context of "
                             f"{limit} (max_model_len)")

    def _run(self) -> Iterator[tuple[Request, int]]:
        """The engine loop: it takes over the requests a stream left unfinished, and stops when a later loop has
        taken over its own."""
        for step in self._in_flight:  # a step ahead of a stream left at a yield: run again when scheduled
            self.executor.discard(step)
        self._in_flight = []
        self._runs += 1
        run = self._runs
        while self.scheduler.has_work:
            for works, logits in self.executor.run(self.scheduler.schedule()):
                if self._steady(works):
                    yield from self._decode_ahead(works, logits, run)
                else:
                    yield from self._complete(works, logits)
                if self._runs != run:
                    return

    def _steady(self, works: list[Work]) -> bool:
        """Whether every step until the batch's last request finishes is known before any token is read: all
        running requests decode in this group and none waits for a slot (a finish would admit it)."""
        return (isinstance(self.executor, FastExecutor) and not self.scheduler.waiting
                and len(works) == len(self.scheduler.running) and all(w.is_step for w in works))

    def _decode_ahead(self, works: list[Work], logits: torch.Tensor, run: int) -> Iterator[tuple[Request, int]]:
        """The decode steps of a steady batch, each launched before the tokens of the one before it are read, so
        the device runs a step while the host reads tokens, finishes requests and prepares the next (it would
        idle otherwise). A step run ahead for a request that then stops is dropped, as are the steps ahead when
        the consumer leaves; on an error the computed steps complete and the steps ahead are dropped, so the
        slots hold what the requests record (one step past it could be dropped, never two)."""
        rows = list(range(len(works)))  # works[i]'s row of logits
        ahead: list[Work] = []  # launched after `works`, their input tokens not read yet
        tokens = None  # works' tokens on the device, once drawn
        try:
            while works:
                tokens = self._draw(logits, _by_row(works, rows, len(logits)))  # [len(logits)]
                going = [i for i, w in enumerate(works) if not w.request.last_step]
                steps = [Work(works[i].request, works[i].end, works[i].end + 1) for i in going]
                next_logits = self.executor.decode_ahead(steps, tokens, [rows[i] for i in going]) if steps else None
                ahead = steps
                drawn = _read(tokens, rows)  # waits for this step only
                kept = []  # of the steps ahead, those whose request goes on (their rows of next_logits)
                for j, (i, step) in enumerate(zip(going, steps)):
                    if step.request.stops_at(drawn[i]):
                        self.executor.discard(step)
                    else:
                        self.executor.record(step, drawn[i])
                        kept.append(j)
                ahead = self._in_flight = [steps[j] for j in kept]  # a later loop drops them if left at a yield
                done, works = works, []
                yield from self._complete(done, drawn=drawn)
                if self._runs != run:
                    return  # a later loop took the requests over (and dropped the steps ahead)
                works, rows, logits, ahead, tokens, self._in_flight = ahead, kept, next_logits, [], None, []
        finally:
            if self._runs == run:
                if works and tokens is not None:  # drawn, not completed: complete them, read from the device again
                    self._complete(works, drawn=_read(tokens, rows))
                elif works:  # not drawn: the steps that computed them run again
                    for step in works:
                        self.executor.discard(step)
                for step in ahead:
                    self.executor.discard(step)
                self._in_flight = []

    def _complete(self, works: list[Work], logits: torch.Tensor | None = None,
                  drawn: list[int] | None = None) -> list[tuple[Request, int]]:
        """Record computed works (logits [len(works), vocab]); sample where they reach the last token, unless
        the tokens are `drawn` already (one per work) -> (request, token) of each sampled one. Every request
        of the group is recorded before the caller yields any of them: a consumer may stop at any yield."""
        rows, requests = [], []
        for i, work in enumerate(works):
            req = work.request
            req.replay_from = None  # a pending replay led this work
            if work.replay:
                continue
            req.computed = work.end
            self.kv.commit(req.cache, req.computed)
            if work.samples:
                rows.append(i)
                requests.append(req)
        if not requests:
            return []
        if drawn is not None:
            tokens = [drawn[i] for i in rows]
        else:
            tokens = self._draw(logits if len(rows) == len(logits) else logits[rows], requests).tolist()
        for req, token in zip(requests, tokens):
            req.append(token)
            if req.finished:
                self.scheduler.finish(req)
        return list(zip(requests, tokens))

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request | None]) -> torch.Tensor:
        """logits [n, vocab] -> each row's next token [n] on the logits' device, with no host sync: one argmax
        over the rows serves the greedy ones (and rows of no request); the others are drawn one by one with
        their own generators."""
        logits = self._mask(logits)
        tokens = logits.argmax(dim=-1)
        for i, req in enumerate(requests):
            if req is not None and req.params.temperature != 0:
                sp = req.params
                tokens[i] = sample(logits[i : i + 1], sp.temperature, sp.top_k, sp.top_p, req.generator)[0]
        return tokens

    def _mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] with the tokens that are never sampled at -inf: V4.1's image token (image input is
        not supported)."""
        image = self.config.image_token_id if self.config.is_v41 else None
        if image is None or image >= logits.shape[-1]:
            return logits
        # on a copy: the executor's logits are inference tensors, read-only out here (a slice's fill uploads no
        # index, so the host does not wait for the device)
        logits = logits.clone()
        logits[:, image] = float("-inf")
        return logits

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


def default_device(impl: str) -> torch.device:
    """The fast implementation runs on the GPU when there is one, the reference model on the host."""
    return torch.device("cuda" if impl == "fast" and torch.cuda.is_available() else "cpu")


def default_dtype(impl: str, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if impl == "fast" and device.type == "cuda" else torch.float32


def _max_model_len(config, impl: str, requested: int | None) -> int:
    context = config.max_position_embeddings
    if requested is None:
        return min(context, FAST_MAX_MODEL_LEN) if impl == "fast" else context
    if not 0 < requested <= context:
        raise ValueError(f"max_model_len must be in 1..{context} (the model's context), got {requested}")
    return requested


def default_block_size(config) -> int:
    """One sliding window of tokens, rounded up to a multiple of every compression ratio."""
    lcm = math.lcm(1, *config.compression_ratios)
    return -(-config.sliding_window // lcm) * lcm


def _broadcast(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _tokenizer(model_dir: Path | None):
    file = None if model_dir is None else model_dir / "tokenizer.json"
    if file is None or not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _placed(model: Dsv4Model, device: torch.device, engram_tables: str) -> Dsv4Model:
    """The model on `device`, its Engram tables left in host memory when asked (moved there first)."""
    if engram_tables == "host":
        from dsv4.fast.engram_prefetch import keep_engram_on_host

        keep_engram_on_host(model)
    return to_device(model, device)


def _by_row(works: list[Work], rows: list[int], n: int) -> list[Request | None]:
    """The request of each of n logits rows (works[i] owns rows[i]; None: a row nobody reads)."""
    out: list[Request | None] = [None] * n
    for work, row in zip(works, rows):
        out[row] = work.request
    return out


def _read(tokens: torch.Tensor, rows: list[int]) -> list[int]:
    """Device tokens [n] -> on the host, those of `rows` in their order (waits for the device)."""
    drawn = tokens.tolist()
    return [drawn[row] for row in rows]
