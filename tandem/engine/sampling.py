"""Sampling parameters and the batched sampler.

`SamplingParams` is validated at construction, with messages that name the field (the router
maps them to INVALID_ARGUMENT). `target_probs` is the one definition of "the distribution we
sample from" after temperature/top-k/top-p/min-p; the speculative verifier uses the same
function, which is what makes rejection sampling lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # per-request generator; None draws from the engine's generator
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (checked on the detokenized text)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be > 0, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] or [n, V] float logits -> probabilities after temperature, top-k, top-p, min-p.
    Greedy params give a one-hot on the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


class Sampler:
    """Samples one token per row. Greedy rows take the argmax (no randomness consumed); a row
    with its own generator (a seeded request) draws from `target_probs` with it, alone, so it
    yields the same tokens whatever else shares its batch; rows without one draw from torch's
    RNG together, one batched draw per distinct (temperature, top_k, top_p, min_p) -- a row at
    a time cost ~10 kernel launches per sampled row, which dominated large sampled batches."""

    def sample(
        self,
        logits: torch.Tensor,  # [n, V] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:  # [n] int64
        tokens = logits.argmax(dim=-1)
        shared: dict[tuple[float, int, float, float], list[int]] = {}  # settings -> rows
        for i, p in enumerate(params):
            if p.greedy:
                continue
            if generators[i] is None:
                shared.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
                continue
            probs = target_probs(logits[i], p)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
        for rows in shared.values():
            idx = torch.tensor(rows, device=logits.device)
            probs = target_probs(logits[idx], params[rows[0]])  # [len(rows), V]
            tokens[idx] = torch.multinomial(probs, 1).squeeze(-1)
        return tokens
