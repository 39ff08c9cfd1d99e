"""A request's state inside one engine, and the values the engine hands back.

`Request` is mutable and owned by the `Scheduler` (the only writer); everything returned to
callers (`RequestOutput`, `Completion`) is a frozen value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.messages import FinishReason, SamplingParams  # noqa: F401 -- re-exported
from tandem.messages import TokenLogprob


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_len: int  # prompt + outputs never exceed this (context limit)
    generator: torch.Generator | None = None
    # Tokens generated; when a stop string ended the request, the token that completed it is
    # not among them (docs/architecture.md, "Request semantics").
    output_ids: list[int] = field(default_factory=list)
    # [len(output_ids)] when params.logprobs, else empty (messages/logprobs.py)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of all_ids whose K/V are in the cache
    text: str = ""  # detokenized output so far (stop strings are found here)
    num_emitted_chars: int = 0  # prefix of `text` already streamed out
    finish_reason: FinishReason | None = None
    error: str = ""  # why it failed (finish_reason ERROR)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Prefix caching (scheduler.py): the chained keys of the prompt's cacheable pages (computed
    # at first admission), how many leading pages of `page_ids` the cache already has (matched
    # or inserted), and the prompt tokens served from the cache at admission (metrics).
    prefix_keys: list[bytes] | None = None
    num_prefix_pages: int = 0
    num_cached_tokens: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """What one engine step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    error: str = ""  # finish_reason ERROR: why this request failed ("stage: Type: message")
    logprobs: tuple[TokenLogprob, ...] = ()  # [len(new_token_ids)] when the request asked


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A finished request."""

    req_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    ttft_s: float  # arrival -> first token
    latency_s: float  # arrival -> finish
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str = ""  # finish_reason ERROR: why this request failed
    logprobs: tuple[TokenLogprob, ...] = ()  # [len(output_ids)] when the request asked
