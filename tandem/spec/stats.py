"""`SpecStats`: how well the draft guesses -- acceptance counted over the rounds an engine ran
(tau, the acceptance per draft position, and tau's standard error)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    """Acceptance bookkeeping (owned by the engine). tau = tokens committed per round per
    request = accepted drafts + 1."""

    num_rounds: int = 0  # request-rounds
    num_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [k] rounds accepting >= j+1 drafts

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_tokens / self.num_rounds if self.num_rounds else 0.0

    def per_position(self) -> list[float]:
        """P(draft j accepted), j = 1 .. k."""
        return [a / self.num_rounds if self.num_rounds else 0.0 for a in self.accepted_at]

    def tau_stderr(self) -> float:
        """Standard error of tau with the rounds taken as independent (they are not quite:
        rounds of one answer are alike, so the true error is somewhat larger)."""
        n = self.num_rounds
        if n < 2:
            return 0.0
        # Rounds committing exactly j + 1 tokens: accepted_at[j-1] - accepted_at[j] (j >= 1).
        at = [n, *self.accepted_at, 0]
        second = sum((j + 1) ** 2 * (at[j] - at[j + 1]) for j in range(len(at) - 1)) / n
        mean = self.mean_acceptance_length
        return max(second - mean * mean, 0.0) ** 0.5 * (n / (n - 1)) ** 0.5 / n**0.5

    def record(self, num_accepted: int, num_steps: int) -> None:
        if len(self.accepted_at) < num_steps:
            self.accepted_at.extend([0] * (num_steps - len(self.accepted_at)))
        self.num_rounds += 1
        self.num_tokens += num_accepted + 1
        for j in range(num_accepted):
            self.accepted_at[j] += 1
