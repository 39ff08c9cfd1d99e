"""Log-probabilities through the public APIs, colocated, on 127.0.0.1: the gRPC front (and the
HTTP front next to it on the same router) -> `Router` -> `ColocatedDispatcher` -> a tiny
random llama (float32) with an EAGLE head, decoding speculatively, with a word tokenizer.

The answers' logprobs equal the plain engine's (`LLMEngine.generate`, no speculation) value for
value: greedy, so the same tokens; float32, so the verify forward's values equal one-token
forwards' to ~1e-6. A request that does not ask gets none; top_logprobs 21 is INVALID_ARGUMENT
naming `sampling.top_logprobs`."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from disagg_helpers import tiny_model_and_head
from http_helpers import write_word_tokenizer

from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.engine.request import Completion
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router.app import BackgroundServer
from tandem.router.router import Router
from tandem.router.server import ServerConfig
from tandem.spec import SpecConfig, SpecEngine
from tandem.tokenizer import ChatMessage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

N = 12  # new tokens of each answer
TOP = 3
PROMPT = "w3 w1 w4 w1 w5 w9"
CHAT = [{"role": "user", "content": "w5 w17 w42 w9"}]
TOL = 1e-5


@dataclass
class System:
    router: Router
    server: BackgroundServer
    refs: dict[str, Completion]  # the plain engine's answers, with logprobs
    http_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


def _engine_cfg(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=160)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from tandem.http_api import HttpConfig, HttpServer

    model_dir, head_dir = tiny_model_and_head(tmp_path_factory.mktemp("lp"))
    write_word_tokenizer(model_dir)
    plain = LLMEngine.from_config(_engine_cfg(model_dir))
    tok = plain.tokenizer
    asking = SamplingParams(max_new_tokens=N, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    chat_ids = tok.encode_chat([ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    refs = {"prompt": plain.generate([tok.encode(PROMPT)], asking)[0],
            "chat": plain.generate([chat_ids], asking)[0]}
    engine = SpecEngine.from_config(_engine_cfg(model_dir),
                                    SpecConfig(draft_model=str(head_dir), num_steps=3))
    router = build_colocated_router(engine, model="tiny")
    http = HttpServer(router, HttpConfig(port=0))
    server = BackgroundServer(router, ServerConfig(port=0), fronts=[http]).start()
    yield System(router, server, refs, http.port)
    server.stop()


@pytest.fixture(scope="module")
def stub(system):
    with grpc.insecure_channel(system.target) as channel:
        yield pb_grpc.RouterStub(channel)


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
        max_tokens=N, ignore_eos=True, **sampling))


def test_grpc_logprobs_equal_plain_decoding(system, stub):
    ref = system.refs["prompt"]
    responses = list(stub.Generate(_request(logprobs=True, top_logprobs=TOP), timeout=60))
    tokens = [t for r in responses for t in r.token_ids]
    lps = [lp for r in responses for lp in r.logprobs]
    assert tuple(tokens) == ref.output_ids
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert len(lps) == len(ref.logprobs) == N
    for got, want in zip(lps, ref.logprobs):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=TOL)
        assert [t.token_id for t in got.top_logprobs] == list(want.top_ids)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(want.top_logprobs,
                                                                      abs=TOL)
        # greedy: the returned token is the most likely one
        assert got.top_logprobs[0].token_id == got.token_id


def test_grpc_without_logprobs_returns_none(stub):
    responses = list(stub.Generate(_request(), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == N
    assert all(not r.logprobs for r in responses)
    only = list(stub.Generate(_request(logprobs=True), timeout=60))
    assert all(len(r.logprobs) == len(r.token_ids) for r in only)
    assert all(not lp.top_logprobs for r in only for lp in r.logprobs)


@pytest.mark.parametrize("sampling, message", [
    ({"logprobs": True, "top_logprobs": 21}, "sampling.top_logprobs: must be in [0, 20], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "sampling.top_logprobs: must be in [0, 20], got -1"),
    ({"top_logprobs": 2}, "sampling.top_logprobs: needs sampling.logprobs"),
])
def test_grpc_top_logprobs_out_of_range_is_invalid_argument(stub, sampling, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request(**sampling), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(message)


# ---- the HTTP front, through the real openai SDK ---------------------------------------------


@pytest.fixture(scope="module")
def client(system):
    from http_helpers import openai_client

    c = openai_client(system.http_port)
    yield c
    c.close()


EXTRA = {"ignore_eos": True}  # the random model may draw its EOS id at any step


def _word(token_id: int) -> str:
    return f"w{token_id}"  # the word tokenizer's text of a token


def _check_chat(content, ref: Completion) -> None:
    assert len(content) == len(ref.logprobs) == N
    for got, want in zip(content, ref.logprobs):
        assert got.token == _word(want.token_id)
        assert got.bytes == list(_word(want.token_id).encode())
        assert got.logprob == pytest.approx(want.logprob, abs=TOL)
        assert [t.token for t in got.top_logprobs] == [_word(t) for t in want.top_ids]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(want.top_logprobs,
                                                                      abs=TOL)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_http_chat_logprobs_equal_plain_decoding(system, client, stream):
    ref = system.refs["chat"]
    answer = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=N,
                                            logprobs=True, top_logprobs=TOP, stream=stream,
                                            extra_body=EXTRA)
    if stream:
        content = [t for ch in answer if ch.choices and ch.choices[0].logprobs
                   for t in ch.choices[0].logprobs.content]
    else:
        assert answer.choices[0].message.content == ref.text
        content = answer.choices[0].logprobs.content
    _check_chat(content, ref)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_http_completion_logprobs_equal_plain_decoding(system, client, stream):
    ref = system.refs["prompt"]
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, logprobs=TOP,
                                       stream=stream, extra_body=EXTRA)
    parts = [ch.choices[0].logprobs for ch in answer if ch.choices and ch.choices[0].logprobs] \
        if stream else [answer.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    values = [v for p in parts for v in p.token_logprobs]
    tops = [d for p in parts for d in p.top_logprobs]
    offsets = [o for p in parts for o in p.text_offset]
    assert tokens == [_word(t) for t in ref.output_ids]
    assert values == pytest.approx([lp.logprob for lp in ref.logprobs], abs=TOL)
    for top, want in zip(tops, ref.logprobs):  # greedy: the token is the first alternative
        assert list(top) == [_word(t) for t in want.top_ids]
        assert list(top.values()) == pytest.approx(want.top_logprobs, abs=TOL)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_http_top_logprobs_21_is_400_naming_it(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                       logprobs=True, top_logprobs=21)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=21)
    assert e.value.status_code == 400 and e.value.body["param"] == "logprobs"
