"""Speculative decoding settings, validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecConfig:
    """num_steps: draft depth (tokens proposed along a path per round). topk: branching per
    node (1 = chain). num_draft_tokens: tree nodes verified per round, root included (for a
    chain it is num_steps + 1)."""

    draft_model: str | None = None  # head directory; None = the shipped head for the default model
    num_steps: int = 4
    topk: int = 1
    num_draft_tokens: int | None = None  # None: num_steps + 1 (chain) or num_steps * topk + 1
    # Adaptive speculation (spec/adaptive.py): each step picks k in 0 .. num_steps drafts to
    # maximise expected tokens per second. Chain only. Off: every round drafts num_steps.
    adaptive: bool = False
    # A measured StepCostTable (JSON file) to use instead of profiling at start-up; None:
    # the table cached for this model, dtype and device, or profile and cache one.
    cost_table: str | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ValueError(f"topk: must be >= 1, got {self.topk}")
        n = self.num_draft_tokens
        if n is not None and not 2 <= n <= self.num_steps * self.topk + 1:
            raise ValueError(
                f"num_draft_tokens: must be in [2, num_steps * topk + 1 = "
                f"{self.num_steps * self.topk + 1}], got {n}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive: must be true or false, got {self.adaptive!r}")
        if self.adaptive and self.topk != 1:
            raise ValueError(f"adaptive: chain drafting only (topk = 1), got topk {self.topk}")
        if self.topk == 1 and n is not None and n != self.num_steps + 1:
            raise ValueError(f"num_draft_tokens: a chain verifies num_steps + 1 = "
                             f"{self.num_steps + 1} tokens, got {n}")

    @property
    def tree_size(self) -> int:
        """Verified nodes per round, root included."""
        return self.num_draft_tokens or self.num_steps * self.topk + 1

    @property
    def slots_per_round(self) -> int:
        """KV slots past `num_cached` a round may write (verify tree or draft scratch)."""
        return max(self.tree_size, self.num_steps * self.topk)
