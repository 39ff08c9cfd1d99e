"""One request in flight on the `DisaggregatedDispatcher` (router/disagg.py): its record in the
dispatcher's table (`Flight`), and how its workers' events become its chunks (`follow`).

The dispatcher owns the table (request id -> `Flight`, the only place a request's state lives on
the router's disaggregated path) and the orchestration: admission, the calls to the workers,
retries and aborts. `follow` reads one attempt's events, from the room's queue that the workers'
channels (router/worker_channel.py) fill, and yields the client's chunks: prefill's first token
as soon as it comes, its outcome (a failure, or the end when the first token finished the
request), then decode's outputs, whose first repeats the first token (dropped here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from tandem import trace
from tandem.messages import DecodeOutput, FinishReason, FirstToken, PrefillResult
from tandem.router.dispatch import (
    DeadlineExceeded,
    RequestFailed,
    RoutedRequest,
    TokenChunk,
    TransferFailed,
    WorkerUnavailable,
    acceptance_from_rounds,
)
from tandem.router.worker_channel import ChannelLost
from tandem.router.worker_health import WorkerHealthTable

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(slots=True)
class Flight:
    """A request from its submission to its end (queued for a slot, waiting for decode pages,
    or on its two workers). `prefill`, `decode` and `room` are its current attempt's: a retry
    after its prefill worker died moves it to another prefill worker, and each attempt (also
    after decode was full) has a room of its own."""

    prefill: str  # worker names
    decode: str
    room: int
    aborted: bool = False  # `abort()` came: it ends as aborted at its next look
    ended_on_prefill: bool = False  # its first token finished it: decode's pages are unused
    waited_s: float = 0.0  # for a running slot, then for decode pages (its last chunk's queue_s)

    def on_last(self, chunk: TokenChunk) -> TokenChunk:
        """`chunk`, with the time waited when it is the request's last."""
        return dataclasses.replace(chunk, queue_s=self.waited_s) if chunk.finished else chunk


async def follow(request: RoutedRequest, flight: Flight, events: asyncio.Queue, *,
                 num_steps: int, table: WorkerHealthTable) -> AsyncGenerator[TokenChunk, None]:
    """The chunks of `flight`'s current attempt from its workers' events, until its last one
    (`events`: (worker name, event) of its room on both workers). A broken event stream marks
    its worker down in `table` and raises WorkerUnavailable."""
    rid, room, pname, dname = request.request_id, flight.room, flight.prefill, flight.decode
    early: tuple[int, str] | None = None  # the first token, streamed from prefill
    prefill_over = False  # the prefill's outcome came (its transfer is terminal)
    rounds: list[int] = []
    outputs = 0  # decode outputs seen
    while True:
        try:
            worker, ev = await asyncio.wait_for(events.get(), remaining(request))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"request '{rid}' passed its deadline") from None
        if isinstance(ev, ChannelLost):
            if worker == pname and (prefill_over or outputs > 0):
                continue  # the KV is on decode already: the prefill worker is not needed
            side = "prefill" if worker == pname else "decode"
            # Down until its next health answer (a restarted worker answers anew): no new
            # request, and no retry, goes to it meanwhile.
            table.down(worker, f"its event stream broke: {ev.error}"[:300])
            raise WorkerUnavailable(worker, f"{side} worker '{worker}' became unavailable "
                                            f"while serving this request: {ev.error}")
        if isinstance(ev, FirstToken):
            if outputs == 0 and early is None:
                early = (ev.token, ev.text)
                trace.mark(room, "router.first")
                yield TokenChunk(request_id=rid, token_ids=(ev.token,), text_delta=ev.text,
                                 logprobs=(ev.logprob,) if ev.logprob is not None else ())
            continue
        if isinstance(ev, PrefillResult):  # the prefill's outcome
            prefill_over = True
            if flight.aborted:  # abort() raced the prefill: end as aborted
                yield aborted_chunk(rid)
                return
            if outputs > 0:  # decode has produced: the KV landed, a late outcome is moot
                continue
            if not ev.ok:
                raise prefill_failure(rid, pname, dname, ev)
            if ev.finished:  # the first token ended the request on prefill
                flight.ended_on_prefill = True
                # No first token when it completed a stop string (only the text before).
                first = () if ev.first_token is None else (ev.first_token,)
                lps = (ev.first_logprob,) if first and ev.first_logprob is not None else ()
                yield TokenChunk(request_id=rid, token_ids=first, text_delta=ev.first_text,
                                 finish_reason=_FINISH.get(ev.finish_reason or "stop"),
                                 logprobs=lps)
                return
            continue
        # a DecodeOutput (what is left on the two channels)
        if ev.finish_reason == "error":
            if flight.aborted:  # abort() raced: decode reports the abort before prefill does
                yield aborted_chunk(rid)
                return
            raise decode_failure(rid, pname, dname, ev)
        tokens, text, lps = tuple(ev.token_ids), ev.text_delta, ev.logprobs
        if outputs > 0 and ev.token_ids:
            rounds.append(len(ev.token_ids))
        elif early is not None:  # decode's first output repeats the first token
            tokens, text = drop_first(tokens, text, early, rid)
            lps = lps[len(ev.token_ids) - len(tokens):]  # and its logprob (asked: one a token)
        else:  # decode's output came first: prefill's first token is moot
            trace.mark(room, "router.first")
            early = (-1, "")  # a FirstToken arriving later is not streamed
        outputs += 1
        reason = _FINISH.get(ev.finish_reason) if ev.finished else None
        if ev.finished and reason is None:  # a finish this router does not know: fail now,
            raise RequestFailed(  # never wait for the deadline of a request that has ended
                f"decode worker '{dname}': unknown finish reason {ev.finish_reason!r}",
                request_id=rid)
        spec = acceptance_from_rounds(rounds, num_steps) if reason is not None else None
        if tokens or text or reason is not None:
            yield TokenChunk(request_id=rid, token_ids=tokens, text_delta=text,
                             finish_reason=reason, spec=spec, logprobs=lps)
        if reason is not None:
            return


def prefill_failure(rid: str, pname: str, dname: str, res: PrefillResult) -> Exception:
    """The error of a request whose prefill side failed (a PrefillResult with ok False)."""
    kind = res.error_kind
    if kind == "aborted":
        return TransferFailed(pname, f"prefill worker '{pname}' aborted the request: "
                                     f"{res.error}")
    if kind in ("request", "worker"):
        return RequestFailed(f"prefill worker '{pname}': {res.error}", request_id=rid)
    return TransferFailed(pname, f"KV transfer from prefill worker '{pname}' to decode "
                                 f"worker '{dname}' failed on the prefill side "
                                 f"({kind or 'error'}): {res.error}")


def decode_failure(rid: str, pname: str, dname: str, out: DecodeOutput) -> Exception:
    if out.error_kind == "request":
        return RequestFailed(f"decode worker '{dname}': {out.error}", request_id=rid)
    return TransferFailed(dname, f"KV transfer from prefill worker '{pname}' to decode "
                                 f"worker '{dname}' failed on the decode side: {out.error}")


def drop_first(tokens: tuple[int, ...], text: str, early: tuple[int, str], rid: str
               ) -> tuple[tuple[int, ...], str]:
    """Decode's first output without the first token the client already has from prefill (an
    output without tokens -- e.g. the end of an aborted request -- passes as it is)."""
    if not tokens:
        return tokens, text
    if tokens[:1] == (early[0],) and text.startswith(early[1]):
        return tokens[1:], text[len(early[1]):]
    log.error("request '%s': decode's first output %r / %r does not start with prefill's first "
              "token %r / %r", rid, tokens[:1], text[:20], early[0], early[1][:20])
    return tokens, text


def aborted_chunk(rid: str) -> TokenChunk:
    return TokenChunk(request_id=rid, token_ids=(), text_delta="", finish_reason=FinishReason.ABORT)


def remaining(request: RoutedRequest) -> float | None:
    """Seconds left to `request`'s deadline (None: it has none)."""
    if request.deadline is None:
        return None
    return max(0.0, request.deadline - time.time())
