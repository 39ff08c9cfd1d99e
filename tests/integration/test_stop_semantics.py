"""The stop rules of docs/architecture.md, "Request semantics", on SmolLM2 (float32) in every
layout: the plain and the speculative engine, the colocated gRPC server and a disaggregated
prefill + decode pair (in one process, KV over the fake backend, the test playing the router).

"What is the capital of France?" is answered "The capital of France is Paris." With the stop
string "Paris" the answer is "The capital of France is " and five tokens -- the same when the
token " Paris" (7042) is also a stop token, and usage.completion_tokens counts the tokens
returned. A stop string its first token completes ends the request on the prefill worker, with
no token for the client."""

from __future__ import annotations

import time

import grpc
import pytest

from disagg_helpers import FAST_ENDPOINT
from tandem.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from tandem.tokenizer import ChatMessage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = "What is the capital of France?"
PARIS = 7042  # " Paris"
ANSWER = "The capital of France is "
STOP_ALONE = SamplingParams(max_new_tokens=16, stop=("Paris",))
STOP_AND_TOKEN = SamplingParams(max_new_tokens=16, stop=("Paris",), stop_token_ids=(PARIS,))


def _engine_cfg(smollm2_dir) -> EngineConfig:
    del smollm2_dir  # imported: "default" names it (and its shipped EAGLE head)
    return EngineConfig(model="default", dtype="float32", num_pages=96, cuda_graphs=False)


@pytest.fixture(scope="module")
def plain(smollm2_dir):
    return LLMEngine.from_config(_engine_cfg(smollm2_dir))


@pytest.fixture(scope="module")
def prompt(plain) -> list[int]:
    tok = plain.tokenizer
    assert tok.encode(" Paris") == [PARIS]
    return tok.encode_chat([ChatMessage(role="user", content=QUESTION)])


@pytest.fixture(scope="module")
def want(plain, prompt):
    """The five tokens before " Paris" (the answer without stops, cut)."""
    full = plain.generate([prompt], SamplingParams(max_new_tokens=16))[0]
    assert full.text.startswith(ANSWER + "Paris") and full.output_ids[5] == PARIS
    return full.output_ids[:5]


@pytest.mark.parametrize("engine", ["plain", "speculative"])
def test_engines(smollm2_dir, plain, prompt, want, engine):
    if engine == "speculative":
        from tandem.spec import SpecConfig, SpecEngine

        eng = SpecEngine.from_config(_engine_cfg(smollm2_dir), SpecConfig(num_steps=4))
    else:
        eng = plain
    for params in (STOP_ALONE, STOP_AND_TOKEN):
        c = eng.generate([prompt], params)[0]
        assert (c.text, c.output_ids, c.finish_reason) == (ANSWER, want, FinishReason.STOP)


def test_colocated_server(smollm2_dir, want):
    from tandem.colocated_node import build_colocated_router
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    router = build_colocated_router(LLMEngine.from_config(_engine_cfg(smollm2_dir)))
    server = BackgroundServer(router, ServerConfig(host="127.0.0.1", port=0)).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            for params in (STOP_ALONE, STOP_AND_TOKEN):
                msgs = list(stub.Generate(pb.GenerateRequest(
                    messages=[pb.ChatMessage(role="user", content=QUESTION)],
                    sampling=pb.SamplingParams(max_tokens=16, stop=params.stop,
                                               stop_token_ids=params.stop_token_ids)),
                    timeout=60))
                assert "".join(m.text_delta for m in msgs) == ANSWER
                assert tuple(t for m in msgs for t in m.token_ids) == want
                assert msgs[-1].usage.completion_tokens == len(want)
                assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    finally:
        server.stop()


def test_disaggregated(smollm2_dir, prompt, want):
    from tandem.decode_node.worker import DecodeWorker
    from tandem.prefill_node.worker import PrefillWorker
    from tandem.spec import SpecConfig
    from tandem.worker import WorkerConfig, WorkerLoop

    def cfg(name: str) -> WorkerConfig:
        return WorkerConfig(name=name, engine=_engine_cfg(smollm2_dir),
                            spec=SpecConfig(num_steps=4), transfer_backend="fake",
                            endpoint=FAST_ENDPOINT, transfer_timeout_s=10.0)

    prefill, decode = PrefillWorker(cfg("prefill-0")), DecodeWorker(cfg("decode-0"))
    dloop = WorkerLoop(decode, lambda outs: None)  # decode answers the handshake from a thread
    try:
        prefill.connect(dloop.call(decode.endpoint))
    finally:
        dloop.close()

    def run(room: int, params: SamplingParams):
        """(text, tokens, finish reason) as the router streams them: decode's outputs (whose
        first repeats prefill's first token), or prefill's result when that ended it."""
        prefill.submit(room, prompt, params, decode.reserve(room, prompt, params))
        text, tokens = "", []
        for _ in range(5000):
            for r in prefill.step():
                assert r.ok, r.error
                if r.finished:
                    decode.abort(room)  # what the router does: decode's reservation goes
                    first = () if r.first_token is None else (r.first_token,)
                    return r.first_text, tuple(first), r.finish_reason
            for o in decode.step():
                text, tokens = text + o.text_delta, tokens + list(o.token_ids)
                if o.finished:
                    return text, tuple(tokens), o.finish_reason
            time.sleep(0.001)
        raise AssertionError("the request did not finish")

    try:
        assert run(1, STOP_ALONE) == (ANSWER, want, "stop")
        assert run(2, STOP_AND_TOKEN) == (ANSWER, want, "stop")
        # "The" is the first token: the request ends on prefill, nothing returned.
        assert run(3, SamplingParams(max_new_tokens=16, stop=("The",))) == ("", (), "stop")
        for _ in range(200):  # decode's pages of room 3 come back once its abort settled
            if decode.num_free_pages() == decode.num_pages():
                break
            decode.step()
            time.sleep(0.01)
        assert prefill.num_free_pages() == prefill.num_pages()
        assert decode.num_free_pages() == decode.num_pages()
    finally:
        prefill.close()
        decode.close()
