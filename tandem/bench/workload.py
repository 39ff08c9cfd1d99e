"""What the benchmark sends: a deterministic list of requests for a workload config.

Kinds:
- `random`: prompts of uniformly random token ids (sent as `prompt_token_ids`, so no tokenizer
  is needed: works with `--load-format dummy` models), input and output lengths drawn
  uniformly from the given ranges; the answer is forced to its length (`ignore_eos`).
- `fixed`: like `random` with exactly one input and one output length.
- `chat`: chat questions built offline (tandem's held-out EAGLE questions, then the prompt
  builder of `tandem.spec.train_data`: templated questions, standard-library code, local
  documentation), sent as `messages` (the server applies the chat template); answers end at
  EOS or at an output length drawn from the range.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("random", "fixed", "chat")
FIRST_TOKEN_ID = 256  # random prompts avoid the low ids, where models keep special tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthRange:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"need 1 <= lo <= hi, got {self.lo}:{self.hi}")

    @staticmethod
    def parse(text: str | int | list, field: str) -> LengthRange:
        """'128', '2048:4096', 128 or [2048, 4096] (YAML)."""
        try:
            if isinstance(text, (list, tuple)) and len(text) == 2:
                return LengthRange(lo=int(text[0]), hi=int(text[1]))
            parts = str(text).split(":")
            if len(parts) == 1:
                return LengthRange(lo=int(parts[0]), hi=int(parts[0]))
            if len(parts) == 2:
                return LengthRange(lo=int(parts[0]), hi=int(parts[1]))
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from exc
        raise ValueError(f"{field}: expected N or LO:HI, got {text!r}")

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    kind: str = "random"
    input_len: LengthRange = LengthRange(lo=128, hi=512)  # prompt tokens (random, fixed)
    output_len: LengthRange = LengthRange(lo=64, hi=128)  # new tokens (max for chat)
    vocab_size: int = 32000  # random ids are drawn below this (every supported model has more)
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dataset: '{self.kind}' is not one of {', '.join(KINDS)}")
        if self.kind == "fixed" and (self.input_len.lo != self.input_len.hi
                                     or self.output_len.lo != self.output_len.hi):
            raise ValueError("input_len/output_len: a fixed workload takes single lengths")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size: must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "input_len": [self.input_len.lo, self.input_len.hi],
                "output_len": [self.output_len.lo, self.output_len.hi],
                "vocab_size": self.vocab_size, "temperature": self.temperature,
                "seed": self.seed}


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRequest:
    """One request, ready to become a `GenerateRequest`."""

    prompt_token_ids: tuple[int, ...] = ()  # [input_len] (random, fixed)
    question: str | None = None  # a user chat turn (chat)
    max_tokens: int
    ignore_eos: bool


def build_requests(cfg: WorkloadConfig, num: int, stream: int = 0) -> list[BenchRequest]:
    """`num` requests, a pure function of (cfg, num, stream). Different `stream`s (one per load
    level) give different prompts, so a prefix cache cannot serve one level from another."""
    rng = random.Random(f"{cfg.seed}:{stream}")
    if cfg.kind == "chat":
        questions = chat_questions(num * (stream + 1), cfg.seed)
        start = num * stream % len(questions)
        return [BenchRequest(question=questions[(start + i) % len(questions)],
                             max_tokens=rng.randint(cfg.output_len.lo, cfg.output_len.hi),
                             ignore_eos=False) for i in range(num)]
    out = []
    for _ in range(num):
        n = rng.randint(cfg.input_len.lo, cfg.input_len.hi)
        ids = tuple(rng.randrange(FIRST_TOKEN_ID, cfg.vocab_size) for _ in range(n))
        out.append(BenchRequest(prompt_token_ids=ids,
                                max_tokens=rng.randint(cfg.output_len.lo, cfg.output_len.hi),
                                ignore_eos=True))
    return out


def chat_questions(num: int, seed: int) -> list[str]:
    """Held-out questions first (the ones `tandem eval-eagle` measures tau on), then built
    prompts; deterministic for a seed."""
    from tandem.spec.train_data import HELD_OUT_QUESTIONS, build_prompts

    out = list(HELD_OUT_QUESTIONS)
    if num > len(out):
        out += [p for p in build_prompts(num, seed) if p not in HELD_OUT_QUESTIONS]
    return out[:max(num, 1)]
