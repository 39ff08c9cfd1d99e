"""OpenAI request bodies -> router values, router outputs -> OpenAI response bodies. Pure
functions; what a value may be is checked by the router (router/validate.py), and only what the
gRPC API cannot express is refused here (n > 1, penalties, tools, batched prompts).

Log-probabilities: chat's `logprobs` / `top_logprobs` and completions' `logprobs: n` become the
router's `sampling.logprobs` / `sampling.top_logprobs` (n alternatives, 0 to 20 -- OpenAI
allows 5 for completions, vLLM 20 as here); the answers carry them in OpenAI's shapes
(http_api/logprobs.py).

Field names: the router names `sampling.temperature`, `sampling.max_tokens`,
`prompt_token_ids[3]`; `Call.rename` maps them to what this request sent (`temperature`,
`max_completion_tokens`, `prompt[3]`), so an error's `param` is a field of the request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tandem.http_api.errors import invalid
from tandem.http_api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatFirstDelta,
    ChatMessageIn,
    Completion,
    CompletionChoice,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from tandem.messages import FinishReason
from tandem.router import GenerateInput, GenerateOutput, ModelInfo, SamplingInput
from tandem.tokenizer import ChatMessage

# OpenAI's newer name for the system role (its reasoning models' instructions).
_ROLE_ALIASES = {"developer": "system"}


class Endpoint(str, Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One generation request, as the router takes it and as its answer is shaped."""

    endpoint: Endpoint
    inp: GenerateInput
    model: str  # echoed in every body: the request's, or the only served model's
    stream: bool
    include_usage: bool  # streamed: a last chunk with the usage and no choices
    created: int  # unix seconds, the same in every chunk
    # (router field prefix, this request's name for it), first match wins; see `rename`.
    renames: tuple[tuple[str, str], ...]
    fields: frozenset[str]  # the request's top-level fields

    def rename(self, field: str) -> str | None:
        """A router field path as this request spells it; None when the request has no such
        field (the router's `queue`, `deadline`, `request_id`, ...)."""
        for prefix, ours in self.renames:
            if field.startswith(prefix):
                field = ours + field[len(prefix):]
                break
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        return field if root in self.fields else None


def chat_call(req: ChatCompletionRequest, models: Sequence[ModelInfo], now: int) -> Call:
    refuse_unsupported(req)
    if not req.messages:
        raise invalid("messages", "must hold at least one message")
    messages = tuple(_message(i, m) for i, m in enumerate(req.messages))
    max_tokens, max_tokens_field = _max_tokens(req)
    return Call(
        endpoint=Endpoint.CHAT,
        inp=GenerateInput(messages=messages, sampling=_sampling(req, max_tokens), model=req.model),
        model=_model_name(req.model, models), stream=req.stream,
        include_usage=_include_usage(req), created=now,
        renames=(("sampling.max_tokens", max_tokens_field), *_stop_renames(req),
                 ("sampling.", "")),
        fields=frozenset(ChatCompletionRequest.model_fields))


def completion_call(req: CompletionRequest, models: Sequence[ModelInfo], now: int) -> Call:
    refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:  # a batch: OpenAI answers it as n choices, we take one prompt
            raise invalid("prompt", f"one prompt per request, got {len(prompt)}; send them as "
                                    "separate requests")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("prompt", "is empty")
        inp = GenerateInput(prompt_token_ids=tuple(prompt), sampling=_sampling(req, req.max_tokens),
                            model=req.model)
    else:
        inp = GenerateInput(prompt=prompt, sampling=_sampling(req, req.max_tokens),
                            model=req.model)
    return Call(
        endpoint=Endpoint.COMPLETIONS, inp=inp, model=_model_name(req.model, models),
        stream=req.stream, include_usage=_include_usage(req), created=now,
        renames=(("prompt_token_ids", "prompt"), ("sampling.top_logprobs", "logprobs"),
                 *_stop_renames(req), ("sampling.", "")),
        fields=frozenset(CompletionRequest.model_fields))


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """400 for what would change the answer but that tandem cannot do (yet)."""
    if req.n != 1:
        raise invalid("n", f"only n=1 is supported (one choice per request), got {req.n}")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:  # as OpenAI: alternatives need logprobs
            raise invalid("top_logprobs", "needs logprobs: true")
        if req.tools or req.tool_choice not in (None, "none"):
            raise invalid("tools" if req.tools else "tool_choice",
                          "tool calls are not supported")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise invalid("response_format", "only {'type': 'text'} is supported")
    else:
        if req.echo:
            raise invalid("echo", "not supported")
        if req.suffix:
            raise invalid("suffix", "not supported")
        if req.best_of not in (None, 1):
            raise invalid("best_of", f"only 1 is supported, got {req.best_of}")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0):
            raise invalid(name, "not supported (only 0)")
    if req.logit_bias:
        raise invalid("logit_bias", "not supported")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "only with stream: true")


def _message(i: int, m: ChatMessageIn) -> ChatMessage:
    if m.content is None or isinstance(m.content, str):
        content = m.content or ""
    else:
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise invalid(f"messages[{i}].content[{j}].type",
                              f"'{part.type}' parts are not supported (text only)")
            texts.append(part.text or "")
        content = "".join(texts)
    return ChatMessage(role=_ROLE_ALIASES.get(m.role, m.role), content=content)


def _max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    """(the new-token bound, the field that set it)."""
    if req.max_completion_tokens is None:
        return req.max_tokens, "max_tokens"
    if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise invalid("max_completion_tokens", f"{req.max_completion_tokens} differs from "
                                               f"max_tokens {req.max_tokens}; give one")
    return req.max_completion_tokens, "max_completion_tokens"


def _sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None
              ) -> SamplingInput:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if isinstance(req, ChatCompletionRequest):
        logprobs, top_logprobs = bool(req.logprobs), req.top_logprobs
    else:  # completions' `logprobs: n`: the returned token's and n alternatives
        logprobs, top_logprobs = req.logprobs is not None, req.logprobs
    return SamplingInput(
        max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
        min_p=req.min_p, seed=req.seed, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        logprobs=logprobs, top_logprobs=top_logprobs)


def _stop_renames(req: ChatCompletionRequest | CompletionRequest) -> tuple[tuple[str, str], ...]:
    # A single stop string is `stop`, not `stop[0]`.
    return (("sampling.stop[0]", "stop"),) if isinstance(req.stop, str) else ()


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return req.stream and req.stream_options is not None and req.stream_options.include_usage


def _model_name(requested: str, models: Sequence[ModelInfo]) -> str:
    if requested or len(models) != 1:
        return requested  # an unknown or missing name is the router's error to give
    return models[0].name


# ---- responses ------------------------------------------------------------------------------


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(out: GenerateOutput) -> Usage:
    u = out.usage
    assert u is not None, "the router's last output carries the usage"
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens)


def response_id(call: Call, request_id: str) -> str:
    return f"{'chatcmpl' if call.endpoint is Endpoint.CHAT else 'cmpl'}-{request_id}"


Logprobs = ChatLogprobs | CompletionLogprobs  # the endpoint's shape (http_api/logprobs.py)


def whole_body(call: Call, text: str, final: GenerateOutput,
               logprobs: Logprobs | None = None) -> ChatCompletion | Completion:
    """The answer to a request without `stream`; `logprobs` when it asked, for every token."""
    rid = response_id(call, final.request_id)
    reason = finish_reason(final.finish_reason)
    if call.endpoint is Endpoint.CHAT:
        return ChatCompletion(
            id=rid, created=call.created, model=call.model, usage=usage(final),
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason,
                                logprobs=logprobs)])
    return Completion(id=rid, created=call.created, model=call.model, usage=usage(final),
                      choices=[CompletionChoice(text=text, finish_reason=reason,
                                                logprobs=logprobs)])


def chunk_body(call: Call, request_id: str, text: str, reason: FinishReason | None,
               first: bool, logprobs: Logprobs | None = None
               ) -> ChatCompletionChunk | Completion:
    """One streamed chunk; a chat stream's first chunk names the role. `logprobs`: the chunk's
    tokens' when the request asked."""
    rid = response_id(call, request_id)
    if call.endpoint is Endpoint.CHAT:
        delta = ChatFirstDelta(content=text) if first else ChatDelta(content=text)
        return ChatCompletionChunk(
            id=rid, created=call.created, model=call.model,
            choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason(reason),
                                     logprobs=logprobs)])
    return Completion(id=rid, created=call.created, model=call.model,
                      choices=[CompletionChoice(text=text, finish_reason=finish_reason(reason),
                                                logprobs=logprobs)])


def usage_body(call: Call, final: GenerateOutput) -> ChatCompletionChunk | Completion:
    """The `stream_options.include_usage` chunk: no choices, the usage."""
    rid = response_id(call, final.request_id)
    cls = ChatCompletionChunk if call.endpoint is Endpoint.CHAT else Completion
    return cls(id=rid, created=call.created, model=call.model, choices=[], usage=usage(final))
