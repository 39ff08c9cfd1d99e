"""`tandem bench` over an OpenAI-compatible HTTP front, without a server: what `--target` means
(the scheme picks the API), how a streamed answer's token count is spread over its chunks, and
how every way an answer can go wrong is counted under a gRPC status name. The HTTP client reads
scripted answers through httpx2's mock transport; the real front is the integration test's
(integration/test_bench_http.py)."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from tandem.bench.client import DriverConfig
from tandem.bench.http_client import CHAT, COMPLETIONS, HttpClient, spread, status_name
from tandem.bench.metrics import itls, latency, tpot, ttft
from tandem.bench.results import status_of
from tandem.bench.target import Api, Target
from tandem.bench.workload import BenchRequest
from tandem.engine.config import ConfigError

URL = "http://127.0.0.1:8000"


def test_the_scheme_picks_the_api():
    assert Target.parse("127.0.0.1:50051") == Target(api=Api.GRPC, address="127.0.0.1:50051")
    assert Target.parse("grpc://h:1") == Target(api=Api.GRPC, address="h:1")
    assert Target.parse("http://127.0.0.1:8000") == Target(api=Api.HTTP, address=URL)
    assert Target.parse("HTTPS://h/") == Target(api=Api.HTTP, address="https://h")
    # An OpenAI client's base_url works as it is: the driver adds /v1/... itself.
    assert Target.parse("http://h:8000/v1").address == "http://h:8000"
    assert Target.parse("http://h:8000/proxy/v1/").address == "http://h:8000/proxy"
    for bad, match in [("localhost", "HOST:PORT"), ("grpc://h", "HOST:PORT"),
                       ("ftp://h:1", "scheme 'ftp'"), ("http://:80", "HOST"),
                       ("http://h:port", "not a URL"), ("http://h:1?x=1", "HOST")]:
        with pytest.raises(ConfigError, match=f"target: .*{match}"):
            Target.parse(bad)


@pytest.mark.parametrize("num_tokens,num_chunks", [(1, 1), (8, 8), (9, 3), (16, 5), (7, 1),
                                                   (5, 6), (2, 2)])
def test_spread_keeps_the_count_and_the_metrics_identities(num_tokens, num_chunks):
    from tandem.bench.metrics import RequestRecord

    counts = spread(num_tokens, num_chunks)
    assert len(counts) == num_chunks and sum(counts) == num_tokens and min(counts) >= 0
    assert counts[0] == (num_tokens if num_chunks == 1 else 1)  # the prefill's token alone
    assert max(counts[1:], default=0) - min(counts[1:], default=0) <= 1  # an even share
    times = tuple(0.1 + 0.03 * i for i in range(num_chunks))
    r = RequestRecord(chunk_times_s=times, chunk_tokens=counts, prompt_tokens=4)
    if num_tokens >= num_chunks:  # every gap counted: the mean ITL is the TPOT
        gaps = itls(r)
        assert len(gaps) == num_tokens - 1
        assert sum(gaps) == pytest.approx(latency(r) - ttft(r))
        if num_tokens > 1:
            assert sum(gaps) / len(gaps) == pytest.approx(tpot(r))


def test_http_statuses_read_as_the_grpc_names_the_front_maps_from():
    # The front's table (tandem/http_api/errors.py), read backwards.
    assert {s: status_name(s) for s in (400, 401, 404, 409, 429, 499, 500, 503, 504)} == {
        400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
        429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE",
        504: "DEADLINE_EXCEEDED"}
    assert status_name(418) == "UNKNOWN"


# ---- the client over scripted answers -------------------------------------------------------


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def text_chunk(text: str, reason: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text,
                                                      "finish_reason": reason}]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


def stream(body: bytes, status: int = 200) -> httpx2.Response:
    return httpx2.Response(status, content=body,
                           headers={"content-type": "text/event-stream; charset=utf-8"})


def send(handler, req: BenchRequest, timeout_s: float = 30.0, token: str | None = "tok"):
    """(the record, the requests the server saw)."""
    seen: list[httpx2.Request] = []

    async def handle(request: httpx2.Request):
        seen.append(request)
        out = handler(request)
        return await out if asyncio.iscoroutine(out) else out

    async def main():
        cfg = DriverConfig(target=Target.parse(URL), auth_token=token, temperature=0.5,
                           request_timeout_s=timeout_s)
        async with httpx2.AsyncClient(base_url=URL, transport=httpx2.MockTransport(handle),
                                      headers={"authorization": f"Bearer {token}"}) as http:
            client = HttpClient(http, cfg, model="tiny")
            return await client.send(client.prepare(req), 0.0)

    return asyncio.run(main()), seen


IDS = BenchRequest(prompt_token_ids=(300, 301, 302), max_tokens=4, ignore_eos=True)
CHAT_Q = BenchRequest(question="why?", max_tokens=4, ignore_eos=False)


def test_a_streamed_completion_is_measured_from_its_chunks_and_usage():
    body = sse(text_chunk(" w1"), text_chunk(" w2 w3"), text_chunk(" w4", "length"),
               usage(3, 4), "[DONE]")
    r, seen = send(lambda req: stream(body), IDS)
    assert r.ok and r.error is None and status_of(r) == "OK"
    assert (r.output_tokens, r.chunk_tokens, r.prompt_tokens) == (4, (1, 2, 1), 3)
    assert r.spec is None and r.server_ttft_s is None  # n/a over OpenAI's API
    (request,) = seen
    assert request.url.path == COMPLETIONS
    assert request.headers["authorization"] == "Bearer tok"
    sent = json.loads(request.content)
    assert sent == {"model": "tiny", "prompt": [300, 301, 302], "max_tokens": 4,
                    "temperature": 0.5, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}


def test_a_chat_question_goes_to_chat_completions_and_the_role_chunk_is_not_a_token():
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    delta = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    body = sse(role_only, delta, delta, end, usage(9, 3), "[DONE]")
    r, seen = send(lambda req: stream(body), CHAT_Q)
    assert seen[0].url.path == CHAT
    assert json.loads(seen[0].content)["messages"] == [{"role": "user", "content": "why?"}]
    assert "ignore_eos" not in json.loads(seen[0].content)
    # Three chunks: two with text, the finish (here carrying the EOS, counted by the usage).
    assert r.ok and len(r.chunk_times_s) == 3 and r.output_tokens == 3
    assert r.prompt_tokens == 9


def test_without_usage_each_chunk_counts_one_token():
    r, _ = send(lambda req: stream(sse(text_chunk("a"), text_chunk("b", "length"), "[DONE]")),
                IDS)
    assert r.ok and r.output_tokens == 2 and r.prompt_tokens == 3  # the ids sent


@pytest.mark.parametrize("answer,status,in_error", [
    (lambda req: httpx2.Response(401, json={"error": {"message": "bad token",
                                                      "type": "authentication_error"}}),
     "UNAUTHENTICATED", "HTTP 401: bad token"),
    (lambda req: httpx2.Response(429, json={"error": {"message": "queue: full"}}),
     "RESOURCE_EXHAUSTED", "queue: full"),
    (lambda req: httpx2.Response(503, text="<html>down</html>"), "UNAVAILABLE", "<html>down"),
    (lambda req: httpx2.Response(422, json={"detail": "x"}), "INVALID_ARGUMENT", "HTTP 422"),
    # An error event after the stream started: by its type (tandem), or its code (vLLM's).
    (lambda req: stream(sse(text_chunk("a"), {"error": {"message": "worker d died",
                                                        "type": "service_unavailable"}},
                            "[DONE]")), "UNAVAILABLE", "worker d died"),
    (lambda req: stream(sse(text_chunk("a"), {"error": {"message": "m", "type": "X",
                                                        "code": 500}})), "INTERNAL", "m"),
    (lambda req: stream(sse(text_chunk("a"), text_chunk("", "abort"), usage(3, 1))), "OTHER",
     "aborted"),
    (lambda req: stream(sse(text_chunk("a"))), "OTHER", "without a final message"),
    (lambda req: stream(b"data: {not json\n\n"), "OTHER", "not JSON"),
    (lambda req: stream(sse({"choices": ["x"]})), "OTHER", "unexpected event"),
    (lambda req: httpx2.Response(200, json={"choices": []}), "OTHER", "not an event stream"),
    (lambda req: (_ for _ in ()).throw(httpx2.ConnectError("connection refused")),
     "UNAVAILABLE", "ConnectError: connection refused"),
])
def test_each_failure_is_counted_under_a_status(answer, status, in_error):
    r, _ = send(answer, IDS)
    assert not r.ok and status_of(r) == status and in_error in r.error, r.error


def test_the_deadline_closes_the_request_as_deadline_exceeded():
    async def slow(req):
        await asyncio.sleep(5)
        return stream(sse(text_chunk("a", "length"), usage(3, 1)))

    r, _ = send(slow, IDS, timeout_s=0.2)
    assert status_of(r) == "DEADLINE_EXCEEDED" and "0.2 s" in r.error
