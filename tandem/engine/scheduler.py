"""The engine's scheduler: continuous batching with chunked prefill, and recompute preemption.

Every request is treated the same way: its tokens `all_ids[num_computed:]` still need their
K/V computed; a step computes a chunk of them, and when a chunk reaches the end of `all_ids`
the step's logits for the last token give the next token. A decoding request is just one with
exactly one token to compute. Each step takes, in order: one token for every decoding request,
then chunks of prefilling requests, then newly admitted requests, until the token budget runs
out. When a decode cannot get a page, the most recently admitted request is preempted: its
pages go back and it recomputes from scratch later (outputs kept).

The scheduler owns the request table and the queues (the only writer of `Request` objects).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.engine.kv_cache import PageAllocator
from tandem.engine.request import FinishReason, Request


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    req_id: str
    page_ids: tuple[int, ...]
    num_cached: int  # tokens already in the cache
    token_ids: tuple[int, ...]  # tokens computed this step
    samples: bool  # the chunk ends at the request's last token: sample the next one


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self, allocator: PageAllocator, page_size: int, max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.allocator, self.page_size = allocator, page_size
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last is preempted first
        self.num_preemptions = 0  # total, for metrics

    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"req_id: '{req.req_id}' is already in the engine")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a request whose KV already sits in `req.page_ids` (handed off by a prefill
        worker): it joins the running set directly, past every queue."""
        if req.req_id in self.requests:
            raise ValueError(f"req_id: '{req.req_id}' is already in the engine")
        self.requests[req.req_id] = req
        self.running.append(req)

    def detach(self, req: Request) -> list[int]:
        """Remove a request WITHOUT freeing its pages; the caller now owns them (a prefill
        worker keeps them until their transfer has completed) and must free them."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.req_id]
        pages = list(req.page_ids)
        req.page_ids.clear()
        return pages

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def schedule(self, exclude: frozenset[str] = frozenset()) -> StepPlan:
        """Plan one forward. Running requests in `exclude` are advanced by someone else this
        step (the speculative round) and get no tokens here."""
        budget = self.token_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[str] = set()
        # Decoding requests first (one token each), then running prefills, in admission order.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1):
            if budget == 0:
                break
            if req.req_id in scheduled or req.req_id in exclude or req not in self.running:
                continue  # handled elsewhere, or preempted by an earlier allocation
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n, preempted, scheduled):
                continue
            chunks.append(self._chunk(req, n))
            scheduled.add(req.req_id)
            budget -= n
        # Admit waiting requests while budget, slots and pages allow (never preempt for them).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.pages_needed(req.num_computed + n) - len(req.page_ids)
            if not self.allocator.can_alloc(need):
                break
            req.page_ids.extend(self.allocator.alloc(need))
            self.waiting.popleft()
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            scheduled.add(req.req_id)
            budget -= n
        return StepPlan(chunks=tuple(chunks), preempted=tuple(preempted))

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        return ScheduledChunk(
            req_id=req.req_id, page_ids=tuple(req.page_ids), num_cached=start,
            token_ids=tuple(req.all_ids[start : start + n]), samples=start + n == req.num_tokens,
        )

    def reserve(self, req: Request, num_slots: int, protected: set[str]) -> tuple[bool, list[str]]:
        """Make `req`'s page table cover `num_slots` KV slots (a speculative round writes past
        its committed tokens), preempting later requests not in `protected` if needed. Returns
        (whether req kept its place, the ids preempted)."""
        preempted: list[str] = []
        ok = self._grow(req, num_slots - req.num_computed, preempted, protected)
        return ok, preempted

    def _grow(self, req: Request, n: int, preempted: list[str], scheduled: set[str]) -> bool:
        """Give `req` pages for `n` more tokens, preempting later requests if needed. False if
        `req` itself had to be preempted."""
        need = max(0, self.pages_needed(req.num_computed + n) - len(req.page_ids))
        while not self.allocator.can_alloc(need):
            victim = next((r for r in reversed(self.running) if r.req_id not in scheduled), None)
            if victim is None:
                return False  # everyone else is already in this step; try again next step
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is req:
                return False
        req.page_ids.extend(self.allocator.alloc(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.page_ids)
        req.page_ids.clear()
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def commit(self, plan: StepPlan) -> None:
        """The step's forward ran: the scheduled tokens' K/V are now in the cache."""
        for c in plan.chunks:
            self.requests[c.req_id].num_computed = c.num_cached + len(c.token_ids)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Remove a request (finished or aborted) and return its pages."""
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.page_ids:
            self.allocator.free(req.page_ids)
            req.page_ids.clear()
        del self.requests[req.req_id]
