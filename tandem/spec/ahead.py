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

**Verifying ahead** (batches of at most `TANDEM_VERIFY_AHEAD` requests, default any; 0: never):
the next round's verify is queued too, right behind its drafting (`verify_ahead`: its tokens,
page table and num_cached are the drafting's, on the device). The host then commits this
round while the GPU verifies the next, and the next step launches acceptance and draft-extend
behind a verify already run: rounds back to back are GPU time, not GPU + host (SmolLM2 at
batch 1: ~1.3 ms served against ~1.1 of GPU work). The next step uses it only with the
drafting it verified (`take`) and only if no verify replayed since (`verified`); dropped, it
wrote target KV only where the drafting wrote draft KV (past every committed position, inside
the pages checked), rewritten before any read, and logits the next verify overwrites. A drop
costs a verify of GPU time, so it is not queued where this round may end a request by length
(`may_end`; an EOS cannot be foreseen). At every batch size it pays all the same (SmolLM2, the
50 chat prompts, an H200: rounds served 2.05 -> 1.91 ms at 13.5 requests, 3.19 -> 2.68 at 36,
with ~15-20% of the verifies queued dropped; it was kept to batches of 4 until then, on the
guess that larger ones end requests too often). Greedy chains in graphs with device metadata
only, one DP rank (the others would not join the verify's collectives).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.request import Request
from tandem.engine.runner import ForwardOutput
from tandem.spec.cuda_graphs import SpecGraphRunner
from tandem.spec.phases import DraftInput, ExtendOutput, VerifyInput


def enabled_by_env() -> bool:
    return os.environ.get("TANDEM_DRAFT_AHEAD", "1") != "0"


ANY_BATCH = 1 << 20  # (a batch limit no engine reaches)


def verify_batch_by_env() -> int:
    """The largest batch whose next verify is queued ahead too (0: none; unset: any)."""
    return max(0, int(os.environ.get("TANDEM_VERIFY_AHEAD", str(ANY_BATCH))))


def may_end(reqs: Sequence[Request], num_drafts: int) -> bool:
    """Whether a round committing up to num_drafts + 1 tokens may end one of `reqs` by its
    length (max_new_tokens or the context limit; `Request.finished`'s length terms)."""
    n = num_drafts + 1
    return any(len(r.output_ids) + n >= r.params.max_new_tokens
               or r.num_tokens + n >= r.max_total_len for r in reqs)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Queued:
    runner: SpecGraphRunner
    writes: int  # runner.drafts_launched right after the launch
    req_ids: tuple[str, ...]
    page_ids: tuple[tuple[int, ...], ...]  # the page lists the drafting read
    num_cached: tuple[int, ...] | None  # [bs] the next round's; None until the host read
    verified: ForwardOutput | None = None  # its verify, queued ahead too (None: not queued)
    verifies: int = 0  # the engine's verify replays right after that launch


class DraftAhead:
    """Owns the one drafting queued ahead (at most one: the step's last round queues it, the
    next step's first proposal takes or drops it). Counts what became of each."""

    def __init__(self, enabled: bool = True, verify_batch: int = 0) -> None:
        self.enabled = enabled
        self.verify_batch = verify_batch  # largest batch verified ahead too (0: none)
        self._queued: _Queued | None = None
        self._taken: tuple[VerifyInput, _Queued] | None = None  # used drafting, its verify
        self.used = 0  # queued draftings a round verified
        self.dropped = 0  # queued draftings the next round could not use
        self.verify_queued = 0  # verifies queued ahead, and what became of them
        self.verify_used = 0
        self.verify_dropped = 0

    def counts(self) -> dict[str, int]:
        """What became of the draftings and verifies queued ahead so far (benchmarks, logs)."""
        return {"used": self.used, "dropped": self.dropped, "verify_queued": self.verify_queued,
                "verify_used": self.verify_used, "verify_dropped": self.verify_dropped}

    def launch(self, runner: SpecGraphRunner, reqs: Sequence[Request], verify: VerifyInput,
               num_accepted: torch.Tensor, ext: ExtendOutput, verify_ok: bool = True) -> None:
        """After the round's draft-extend was queued, before its host read: queue the next
        round's drafting of the same rows `reqs` (num_accepted [bs] int32 on the device), and
        its verify where that pays (module docstring) and `verify_ok` (False: a prompt waits,
        whose step will carry the next verify in its own forward: `SpecEngine._arrival_round`)."""
        self._drop(self._queued)
        self._queued = None
        if self.enabled and runner.draft_ahead(verify, num_accepted, ext):
            out = None
            if (verify_ok and len(reqs) <= self.verify_batch
                    and not may_end(reqs, runner.num_drafts)):
                out = runner.verify_ahead(len(reqs))
                self.verify_queued += out is not None
            self._queued = _Queued(runner=runner, writes=runner.drafts_launched,
                                   req_ids=tuple(r.req_id for r in reqs),
                                   page_ids=verify.page_ids, num_cached=None, verified=out,
                                   verifies=runner.memory.verifies.n)

    def arm(self, nxt: DraftInput) -> None:
        """The round's host read is done: `nxt` is the next round's input as the host sees it
        (num_cached advanced by what was accepted)."""
        q = self._queued
        if q is not None and q.num_cached is None:
            self._queued = dataclasses.replace(q, num_cached=nxt.num_cached)

    def take(self, runner: SpecGraphRunner, req_ids: Sequence[str], inp: DraftInput
             ) -> VerifyInput | None:
        """The queued drafting as this round's VerifyInput if it drafted exactly `inp` (module
        docstring), else None (and it is dropped: the round proposes as usual)."""
        q, self._queued = self._queued, None
        self._drop(self._taken[1] if self._taken else None)
        self._taken = None
        if q is None:
            return None
        if (q.runner is not runner or runner.drafts_launched != q.writes
                or q.req_ids != tuple(req_ids) or q.num_cached != inp.num_cached
                or any(p[: len(old)] != old for p, old in zip(inp.page_ids, q.page_ids))):
            self.dropped += 1
            self._drop(q)
            return None
        self.used += 1
        drafted = runner.drafted(inp)
        if q.verified is not None:
            self._taken = (drafted, q)
        return drafted

    def verified(self, verify: object) -> ForwardOutput | None:
        """The verify queued ahead of `verify` (the drafting `take` just returned) if no
        verify replayed since, else None (the round verifies as usual)."""
        t, self._taken = self._taken, None
        if t is None:
            return None
        drafted, q = t
        if drafted is verify and q.runner.memory.verifies.n == q.verifies:
            self.verify_used += 1
            if verify.page_ids == q.page_ids:  # no page since: extend reloads no table
                q.runner.adopt_verify_table(verify)
            return q.verified
        self._drop(q)
        return None

    def _drop(self, q: _Queued | None) -> None:
        if q is not None and q.verified is not None:
            self.verify_dropped += 1
