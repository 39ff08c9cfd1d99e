"""The gRPC API end to end on 127.0.0.1: `RouterServer` (auth on) -> `Router` ->
`ColocatedDispatcher` -> `EngineLoop` -> SmolLM2 (bf16), in-process on a random port.

Checks: streamed output equals `LLMEngine.generate` on the same prompt (greedy, batch 1 both
ways, so bf16 numerics are identical); stream order and final text; Abort, client cancel and a
short deadline stop generation and return every KV page; health is SERVING; reflection lists
the service; a missing or wrong token is UNAUTHENTICATED; `tandem generate` prints the answer."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.engine.request import Completion
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router.app import BackgroundServer
from tandem.router.router import Router
from tandem.router.server import ServerConfig
from tandem.tokenizer import ChatMessage

pytestmark = pytest.mark.slow

TOKEN = "integration-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
WORKER = "colocated-0"
N = 16  # new tokens of the compared answers
LONG = 1500  # a request that would run for a minute on this CPU unless stopped
QUESTION = "What is the capital of France?"
PROMPT = "The three primary colors are"


@dataclass
class System:
    engine: LLMEngine
    router: Router
    server: BackgroundServer
    refs: dict[str, Completion]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def wait_pages_free(self, timeout_s: float = 10.0) -> float:
        """Seconds until the engine loop is idle; asserts that every KV page is back."""
        t0 = time.perf_counter()
        assert self.router.dispatcher.loop(WORKER).wait_idle(timeout_s), "generation went on"
        alloc = self.engine.allocator
        assert alloc.num_free == alloc.num_usable, "KV pages leaked"
        return time.perf_counter() - t0


@pytest.fixture(scope="module")
def system(smollm2_dir):
    engine = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="bfloat16",
                                                num_pages=160))
    tok = engine.tokenizer
    greedy = SamplingParams(max_new_tokens=N)
    # References first, from the same engine before its loop thread owns it (batch 1 each).
    refs = {
        "chat": engine.generate([tok.encode_chat([ChatMessage(role="user", content=QUESTION)])],
                                greedy)[0],
        "prompt": engine.generate([tok.encode(PROMPT)], greedy)[0],
    }
    router = build_colocated_router(engine, model="smollm2", worker=WORKER)
    server = BackgroundServer(router, ServerConfig(port=0, auth_token=TOKEN)).start()
    yield System(engine, router, server, refs)
    server.stop()


@pytest.fixture(scope="module")
def channel(system):
    with grpc.insecure_channel(system.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.RouterStub(channel)


def _chat_request(max_tokens: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=QUESTION)],
                              sampling=pb.SamplingParams(max_tokens=max_tokens, **kw))


def _long_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, request_id=request_id,
                              sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True))


@pytest.mark.timeout(90)
def test_stream_equals_engine_generate(system, stub):
    for name, request in [("chat", _chat_request(N)),
                          ("prompt", pb.GenerateRequest(prompt=PROMPT,
                                                        sampling=pb.SamplingParams(max_tokens=N))),
                          ("prompt", pb.GenerateRequest(
                              prompt_token_ids=system.refs["prompt"].prompt_ids,
                              sampling=pb.SamplingParams(max_tokens=N)))]:
        ref = system.refs[name]
        msgs = list(stub.Generate(request, timeout=60, metadata=AUTH))
        assert [t for m in msgs for t in m.token_ids] == list(ref.output_ids), name
        # Order and framing: one id per message, only the last one finished, consistent ids.
        assert all(len(m.token_ids) == 1 for m in msgs)
        assert [m.finish_reason for m in msgs[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (
            len(msgs) - 1)
        final = msgs[-1]
        assert final.finish_reason == {"stop": pb.FINISH_REASON_STOP,
                                       "length": pb.FINISH_REASON_LENGTH}[ref.finish_reason.value]
        assert "".join(m.text_delta for m in msgs) == ref.text
        assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
        assert final.usage.prompt_tokens == len(ref.prompt_ids)
        assert final.usage.completion_tokens == len(ref.output_ids)
        assert 0 < final.ttft_s <= final.latency_s
        assert not final.HasField("spec_stats")  # not speculative
    system.wait_pages_free()


def _stream_in_thread(call, num_before: int):
    """Read `call` in a thread; returns (messages, error holder, event set after num_before)."""
    msgs: list[pb.GenerateResponse] = []
    errors: list[grpc.RpcError] = []
    started = threading.Event()

    def read():
        try:
            for m in call:
                msgs.append(m)
                if len(msgs) >= num_before:
                    started.set()
        except grpc.RpcError as exc:
            errors.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return msgs, errors, started, thread


@pytest.mark.timeout(90)
def test_abort_stops_generation_and_frees_pages(system, stub):
    call = stub.Generate(_long_request("to-abort"), timeout=120, metadata=AUTH)
    msgs, errors, started, thread = _stream_in_thread(call, 3)
    assert started.wait(60)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10, metadata=AUTH).found
    thread.join(10)
    assert not errors and msgs[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert msgs[-1].usage.completion_tokens < LONG
    system.wait_pages_free(5.0)


@pytest.mark.timeout(90)
def test_client_cancel_stops_generation_and_frees_pages(system, stub):
    before = system.server.call(_stats(system)).num_aborted
    call = stub.Generate(_long_request("to-cancel"), timeout=120, metadata=AUTH)
    _, errors, started, thread = _stream_in_thread(call, 3)
    assert started.wait(60)
    call.cancel()
    thread.join(10)
    assert errors and errors[0].code() == grpc.StatusCode.CANCELLED
    system.wait_pages_free(5.0)  # LONG tokens would take far longer: generation stopped
    assert system.server.call(_stats(system)).num_aborted == before + 1


@pytest.mark.timeout(90)
def test_deadline_exceeded_frees_pages(system, stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_long_request("to-expire"), timeout=1.0, metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    system.wait_pages_free(5.0)
    # The server still serves.
    msgs = list(stub.Generate(_chat_request(2), timeout=60, metadata=AUTH))
    assert msgs[-1].usage.completion_tokens == 2


def _stats(system):
    async def get():
        return system.router.stats()
    return get


@pytest.mark.timeout(30)
def test_health_serving_without_token(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Router"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(30)
def test_reflection_lists_the_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10,
        metadata=AUTH))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"tandem.v1.Router", "grpc.health.v1.Health"} <= names


@pytest.mark.timeout(30)
def test_wrong_or_missing_token_is_unauthenticated(stub):
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_chat_request(2), timeout=10, metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details().startswith("authorization")


@pytest.mark.timeout(30)
def test_list_workers_and_stats(stub):
    (w,) = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10, metadata=AUTH).workers
    assert (w.name, w.role, w.model, w.healthy) == (WORKER, pb.WORKER_ROLE_COLOCATED,
                                                    "smollm2", True)
    assert w.num_pages == 159 and w.num_free_pages == 159
    stats = stub.Stats(pb.StatsRequest(), timeout=10, metadata=AUTH)
    assert stats.num_in_flight == 0 and len(stats.workers) == 1


@pytest.mark.timeout(60)
def test_tandem_generate_cli(system, capsys):
    from tandem.cli import main

    rc = main(["generate", "--target", system.target, "--auth-token", TOKEN, "--chat",
               QUESTION, "--max-new-tokens", str(N)])
    out, err = capsys.readouterr()
    assert rc == 0 and out == system.refs["chat"].text + "\n"
    assert "TTFT" in err and f"{len(system.refs['chat'].output_ids)} completion tokens" in err
    rc = main(["generate", "--target", system.target, "--auth-token", TOKEN, "hi",
               "--top-p", "0"])
    assert rc == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in capsys.readouterr().err
