"""The context limit of docs/architecture.md, "Request semantics", applied alike by the engines,
the router's validation, the gRPC API and `tandem generate`:

- a prompt that leaves no room for one new token is refused, naming the prompt's field;
- max_tokens (given or the default) is capped to what the context leaves after the prompt, and
  the answer ends there with finish reason length;
- one worker's KV cache caps an unset max_tokens and refuses a given one that does not fit.

A tiny target with a 32-token context, on the CPU."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import grpc
import pytest
from spec_helpers import (
    VOCAB,
    assert_pages_free,
    engine_cfg,
    letter_tokenizer,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_head,
    tiny_target,
)

from tandem.engine import FinishReason, LLMEngine, SamplingParams
from tandem.router import ModelInfo
from tandem.router.errors import Code, RouterError
from tandem.router.validate import GenerateInput, SamplingInput, validate
from tandem.spec import SpecConfig, SpecEngine

CONTEXT = 32
PROMPT_LEN = 20  # leaves 12 new tokens


def _tokenizer():
    return letter_tokenizer(split_on_spaces=True)  # `tandem generate` sends text


def _model():
    return tiny_target("llama", live=None, max_position=CONTEXT)  # as build_model sizes it


def _prompt(n: int = PROMPT_LEN) -> list[int]:
    return prompts(1, seed=420, lo=n, hi=n)[0]


def _engine(kind: str) -> LLMEngine:
    model, cfg = _model(), engine_cfg(max_model_len=CONTEXT)
    if kind == "plain":
        return LLMEngine(cfg, model, _tokenizer())
    head = tiny_head(model, "eagle", live=None, max_position=CONTEXT)
    return SpecEngine(cfg, SpecConfig(num_steps=4), model, head, _tokenizer())


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_engine_caps_max_new_tokens_to_the_context(kind):
    eng = _engine(kind)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    (c,) = eng.generate([_prompt()], params)
    assert len(c.output_ids) == CONTEXT - PROMPT_LEN and c.finish_reason == FinishReason.LENGTH
    (c,) = eng.generate([_prompt(CONTEXT - 1)], params)  # room for exactly one
    assert len(c.output_ids) == 1 and c.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match=r"^prompt_token_ids: the prompt has 32 tokens"):
        eng.add_request(_prompt(CONTEXT), params)
    assert_pages_free(eng)


def _validate(max_tokens: int | None, n: int = PROMPT_LEN, capacity: int = 1000,
              default: int = 128) -> SamplingParams:
    model = ModelInfo(name="tiny", vocab_size=VOCAB, max_model_len=CONTEXT,
                      max_request_tokens=capacity)
    inp = GenerateInput(prompt_token_ids=tuple(_prompt(n)),
                        sampling=SamplingInput(max_tokens=max_tokens))
    return validate(inp, model, None, default).params


def test_router_caps_max_tokens_given_or_not():
    assert _validate(100).max_new_tokens == CONTEXT - PROMPT_LEN  # given: capped
    assert _validate(None).max_new_tokens == CONTEXT - PROMPT_LEN  # the default: capped
    assert _validate(5).max_new_tokens == 5  # fits: as given
    assert _validate(None, default=7).max_new_tokens == 7
    with pytest.raises(RouterError) as e:
        _validate(1, n=CONTEXT)
    assert e.value.code is Code.INVALID_ARGUMENT
    assert e.value.message.startswith("prompt_token_ids: the prompt has 32 tokens")


def test_router_kv_capacity_caps_the_default_and_refuses_a_given_max_tokens():
    assert _validate(None, capacity=26).max_new_tokens == 6
    assert _validate(6, capacity=26).max_new_tokens == 6
    with pytest.raises(RouterError) as e:
        _validate(100, capacity=26)  # capped to 12 by the context: still more than fits
    assert e.value.code is Code.RESOURCE_EXHAUSTED
    assert e.value.message.startswith("sampling.max_tokens: prompt (20 tokens) + max_tokens "
                                      "(100) needs more KV cache")


@pytest.fixture(scope="module")
def server():
    from tandem.colocated_node import build_colocated_router
    from tandem.router.app import BackgroundServer
    from tandem.router.server import ServerConfig

    engine = LLMEngine(engine_cfg(max_model_len=CONTEXT), _model(), _tokenizer())
    srv = BackgroundServer(build_colocated_router(engine, model="tiny"),
                           ServerConfig(host="127.0.0.1", port=0)).start()
    yield srv
    srv.stop()


@pytest.mark.timeout(60)
def test_grpc_api_caps_and_refuses(server):
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.RouterStub(channel)
        for sampling in (pb.SamplingParams(max_tokens=100, ignore_eos=True),
                         pb.SamplingParams(ignore_eos=True)):
            msgs = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=_prompt(),
                                                         sampling=sampling), timeout=30))
            n = sum(len(m.token_ids) for m in msgs)
            assert n == msgs[-1].usage.completion_tokens == CONTEXT - PROMPT_LEN
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=_prompt(CONTEXT)),
                               timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("prompt_token_ids: the prompt has 32 tokens")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [[], ["--max-new-tokens", "100"]], ids=["unset", "given"])
def test_tandem_generate_gets_the_cap(server, flags):
    from tandem.cli.app import main

    text = " ".join(_tokenizer().decode([t]) for t in _prompt())
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(["generate", text, "--target", f"127.0.0.1:{server.port}", "--ignore-eos",
                       *flags])
    assert status == 0, err.getvalue()
    assert f"[length: {PROMPT_LEN} prompt + {CONTEXT - PROMPT_LEN} completion tokens" in (
        err.getvalue())


@pytest.mark.timeout(60)
def test_tandem_generate_names_the_prompt_when_it_fills_the_context(server):
    from tandem.cli.app import main

    text = " ".join(_tokenizer().decode([t]) for t in _prompt(CONTEXT))
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        status = main(["generate", text, "--target", f"127.0.0.1:{server.port}"])
    assert status == 1
    assert "INVALID_ARGUMENT: prompt: the prompt has 32 tokens" in err.getvalue()


@pytest.mark.timeout(60)
def test_tandem_generate_prints_logprobs_when_asked(server):
    """`tandem generate --logprobs N`: one line per returned token, its id and log-probability
    and N alternatives (greedy: the token is the most likely one)."""
    from tandem.cli.app import main

    text = " ".join(_tokenizer().decode([t]) for t in _prompt())
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        status = main(["generate", text, "--target", f"127.0.0.1:{server.port}", "--ignore-eos",
                       "--max-new-tokens", "3", "--logprobs", "2"])
    assert status == 0, err.getvalue()
    lines = err.getvalue().split("[logprobs: ")[1].splitlines()[1:]
    assert len(lines) == 3
    for line in lines:
        token_id, logprob, *alts = line.split()
        assert float(logprob) <= 0 and len(alts) == 2
        assert alts[0].split(":")[0] == token_id
    with redirect_stdout(io.StringIO()), redirect_stderr(err := io.StringIO()):
        main(["generate", text, "--target", f"127.0.0.1:{server.port}", "--max-new-tokens", "2"])
    assert "[logprobs" not in err.getvalue()  # not asked: none
