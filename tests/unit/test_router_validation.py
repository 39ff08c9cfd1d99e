"""The bad-input matrix of issue 7 through the real gRPC server (127.0.0.1, random port) in front
of a scripted dispatcher with SmolLM2's tokenizer: every bad request ends with the right status
code and a message naming the field, and the server answers the next good request."""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_router_lifecycle import FakeDispatcher

from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router import ModelInfo, Router, WorkerInfo, WorkerRole
from tandem.router.app import BackgroundServer
from tandem.router.server import ServerConfig
from tandem.tokenizer import Tokenizer

VOCAB = 49152
MODEL = ModelInfo(name="smol", vocab_size=VOCAB, max_model_len=64, max_request_tokens=48)
WORKERS = [WorkerInfo(name="c0", role=WorkerRole.COLOCATED, model="smol", num_pages=8,
                      num_free_pages=8)]
TOKEN = "s3cret"
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


def _server(tokenizer, **cfg) -> BackgroundServer:
    router = Router(FakeDispatcher(WORKERS, models=(MODEL,)), {"smol": tokenizer})
    return BackgroundServer(router, ServerConfig(port=0, **cfg)).start()


@pytest.fixture(scope="module")
def server(tokenizer):
    srv = _server(tokenizer)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.RouterStub(channel)


def _sp(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


def _chat(role="user", content="hi") -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=role, content=content)]


GOOD = pb.GenerateRequest(prompt="Hello", sampling=_sp(max_tokens=3))

# (id, request, status code, the message starts with)
MATRIX = [
    ("empty-prompt", pb.GenerateRequest(prompt=""), Code.INVALID_ARGUMENT, "prompt: is empty"),
    ("no-prompt", pb.GenerateRequest(), Code.INVALID_ARGUMENT, "prompt: the request has no"),
    ("prompt-and-messages", pb.GenerateRequest(prompt="a", messages=_chat()),
     Code.INVALID_ARGUMENT, "prompt, messages: give only one"),
    ("prompt-and-ids", pb.GenerateRequest(prompt="a", prompt_token_ids=[1]),
     Code.INVALID_ARGUMENT, "prompt, prompt_token_ids: give only one"),
    ("unknown-role", pb.GenerateRequest(messages=_chat(role="robot")), Code.INVALID_ARGUMENT,
     "messages[0].role: unknown role 'robot'"),
    ("max-tokens-zero", pb.GenerateRequest(prompt="a", sampling=_sp(max_tokens=0)),
     Code.INVALID_ARGUMENT, "sampling.max_tokens: must be > 0"),
    ("max-tokens-negative", pb.GenerateRequest(prompt="a", sampling=_sp(max_tokens=-5)),
     Code.INVALID_ARGUMENT, "sampling.max_tokens: must be > 0"),
    # Capped to the context (63), which is still more than a worker's KV cache holds (48).
    ("max-tokens-beyond-context", pb.GenerateRequest(prompt="a", sampling=_sp(max_tokens=64)),
     Code.RESOURCE_EXHAUSTED,
     "sampling.max_tokens: prompt (1 tokens) + max_tokens (64) needs more KV cache"),
    ("temperature-negative", pb.GenerateRequest(prompt="a", sampling=_sp(temperature=-0.5)),
     Code.INVALID_ARGUMENT, "sampling.temperature: must be a finite number >= 0"),
    ("temperature-nan", pb.GenerateRequest(prompt="a", sampling=_sp(temperature=math.nan)),
     Code.INVALID_ARGUMENT, "sampling.temperature"),
    ("top-p-zero", pb.GenerateRequest(prompt="a", sampling=_sp(top_p=0.0)),
     Code.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"),
    ("top-p-above-one", pb.GenerateRequest(prompt="a", sampling=_sp(top_p=1.5)),
     Code.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"),
    ("top-k-negative", pb.GenerateRequest(prompt="a", sampling=_sp(top_k=-1)),
     Code.INVALID_ARGUMENT, "sampling.top_k: must be >= 0"),
    ("min-p-above-one", pb.GenerateRequest(prompt="a", sampling=_sp(min_p=2.0)),
     Code.INVALID_ARGUMENT, "sampling.min_p"),
    ("empty-stop-string", pb.GenerateRequest(prompt="a", sampling=_sp(stop=["x", ""])),
     Code.INVALID_ARGUMENT, "sampling.stop[1]"),
    ("stop-token-oov", pb.GenerateRequest(prompt="a", sampling=_sp(stop_token_ids=[VOCAB])),
     Code.INVALID_ARGUMENT, "sampling.stop_token_ids[0]"),
    ("token-id-oov", pb.GenerateRequest(prompt_token_ids=[1, VOCAB]), Code.INVALID_ARGUMENT,
     f"prompt_token_ids[1]: token id {VOCAB} is outside the vocabulary"),
    ("token-id-negative", pb.GenerateRequest(prompt_token_ids=[-1]), Code.INVALID_ARGUMENT,
     "prompt_token_ids[0]: token id -1 is outside"),
    ("token-ids-longer-than-context", pb.GenerateRequest(prompt_token_ids=[1] * 64),
     Code.INVALID_ARGUMENT, "prompt_token_ids: the prompt has 64 tokens"),
    ("prompt-longer-than-context", pb.GenerateRequest(prompt="hello " * 80),
     Code.INVALID_ARGUMENT, "prompt: the prompt has 81 tokens"),  # 80 words + the last space
    ("long-prompt-tokenized-off-loop", pb.GenerateRequest(prompt="hello " * 800),
     Code.INVALID_ARGUMENT, "prompt: the prompt has 801 tokens"),
    # SmolLM2's longest token is 81 bytes: 42000 bytes are >= 519 tokens, never tokenized.
    ("huge-prompt-refused-by-size", pb.GenerateRequest(prompt="hello " * 7000),
     Code.INVALID_ARGUMENT, "prompt: the prompt has 42000 bytes, so at least 519 tokens"),
    ("huge-message-refused-by-size", pb.GenerateRequest(
        messages=[*_chat(content="hi"), *_chat(content="hi " * 7000)]), Code.INVALID_ARGUMENT,
     "messages[1].content: the rendered conversation has 21"),
    ("messages-longer-than-context", pb.GenerateRequest(messages=_chat(content="hi " * 80)),
     Code.INVALID_ARGUMENT, "messages: the prompt has"),
    ("larger-than-kv-pool", pb.GenerateRequest(prompt="a", sampling=_sp(max_tokens=50)),
     Code.RESOURCE_EXHAUSTED,
     "sampling.max_tokens: prompt (1 tokens) + max_tokens (50) needs more KV cache"),
    ("unknown-model", pb.GenerateRequest(prompt="a", model="gpt-9"), Code.NOT_FOUND,
     "model: no model named 'gpt-9' (served: smol)"),
    ("unknown-prefill-worker", pb.GenerateRequest(prompt="a", prefill_worker="p9"),
     Code.NOT_FOUND, "prefill_worker: no worker named 'p9'"),
    ("unknown-decode-worker", pb.GenerateRequest(prompt="a", decode_worker="d9"),
     Code.INVALID_ARGUMENT, "decode_worker: 'c0' is a colocated worker"),
    ("request-id-too-long", pb.GenerateRequest(prompt="a", request_id="x" * 300),
     Code.INVALID_ARGUMENT, "request_id: longer than"),
]


def _generate(stub, request, **kw) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=10, **kw))


def _assert_serves(stub, **kw) -> None:
    outs = _generate(stub, GOOD, **kw)
    assert outs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert outs[-1].usage.completion_tokens == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_, code, start", [m[1:] for m in MATRIX],
                         ids=[m[0] for m in MATRIX])
def test_bad_input(stub, request_, code, start):
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, request_)
    assert e.value.code() == code, e.value.details()
    assert e.value.details().startswith(start), e.value.details()
    _assert_serves(stub)


@pytest.mark.timeout(60)
def test_invalid_utf8_names_the_field(server, stub):
    raw = pb.GenerateRequest(messages=_chat(content="ab")).SerializeToString().replace(
        b"ab", b"\xc3\x28")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_stream("/tandem.v1.Router/Generate",
                                    request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=10))
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert e.value.details().startswith("messages[0].content: invalid UTF-8")
    _assert_serves(stub)


@pytest.mark.timeout(60)
def test_16_mib_message_is_resource_exhausted(stub):
    big = pb.GenerateRequest(prompt="x" * (16 << 20))
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, big)
    assert e.value.code() == Code.RESOURCE_EXHAUSTED
    # gRPC's own message states both sizes, e.g. "Received message larger than max (16777221
    # vs. 4194304)".
    assert "larger than max" in e.value.details() and "4194304" in e.value.details()
    _assert_serves(stub)


@pytest.mark.timeout(60)
def test_abort_without_request_id(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(), timeout=10)
    assert e.value.code() == Code.INVALID_ARGUMENT and e.value.details() == "request_id: required"
    assert stub.Abort(pb.AbortRequest(request_id="nope"), timeout=10).found is False


@pytest.mark.timeout(60)
def test_auth_token(tokenizer):
    srv = _server(tokenizer, auth_token=TOKEN)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            for metadata, start in [((), "authorization: missing"),
                                    ((("authorization", "Bearer wrong"),),
                                     "authorization: invalid token"),
                                    ((("authorization", TOKEN),), "authorization: expected")]:
                with pytest.raises(grpc.RpcError) as e:
                    _generate(stub, GOOD, metadata=metadata)
                assert e.value.code() == Code.UNAUTHENTICATED
                assert e.value.details().startswith(start)
                with pytest.raises(grpc.RpcError) as e:
                    stub.ListWorkers(pb.ListWorkersRequest(), timeout=10, metadata=metadata)
                assert e.value.code() == Code.UNAUTHENTICATED
            _assert_serves(stub, metadata=(("authorization", f"Bearer {TOKEN}"),))
            # Health probes need no token.
            health = health_pb2_grpc.HealthStub(channel)
            resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop()


@pytest.mark.timeout(60)
def test_tls(tokenizer, tmp_path):
    """With a certificate the server speaks TLS only; `tandem generate --tls-ca` connects."""
    import shutil
    import subprocess

    from tandem.router.client import ClientConfig, open_channel

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    srv = _server(tokenizer, tls_cert=cert, tls_key=key)
    try:
        target = f"127.0.0.1:{srv.port}"
        with open_channel(ClientConfig(target=target, tls_ca=cert)) as channel:
            _assert_serves(pb_grpc.RouterStub(channel))
        with grpc.insecure_channel(target) as channel:  # plaintext is refused
            with pytest.raises(grpc.RpcError) as e:
                _generate(pb_grpc.RouterStub(channel), GOOD)
            assert e.value.code() == Code.UNAVAILABLE
    finally:
        srv.stop()
