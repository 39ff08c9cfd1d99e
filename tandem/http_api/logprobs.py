"""Returned tokens' log-probabilities in OpenAI's two shapes. Pure functions over the router's
`TokenLogprob`s (the values' rule is messages/logprobs.py's: the log-softmax of the model's raw
logits, whatever the sampling settings).

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}`, one entry per token, `top_logprobs` the request's number of most
  likely alternatives (the returned token among them only when it is that likely);
- completions (the legacy shape): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
  (per token a dict text -> logprob of the alternatives plus the returned token, so up to
  `logprobs` + 1 entries, as OpenAI documents) and `text_offset` (where each token's text starts
  in the completion's text, counted over the whole answer: a stream's chunks continue it).

A token's text is its bytes decoded as UTF-8, a partial character replaced by U+FFFD (its
`bytes` are exact); with no tokenizer it is "token_id:<id>" and `bytes` is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.http_api.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from tandem.messages import TokenLogprob as RouterLogprob
from tandem.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenNamer:
    """A token id's text and bytes, from the served model's tokenizer (None: ids only)."""

    tokenizer: Tokenizer | None

    def name(self, token_id: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(lps: Sequence[RouterLogprob], namer: TokenNamer) -> ChatLogprobs:
    content = []
    for lp in lps:
        text, raw = namer.name(lp.token_id)
        top = []
        for t, v in zip(lp.top_ids, lp.top_logprobs):
            t_text, t_raw = namer.name(t)
            top.append(TopLogprob(token=t_text, logprob=v, bytes=t_raw))
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(lps: Sequence[RouterLogprob], namer: TokenNamer, offset: int
                        ) -> tuple[CompletionLogprobs, int]:
    """The shape for `lps`, their texts starting at character `offset` of the completion; and
    the offset after them (where the next chunk's start)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = namer.name(lp.token_id)
        top: dict[str, float] = {}
        for t, v in zip(lp.top_ids, lp.top_logprobs):
            top.setdefault(namer.name(t)[0], v)
        top.setdefault(text, lp.logprob)  # the returned token is always there
        tokens.append(text)
        values.append(lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                              text_offset=offsets), offset
