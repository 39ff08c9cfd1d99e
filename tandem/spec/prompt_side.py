"""The speculative engine's prompt steps (a mixin of `SpecEngine`): the target forward over
this step's prompt chunks, the draft over the same chunks, and for each prompt that completes
its first token and draft seed.

A prompt step is two halves. `_prefill_step` queues the device work -- target forward,
sampling, the draft prefill, the seeds' first proposals -- and returns `finish`, which reads
the sampled tokens and commits them (first token through the stop checks, then the seed or
the hand-off). The engine runs the others' round between the two (`SpecEngine.step`): the
GPU goes from the prompt to the round without waiting for the host, and one host read (the
round's) covers both; before, the step read the prompt's tokens first, and the GPU idled
while the host committed them and planned the round. The requests of the step's chunks are
kept from preemption until `finish` (`SpecScheduler.reserve` protects them): a request
preempted between its sampling and its commit would draw its first token again.

Where the draft prefill needs the sampled tokens on the host (no draft-prefill graph, or a
prompt handed off: the prefill worker's hooks want the target KV first), the read happens in
the first half; `finish` then only commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tandem.engine.request import Request, RequestOutput
from tandem.engine.runner import ForwardBatch, ForwardOutput
from tandem.engine.sampling import SampledRead, read_sampled, row_error
from tandem.engine.scheduler import ScheduledChunk, StepPlan
from tandem.messages import TokenLogprob
from tandem.spec.extend import draft_prefill
from tandem.spec.phases import DraftSeed, VerifyInput

log = logging.getLogger(__name__)


class PromptSide:
    """Methods only: the state is SpecEngine's (its runner, graphs, sampler, schedulers,
    draft, head and hooks)."""

    def _prefill_step(self, plan: StepPlan) -> Callable[[], list[RequestOutput]]:
        """Queue this step's prompt work (module docstring) -> `finish`, which reads and
        commits it (the step's outputs of these chunks)."""
        return self._prompt_work(plan, None)[0]

    def _merged_prefill_step(self, plan: StepPlan, verify: VerifyInput
                             ) -> tuple[Callable[[], list[RequestOutput]], ForwardOutput]:
        """`_prefill_step` whose target forward also verifies the chains of `verify`: each
        chain is a chunk of its N tokens at num_cached (what a chain verify computes: root
        and drafts, causal, over the request's pages), after the prompts' rows; the tokens
        are copied in on the device (the drafts are never read). -> (`finish`, the verify's
        output as `SpecEngine._verify_forward` returns it: logits [bs * N, V] float32 and the
        rows' hidden states / streams)."""
        finish, out = self._prompt_work(plan, verify)
        assert out is not None
        return finish, out

    def _merge_fits(self, plan: StepPlan, verify: VerifyInput) -> bool:
        """Whether the merged forward replays a graph (or no graphs are captured: eager
        either way); else it would run eagerly where the two apart replay graphs. (No
        per-layer hook to rule out: steps merge only without prompts handed off.)"""
        return (self.graphs is None
                or self._graph_batch_size(_with_verify_rows(plan, verify)) is not None)

    def _prompt_work(self, plan: StepPlan, verify: VerifyInput | None
                     ) -> tuple[Callable[[], list[RequestOutput]], ForwardOutput | None]:
        completing = tuple(c for c in plan.chunks if c.samples and c.req_id in self.handoff_only)
        hook = self.prefill_layer_hook
        after_layer = hook(completing) if hook and completing else None
        # The target forward replays a graph where one takes the prompt rows (no per-layer
        # hook: a Python callback cannot run inside a graph), else runs eagerly. So does the
        # draft's, where its graphs are on and no prompt is handed off here (a prefill
        # worker's hook wants the target KV before the draft runs).
        num_tokens = sum(len(c.token_ids) for c in plan.chunks)
        rows_plan = _with_verify_rows(plan, verify)
        rows = (self._graph_batch_size(rows_plan)
                if after_layer is None and self.model.par.dp.size == 1 else None)
        batch = self._build_batch(rows_plan, rows or rows_plan.num_tokens, busy=True)
        if verify is not None:  # the chains' tokens over the placeholders, on the device
            n = verify.batch_size * verify.num_nodes
            batch.input_ids[num_tokens : num_tokens + n].copy_(verify.tokens.reshape(-1))
        draft_graph = rows is not None and self.draft_prefill is not None and not completing
        if rows is not None and self.graphs is not None:  # every row's hidden, padding last
            out = self.graphs.run_forward(batch, copy=not draft_graph)
        else:
            out = self.runner.forward(ForwardBatch(
                input_ids=batch.input_ids, positions=batch.positions, attn=batch.attn,
                logits_indices=batch.logits_indices, capture_layers=self.capture,
                after_layer=after_layer))
        verified = None
        if verify is not None:  # its rows' logits: the LM head over their hidden states
            at = slice(num_tokens, num_tokens + n)
            hidden = out.hidden[at]
            verified = ForwardOutput(logits=self.model.compute_logits(hidden), hidden=hidden,
                                     aux_hidden=tuple(a[at] for a in out.aux_hidden))
        sampling = [c for c in plan.chunks if c.samples]
        reqs = [self.scheduler.requests[c.req_id] for c in sampling]
        drawn = self.sampler.sample(out.logits, [r.params for r in reqs],
                                    [r.generator for r in reqs], [r.req_id for r in reqs])
        self.scheduler.commit(plan)
        # Draft prefill over the same chunks: pairs (f_t, x_{t+1}). A row whose sampling
        # failed keeps its placeholder token through it (it writes only that request's own
        # pages) and fails after it.
        next_tokens = [list(self.scheduler.requests[c.req_id].all_ids[
            c.num_cached + 1 : c.num_cached + len(c.token_ids) + 1]) for c in plan.chunks]
        read: tuple | None = None
        if draft_graph:  # queued before the host read: the sampled tokens stay on the device
            ids = [t for c, nxt in zip(plan.chunks, next_tokens)  # 0: the sampled one, below
                   for t in (nxt + [0] if c.samples else nxt)]
            hidden = self.draft_prefill.run(rows, out, ids + [0] * (rows - len(ids)),
                                            batch.logits_indices, drawn.tokens)
        else:
            read = read_sampled(drawn)  # SYNC: tokens and asked-for logprobs, for the draft
            if self.prefill_synced_hook is not None and completing:
                self.prefill_synced_hook(completing)
            sampled = iter(read[0])
            for c, nxt in zip(plan.chunks, next_tokens):
                if c.samples:
                    nxt.append(next(sampled))
            hidden = draft_prefill(self.draft, [c.page_ids for c in plan.chunks],
                                   [c.num_cached for c in plan.chunks], next_tokens,
                                   self.head.target_features(out.hidden, out.aux_hidden)
                                   [:num_tokens])
        if not sampling:  # prompt chunks that complete no prompt: no seeds yet
            return (lambda: []), verified
        # Queued now, the copy is what `finish` waits for -- not what the round queues ahead of
        # the next step after its own read (a `.tolist()` at `finish` would wait for that too).
        copy = SampledRead.start(drawn) if read is None else None
        # The sampling rows' draft hidden [n, H]: they are the batch's logits rows (a list
        # index would cross in a blocking copy, waiting for both forwards to finish).
        last = hidden.index_select(0, batch.logits_indices)
        ids, logp = self.head.topk(last, self.spec.topk)  # one launch set for every prompt

        def finish() -> list[RequestOutput]:
            tokens, logprobs = read if copy is None else copy.wait()  # SYNC: one
            return [self._first_token_row(self.scheduler.requests[c.req_id], tokens[i],
                                          drawn.errors[i], last[i : i + 1], ids[i], logp[i],
                                          logprobs[i])
                    for i, c in enumerate(sampling)]

        return finish, verified

    def _first_token_row(self, req: Request, token: int, error: str,
                         hidden: torch.Tensor,  # [1, H] draft hidden of the prompt's last token
                         topk_ids: torch.Tensor,  # [topk] the draft's first guesses from it
                         topk_logp: torch.Tensor,  # [topk]
                         logprob: TokenLogprob | None = None,  # None: the request did not ask
                         ) -> RequestOutput:
        """A prompt completed in this step: its first token through the stop checks, then its
        draft seed (decoding here) or its hand-off (prefill-only). Isolated per request, as
        `LLMEngine._append_row`: a failure here fails this request alone."""
        if error:
            return self._fail_request(req, error)
        try:
            result = self._append(req, token, logprob)
        except Exception as exc:  # noqa: BLE001 -- this request fails, the batch goes on
            log.warning("request '%s' failed after sampling", req.req_id, exc_info=exc)
            return self._fail_request(req, row_error("detokenizer/stop checks", exc))
        seed = DraftSeed(num_cached=req.num_computed, last_token=token,
                         topk_ids=topk_ids, topk_logp=topk_logp, hidden=hidden[0])
        if req.req_id in self.handoff_only:
            self._hand_off(req, seed, result)
        elif not result.finished and not self.spec_scheduler.is_plain(req.req_id):
            self.spec_scheduler.set_seed(req.req_id, seed)
        return result


def _with_verify_rows(plan: StepPlan, verify: VerifyInput | None) -> StepPlan:
    """`plan` with each chain of `verify` as a chunk after its own: N placeholder tokens at
    num_cached over the request's pages, sampling nothing (their logits: the caller's)."""
    if verify is None:
        return plan
    return StepPlan(chunks=plan.chunks + tuple(
        ScheduledChunk(req_id=f"verify-{i}", page_ids=p, num_cached=nc,
                       token_ids=(0,) * verify.num_nodes, samples=False)
        for i, (p, nc) in enumerate(zip(verify.page_ids, verify.num_cached))), preempted=())
