"""Failure injection for tests: `FailureInjection(probability, kind, seed)` makes a sender misbehave
on a random subset of its transfers, so that the receiver's checks and the lease logic are
exercised over real backends. Production passes `None` (the default)."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class FaultKind(enum.Enum):
    DROP_NOTIFICATION = "drop_notification"  # final aux write carries no FINAL: decode times out
    CORRUPT_AUX = "corrupt_aux"  # flip one payload byte after the checksum: decode sees CORRUPT
    WRONG_ROOM = "wrong_room"  # seed written for another room: decode sees a room mismatch
    FAIL_TRANSFER = "fail_transfer"  # the first page batch "fails" as a backend error
    DELAY = "delay"  # writes start `delay_s` after the grant (push past the deadline)


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureInjection:
    probability: float  # chance that one transfer is faulted, drawn once per transfer
    kind: FaultKind
    seed: int = 0
    delay_s: float = 0.0  # DELAY only

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("FailureInjection.probability must be in [0, 1], "
                             f"got {self.probability}")
        if self.kind is FaultKind.DELAY and self.delay_s <= 0:
            raise ValueError("FailureInjection.delay_s must be > 0 for kind DELAY")


class FaultDice:
    """The random stream of one endpoint (owned by it; deterministic for a given seed)."""

    def __init__(self, injection: FailureInjection | None):
        self.injection = injection
        self._rng = random.Random(injection.seed if injection else 0)

    def draw(self) -> FaultKind | None:
        """The fault for the next transfer, or None."""
        if self.injection is None or self.injection.probability == 0.0:
            return None
        return self.injection.kind if self._rng.random() < self.injection.probability else None
