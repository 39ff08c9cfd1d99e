"""The router's edge against a scripted dispatcher (no model): request ids and Abort are per
caller (per gRPC connection), prompts are refused by size before tokenizing and answered late,
long prompts are tokenized off the event loop, and where the auth token comes from and what the
server warns about its address."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from test_router_lifecycle import FakeDispatcher

from tandem.engine.request import FinishReason
from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc
from tandem.router import (
    Code,
    GenerateInput,
    ModelInfo,
    Router,
    RouterConfig,
    RouterError,
    SamplingInput,
    WorkerInfo,
    WorkerRole,
)
from tandem.router.app import BackgroundServer
from tandem.router.auth import edge_warnings, is_loopback, resolve_auth_token
from tandem.router.server import ServerConfig
from tandem.tokenizer import ChatMessage, Tokenizer

WORKERS = [WorkerInfo(name="c0", role=WorkerRole.COLOCATED, model="smol", num_pages=8,
                      num_free_pages=8)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


def _model(max_model_len: int = 64) -> ModelInfo:
    return ModelInfo(name="smol", vocab_size=49152, max_model_len=max_model_len,
                     max_request_tokens=max_model_len)


def _router(tokenizer=None, cfg: RouterConfig = RouterConfig(), *, max_model_len: int = 64,
            **fake) -> tuple[Router, FakeDispatcher]:
    d = FakeDispatcher(WORKERS, models=(_model(max_model_len),), **fake)
    return Router(d, {"smol": tokenizer}, cfg), d


def _long(request_id: str) -> GenerateInput:
    return GenerateInput(prompt_token_ids=(1, 2, 3), request_id=request_id,
                         sampling=SamplingInput(max_tokens=40))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


# ---- request ids and Abort belong to their caller --------------------------------------------


@pytest.mark.timeout(30)
def test_abort_reaches_only_the_callers_own_request():
    async def main():
        router, d = _router(num_tokens=40, delay_s=0.02)
        a = router.generate(_long("r1"), caller="peer-a")
        b = router.generate(_long("r1"), caller="peer-b")  # the same id: no ALREADY_EXISTS
        first_a, first_b = await anext(a), await anext(b)
        assert first_a.request_id == first_b.request_id == "r1"
        # The workers see distinct ids; the first keeps the client's.
        routed = [r.request_id for r in d.submitted]
        assert routed[0] == "r1" and routed[1].startswith("r1~") and len(set(routed)) == 2
        assert await router.abort("r1", caller="peer-c") is False  # nothing of peer-c's
        assert await router.abort("r1", caller="peer-b") is True
        outs_b = [o async for o in b]
        assert outs_b[-1].finish_reason is FinishReason.ABORT
        outs_a = [o async for o in a]  # untouched by b's abort
        assert outs_a[-1].finish_reason is FinishReason.LENGTH
        assert len(outs_a) + 1 == 40
    run(main())


@pytest.mark.timeout(30)
def test_duplicate_id_is_refused_only_within_a_caller():
    async def main():
        router, _ = _router(num_tokens=20, delay_s=0.02)
        a = router.generate(_long("dup"), caller="peer-a")
        await anext(a)
        with pytest.raises(RouterError) as e:
            await anext(router.generate(_long("dup"), caller="peer-a"))
        assert e.value.code is Code.ALREADY_EXISTS and e.value.message.startswith("request_id")
        other = router.generate(_long("dup"), caller="peer-b")
        assert (await anext(other)).request_id == "dup"
        await other.aclose()
        await a.aclose()
        assert router.stats().num_in_flight == 0
    run(main())


@pytest.mark.timeout(60)
def test_grpc_abort_from_another_connection_finds_nothing(tokenizer):
    router, d = _router(tokenizer, num_tokens=200, delay_s=0.02)
    server = BackgroundServer(router, ServerConfig(port=0)).start()
    target = f"127.0.0.1:{server.port}"
    # A subchannel pool of its own: a separate TCP connection, as another client would have.
    options = [("grpc.use_local_subchannel_pool", 1)]
    try:
        with grpc.insecure_channel(target, options=options) as ch_a, \
                grpc.insecure_channel(target, options=options) as ch_b:
            stub_a, stub_b = pb_grpc.RouterStub(ch_a), pb_grpc.RouterStub(ch_b)
            call = stub_a.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], request_id="x",
                                                      sampling=pb.SamplingParams(max_tokens=40)),
                                   timeout=30)
            assert next(call).request_id == "x"
            assert not stub_b.Abort(pb.AbortRequest(request_id="x"), timeout=10).found
            # b may use the id itself while a's request runs.
            outs = list(stub_b.Generate(pb.GenerateRequest(
                prompt_token_ids=[1], request_id="x", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=30))
            assert outs[-1].request_id == "x" and outs[-1].usage.completion_tokens == 2
            assert stub_a.Abort(pb.AbortRequest(request_id="x"), timeout=10).found
            rest = list(call)
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    finally:
        server.stop()


# ---- size before work ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_prompt_refused_by_size_is_never_tokenized(tokenizer, monkeypatch):
    router, d = _router(tokenizer, RouterConfig(too_long_delay_s=0))
    calls = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, *a, **k: calls.append(a) or [1])
    huge = "x" * 3_900_000

    async def main():
        for inp, field in [(GenerateInput(prompt=huge), "prompt"),
                           (GenerateInput(messages=(ChatMessage(role="user", content="hi"),
                                                    ChatMessage(role="user", content=huge))),
                            "messages[1].content")]:
            t0 = time.perf_counter()
            with pytest.raises(RouterError) as e:
                await anext(router.generate(inp))
            assert time.perf_counter() - t0 < 0.5
            assert e.value.code is Code.INVALID_ARGUMENT
            assert e.value.message.startswith(f"{field}: the "), e.value.message
            assert "at least 48149 tokens" in e.value.message or field != "prompt"
            assert "covers at most 81 bytes" in e.value.message
            assert "holds 64" in e.value.message
    run(main())
    assert not calls and not d.submitted


def test_size_bound_is_tight_and_never_refuses_what_fits(tokenizer):
    """SmolLM2's longest token (a newline and 80 spaces) repeated 63 times is 63 x 81 bytes and
    exactly 63 tokens: it fits a context of 64 and is served; 64 of them are refused by size."""
    longest = "\n" + " " * 80

    async def main():
        router, d = _router(tokenizer, RouterConfig(too_long_delay_s=0))
        outs = [o async for o in router.generate(GenerateInput(
            prompt=longest * 63, sampling=SamplingInput(max_tokens=1)))]
        assert outs[-1].usage.prompt_tokens == 63
        with pytest.raises(RouterError) as e:  # 64 x 81 bytes: at least 64 tokens
            await anext(router.generate(GenerateInput(prompt=longest * 64)))
        assert e.value.message.startswith("prompt: the prompt has 5184 bytes, so at least 64")
    run(main())


@pytest.mark.timeout(30)
def test_too_long_refusal_is_answered_late_and_counted():
    async def main():
        router, d = _router(cfg=RouterConfig(too_long_delay_s=0.3))
        t0 = time.perf_counter()
        with pytest.raises(RouterError) as e:
            await anext(router.generate(GenerateInput(prompt_token_ids=(1,) * 64)))
        assert time.perf_counter() - t0 >= 0.3
        assert e.value.message.startswith("prompt_token_ids: the prompt has 64 tokens")
        t0 = time.perf_counter()  # other refusals are not delayed
        with pytest.raises(RouterError):
            await anext(router.generate(GenerateInput(prompt_token_ids=(1,),
                                                      sampling=SamplingInput(max_tokens=0))))
        assert time.perf_counter() - t0 < 0.2
        assert router.stats().num_rejected == 2 and not d.submitted
    run(main())


@pytest.mark.timeout(60)
def test_long_prompt_is_tokenized_off_the_event_loop(tokenizer):
    """While a 1 MB prompt is tokenized (about half a second), the loop keeps running."""
    text = "the quick brown fox jumps over the lazy dog " * 24_000

    async def main():
        router, d = _router(tokenizer, max_model_len=1 << 20)
        ticks: list[float] = []

        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        outs = [o async for o in router.generate(GenerateInput(
            prompt=text, sampling=SamplingInput(max_tokens=1)))]
        took = time.perf_counter() - t0
        task.cancel()
        assert outs[-1].usage.prompt_tokens > 200_000
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < took / 4, (max(gaps), took)
        await router.close()
    run(main())


# ---- the auth token and the address ----------------------------------------------------------


def test_auth_token_sources(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    env = {"TANDEM_AUTH_TOKEN": "from-env"}
    assert resolve_auth_token(file=path, environ=env) == "s3cret"
    assert resolve_auth_token(environ=env) == "from-env"
    assert resolve_auth_token(environ={}) is None
    assert resolve_auth_token(environ={"TANDEM_AUTH_TOKEN": ""}) is None
    with caplog.at_level(logging.WARNING, logger="tandem.router.auth"):
        assert resolve_auth_token(value="on-the-command-line", environ=env) == (
            "on-the-command-line")
    assert "process list" in caplog.text and "on-the-command-line" not in caplog.text
    with pytest.raises(ValueError, match="give only one"):
        resolve_auth_token(value="a", file=path, environ={})
    with pytest.raises(ValueError, match="^--auth-token-file: no such file"):
        resolve_auth_token(file=tmp_path / "missing", environ={})
    (tmp_path / "empty").write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no token"):
        resolve_auth_token(file=tmp_path / "empty", environ={})


def test_edge_warnings():
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert is_loopback(host) and edge_warnings(host, auth=True, tls=False) == []
    for host in ("0.0.0.0", "::", "10.0.0.7", "router.example.com", ""):
        assert not is_loopback(host)
    (w,) = edge_warnings("0.0.0.0", auth=True, tls=False)
    assert "plaintext" in w and "TLS" in w
    assert edge_warnings("0.0.0.0", auth=True, tls=True) == []
    (w,) = edge_warnings("10.0.0.7", auth=False, tls=True)
    assert "no auth token" in w


@pytest.mark.timeout(60)
def test_server_warns_when_token_goes_over_plaintext(tokenizer, caplog):
    router, _ = _router(tokenizer)
    with caplog.at_level(logging.WARNING, logger="tandem.router.auth"), \
            caplog.at_level(logging.WARNING, logger="tandem.router.server"):
        server = BackgroundServer(router, ServerConfig(host="0.0.0.0", port=0,
                                                       auth_token="t0ken")).start()
        server.stop()
    assert "the auth token is sent in plaintext" in caplog.text
    assert "t0ken" not in caplog.text


@pytest.mark.timeout(60)
def test_cli_token_file_and_conflicting_flags(tokenizer, tmp_path, capsys, monkeypatch):
    from tandem.cli import main

    monkeypatch.delenv("TANDEM_AUTH_TOKEN", raising=False)

    router, _ = _router(tokenizer)
    server = BackgroundServer(router, ServerConfig(port=0, auth_token="filed")).start()
    try:
        (tmp_path / "tok").write_text("filed\n")
        target = f"127.0.0.1:{server.port}"
        args = ["generate", "--target", target, "hi", "--max-new-tokens", "2"]
        assert main([*args, "--auth-token-file", str(tmp_path / "tok")]) == 0
        assert "2 completion tokens" in capsys.readouterr().err
        assert main(args) == 1  # no token at all
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main([*args, "--auth-token", "x", "--auth-token-file",
                     str(tmp_path / "tok")]) == 2
        assert "give only one" in capsys.readouterr().err
    finally:
        server.stop()
    assert main(["serve", "--auth-token-file", str(tmp_path / "missing")]) == 2
    assert "--auth-token-file: no such file" in capsys.readouterr().err
