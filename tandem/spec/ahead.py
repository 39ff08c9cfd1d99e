"""Drafting ahead: the speculative round's share of overlap scheduling.

A greedy round in CUDA graphs queues acceptance and draft-extend on the device, then reads what
was accepted (its one host read) and commits it. Without this module the GPU then idles while
the host commits, schedules the next step, builds and plans its verify -- until the next
round's drafting is launched. Here the next round's drafting is queued right behind the
draft-extend, BEFORE the host read, from device values alone (`SpecGraphRunner.draft_ahead`:
root = bonus, d_1 = the extend's top-1, num_cached + a + 1 computed on the device), so the GPU
drafts while the host commits and plans; the next step's verify then follows on the GPU.

What is queued is a guess about the next step. It is used only if that step's round is the
round it drafted for, checked on the host before use (`take`):
- the same runner (k), and no drafting has replayed on it since (its buffers are ours);
- the same requests in the same order (none finished, failed, was aborted, preempted or
  joined; a split step or a plain step in between changes them);
- every request at the num_cached the host committed (after the round's read) and with the
  page lists the drafting read as a prefix of its own (pages only grow; a preempted request
  would have new ones).
Then the VerifyInput equals the one `propose` would build: same tokens, same positions, same
pages -- the round's outputs and its acceptance are those of drafting in the step. Otherwise
it is dropped and the step drafts as usual; the dropped drafting wrote draft KV only at
positions past each request's committed ones (inside its own pages, which `draft_ahead`
checks cover them; a page freed since is rewritten in stream order by its next owner), which
every later round rewrites before reading: dropping never changes an output either.

The next round's slots must be in the page lists the drafting reads, so the SpecScheduler
reserves them one round early where pages are free (`SpecScheduler.spare_slots`).
`TANDEM_DRAFT_AHEAD=0` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.spec.cuda_graphs import ExtendOutput, SpecGraphRunner
from tandem.spec.phases import DraftInput, VerifyInput


def enabled_by_env() -> bool:
    return os.environ.get("TANDEM_DRAFT_AHEAD", "1") != "0"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Queued:
    runner: SpecGraphRunner
    writes: int  # runner.drafts_launched right after the launch
    req_ids: tuple[str, ...]
    page_ids: tuple[tuple[int, ...], ...]  # the page lists the drafting read
    num_cached: tuple[int, ...] | None  # [bs] the next round's; None until the host read


class DraftAhead:
    """Owns the one drafting queued ahead (at most one: the step's last round queues it, the
    next step's first proposal takes or drops it). Counts what became of each."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._queued: _Queued | None = None
        self.used = 0  # queued draftings a round verified
        self.dropped = 0  # queued draftings the next round could not use

    def launch(self, runner: SpecGraphRunner, req_ids: Sequence[str], verify: VerifyInput,
               num_accepted: torch.Tensor, ext: ExtendOutput) -> None:
        """After the round's draft-extend was queued, before its host read: queue the next
        round's drafting of the same rows (num_accepted [bs] int32 on the device)."""
        self._queued = None
        if self.enabled and runner.draft_ahead(verify, num_accepted, ext):
            self._queued = _Queued(runner=runner, writes=runner.drafts_launched,
                                   req_ids=tuple(req_ids), page_ids=verify.page_ids,
                                   num_cached=None)

    def arm(self, nxt: DraftInput) -> None:
        """The round's host read is done: `nxt` is the next round's input as the host sees it
        (num_cached advanced by what was accepted)."""
        q = self._queued
        if q is not None and q.num_cached is None:
            self._queued = _Queued(runner=q.runner, writes=q.writes, req_ids=q.req_ids,
                                   page_ids=q.page_ids, num_cached=nxt.num_cached)

    def take(self, runner: SpecGraphRunner, req_ids: Sequence[str], inp: DraftInput
             ) -> VerifyInput | None:
        """The queued drafting as this round's VerifyInput if it drafted exactly `inp` (module
        docstring), else None (and it is dropped: the round proposes as usual)."""
        q, self._queued = self._queued, None
        if q is None:
            return None
        if (q.runner is not runner or runner.drafts_launched != q.writes
                or q.req_ids != tuple(req_ids) or q.num_cached != inp.num_cached
                or any(p[: len(old)] != old for p, old in zip(inp.page_ids, q.page_ids))):
            self.dropped += 1
            return None
        self.used += 1
        return runner.drafted(inp)
