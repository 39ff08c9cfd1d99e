"""What a worker tells its router: the events of its requests, which travel in batches on the
router's event channel (worker/channels.py, router/worker_channel.py), and its health answer.

A prefill worker's channel carries `FirstToken`s and `PrefillResult`s, a decode worker's
`DecodeOutput`s; the router tells them apart by type.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.messages.logprobs import TokenLogprob


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstToken:
    """A prefill worker's first token of a room, as soon as its forward is over (before the
    KV moves): the router streams it to the client at once."""

    room: int
    token: int
    text: str
    logprob: TokenLogprob | None = None  # when the request asks (messages/logprobs.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillResult:
    """The end of a request's life on the prefill worker."""

    room: int
    ok: bool  # False: prefill or transfer failed (see error)
    # None when it failed, or when the first token ended the request by completing a stop
    # string: then the client gets `first_text` (the text before the stop string) but no token.
    first_token: int | None = None
    first_text: str = ""
    first_logprob: TokenLogprob | None = None  # with first_token, when the request asks
    finished: bool = False  # the first token ended the request; nothing was transferred
    finish_reason: str | None = None
    error: str = ""
    # TransferError kind, "aborted", "invalid", "handshake", "worker" (the prefill worker
    # failed the room), or "request": this request's own work failed in the prefill forward's
    # step (its sampling or stop checks raised); the worker ended it, freed its pages,
    # transferred nothing and serves the others on.
    error_kind: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeOutput:
    """New tokens of one request on the decode worker (or its failure)."""

    room: int
    token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    # [len(token_ids)] when the request asks (messages/logprobs.py), else ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str = ""
    # With finish_reason "error": "request" when this request's own work failed on the worker
    # (its sampling, stop checks or detokenizer raised; the worker ended it, freed its pages
    # and serves the others on), "" for a KV transfer / seed failure.
    error_kind: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferTotals:
    """A worker's KV transfers since its process started (its rank 0's endpoint; a prefill
    worker counts what it sent, a decode worker what it received). Cumulative: they only grow,
    and start again at 0 when Ray restarts the worker (a new `WorkerHealth.incarnation`), which
    the router accounts for (router/worker_counts.py)."""

    backend: str  # "mooncake" | "nixl" | "fake"
    num_done: int = 0  # transfers that completed
    num_bytes: int = 0  # payload bytes of those (KV pages + seed)
    latency_bounds_s: tuple[float, ...] = ()  # upper bounds of the latency buckets, ascending
    # [len(latency_bounds_s) + 1] completed transfers per bucket (not cumulative); the last
    # bucket is above every bound
    latency_counts: tuple[int, ...] = ()
    latency_sum_s: float = 0.0
    failures: tuple[tuple[str, int], ...] = ()  # (error kind, count), sorted by kind

    def __add__(self, other: TransferTotals) -> TransferTotals:
        """Both counted together (the router adds a restarted worker's new counts to what its
        earlier incarnations reported). Latency buckets add up only under the same bounds; with
        other bounds (another tandem version) `other`'s histogram replaces this one's."""
        same = self.latency_bounds_s == other.latency_bounds_s
        failures = dict(self.failures)
        for kind, n in other.failures:
            failures[kind] = failures.get(kind, 0) + n
        return TransferTotals(
            backend=other.backend, num_done=self.num_done + other.num_done,
            num_bytes=self.num_bytes + other.num_bytes,
            latency_bounds_s=other.latency_bounds_s,
            latency_counts=(tuple(a + b for a, b in zip(self.latency_counts,
                                                        other.latency_counts))
                            if same else other.latency_counts),
            latency_sum_s=(self.latency_sum_s if same else 0.0) + other.latency_sum_s,
            failures=tuple(sorted(failures.items())))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHealth:
    """A worker's answer to the router's health poll."""

    name: str
    role: str  # "prefill" | "decode"
    healthy: bool
    error: str
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int
    node: str  # Ray node id / hostname the actor runs on
    mean_acceptance_length: float = 0.0
    per_position: tuple[float, ...] = ()
    num_rounds: int = 0
    num_free_slots: int = 0  # decode: seed slots free / in all (this rank, or summed over DP)
    num_slots: int = 0
    incarnation: str = ""  # new each time the actor (re)starts: a restart means new endpoints
    pid: int = 0  # the worker's process (what an operator or a fault test signals)
    transfer: TransferTotals | None = None  # None: the worker has no transfer endpoint
