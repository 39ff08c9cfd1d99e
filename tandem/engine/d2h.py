"""Device-to-host reads that wait once for several tensors.

A decode step reads its sampled tokens on the host (stop checks need them); a request that asks
for log-probabilities needs a few more tensors read at the same point. `tensor.tolist()` per
tensor would wait for the device once per tensor; `HostCopy` queues every copy first (into
pinned memory, non-blocking, on CUDA) and records one event after the last, so reading them
all is one wait -- and not a wait for work queued after `start` (the speculative round queues
its draft-extend graph before it reads the acceptance). On CPU devices the copies are the
tensors themselves and nothing waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True, eq=False)
class HostCopy:
    """Host copies of some device tensors, in flight until `wait`."""

    host: tuple[torch.Tensor, ...]  # same shapes and dtypes as the device tensors
    ready: Any  # torch.cuda.Event recorded after the last copy; None on CPU

    @staticmethod
    def start(tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Queue the copies of `tensors` (all on one device); never waits."""
        if not any(t.is_cuda for t in tensors):
            return HostCopy(tuple(tensors), None)
        host = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            host.append(h)
        ready = torch.cuda.Event()
        ready.record()
        return HostCopy(tuple(host), ready)

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The host tensors, once their copies ran."""
        if self.ready is not None:
            # SYNC: the caller's one host read -- waits for the copies and what they depend on,
            # not for work queued after `start`.
            self.ready.synchronize()
        return self.host
