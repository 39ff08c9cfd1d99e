"""`SpecScheduler`: the scheduling side of speculative decoding. It picks the requests a round
advances, gets them the pages the round may write, and keeps what a round leaves behind -- each
request's draft seed -- so that the round itself (`SpecEngine._spec_round`) only computes: it
takes a `RoundInput` and returns what the target accepted.

A step of the speculative engine, with the parts that are this module's marked *:

    drop_unrunnable* -> Scheduler.schedule(seeded requests excluded) -> prefill (set_seed*)
    -> reserve* -> DP join -> round_inputs* -> round(s) -> stop checks -> commit_round*

With a k policy (spec/adaptive.py) `round_inputs` also decides how many drafts the step's
round proposes (k = 0: a plain step, whose round verifies the root alone and draft-extends its
one new token, so every seed stays valid) and may split the step into a drafting round and a
plain one; rounds feed the policy their acceptance through `observe_round`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.spec.adaptive import KPolicy
from tandem.spec.config import SpecConfig
from tandem.spec.phases import DraftInput, DraftSeed, RoundInput


class SpecScheduler:
    """Owns the draft seeds: one `DraftSeed` per request that decodes by speculative rounds.

    Invariants, between steps: a seeded request is running in the engine's `Scheduler`, with
    seed.num_cached == req.num_computed == req.num_tokens - 1 (its last committed token is
    the next round's root, not yet in the target KV); a request that stops running (finished,
    aborted, failed, preempted, handed off) loses its seed. Pages stay the `Scheduler`'s: a
    round's reservation goes through `Scheduler.reserve`, which may preempt.
    """

    def __init__(self, scheduler: Scheduler, spec: SpecConfig, max_model_len: int,
                 policy: KPolicy | None = None) -> None:
        self.scheduler, self.spec, self.max_model_len = scheduler, spec, max_model_len
        self._seeds: dict[str, DraftSeed] = {}
        # Requests that decode by plain steps for the rest of their life (the plain regime
        # made them so: their draft KV stops being written, so they never draft again)
        self._plain: set[str] = set()  # within the requests held (`_prune_plain`)
        self._removed_seen = 0  # scheduler.num_removed when `_plain` was last pruned
        # Steps `plain_held` ran that the policy has not heard of yet: (requests decoding,
        # seconds or None); `flush_plain` tells it, in order
        self._deferred: list[tuple[int, float | None]] = []
        self.policy = policy  # None: every round drafts spec.num_steps
        # Slots past a round's own that `reserve` takes where pages are free: the next
        # round's, for drafting ahead (spec/ahead.py; the engine sets it, 0 = none).
        self.spare_slots = 0

    @property
    def seeds(self) -> Mapping[str, DraftSeed]:
        """req_id -> its seed (read-only: `set_seed`, `drop_seed` and `commit_round` write)."""
        return MappingProxyType(self._seeds)

    def set_seed(self, req_id: str, seed: DraftSeed) -> None:
        """`req_id`'s prompt is in the KV (prefilled here, or handed in by a prefill worker)
        and its first token committed: it decodes by rounds from the next step on."""
        self._seeds[req_id] = seed

    def drop_seed(self, req_id: str) -> None:
        self._seeds.pop(req_id, None)
        self._forget(req_id)

    def is_plain(self, req_id: str) -> bool:
        return req_id in self._plain

    def plain_regime(self, allowed: bool) -> bool:
        """Whether this step runs as a plain engine step (`LLMEngine.step`: no draft model,
        overlap scheduling where the engine has it): when `allowed` and the policy prices a
        plain step over every request the engine holds above the best round
        (`AdaptivePolicy.plain_wins`). Then every request becomes plain for good (seeds
        dropped): outputs stay those of plain decoding (a request's tokens never depend on
        how they were proposed), and the regime never leaves a seed stale. The regime holds,
        unasked, while any plain request is in the engine, and requests arriving meanwhile
        are plain too: a step never runs plain rows' forward next to a round (two forwards
        and two host reads a step -- 0.55x plain at c=16 on an H100, session 17, when new
        requests drafted next to old plain ones). The policy hears of each such step
        (`plain_step`: its estimate relaxes toward the prior, or an engine that turned plain
        once would never draft again) and is asked again once the plain requests are gone.
        While every request held decodes by rounds (each has its seed: no arrival in this
        step) the policy is asked as `settled`: plain must then win outright, since the turn
        is for good for requests already drafting. While requests wait and the policy says
        rounds now win by their served prices (`plain_loses`), the regime drains instead:
        nobody is admitted until the plain requests are gone, then the waiting ones arrive
        under rounds (under steady load each arrival would turn plain, and the regime, once
        entered, would never end)."""
        wins = getattr(self.policy, "plain_wins", None)
        s = self.scheduler
        held = s.requests.keys()
        s.admitting = True
        if not allowed or wins is None or not held:
            return False
        batch = min(len(held), s.max_num_seqs)
        self._prune_plain()
        if self._plain:  # plain requests still decode: the regime holds, unasked
            step = getattr(self.policy, "plain_step", None)
            if step is not None:  # but a plain step all the same
                step()
            # Draining: where rounds now win by the served prices, nobody is admitted until
            # the plain requests (running ones: a preempted one waits to be re-admitted) are
            # gone; arrivals would be plain too, and under steady load it would never end.
            loses = getattr(self.policy, "plain_loses", None)
            s.admitting = not (loses is not None and s.waiting
                               and any(r.req_id in self._plain for r in s.running)
                               and loses(batch))
        elif not wins(batch, tuple(held), settled=held <= self._seeds.keys()):
            return False
        if s.admitting and len(held) > len(self._plain):
            for rid in held - self._plain:  # new since the last step: plain too
                self._plain.add(rid)
                self.drop_seed(rid)
        return True

    def plain_held(self) -> bool:
        """Whether this step is the plain regime's, as the last one was, decided in O(1) and
        without the policy (`plain_regime` walks the requests and asks it; a plain-regime
        step is host-bound at 48 rows of SmolLM2 on an H200, where that walk and the policy's
        bookkeeping cost ~4%): every request held is plain, none waits, none left since the
        last step, no prompt is part-done -- a steady step."""
        s = self.scheduler
        return (bool(self._plain) and not s.waiting and not s.num_partial
                and s.num_removed == self._removed_seen and len(s.requests) == len(self._plain))

    def defer_plain(self, batch_size: int, seconds: float | None) -> None:
        """A `plain_held` step over `batch_size` requests took `seconds` (None: the policy
        hears no times). Told the policy by `flush_plain` after 32 such steps, once a request
        has left, or before anything else asks it."""
        self._deferred.append((batch_size, seconds))
        if len(self._deferred) >= 32 or self.scheduler.num_removed != self._removed_seen:
            self.flush_plain()

    def flush_plain(self) -> None:
        """Tell the policy of the deferred plain-regime steps, each as `plain_regime` and
        `served` would have told it at the time: an unobserved step, then its time."""
        if not self._deferred:
            return
        step = getattr(self.policy, "plain_step", None)
        for batch_size, seconds in self._deferred:
            if step is not None:
                step()
            if seconds is not None:
                self.served(batch_size, seconds, None)
        self._deferred.clear()

    def step_shape(self) -> tuple[int, int] | None:
        """(requests decoding, prompts it may complete: waiting or partly prefilled) for the
        step about to run; (b, 0) is a steady step, what the cost table prices. None without
        a policy that hears step times (`served`): no walk over the batch then."""
        if getattr(self.policy, "served", None) is None:
            return None
        s = self.scheduler
        return len(s.running) - s.num_partial, len(s.waiting) + s.num_partial

    def served(self, batch_size: int, seconds: float, num_drafts: int | None,
               prompts: int = 0) -> None:
        """Tell the policy what a step over `batch_size` decoding requests took: a steady one
        (`AdaptivePolicy.served`), or one that completed `prompts` prompts besides
        (`AdaptivePolicy.arrived`, where the policy hears arrivals)."""
        if prompts:
            told = getattr(self.policy, "arrived", None)
            if told is not None:
                told(batch_size, seconds, num_drafts, prompts)
            return
        told = getattr(self.policy, "served", None)
        if told is not None and batch_size > 0:
            told(batch_size, seconds, num_drafts)

    def drop_unrunnable(self) -> None:
        """Before a step, drop the seeds no round may use:
        - a preempted request lost its KV: it is prefilled again and gets a new seed;
        - a round writes rope positions up to num_cached + num_steps (its deepest verify node),
          but the rope table and the context end at max_model_len: past it the forward
          indexes out of bounds. A request that close to the end finishes with plain decode
          steps (the scheduler runs a seedless request like any other), which never look past
          their token.
        First the policy hears of the steps `plain_held` ran (`flush_plain`)."""
        self.flush_plain()
        self._drop_stale()
        limit = self.max_model_len - self.spec.num_steps
        for rid in [rid for rid, s in self._seeds.items() if s.num_cached >= limit]:
            self.drop_seed(rid)

    def reserve(self, exclude: frozenset[str]) -> list[Request]:
        """The requests this step's round advances, in admission order: the seeded running
        ones except `exclude` (their prompt completed in this step: they decode from the next),
        each now holding pages for every KV slot the round may write. Under page pressure the
        latest requests are preempted (and are prefilled again later; their seeds go), never
        one already served this round nor one of `exclude` (its first token, sampled, is
        committed after the round: spec/prompt_side.py) -- down to the request asking, if
        need be."""
        candidates = [r for r in self.scheduler.running
                      if r.req_id in self._seeds and r.req_id not in exclude]
        served: list[Request] = []
        protected: set[str] = set(exclude)  # (their tokens are not committed yet)
        for req in candidates:
            if req not in self.scheduler.running:
                continue  # preempted to make room for an earlier request of this round
            slots = req.num_computed + self.spec.slots_per_round
            ok, _ = self.scheduler.reserve(req, slots, protected)
            if ok:
                served.append(req)
                protected.add(req.req_id)
                if self.spare_slots:  # never past the table a round reads (max_kv_len)
                    self.scheduler.reserve_spare(req, min(
                        slots + self.spare_slots, self.max_model_len + self.spec.slots_per_round))
        self._drop_stale()
        return served

    def round_input(self, reqs: Sequence[Request], num_drafts: int | None = None) -> RoundInput:
        """The round over `reqs` (as `reserve` returned them): their seeds batched with their
        page tables, how each samples, and its k (None: spec.num_steps)."""
        k = self.spec.num_steps if num_drafts is None else num_drafts
        return RoundInput(
            req_ids=tuple(r.req_id for r in reqs), params=tuple(r.params for r in reqs),
            generators=tuple(r.generator for r in reqs),
            draft=DraftInput.from_seeds([self._seeds[r.req_id] for r in reqs],
                                        [r.page_ids for r in reqs]), num_drafts=k)

    def round_inputs(self, reqs: Sequence[Request], allow_split: bool
                     ) -> list[tuple[list[Request], RoundInput]]:
        """This step's rounds over `reqs`, each with its requests: one round at num_steps
        without a policy; with one, the policy's k, and -- when its plan splits the batch
        (never with `allow_split` False: DP ranks must run the same number of target
        forwards) -- the drafting rows' round first, then the plain rows' (k = 0)."""
        if self.policy is None:
            return [(list(reqs), self.round_input(reqs))]
        plan = self.policy.plan([r.req_id for r in reqs], allow_split)
        if not plan.splits:  # (as the split's filter below: no rows, no round)
            return [(list(reqs), self.round_input(reqs, plan.num_drafts))] if reqs else []
        drafting = [r for r, d in zip(reqs, plan.drafting) if d]
        plain = [r for r, d in zip(reqs, plan.drafting) if not d]
        return [(rows, self.round_input(rows, k))
                for rows, k in ((drafting, plan.num_drafts), (plain, 0)) if rows]

    def observe_round(self, num_drafts: int, rows: Sequence[tuple[str, int]]) -> None:
        """A round of `num_drafts` drafts accepted, per row, (req_id, drafts accepted): the
        policy learns from each in order (a plain round teaches nothing), in one call where it
        takes them so (`observe_many`: per row is on the host's critical path, ~1.5 us a row
        on this VM)."""
        if self.policy is None or num_drafts <= 0:
            return
        many = getattr(self.policy, "observe_many", None)
        if many is not None:
            many(num_drafts, rows)
            return
        for req_id, num_accepted in rows:
            self.policy.observe(req_id, num_drafts, num_accepted)

    def commit_round(self, req: Request, seed: DraftSeed | None) -> None:
        """A round's tokens went through `req`'s stop checks. Still running (`seed` given): the
        target KV now holds the old root and the accepted drafts (num_computed =
        seed.num_cached) and `seed` -- the draft-extend's last row -- drafts its next round.
        `seed` None: the request finished inside the round (its pages are back already)."""
        if seed is None:
            self.drop_seed(req.req_id)
            return
        req.num_computed = seed.num_cached
        self._seeds[req.req_id] = seed

    def _drop_stale(self) -> None:
        """A request no longer running (preempted: its KV is gone) keeps no seed; one the
        engine no longer holds is no longer plain."""
        if self._seeds:
            running = {r.req_id for r in self.scheduler.running}
            for rid in [rid for rid in self._seeds if rid not in running]:
                self.drop_seed(rid)
        self._prune_plain()

    def _prune_plain(self) -> None:
        """Keep `_plain` within the requests held, walking them only after some left (so
        `plain_regime` asks "any plain?" and "any new?" by counts: every plain-regime step
        runs this, on the host's critical path)."""
        removed = self.scheduler.num_removed
        if removed != self._removed_seen:
            self._removed_seen = removed
            if self._plain:
                self._plain &= self.scheduler.requests.keys()

    def _forget(self, req_id: str) -> None:
        if self.policy is not None:
            self.policy.forget(req_id)
