"""Request validation and tokenization: a client's `GenerateInput` becomes prompt token ids plus
engine `SamplingParams`, or a `RouterError` whose message starts with the offending field as the
API spells it (`prompt`, `messages[1].role`, `sampling.top_p`, ...).

Pure functions; the tokenizer is immutable and shared. Tokenization happens here, once per
request: workers receive token ids only.

Size before work: a text prompt is bounded by its UTF-8 length before it is tokenized. With
byte-level BPE every input byte is covered by exactly one token and a token covers at most
`Tokenizer.max_token_bytes` (L) bytes, so B bytes are at least ceil(B / L) tokens; when that
alone leaves no room in the context, the request is refused at once (SmolLM2: L = 81, context
8192, so about 660 KB; a 3.9 MB prompt costs microseconds instead of seconds of tokenizing).
For chat the bound applies to the rendered conversation, which holds every content the template
keeps (rendering is a string join, ~1 ms for 4 MB).

Control tokens: a raw `prompt` may contain special-token text and it becomes the control token
(as in vLLM's raw completions: the client writes the whole prompt, markers included). Message
contents may not: `Tokenizer.encode_chat` encodes special-token text in a content as text, so
only the chat template's own markers are control tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.messages import MAX_TOP_LOGPROBS, SamplingParams
from tandem.router.dispatch import ModelInfo
from tandem.router.errors import Code, RouterError, invalid
from tandem.tokenizer import ALLOWED_ROLES, ChatMessage, Tokenizer

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_REQUEST_ID_CHARS = 256


class PromptTooLong(RouterError):
    """INVALID_ARGUMENT: the prompt cannot fit the model's context, shown by its size or its
    token count (a refusal the router answers late, see `RouterConfig.too_long_delay_s`)."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingInput:
    """`tandem.v1.SamplingParams` as plain values; None = not set (engine default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateInput:
    """`tandem.v1.GenerateRequest` as plain values (see router.proto for the meaning)."""

    prompt: str | None = None  # None: not set ("" is set and empty)
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    sampling: SamplingInput = SamplingInput()
    model: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def resolve_model(name: str, models: Sequence[ModelInfo]) -> ModelInfo:
    if not name:
        if len(models) == 1:
            return models[0]
        raise invalid(f"model: this router serves several models; name one of "
                      f"{', '.join(m.name for m in models)}")
    for m in models:
        if m.name == name:
            return m
    raise RouterError(Code.NOT_FOUND, f"model: no model named '{name}' (served: "
                                      f"{', '.join(m.name for m in models)})")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
    if any(not c.isprintable() for c in request_id):
        raise invalid("request_id: must contain printable characters only")


def num_text_chars(inp: GenerateInput) -> int:
    """Characters of text to tokenize (<= its UTF-8 bytes; O(1) per field)."""
    return len(inp.prompt or "") + sum(len(m.content) for m in inp.messages)


def check_text_size(field: str, num_bytes: int, tokenizer: Tokenizer, model: ModelInfo,
                    what: str = "the prompt") -> None:
    """Refuse text that must be longer than the context, from its size alone (see above)."""
    max_token_bytes = tokenizer.max_token_bytes
    if max_token_bytes is None:  # no provable bound for this tokenizer: tokenize and count
        return
    min_tokens = -(-num_bytes // max_token_bytes)
    if min_tokens >= model.max_model_len:
        raise PromptTooLong(
            f"{field}: {what} has {num_bytes} bytes, so at least {min_tokens} tokens (a token of "
            f"this model covers at most {max_token_bytes} bytes); the context of model "
            f"'{model.name}' holds {model.max_model_len} (prompt + at least one new token)")


def validate(inp: GenerateInput, model: ModelInfo, tokenizer: Tokenizer | None,
             default_max_tokens: int) -> ValidRequest:
    """Check everything about the request that does not depend on worker state."""
    check_sampling_fields(inp.sampling, model)
    field, prompt_ids = tokenize(inp, tokenizer, model)
    n = len(prompt_ids)
    if n >= model.max_model_len:
        raise PromptTooLong(f"{field}: the prompt has {n} tokens; the context of model "
                            f"'{model.name}' holds {model.max_model_len} (prompt + at least one "
                            f"new token)")
    s = inp.sampling
    # The context limit (docs/architecture.md, "Request semantics"), as the engine applies it:
    # max_tokens, given or the default, is capped to what the context leaves after the prompt,
    # where the request ends with finish reason length. One worker's KV cache is a bound of
    # the deployment instead: the default is capped to it, a given max_tokens that does not
    # fit (once capped to the context) is refused.
    if s.max_tokens is None:
        max_tokens = min(default_max_tokens, model.max_model_len - n,
                         model.max_request_tokens - n)
        if max_tokens <= 0:
            raise RouterError(Code.RESOURCE_EXHAUSTED, _capacity_message(field, n, 1, model))
    else:
        max_tokens = min(s.max_tokens, model.max_model_len - n)
        if n + max_tokens > model.max_request_tokens:
            raise RouterError(Code.RESOURCE_EXHAUSTED,
                              _capacity_message("sampling.max_tokens", n, s.max_tokens, model))
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=0.0 if s.temperature is None else s.temperature,
            top_k=0 if s.top_k is None else s.top_k,
            top_p=1.0 if s.top_p is None else s.top_p,
            min_p=0.0 if s.min_p is None else s.min_p,
            seed=s.seed, stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
            logprobs=s.logprobs, top_logprobs=s.top_logprobs or 0)
    except ValueError as exc:  # backstop: the checks above cover every field
        raise invalid(f"sampling.{exc}") from exc
    return ValidRequest(prompt_ids=tuple(prompt_ids), params=params)


def check_sampling_fields(s: SamplingInput, model: ModelInfo) -> None:
    if s.max_tokens is not None and s.max_tokens <= 0:
        raise invalid(f"sampling.max_tokens: must be > 0, got {s.max_tokens}")
    if s.temperature is not None and not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid(f"sampling.temperature: must be a finite number >= 0, got {s.temperature}")
    if s.top_k is not None and s.top_k < 0:
        raise invalid(f"sampling.top_k: must be >= 0 (0 disables), got {s.top_k}")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise invalid(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    if s.min_p is not None and not 0.0 <= s.min_p <= 1.0:
        raise invalid(f"sampling.min_p: must be in [0, 1], got {s.min_p}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise invalid(f"sampling.stop[{i}]: must have 1 to {MAX_STOP_CHARS} characters")
    for i, t in enumerate(s.stop_token_ids):
        if not 0 <= t < model.vocab_size:
            raise invalid(f"sampling.stop_token_ids[{i}]: token id {t} is outside the "
                          f"vocabulary [0, {model.vocab_size})")
    if s.top_logprobs is not None and not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"sampling.top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got "
                      f"{s.top_logprobs}")
    if s.top_logprobs and not s.logprobs:
        raise invalid("sampling.top_logprobs: needs sampling.logprobs (set it to true)")


def tokenize(inp: GenerateInput, tokenizer: Tokenizer | None, model: ModelInfo
             ) -> tuple[str, list[int]]:
    """(the field the prompt came from, its token ids). Exactly one source must be given."""
    given = [name for name, present in (("prompt", inp.prompt is not None),
                                        ("prompt_token_ids", bool(inp.prompt_token_ids)),
                                        ("messages", bool(inp.messages))) if present]
    if len(given) > 1:
        raise invalid(f"{', '.join(given)}: give only one of prompt, prompt_token_ids, messages")
    if not given:
        raise invalid("prompt: the request has no prompt (set prompt, prompt_token_ids or "
                      "messages)")
    field = given[0]
    if field == "prompt_token_ids":
        if len(inp.prompt_token_ids) >= model.max_model_len:  # before a Python loop over them
            return field, list(inp.prompt_token_ids)  # validate() names the length
        for i, t in enumerate(inp.prompt_token_ids):
            if not 0 <= t < model.vocab_size:
                raise invalid(f"prompt_token_ids[{i}]: token id {t} is outside the vocabulary "
                              f"[0, {model.vocab_size})")
        return field, list(inp.prompt_token_ids)
    if field == "prompt" and not inp.prompt:
        raise invalid("prompt: is empty")
    if tokenizer is None:
        raise RouterError(Code.FAILED_PRECONDITION,
                          f"{field}: model '{model.name}' has no tokenizer; send "
                          f"prompt_token_ids")
    if field == "prompt":
        prompt = inp.prompt or ""
        check_text_size("prompt", len(prompt.encode()), tokenizer, model)
        ids = tokenizer.encode(prompt)  # control-token text stays a control token (see above)
        if not ids:
            raise invalid("prompt: encodes to no tokens")
        return field, ids
    for i, m in enumerate(inp.messages):
        if m.role not in ALLOWED_ROLES:
            raise invalid(f"messages[{i}].role: unknown role '{m.role}' (expected one of "
                          f"{', '.join(ALLOWED_ROLES)})")
    messages = list(inp.messages)
    try:
        text = tokenizer.apply_chat_template(messages)
        # Named after the largest content: the one to shorten.
        largest = max(range(len(messages)), key=lambda i: len(messages[i].content))
        check_text_size(f"messages[{largest}].content", len(text.encode()), tokenizer, model,
                        what="the rendered conversation")
        return field, tokenizer.encode_rendered_chat(messages, text)
    except ValueError as exc:  # no template, the template rejects the conversation, ...
        msg = str(exc)
        raise invalid(msg if msg.startswith("messages") else f"messages: {msg}") from exc


def _capacity_message(field: str, num_prompt: int, max_tokens: int, model: ModelInfo) -> str:
    return (f"{field}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs more KV "
            f"cache than a worker of model '{model.name}' has ({model.max_request_tokens} "
            f"tokens); lower max_tokens or shorten the prompt")
