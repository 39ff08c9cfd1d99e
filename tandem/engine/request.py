"""A request's state inside one engine, and the values the engine hands back.

`Request` is mutable and owned by the `Scheduler` (the only writer); everything returned to
callers (`RequestOutput`, `Completion`) is a frozen value.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.messages import FinishReason, SamplingParams  # noqa: F401 -- re-exported
from tandem.messages import TokenLogprob

PENDING = -1  # in `Request.all_ids`: a token sampled on the device whose value is not read yet


class PoolTooSmall(ValueError):
    """The request needs more KV pages (prompt + max_new_tokens) than the whole pool has: it
    can never run on this engine, however long it waits."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    num_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    # Prefix caching (zeros when off): pages the cache maps (those no request holds are not
    # counted free but are reclaimed on demand), and totals of prompt tokens looked up at
    # admission / served from the cache -- hit rate = hit / query.
    num_cached_pages: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, max_len: int) -> None:
    """Raise ValueError naming the problem: empty, out-of-vocab id, or longer than the context."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_token_ids: the prompt is empty")
    for i, t in enumerate(prompt_ids):
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(
                f"prompt_token_ids[{i}]: token id {t!r} is outside the vocabulary [0, {vocab_size})"
            )
    if len(prompt_ids) >= max_len:
        raise ValueError(
            f"prompt_token_ids: the prompt has {len(prompt_ids)} tokens; the context holds "
            f"{max_len} (prompt + at least one new token)"
        )


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
    # Overlap scheduling (engine/overlap.py): tokens sampled on the device and not read yet
    # (0, 1, or 2 for a moment inside a step). They end `all_ids` as PENDING placeholders: the
    # scheduler counts them, the next forward takes them from the device.
    num_pending: int = 0
    text: str = ""  # detokenized output so far (stop strings are found here)
    num_emitted_chars: int = 0  # prefix of `text` already streamed out
    finish_reason: FinishReason | None = None
    error: str = ""  # why it failed (finish_reason ERROR)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # When the scheduler first gave it a running slot (perf_counter; None while queued or
    # when it came in running, handed off): its queue time is this minus arrival_time.
    scheduled_time: float | None = None
    num_preemptions: int = 0
    # Prefix caching (scheduler.py): the chained keys of the prompt's cacheable pages (computed
    # at first admission), how many leading pages of `page_ids` the cache already has (matched
    # or inserted), and the prompt tokens served from the cache at admission (metrics).
    prefix_keys: list[bytes] | None = None
    num_prefix_pages: int = 0
    num_cached_tokens: int = 0

    @property
    def all_ids(self) -> list[int]:
        if self.num_pending:
            return self.prompt_ids + self.output_ids + [PENDING] * self.num_pending
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, stop: int) -> tuple[int, ...]:
        """all_ids[start:stop], without building all_ids (the scheduler asks for every row's
        chunk each step: a decode row's one token of a request thousands long)."""
        p = len(self.prompt_ids)
        if start < p:
            return tuple(self.all_ids[start:stop])
        out = self.output_ids[start - p : stop - p]
        return (*out, *(PENDING,) * (min(stop, self.num_tokens) - start - len(out)))

    @property
    def num_tokens(self) -> int:
        """Tokens known to exist, the pending ones included (what the scheduler plans with)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_resolved(self) -> int:
        """Tokens whose values the host has read: prompt + outputs (stop checks use this)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_reaches_length(self) -> bool:
        """Whether the pending tokens already take the request to a length limit: its next
        read ends it (finish length), so it must not be scheduled again."""
        return self.num_pending > 0 and (
            len(self.output_ids) + self.num_pending >= self.params.max_new_tokens
            or self.num_tokens >= self.max_total_len)

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
    # The finishing output only: seconds it waited in this engine's queue for a running slot
    # (None: it came in running, or the output is not its last)
    queue_s: float | None = None


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


def find_stop(text: str, prev_len: int, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in `text` that was not complete in text[:prev_len]."""
    if not stops:
        return None
    start = max(0, prev_len - max(map(len, stops)) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def token_end(req: Request, token: int, eos_ids: frozenset[int], ahead: int = 0
              ) -> FinishReason | None:
    """Whether `token`, the last of `req`'s outputs once `ahead` more are appended (0: it is
    already), ends the request by its tokens: EOS or a stop token (STOP), else its length
    (LENGTH). Stop strings are the text's (`find_stop`)."""
    p = req.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return FinishReason.STOP
    if (len(req.output_ids) + ahead >= p.max_new_tokens
            or req.num_resolved + ahead >= req.max_total_len):
        return FinishReason.LENGTH
    return None


def completion_of(req: Request) -> Completion:
    """The frozen summary of a finished request."""
    assert req.finish_reason is not None
    now = time.perf_counter()
    return Completion(
        req_id=req.req_id, prompt_ids=tuple(req.prompt_ids), output_ids=tuple(req.output_ids),
        text=req.text, finish_reason=req.finish_reason,
        ttft_s=(req.first_token_time or now) - req.arrival_time,
        latency_s=now - req.arrival_time, num_cached_tokens=req.num_cached_tokens,
        error=req.error, logprobs=tuple(req.output_logprobs),
    )
