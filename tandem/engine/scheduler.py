"""The engine's scheduler: continuous batching with chunked prefill, and recompute preemption.

Every request is treated the same way: its tokens `all_ids[num_computed:]` still need their
K/V computed; a step computes a chunk of them, and when a chunk reaches the end of `all_ids`
the step's logits for the last token give the next token. A decoding request is just one with
exactly one token to compute. Each step takes, in order: one token for every decoding request,
then chunks of prefilling requests, then newly admitted requests, until the token budget runs
out. When a decode cannot get a page, the most recently admitted request is preempted: its
pages go back and it recomputes from scratch later (outputs kept).

Prefix caching (optional `PrefixCache`): a request admitted from the queue first takes the
longest cached chain of its prompt's full pages (a reference each) and starts with
num_computed = the matched tokens -- never all of them: its last token is always computed, so
the step has its logits (and a speculative engine its target feature). Each commit hands the
request's newly completed full prompt pages to the cache. When pages run short, cached pages
no request holds are evicted before anyone is preempted.

The scheduler owns the request table and the queues (the only writer of `Request` objects).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tandem.engine.kv_cache import PageAllocator, PageError
from tandem.engine.prefix_cache import PrefixCache
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
        max_num_batched_tokens: int, prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.allocator, self.page_size, self.prefix_cache = allocator, page_size, prefix_cache
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last is preempted first
        self.num_preemptions = 0  # total, for metrics
        # False: waiting requests are not admitted for now (the speculative engine draining
        # its plain regime: spec/scheduler.py `SpecScheduler.plain_regime`)
        self.admitting = True
        # Running requests the last plan left part-way through their prompt (chunked
        # prefill), and requests removed so far (finished, aborted, detached): what the
        # speculative scheduler reads each step without walking the batch.
        self.num_partial = 0
        self.num_removed = 0
        # Prefix caching, totals for metrics (hit rate = hit / query): prompt tokens looked up
        # at admission, and those served from the cache.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

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
        self.num_removed += 1
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
        # (No prompt left part-done by the last plan: admission order already; a copy, as
        # preemption below edits `running`.)
        order = (list(self.running) if not self.num_partial else
                 sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1))
        unplanned: list[Request] = []  # running rows left out for budget or pages
        for i, req in enumerate(order):
            if budget == 0:
                unplanned += order[i:]
                break
            if req.req_id in scheduled or req.req_id in exclude or req.req_id in preempted:
                continue  # handled elsewhere, or preempted by an earlier allocation
            if req.pending_reaches_length:
                continue  # overlap scheduling: its pending token ends it when read
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n, preempted, scheduled):
                unplanned.append(req)
                continue
            chunks.append(self._chunk(req, n))
            scheduled.add(req.req_id)
            budget -= n
        # Admit waiting requests while budget, slots and pages allow (never preempt for them).
        while (self.admitting and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token not read yet: admitted once it is (next step)
            hit = self._match(req)
            num_start = max(req.num_computed, len(hit) * self.page_size)
            n = min(req.num_tokens - num_start, budget)
            need = self.pages_needed(num_start + n) - len(req.page_ids) - len(hit)
            if not self._can_make_room(need, hit):
                break
            if hit:
                self.allocator.share(hit)  # before evicting: the hit pages are not evictable
                req.page_ids.extend(hit)
                req.num_computed = num_start
                req.num_prefix_pages = len(hit)
            self._make_room(need)
            req.page_ids.extend(self.allocator.alloc(need))
            self._count_hit(req, len(hit))
            self.waiting.popleft()
            self.running.append(req)
            if req.scheduled_time is None:  # its first slot (not a re-admission after preemption)
                req.scheduled_time = time.perf_counter()
            chunks.append(self._chunk(req, n))
            scheduled.add(req.req_id)
            budget -= n
        # Prompts part-done after this plan (more than one token left: the sort key above):
        # its chunks that stop short of that, and rows it left out mid-prompt. Exact, or the
        # next plan would not sort them after the decoding rows.
        self.num_partial = sum(
            self.requests[c.req_id].num_tokens - c.num_cached - len(c.token_ids) > 1
            for c in chunks if not c.samples) + sum(
            r.num_tokens - r.num_computed > 1 for r in unplanned if r.req_id not in preempted)
        return StepPlan(chunks=tuple(chunks), preempted=tuple(preempted))

    def _match(self, req: Request) -> list[int]:
        """Cached pages for a request about to be admitted with no KV yet (new or preempted)."""
        if self.prefix_cache is None or req.page_ids:
            return []
        if req.prefix_keys is None:
            req.prefix_keys = self.prefix_cache.page_keys(req.prompt_ids)
        # Leave at least the last token to compute: its logits sample the next token.
        return self.prefix_cache.match(req.prefix_keys, (req.num_tokens - 1) // self.page_size)

    def _count_hit(self, req: Request, num_hit_pages: int) -> None:
        if self.prefix_cache is None or req.num_preemptions:  # count each prompt once
            return
        req.num_cached_tokens = num_hit_pages * self.page_size
        self.num_prefix_query_tokens += len(req.prompt_ids)
        self.num_prefix_hit_tokens += req.num_cached_tokens

    def _can_make_room(self, need: int, hit: list[int]) -> bool:
        """Whether `need` pages can be had without preempting (evicting idle cached pages
        other than `hit`, which the request is about to take)."""
        if self.allocator.can_alloc(need):
            return True
        if self.prefix_cache is None:
            return False
        idle_hits = sum(1 for p in hit if self.allocator.refcount(p) == 1)
        return need <= self.allocator.num_free + self.prefix_cache.num_evictable() - idle_hits

    def _make_room(self, need: int) -> bool:
        """Evict idle cached pages until `need` pages are free; whether they are."""
        if not self.allocator.can_alloc(need) and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.allocator.num_free)
        return self.allocator.can_alloc(need)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        if self.prefix_cache is not None:  # the pages this chunk writes must be its own alone
            for p in req.page_ids[start // self.page_size : self.pages_needed(start + n)]:
                if self.allocator.refcount(p) != 1:
                    raise PageError(f"page {p}: '{req.req_id}' would write a shared page")
        return ScheduledChunk(
            req_id=req.req_id, page_ids=tuple(req.page_ids), num_cached=start,
            token_ids=req.ids_between(start, start + n), samples=start + n == req.num_tokens,
        )

    def reserve(self, req: Request, num_slots: int, protected: set[str]) -> tuple[bool, list[str]]:
        """Make `req`'s page table cover `num_slots` KV slots (a speculative round writes past
        its committed tokens), preempting later requests not in `protected` if needed. Returns
        (whether req kept its place, the ids preempted)."""
        preempted: list[str] = []
        ok = self._grow(req, num_slots - req.num_computed, preempted, protected)
        return ok, preempted

    def reserve_spare(self, req: Request, num_slots: int) -> bool:
        """Make `req`'s page table cover `num_slots` KV slots from free pages alone, if that
        costs nobody: no preemption, no eviction, not while a request waits, and an eighth
        of the pool stays free. Whether it covers them (pages held a little early: a
        speculative round's drafting ahead writes the next round's slots)."""
        need = max(0, self.pages_needed(num_slots) - len(req.page_ids))
        if need and (self.waiting
                     or self.allocator.num_free - need < self.allocator.num_usable // 8):
            return False
        req.page_ids.extend(self.allocator.alloc(need))
        return True

    def _grow(self, req: Request, n: int, preempted: list[str], scheduled: set[str]) -> bool:
        """Give `req` pages for `n` more tokens, preempting later requests if needed. False if
        `req` itself had to be preempted."""
        need = max(0, self.pages_needed(req.num_computed + n) - len(req.page_ids))
        while not self._make_room(need):
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
        req.num_prefix_pages = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def commit(self, plan: StepPlan) -> None:
        """The step's forward ran: the scheduled tokens' K/V are now in the cache."""
        for c in plan.chunks:
            req = self.requests[c.req_id]
            req.num_computed = c.num_cached + len(c.token_ids)
            self._cache_full_pages(req)

    def _cache_full_pages(self, req: Request) -> None:
        """Hand the request's newly completed full prompt pages to the prefix cache. In a
        speculative engine the step's draft prefill writes the draft KV of these pages after
        this commit, but no lookup can happen before the next `schedule`, when it is done."""
        if self.prefix_cache is None or req.prefix_keys is None:
            return  # handed-in requests (add_running) are never cached
        num_full = min(req.num_computed // self.page_size, len(req.prefix_keys))
        if num_full <= req.num_prefix_pages:
            return
        for k in range(req.num_prefix_pages, num_full):
            self.prefix_cache.insert(req.prefix_keys[k], req.page_ids[k])
        req.num_prefix_pages = num_full
        self.prefix_cache.touch(req.page_ids[:num_full])

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
        self.num_removed += 1
