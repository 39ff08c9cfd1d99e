"""`GenerationResponse`: one request of /v1/chat/completions or /v1/completions, from the router's
first output to the last byte of its answer, as an ASGI response.

Two things decide its shape:

- The status line waits for the router's first output. Everything that refuses a request --
  validation, an unknown model, a full router (RESOURCE_EXHAUSTED), a worker that fails before
  the first token -- raises there, so it becomes an HTTP error status, not a 200 whose stream
  carries an error. An error after the first chunk of a stream is sent as an SSE event
  `data: {"error": {...}}` (then `data: [DONE]`), which OpenAI's SDK raises as APIError.
- The client's disconnect ends the request in the router. The answer runs as a task next to a
  watcher of the ASGI `receive` channel; when the watcher sees `http.disconnect` first, the
  answer task is cancelled once, which closes the router's stream and so aborts the request on
  its workers and frees its KV pages (the router's contract, router/router.py). The watcher is
  needed because sending to a gone client does not fail (the server drops the bytes), and a
  request that is still waiting for its first token sends nothing at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tandem.http_api.convert import (Call, Endpoint, Logprobs, chunk_body, finish_reason,
                                     usage_body, whole_body)
from tandem.http_api.errors import ApiError, from_router_error, send_error
from tandem.http_api.hooks import Observer, RequestRecord
from tandem.http_api.logprobs import TokenNamer, chat_logprobs, completion_logprobs
from tandem.messages import TokenLogprob
from tandem.router import GenerateOutput, Router, RouterError

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # the status a request records when its client left before the end
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]  # a proxy in front must not buffer the stream


@dataclass(slots=True)
class _Outcome:
    """What the answer learned, for the request's record: written by the answer task, and by
    `__call__` once, when it cancels that task (the client is gone)."""

    status: int = CLIENT_GONE
    error_type: str | None = None
    first: GenerateOutput | None = None
    final: GenerateOutput | None = None


class GenerationResponse(Response):
    def __init__(self, router: Router, call: Call, *, caller: str, started_at: float,
                 observer: Observer | None, traceparent: str = "") -> None:
        # No Response.__init__: this class sends its own messages (see __call__).
        self.router, self.call, self.caller = router, call, caller
        self.traceparent = traceparent  # the client's W3C trace context ("": none)
        self.started_at, self.observer = started_at, observer
        self.background = None
        self._outcome = _Outcome()
        # Names returned tokens when the request asks for logprobs (None: it does not)
        self._namer = (TokenNamer(router.tokenizer(call.model))
                       if call.inp.sampling.logprobs else None)
        self._text_offset = 0  # completions: where the next token's text starts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = asyncio.create_task(self._answer(send))
        gone = asyncio.create_task(_client_gone(receive))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelling an unfinished answer closes the router's stream: the request is
            # aborted on its workers (client gone, or the server stopping and cancelling us).
            if not answer.done():
                self._outcome.status = CLIENT_GONE
            for task in (answer, gone):
                task.cancel()
            failure = (await asyncio.gather(answer, gone, return_exceptions=True))[0]
            if isinstance(failure, Exception):  # sending failed; nothing more can be said
                log.error("%s: answer failed: %r", self.call.endpoint.value, failure)
            self._record()

    # ---- the answer -------------------------------------------------------------------------

    async def _answer(self, send: Send) -> None:
        call = self.call
        async with aclosing(self.router.generate(call.inp, caller=self.caller,
                                                 traceparent=self.traceparent,
                                                 api=call.endpoint.value)) as outputs:
            try:
                first = await anext(outputs)
            except RouterError as exc:
                await self._refuse(send, from_router_error(exc, call.rename))
                return
            except Exception:
                log.exception("%s: the router failed before the first output", call.endpoint.value)
                await self._refuse(send, _internal())
                return
            self._outcome.first = first
            if call.stream:
                await self._stream(send, outputs, first)
            else:
                await self._whole(send, outputs, first)

    async def _whole(self, send: Send, outputs, out: GenerateOutput) -> None:
        texts, lps = [out.text_delta], list(out.logprobs)
        try:
            while out.finish_reason is None:
                out = await anext(outputs)
                texts.append(out.text_delta)
                lps += out.logprobs
        except RouterError as exc:
            await self._refuse(send, from_router_error(exc, self.call.rename))
            return
        except Exception:
            log.exception("%s: the router failed", self.call.endpoint.value)
            await self._refuse(send, _internal())
            return
        self._outcome.final = out
        body = whole_body(self.call, "".join(texts), out,
                          self._logprobs(lps)).model_dump_json().encode()
        await _send_json(send, body)
        self._outcome.status = 200

    async def _stream(self, send: Send, outputs, out: GenerateOutput) -> None:
        call = self.call
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self._outcome.status = 200
        first = True
        held: list[TokenLogprob] = []  # logprobs of outputs not sent yet (no text)
        try:
            while True:
                # Chunks without text (a token that ends inside a UTF-8 character) wait for the
                # next; the first chunk goes anyway (it names the role), and so does the last.
                # Their tokens' logprobs go with the next chunk sent.
                held += out.logprobs
                if out.text_delta or first or out.finish_reason is not None:
                    body = chunk_body(call, out.request_id, out.text_delta, out.finish_reason,
                                      first, self._logprobs(held))
                    await _send_event(send, body.model_dump_json())
                    first, held = False, []
                if out.finish_reason is not None:
                    break
                out = await anext(outputs)
            self._outcome.final = out
            if call.include_usage:
                await _send_event(send, usage_body(call, out).model_dump_json())
        except Exception as exc:
            if isinstance(exc, RouterError):
                err = from_router_error(exc, call.rename)
            else:
                log.exception("%s: the router failed mid-stream", call.endpoint.value)
                err = _internal()
            self._outcome.error_type = err.type
            await _send_event(send, err.body().decode())
        await _send_event(send, "[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _logprobs(self, lps: list[TokenLogprob]) -> Logprobs | None:
        """`lps` in the endpoint's shape; None when the request did not ask."""
        if self._namer is None:
            return None
        if self.call.endpoint is Endpoint.CHAT:
            return chat_logprobs(lps, self._namer)
        shape, self._text_offset = completion_logprobs(lps, self._namer, self._text_offset)
        return shape

    async def _refuse(self, send: Send, err: ApiError) -> None:
        self._outcome.status, self._outcome.error_type = err.status, err.type
        await send_error(send, err)

    # ---- the record -------------------------------------------------------------------------

    def _record(self) -> None:
        if self.observer is None:
            return
        o, call = self._outcome, self.call
        final = o.final
        u = final.usage if final is not None else None
        record = RequestRecord(
            endpoint=call.endpoint.value, model=call.inp.model, stream=call.stream,
            status=o.status, error_type=o.error_type,
            finish_reason=finish_reason(final.finish_reason) if final is not None else None,
            request_id=o.first.request_id if o.first is not None else None,
            prompt_tokens=u.prompt_tokens if u is not None else 0,
            completion_tokens=u.completion_tokens if u is not None else 0,
            started_at=self.started_at, ttft_s=final.ttft_s if final is not None else None,
            latency_s=time.time() - self.started_at)
        try:
            self.observer.request_ended(record)
        except Exception:  # an observer's bug must not fail the request
            log.exception("observer failed on %s", record)


async def _client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read before the response starts, so
    nothing else arrives on this channel; after the response ends the server reports a
    disconnect too, harmlessly)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Send, body: bytes) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_event(send: Send, data: str) -> None:
    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                "more_body": True})


def _internal() -> ApiError:
    return ApiError(status=500, message="internal error (see the server's log)",
                    type="server_error")
