"""The request vocabulary every process shares -- sampling parameters and finish reasons --
without torch: the router (often a small CPU machine in front of the cluster) imports these, and
so do the engine and the workers (the engine's face offers them too: `tandem.engine.sampling`
and `tandem.engine.request` re-export them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tandem.messages.logprobs import MAX_TOP_LOGPROBS


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"
    # This request's own per-row work after the forward raised (its sampling, stop checks or
    # detokenizer): it alone ends, with `error` saying why; the rest of its batch goes on.
    ERROR = "error"


# Below this temperature a request is greedy (the argmax, no randomness consumed), in the
# engine, in speculative acceptance and for a prefill worker's first token alike. vLLM uses the
# same 1e-5. At T >= 1e-5 the shifted logits (logits - max) / T stay finite in float32 for any
# logit gap under ~3e33, and a gap of even 1e-3 already gives the runner-up a weight of
# exp(-100): the distribution is one-hot on the argmax to float32 precision anyway. Below it,
# 1 / T overflows or -- for T < ~1e-45, which float32 rounds to 0 -- divides by zero, and
# logits / T became inf - inf = NaN in the softmax (torch.multinomial then raised, and with it
# the whole step).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings. Edges, as `target_probs` applies them in float32:

    - temperature < GREEDY_TEMPERATURE (1e-5), 0 included, is greedy (`greedy`); any finite
      temperature above it samples (one so large that float32 rounds it to inf gives the
      uniform distribution over the finite logits).
    - top_p in (0, 1]: the smallest prefix of tokens by probability whose mass reaches top_p;
      the most likely token always survives, so a top_p that float32 rounds to 0 (1e-300) is
      top-1.
    - min_p in [0, 1]: drops tokens below min_p * max probability; min_p = 1 keeps exactly the
      tokens tied for the maximum, a min_p that rounds to 0 drops nothing.
    - a row whose probabilities still come out non-finite or all zero (e.g. NaN or +inf
      logits) falls back to its argmax.

    `logprobs` asks for each returned token's log-probability, `top_logprobs` (0 to
    MAX_TOP_LOGPROBS, only with `logprobs`) for that many most likely alternatives too: the
    log-softmax of the target's raw logits, whatever the sampling settings above
    (messages/logprobs.py). A batch where no request asks computes none.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0  # < GREEDY_TEMPERATURE (0 included) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # per-request generator; None draws from the engine's generator
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (checked on the detokenized text)
    ignore_eos: bool = False
    logprobs: bool = False  # return each token's logprob (TokenLogprob)
    top_logprobs: int = 0  # and its this many most likely alternatives, in [0, 20]

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be > 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # rejects NaN
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs (set logprobs to true)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


