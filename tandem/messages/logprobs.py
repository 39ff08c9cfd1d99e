"""The log-probabilities of returned tokens, as they cross processes (engine -> worker event ->
router -> a front). Torch-free.

The rule (one for every path: plain decoding, speculative verify, the prefill worker's first
token): a token's logprob is the log-softmax of the TARGET model's raw logits at its position,
in float32 -- before temperature, top-k, top-p or min-p, which shape only how the token is
drawn. So a value does not depend on how a token was chosen (greedy or sampled, drafted and
accepted or drawn as the bonus), nor on the request's sampling settings, as OpenAI and vLLM
(by default) report them. With speculation the values come from the verify forward's target
logits at each accepted position (and the bonus token's): in float32 they equal plain
decoding's up to the verify forward's rounding (~1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

# The most alternatives a request may ask for per token (OpenAI's bound for chat).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    """One returned token's log-probability and the most likely tokens at its position (see the
    module docstring for which distribution)."""

    token_id: int  # the returned token
    logprob: float  # its log-probability (<= 0)
    # [top_logprobs] the most likely tokens there, by logprob descending (ties in any order);
    # the returned token is among them only when it is that likely
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()  # [top_logprobs] their log-probabilities
