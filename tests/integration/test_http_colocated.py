"""The OpenAI-compatible HTTP front end to end, colocated, driven by the real `openai` SDK on
127.0.0.1: `HttpServer` (auth on) -> `Router` -> `ColocatedDispatcher` -> `EngineLoop` -> a tiny
random llama (float32) with a word-level tokenizer and chat template, in-process; the gRPC server
runs next to it on the same loop and router.

Checks: whole and streamed answers of both endpoints equal `LLMEngine.generate` on the same
prompt (greedy, batch 1 both ways); a stop string ends the text before it with finish reason
stop; the same seed at temperature 1 gives the same text and another seed another; usage,
streamed with include_usage too; one error per class (400 naming the field, 401, 404, 413; a
colocated router queues instead of refusing, so 429 is the disaggregated test's); a client that
disconnects mid-stream aborts its request and every KV page comes back; `tandem serve
--http-port` serves it next to gRPC and stops on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import openai
import pytest
from hf_tiny import save_tiny
from http_helpers import openai_client, write_word_tokenizer
from process_helpers import reap, stop_cleanly, wait_for_line

from tandem.colocated_node import build_colocated_router
from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.engine.request import Completion
from tandem.http_api import HttpConfig, HttpServer
from tandem.router.app import BackgroundServer
from tandem.router.router import Router
from tandem.router.server import ServerConfig
from tandem.tokenizer import ChatMessage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = "http-integration-secret"
WORKER = "colocated-0"
N = 12  # new tokens of the compared answers
LONG = 480  # a request that runs for many seconds on this CPU unless stopped
CHAT = [{"role": "user", "content": "w5 w17 w42 w9"}]
PROMPT = "w3 w1 w4 w1 w5 w9"


@dataclass
class System:
    engine: LLMEngine
    router: Router
    server: BackgroundServer
    http: HttpServer
    refs: dict[str, Completion]
    client: openai.OpenAI

    def wait_pages_free(self, timeout_s: float = 10.0) -> None:
        """Asserts the engine loop goes idle within `timeout_s` with every KV page back."""
        assert self.router.dispatcher.loop(WORKER).wait_idle(timeout_s), "generation went on"
        alloc = self.engine.allocator
        assert alloc.num_free == alloc.num_usable, "KV pages leaked"

    def stats(self):
        async def get():
            return self.router.stats()
        return self.server.call(get)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model_dir, _ = save_tiny("llama", tmp_path_factory.mktemp("http"))
    write_word_tokenizer(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def system(tiny_dir):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_dir), dtype="float32",
                                                page_size=4, num_pages=160))
    tok = engine.tokenizer
    greedy = SamplingParams(max_new_tokens=N, ignore_eos=True)
    # References first, from the same engine before its loop thread owns it (batch 1 each).
    chat_ids = tok.encode_chat([ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    refs = {"chat": engine.generate([chat_ids], greedy)[0],
            "prompt": engine.generate([tok.encode(PROMPT)], greedy)[0]}
    router = build_colocated_router(engine, model="tiny", worker=WORKER)
    http = HttpServer(router, HttpConfig(port=0, auth_token=TOKEN))
    server = BackgroundServer(router, ServerConfig(port=0), fronts=[http]).start()
    client = openai_client(http.port, TOKEN)
    yield System(engine, router, server, http, refs, client)
    client.close()
    server.stop()


EXTRA = {"ignore_eos": True}  # the random model may draw its EOS id at any step


def test_answers_equal_engine_generate(system):
    c = system.client
    ref = system.refs["chat"]
    whole = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=N, extra_body=EXTRA)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(ref.prompt_ids), len(ref.output_ids))
    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=N,
                                            stream=True, extra_body=EXTRA))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"

    ref = system.refs["prompt"]
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, extra_body=EXTRA)
    assert whole.choices[0].text == ref.text
    ids = c.completions.create(model="tiny", prompt=list(ref.prompt_ids), max_tokens=N,
                               extra_body=EXTRA)
    assert ids.choices[0].text == ref.text
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, stream=True,
                                       extra_body=EXTRA))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    system.wait_pages_free()


def test_a_stop_string_ends_the_text_before_it(system):
    ref = system.refs["prompt"]
    words = ref.text.split()
    # The first word from the third on whose text did not show before (not even inside a word).
    i = next(i for i in range(2, len(words)) if words[i] not in " ".join(words[:i]))
    stop, want = words[i], " ".join(words[:i])
    for stream in (False, True):
        out = system.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N,
                                               stop=[stop], stream=stream, extra_body=EXTRA)
        chunks = list(out) if stream else [out]
        text = "".join(ch.choices[0].text for ch in chunks)
        assert text.strip() == want, (ref.text, stop, text)
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_text(system):
    def sample(seed: int, stream: bool) -> str:
        out = system.client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=seed,
            stream=stream, extra_body=EXTRA)
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in out)
        return out.choices[0].message.content

    first = sample(7, False)
    assert sample(7, False) == first and sample(7, True) == first
    assert sample(8, False) != first  # 16 draws from ~256 words: equal only by a fluke
    assert first != system.refs["chat"].text  # it did sample


def test_usage_streamed_with_include_usage(system):
    chunks = list(system.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body=EXTRA))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(system.refs["prompt"].prompt_ids), 5, len(system.refs["prompt"].prompt_ids) + 5)


def test_one_error_per_class(system):
    c = system.client
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=CHAT, temperature=-0.5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai_client(system.http.port, "wrong").chat.completions.create(model="tiny",
                                                                          messages=CHAT)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as e:  # over the default 4 MiB
        c.completions.create(model="tiny", prompt="w1 " * (2 << 20))
    assert e.value.status_code == 413
    assert c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text
    system.wait_pages_free()


def test_a_client_gone_mid_stream_gives_every_page_back(system):
    before = system.stats().num_aborted
    stream = system.client.chat.completions.create(model="tiny", messages=CHAT,
                                                   max_tokens=LONG, stream=True,
                                                   extra_body=EXTRA)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    system.wait_pages_free(10.0)
    assert system.stats().num_aborted == before + 1  # stopped, not run to its end


def test_tandem_serve_http_port(tiny_dir, tmp_path):
    """`tandem serve --http-port 0` next to gRPC on one router; SIGTERM stops both."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tiny_dir), "--dtype",
         "float32", "--served-model-name", "tiny", "--port", "0", "--http-port", "0",
         "--auth-token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        m, lines = wait_for_line(proc, r"HTTP API on 127\.0\.0\.1:(\d+)", timeout_s=90)
        port = int(m.group(1))
        client = openai_client(port, TOKEN)
        out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                             extra_body=EXTRA)
        assert out.usage.completion_tokens == 3
        assert [m.id for m in client.models.list().data] == ["tiny"]
        client.close()
        stop_cleanly(proc, lines)
    finally:
        reap(proc)
