"""The OpenAI-compatible HTTP front against a scripted dispatcher (no model): the real `openai`
SDK talks to `HttpServer` on 127.0.0.1, which runs next to the gRPC server on one loop
(`BackgroundServer(fronts=...)`) over one `Router`.

Checks: the body shapes of both endpoints, streamed and whole (the same text either way), usage
and `stream_options.include_usage`; each error class with its status, OpenAI error shape and the
field it names (400, 401, 404, 409-free ids, 413, 429, 503, 504, an error mid-stream); a client
that goes away mid-stream or before its first token stops the request in the router;
/v1/models, /health, the observer hook; and the pure conversions."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import AsyncGenerator

import openai
import pytest
from http_helpers import openai_client, word_tokenizer

from tandem.http_api import HttpConfig, HttpServer, RequestRecord
from tandem.http_api.convert import completion_call
from tandem.http_api.errors import from_router_error, from_validation_errors
from tandem.http_api.schemas import CompletionRequest
from tandem.messages import FinishReason, TokenLogprob
from tandem.router import (
    CapacityExceeded,
    Code,
    DispatcherStats,
    DispatchError,
    ModelInfo,
    RoutedRequest,
    Router,
    RouterConfig,
    RouterError,
    TokenChunk,
    WorkerInfo,
    WorkerRole,
    WorkerUnavailable,
)
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig

pytestmark = pytest.mark.timeout(60)

TOKEN = "http-secret"
MODEL = ModelInfo(name="tiny", vocab_size=256, max_model_len=64, max_request_tokens=48)
HEALTHY = [WorkerInfo(name="w0", role=WorkerRole.COLOCATED, model="tiny", num_pages=8,
                      num_free_pages=8)]


class ScriptedDispatcher:
    """Streams the words w10, w11, ... (one token each, text " w10", ...) `delay_s` apart, up to
    `num_tokens` or max_new_tokens; `error` is raised after `error_after` chunks. Records every
    request and the streams closed before their last chunk (what an abort looks like here).
    A request that asks for logprobs gets `scripted_logprob(i, top_logprobs)` for token i."""

    def __init__(self) -> None:
        self.num_tokens, self.delay_s = 3, 0.0
        self.error: DispatchError | None = None
        self.error_after = 0
        self.submitted: list[RoutedRequest] = []
        self.closed_early: list[str] = []
        self.live: set[str] = set()
        self.healthy = True

    def models(self):
        return (MODEL,)

    def workers(self):
        return [WorkerInfo(name="w0", role=WorkerRole.COLOCATED, model="tiny",
                           healthy=self.healthy, num_pages=8, num_free_pages=8)]

    async def submit(self, request: RoutedRequest) -> AsyncGenerator[TokenChunk, None]:
        self.submitted.append(request)
        rid = request.request_id
        self.live.add(rid)
        finished = False
        try:
            n = min(self.num_tokens, request.params.max_new_tokens)
            for i in range(n):
                if self.error is not None and i == self.error_after:
                    raise self.error
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                finished = i == n - 1
                p = request.params
                yield TokenChunk(request_id=rid, token_ids=(10 + i,), text_delta=f" w{10 + i}",
                                 finish_reason=FinishReason.LENGTH if finished else None,
                                 logprobs=(scripted_logprob(i, p.top_logprobs),)
                                 if p.logprobs else ())
        finally:
            self.live.discard(rid)
            if not finished:
                self.closed_early.append(rid)

    async def abort(self, request_id: str) -> bool:
        return False

    def stats(self):
        return DispatcherStats(spec=None)

    async def close(self):
        pass


class Front:
    def __init__(self, router_cfg: RouterConfig = RouterConfig(), **http) -> None:
        self.dispatcher = ScriptedDispatcher()
        self.records: list[RequestRecord] = []
        self.router = Router(self.dispatcher, {"tiny": word_tokenizer()}, router_cfg)
        self.http = HttpServer(self.router, HttpConfig(port=0, auth_token=TOKEN, **http),
                               observer=self)
        self.server = BackgroundServer(self.router, ServerConfig(port=0),
                                       fronts=[self.http]).start()
        self.client = openai_client(self.http.port, TOKEN, timeout_s=20)

    def request_ended(self, record: RequestRecord) -> None:
        self.records.append(record)

    def raw(self, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str | None] | None = None) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of one plain HTTP request (a header given as None is
        left out)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http.port, timeout=20)
        sent = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json",
                **(headers or {})}
        try:
            conn.request(method, path, body=body,
                         headers={k: v for k, v in sent.items() if v is not None})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Until the router holds no request and the dispatcher streams none."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.dispatcher.live and self.server.call(self._in_flight) == 0:
                return
            time.sleep(0.02)
        raise AssertionError("the request is still running")

    async def _in_flight(self) -> int:
        return self.router.stats().num_in_flight

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def front():
    f = Front()
    yield f
    f.close()


CHAT = [{"role": "user", "content": "w5 w6"}]


def test_chat_whole_and_streamed(front):
    whole = front.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.model == "tiny" and len(whole.choices) == 1
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == " w10 w11 w12"
    assert choice.finish_reason == "length" and choice.logprobs is None
    # The prompt as the router tokenized it: the chat template around the one message.
    prompt_ids = front.dispatcher.submitted[0].prompt_ids
    assert prompt_ids == (1, word_id("user"), 5, 6, 2, 3)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
            whole.usage.total_tokens) == (6, 3, 9)

    chunks = list(front.client.chat.completions.create(model="tiny", messages=CHAT,
                                                       max_completion_tokens=3, stream=True))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(c.usage is None for c in chunks)  # no include_usage
    assert front.dispatcher.submitted[1].params.max_new_tokens == 3


def word_id(word: str) -> int:
    return word_tokenizer().encode(word)[0]  # not a "wN" word: the unknown id, 0


def test_completions_text_and_token_prompts(front):
    out = front.client.completions.create(model="tiny", prompt="w7 w8", max_tokens=2)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == " w10 w11" and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 2
    assert front.dispatcher.submitted[-1].prompt_ids == (7, 8)
    for prompt in ([7, 8, 9], [[7, 8, 9]], ["w7 w8 w9"]):
        out = front.client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert out.choices[0].text == " w10"
        assert front.dispatcher.submitted[-1].prompt_ids == (7, 8, 9)
    chunks = list(front.client.completions.create(model="tiny", prompt="w7", max_tokens=3,
                                                  stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " w10 w11 w12"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_fields_reach_the_router(front):
    front.client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2, temperature=0.7, top_p=0.9, seed=42,
        stop=["w99", "w98"], user="someone", extra_body={"top_k": 5, "ignore_eos": True})
    p = front.dispatcher.submitted[-1].params
    assert (p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.ignore_eos) == (
        0.7, 0.9, 42, ("w99", "w98"), 5, True)
    front.client.completions.create(model="tiny", prompt="w1", max_tokens=1, stop="w97")
    assert front.dispatcher.submitted[-1].params.stop == ("w97",)
    # No model named: the only served one (and it is the model of the answer).
    status, _, body = front.raw("POST", "/v1/completions",
                                json.dumps({"prompt": "w1", "max_tokens": 1}).encode())
    assert status == 200 and body["model"] == "tiny"


def test_include_usage_adds_a_last_chunk_with_usage_only(front):
    for create, kw in ((front.client.chat.completions.create, {"messages": CHAT}),
                       (front.client.completions.create, {"prompt": "w5 w6"})):
        chunks = list(create(model="tiny", max_tokens=3, stream=True,
                             stream_options={"include_usage": True}, **kw))
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert (last.usage.completion_tokens, last.usage.total_tokens) == (
            3, last.usage.prompt_tokens + 3)
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "length"


def _error(exc_info) -> dict:
    return exc_info.value.body if isinstance(exc_info.value.body, dict) else {}


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"max_tokens": 60}, "max_tokens"),  # prompt + 60 > a worker's KV for one request (48)
    ({"stop": ""}, "stop"),
    ({"stop": ["w1", ""]}, "stop[1]"),
    ({"stop": 5}, "stop"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"seed": 2**70}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "w1"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
])
def test_a_bad_chat_field_is_400_naming_it(front, kw, param):
    kw = {"model": "tiny", "messages": CHAT, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        front.client.chat.completions.create(**kw)
    err = _error(e)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: "), err
    assert not front.dispatcher.submitted


def test_logprobs_out_of_range_name_the_request_field(front):
    with pytest.raises(openai.BadRequestError) as e:
        front.client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True,
                                             top_logprobs=21)
    assert _error(e)["param"] == "top_logprobs"
    assert _error(e)["message"] == "top_logprobs: must be in [0, 20], got 21"
    with pytest.raises(openai.BadRequestError) as e:
        front.client.completions.create(model="tiny", prompt="w1", logprobs=21)
    assert _error(e)["param"] == "logprobs"
    assert _error(e)["message"] == "logprobs: must be in [0, 20], got 21"
    assert not front.dispatcher.submitted


def scripted_logprob(i: int, top: int) -> TokenLogprob:
    """Token i (w{10+i}) at logprob -(i+1)/4, its alternatives w{10+i}, w200, w201, ..."""
    alts = (10 + i, *range(200, 200 + top - 1))[:top]
    return TokenLogprob(token_id=10 + i, logprob=-(i + 1) / 4, top_ids=alts,
                        top_logprobs=tuple(-(i + 1) / 4 - j for j in range(top)))


def test_chat_logprobs_in_openai_shape(front):
    c = front.client
    whole = c.chat.completions.create(model="tiny", messages=CHAT, logprobs=True,
                                      top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert [t.token for t in content] == ["w10", "w11", "w12"]
    assert [t.logprob for t in content] == [-0.25, -0.5, -0.75]
    assert content[1].bytes == list(b"w11")
    assert [(a.token, a.logprob, a.bytes) for a in content[1].top_logprobs] == [
        ("w11", -0.5, list(b"w11")), ("w200", -1.5, list(b"w200"))]
    assert front.dispatcher.submitted[-1].params.top_logprobs == 2
    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, logprobs=True,
                                            stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.top_logprobs) for t in streamed] == [
        ("w10", -0.25, []), ("w11", -0.5, []), ("w12", -0.75, [])]
    plain = c.chat.completions.create(model="tiny", messages=CHAT)
    assert plain.choices[0].logprobs is None
    assert not front.dispatcher.submitted[-1].params.logprobs


def test_completion_logprobs_in_the_legacy_shape(front):
    c = front.client
    whole = c.completions.create(model="tiny", prompt="w1", logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.tokens == ["w10", "w11", "w12"]
    assert lp.token_logprobs == [-0.25, -0.5, -0.75]
    assert lp.top_logprobs[0] == {"w10": -0.25, "w200": -1.25}  # the token is among them
    assert lp.text_offset == [0, 3, 6]
    zero = c.completions.create(model="tiny", prompt="w1", logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs[2] == {"w12": -0.75}  # the token alone
    chunks = list(c.completions.create(model="tiny", prompt="w1", logprobs=1, stream=True))
    got = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [t for g in got for t in g.tokens] == ["w10", "w11", "w12"]
    assert [o for g in got for o in g.text_offset] == [0, 3, 6]  # continued across chunks
    assert c.completions.create(model="tiny", prompt="w1").choices[0].logprobs is None


@pytest.mark.parametrize("kw, param", [
    ({"prompt": [1, 999]}, "prompt[1]"),  # outside the vocabulary of 256
    ({"prompt": ["w1", "w2"]}, "prompt"),  # a batch
    ({"prompt": ""}, "prompt"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": "w1", "max_tokens": 49}, "max_tokens"),  # > a worker's KV for one request
])
def test_a_bad_completions_field_is_400_naming_it(front, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        front.client.completions.create(**{"model": "tiny", "prompt": "w1", **kw})
    assert _error(e)["param"] == param, _error(e)


def test_a_request_that_never_fits_is_400_not_429(front):
    # RESOURCE_EXHAUSTED naming a field: no wait helps, so the SDK must not retry it.
    with pytest.raises(openai.BadRequestError) as e:
        front.client.completions.create(model="tiny", prompt="w1", max_tokens=49)
    assert _error(e)["code"] == "context_length_exceeded"


def test_invalid_json_is_400(front):
    status, _, body = front.raw("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["message"].startswith("body: not valid JSON")


def test_wrong_or_missing_token_is_401_but_health_is_open(front):
    bad = openai_client(front.http.port, "wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=CHAT)
    assert _error(e)["type"] == "authentication_error"
    assert _error(e)["message"] == "authorization: invalid token"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, headers, body = front.raw("GET", "/v1/models", headers={"authorization": None})
    assert status == 401 and body["error"]["message"].startswith("authorization: missing")
    assert headers["www-authenticate"] == "Bearer"
    assert front.raw("GET", "/health", headers={"authorization": None})[0] == 200
    assert not front.dispatcher.submitted


def test_unknown_model_is_404(front):
    with pytest.raises(openai.NotFoundError) as e:
        front.client.chat.completions.create(model="gpt-9", messages=CHAT)
    err = _error(e)
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    assert "gpt-9" in err["message"]
    status, _, body = front.raw("GET", "/v2/nothing")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_over_the_limit_is_413():
    front = Front(max_body_bytes=4096)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            front.client.completions.create(model="tiny", prompt="w1 " * 2000)
        assert e.value.status_code == 413 and _error(e)["code"] == "request_too_large"
        # Without a length up front (chunked), the limit holds as the body arrives.
        conn = http.client.HTTPConnection("127.0.0.1", front.http.port, timeout=20)
        conn.request("POST", "/v1/completions", body=iter([b"{" + b" " * 3000] * 3),
                     headers={"authorization": f"Bearer {TOKEN}"}, encode_chunked=True)
        assert conn.getresponse().status == 413
        conn.close()
        assert not front.dispatcher.submitted
        # Under the limit all is well.
        assert front.client.completions.create(model="tiny", prompt="w1", max_tokens=1)
    finally:
        front.close()


def test_a_full_router_is_429_with_retry_after(front):
    front.dispatcher.error = CapacityExceeded("queue: 4 requests running and 0 waiting "
                                              "(limits 4 and 0); retry later")
    with pytest.raises(openai.RateLimitError) as e:
        front.client.chat.completions.create(model="tiny", messages=CHAT, stream=True)
    err = _error(e)
    assert (err["param"], err["code"]) == (None, "rate_limit_exceeded")
    assert err["message"].startswith("queue: ")
    assert e.value.response.headers["retry-after"] == "1"


def test_a_dead_worker_is_503_and_a_deadline_504():
    front = Front(router_cfg=RouterConfig(max_request_s=0.3, quarantine_s=0.0))
    try:
        front.dispatcher.error = WorkerUnavailable("w0", "worker 'w0' died")
        with pytest.raises(openai.InternalServerError) as e:
            front.client.completions.create(model="tiny", prompt="w1")
        assert e.value.status_code == 503
        front.dispatcher.error = None
        front.dispatcher.delay_s = 1.0
        with pytest.raises(openai.APIStatusError) as e:
            front.client.completions.create(model="tiny", prompt="w1", stream=True)
        assert e.value.status_code == 504 and _error(e)["type"] == "timeout"
        front.wait_idle()
    finally:
        front.close()


def test_an_error_after_the_first_chunk_ends_the_stream_with_an_error_event(front):
    front.dispatcher.num_tokens, front.dispatcher.error_after = 5, 2
    front.dispatcher.error = WorkerUnavailable("w0", "worker 'w0' died")
    seen = []
    with pytest.raises(openai.APIError) as e:
        for chunk in front.client.chat.completions.create(model="tiny", messages=CHAT,
                                                          max_tokens=5, stream=True):
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["", " w10", " w11"] or seen == [" w10", " w11"]
    assert "w0" in str(e.value)
    # Whole answers have nothing sent yet: the status says it.
    with pytest.raises(openai.InternalServerError):
        front.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5)


def test_a_client_gone_mid_stream_stops_the_request(front):
    front.dispatcher.num_tokens, front.dispatcher.delay_s = 1000, 0.02
    stream = front.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40,
                                                  stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()
    front.wait_idle()
    assert len(front.dispatcher.closed_early) == 1
    assert front.server.call(_stats(front)).num_aborted == 1
    assert [r.status for r in front.records] == [499]


def test_a_client_gone_before_its_first_token_stops_the_request(front):
    front.dispatcher.num_tokens, front.dispatcher.delay_s = 3, 5.0
    quick = openai_client(front.http.port, TOKEN, timeout_s=0.5)
    with pytest.raises(openai.APITimeoutError):
        quick.completions.create(model="tiny", prompt="w1")  # whole answer: silent till the end
    front.wait_idle()
    assert len(front.dispatcher.closed_early) == 1


def _stats(front):
    async def get():
        return front.router.stats()
    return get


def test_models_and_health(front):
    models = front.client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [("tiny", "model", "tandem")]
    assert models.data[0].model_extra["max_model_len"] == 64
    status, _, body = front.raw("GET", "/health")
    assert (status, body) == (200, {"status": "serving"})
    front.dispatcher.healthy = False
    end = time.monotonic() + 5
    while front.raw("GET", "/health")[0] != 503:
        assert time.monotonic() < end, "health stayed 200 with no healthy worker"
        time.sleep(0.1)


def test_the_observer_hears_every_request(front):
    front.client.completions.create(model="tiny", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        front.client.completions.create(model="tiny", prompt="w1", temperature=-1)
    ok, bad = front.records
    assert (ok.endpoint, ok.status, ok.finish_reason, ok.prompt_tokens,
            ok.completion_tokens) == ("/v1/completions", 200, "length", 1, 2)
    assert ok.request_id and ok.ttft_s is not None and ok.latency_s >= ok.ttft_s
    assert (bad.status, bad.error_type, bad.request_id) == (400, "invalid_request_error", None)


def test_router_errors_name_the_request_s_fields():
    call = completion_call(CompletionRequest(prompt=[1, 2], stop="x"), (MODEL,), 0)
    cases = [
        (RouterError(Code.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1], got 0"),
         400, "top_p", "top_p: must be in (0, 1], got 0"),
        (RouterError(Code.INVALID_ARGUMENT, "prompt_token_ids[1]: token id 999 is outside"),
         400, "prompt[1]", "prompt[1]: token id 999 is outside"),
        (RouterError(Code.INVALID_ARGUMENT, "sampling.stop[0]: must have 1 to 512 characters"),
         400, "stop", "stop: must have 1 to 512 characters"),
        (RouterError(Code.RESOURCE_EXHAUSTED, "queue: full"), 429, None, "queue: full"),
        (RouterError(Code.DEADLINE_EXCEEDED, "deadline: request 'x' ran past"), 504, None,
         "deadline: request 'x' ran past"),
        (RouterError(Code.INTERNAL, "dispatch: boom"), 500, None, "dispatch: boom"),
    ]
    for exc, status, param, message in cases:
        err = from_router_error(exc, call.rename)
        assert (err.status, err.param, err.message) == (status, param, message), exc


def test_union_validation_errors_name_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "w1", "stop": 5})
    errors = [{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]
    assert len(errors) > 1  # one per member of the union
    assert from_validation_errors(errors).param == "stop"
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": [[1, "x"]]})
    errors = [{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]
    assert from_validation_errors(errors).param == "prompt"


def test_tls_serves_https_only(tmp_path):
    """The gRPC front's TLS options, through uvicorn: HTTPS with the certificate, no plaintext."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    front = Front(tls_cert=cert, tls_key=key)
    try:
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{front.http.port}/v1",
                               api_key=TOKEN, max_retries=0, timeout=20,
                               http_client=openai.DefaultHttpxClient(
                                   verify=ssl.create_default_context(cafile=str(cert))))
        out = client.completions.create(model="tiny", prompt="w1", max_tokens=2)
        assert out.choices[0].text == " w10 w11"
        client.close()
        with pytest.raises(openai.APIConnectionError):  # plaintext to the HTTPS port
            front.client.completions.create(model="tiny", prompt="w1", max_tokens=2)
    finally:
        front.close()
