"""The OpenAI wire format: request and response bodies of /v1/chat/completions, /v1/completions
and /v1/models, as pydantic models. Shapes only -- types and the integer widths of the gRPC API;
what a value may be (temperature >= 0, top_p in (0, 1], ...) is the router's validation, so both
fronts refuse the same requests (http_api/convert.py maps the fields).

Requests ignore fields they do not know (clients send `store`, `metadata`, ...); fields that
would change the answer if ignored (penalties, tools, ...) are declared here so that convert.py
can refuse them by name. Response choices carry `logprobs` when the request asked (null
otherwise), in OpenAI's shape for the endpoint (http_api/logprobs.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integer widths of the gRPC API (router.proto): int32 counts, int64 seeds and token ids.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False  # one more chunk at the end: empty choices, the usage


class _Sampling(_Request):
    """The fields both generation endpoints share."""

    model: str = ""  # "": the only served model
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # Refused unless left at their neutral value (convert.refuse_unsupported).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (as vLLM names them): the gRPC API's other sampling fields.
    top_k: Int32 | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessageIn(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted and ignored


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int32 | None = None  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


class CompletionRequest(_Sampling):
    # One prompt: a string or token ids (a one-element batch of either is accepted too).
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None


# ---- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    """One generated token of a chat answer, as OpenAI's `logprobs.content[i]`."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


FinishReasonOut = Literal["stop", "length", "abort"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonOut | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    content: str | None = None


class ChatFirstDelta(ChatDelta):
    """A stream's first delta names the role; the others leave it out (as OpenAI streams)."""

    role: Literal["assistant"] = "assistant"


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatFirstDelta | ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonOut | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # the include_usage chunk only


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonOut | None = None


class Completion(BaseModel):
    """A completion, and (with usage null until the last) each chunk of a streamed one: the
    legacy API streams the same object."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int  # prompt + new tokens (an extension, as vLLM reports it)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo
