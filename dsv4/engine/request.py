"""Requests and their results, shaped like vLLM's so its users feel at home.

`SamplingParams` says how to continue a prompt; a `Request` is one prompt moving through the engine;
`RequestOutput` (with `CompletionOutput` and `RequestMetrics`) is what `LLM.generate` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """max_tokens new tokens at most; temperature 0 is greedy; top_k 0 / top_p 1 disable the filters;
    `seed` makes a sampled request reproducible; generation stops after any of `stop_token_ids`
    (and the model's end-of-sequence token unless `ignore_eos`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, n_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or n_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (n_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop", "length", or None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


class Request:
    """One prompt in flight: its tokens, progress, cache and sampling state."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, eos: list[int],
                 prompt_text: str | None = None, session_id: str | None = None, device: torch.device | str = "cpu"):
        self.request_id, self.prompt_text, self.session_id = request_id, prompt_text, session_id
        self.prompt_ids, self.params = list(prompt_ids), params
        self.output_ids: list[int] = []
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        # on the device the logits are sampled on (a seed's draws differ between CPU and GPU)
        self.generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.cache = None  # the KV manager's cache while running
        self.computed = 0  # positions whose state is in the cache
        self.replay_from: int | None = None  # a prefix hit's window replay still to run
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        now = time.perf_counter()
        if not self.output_ids:
            self.metrics.first_token_time = now
        self.finish_reason = self.stops_at(token)
        self.output_ids.append(token)
        if self.finished:
            self.metrics.finished_time = now

    @property
    def last_step(self) -> bool:
        """The next token is the last: max_tokens ends the request there."""
        return len(self.output_ids) + 1 >= self.params.max_tokens

    def stops_at(self, token: int) -> str | None:
        """The finish reason that appending `token` gives (None: the request goes on)."""
        if token in self.stop_ids:
            return "stop"
        return "length" if self.last_step else None

    def to_output(self, text: str | None) -> RequestOutput:
        completion = CompletionOutput(0, list(self.output_ids), text, self.finish_reason)
        return RequestOutput(self.request_id, self.prompt_text, list(self.prompt_ids), [completion],
                             self.finished, self.num_cached_tokens, self.metrics)
