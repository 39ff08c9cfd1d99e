"""`SpecEngine`: the engine with EAGLE speculative decoding, colocated (target and draft in one
process). It is the reference the disaggregated workers must equal.

A step runs (1) one chunked-prefill forward for requests without a draft seed -- target, then
the draft over the same chunk, and a seed for each request whose prompt completed (requests
made plain decode there without draft work: `SpecScheduler.plain_regime`, whose steps are the
plain engine's own; spec/prompt_side.py: the prompts' tokens are read and committed after
(2)) -- and (2) one speculative round (`_spec_round`) for each seeded one:

    draft -> verify (one target forward) -> accept -> compact -> draft-extend

With `merge_arrivals` (`_arrival_round`) a step that has both drafts first, and (1)'s target
forward also verifies the round's chains: one target forward a step.

The scheduling around the round is the `SpecScheduler`'s (spec/scheduler.py): which requests
run it, their pages (reserved before, preempting under pressure) and their seeds (kept after).
Committing appends the accepted tokens one by one through the same stop checks as plain
decoding, so an EOS or stop string inside an accepted run ends the request right there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import graph_batch_sizes
from tandem.engine.llm import LLMEngine
from tandem.engine.loader import DTYPES, build_model, resolve_model
from tandem.engine.parallel import ParallelContext
from tandem.engine.request import Request, RequestOutput, token_end
from tandem.engine.sampling import row_error
from tandem.engine.runner import ForwardBatch, ForwardOutput
from tandem.engine.scheduler import ScheduledChunk, StepPlan
from tandem.messages import FinishReason, TokenLogprob
from tandem.spec.accept import accept, with_row_faults
from tandem.spec.device_accept import launch_device_accept
from tandem.spec.ahead import DraftAhead, enabled_by_env, verify_batch_by_env
from tandem.spec.adaptive import KPolicy
from tandem.spec.config import SpecConfig
from tandem.spec.cuda_graphs import SpecGraphRunner
from tandem.spec.graph_memory import spec_graph_batch_sizes
from tandem.spec.graph_set import capture_k_graphs, graphs_for, policy_ks, verify_drafts
from tandem.spec.draft_prefill import DraftPrefillGraphs
from tandem.spec.draft_prefill import wanted as draft_prefill_wanted
from tandem.spec.draft_runner import DraftRunner, draft_kv_group
from tandem.spec.extend import (
    compact_accepted_path,
    draft_extend,
    make_extend_input,
    next_draft_input,
)
from tandem.spec.handoff import PrefillHandoff
from tandem.spec.handoff_side import HandoffSide
from tandem.spec.prompt_side import PromptSide
from tandem.spec.head import EagleHead
from tandem.spec.phases import DraftInput, DraftSeed, RoundInput, VerifyInput, VerifyResult
from tandem.spec.propose import propose
from tandem.spec.scheduler import SpecScheduler
from tandem.spec.slices import verify_layout
from tandem.spec.stats import SpecStats
from tandem.spec.tree_graphs import (
    DraftedTree,
    TreeDraftGraphs,
    graphs_expected,
    lanes_needed,
)

log = logging.getLogger(__name__)


def target_features(out: ForwardOutput, head: EagleHead) -> torch.Tensor:
    """[T, F]: what the head consumes from this target forward."""
    return head.target_features(out.hidden, out.aux_hidden)


class SpecEngine(HandoffSide, PromptSide, LLMEngine):
    # The draft KV at position p is computed from (f_p, x_{p+1}) and shares the target's page
    # ids: a cached page must also match the token after it (engine/prefix_cache.py).
    PREFIX_LOOKAHEAD = 1
    PLAIN_STEPS = False  # rounds, each reading its acceptance (engine/llm.py)

    def __init__(self, engine_cfg: EngineConfig, spec: SpecConfig, model, head: EagleHead,
                 tokenizer: object | None = None, policy: KPolicy | None = None) -> None:
        """policy: how many drafts each step proposes (None: the adaptive policy when
        spec.adaptive, else always spec.num_steps; tests pass a forced one)."""
        # Tree drafting in CUDA graphs drafts over lane pages of its own (spec/tree_graphs.py):
        # reserved out of the allocator when graphs will be captured.
        lanes = lanes_needed(spec, engine_cfg.page_size, graph_batch_sizes(
            engine_cfg.max_num_seqs)) if graphs_expected(engine_cfg, model) else 0
        super().__init__(engine_cfg, model, tokenizer, extra_kv_groups=[draft_kv_group(head)],
                         reserved_pages=lanes, graph_capture_layers=head.cfg.feature_layers)
        self.spec, self.head = spec, head
        self.draft = DraftRunner(head, self.kv_pool, self.runner.backend,
                                 max_kv_len=self.max_model_len + spec.slots_per_round)
        self.spec_scheduler = SpecScheduler(self.scheduler, spec, self.max_model_len, policy)
        self.handoff_only: set[str] = set()  # prefill-only requests still prefilling
        self.handoffs: dict[str, PrefillHandoff] = {}  # prefilled, waiting to be taken
        # Set by a prefill worker for layer-wise KV push: given the chunks of prefill-only
        # requests whose prompt completes in the coming prefill forward, it returns that
        # forward's per-layer hook (ForwardBatch.after_layer), or None for no hook.
        self.prefill_layer_hook: Callable[[tuple[ScheduledChunk, ...]],
                                          Callable[[int], None] | None] | None = None
        # Prefill-only: called with the chunks that complete their prompts right after the
        # step's sampling sync, before the draft prefill -- their target KV is final on the
        # device then (the prefill worker starts transfers whose destination came meanwhile).
        self.prefill_synced_hook: Callable[[tuple[ScheduledChunk, ...]], None] | None = None
        self.spec_stats = SpecStats()
        self.capture = head.cfg.feature_layers
        # CUDA graphs for chain draft steps, verify and draft-extend: on whenever decode graphs
        # are (CUDA, FlashInfer, cuda_graphs=True); batches beyond the largest bucket run
        # eagerly. `spec_graphs` holds rounds of num_steps drafts; with a k policy, `k_graphs`
        # holds the other k it may choose (spec/graph_set.py), sharing its pool and logits.
        self.spec_graphs: SpecGraphRunner | None = None
        self.k_graphs: dict[int, SpecGraphRunner] = {}
        self.tree_graphs: TreeDraftGraphs | None = None  # tree drafting (topk > 1)
        if self.graphs is not None:
            self.spec_graphs = SpecGraphRunner(
                self.runner, self.draft, spec, spec_graph_batch_sizes(self.graphs.decode_sizes),
                max_kv_len=self.max_model_len + spec.slots_per_round,
                capture_layers=self.capture)
            self.spec_graphs.capture()
            if lanes:
                self.tree_graphs = TreeDraftGraphs(
                    self.draft, spec, self.spec_graphs.batch_sizes,
                    max_kv_len=self.max_model_len + spec.slots_per_round,
                    lane_pages=range(1, 1 + lanes), pool=self.spec_graphs.memory.pool)
                self.tree_graphs.capture()
            if policy is not None or spec.adaptive:
                self.k_graphs = capture_k_graphs(self.spec_graphs, policy_ks(spec))
        self.draft_prefill: DraftPrefillGraphs | None = None  # spec/draft_prefill.py
        if (self.graphs is not None and self.graphs.device_metadata and draft_prefill_wanted()
                and model.par.dp.size == 1):  # prompt steps replay graphs only without DP
            self.draft_prefill = DraftPrefillGraphs(self.draft, self.graphs,
                                                    self.spec_graphs.memory.pool)
            self.draft_prefill.capture()
        # Greedy rounds in graphs queue the next round's drafting (and verify): spec/ahead.py.
        self.draft_ahead = DraftAhead(verify_batch=verify_batch_by_env() * (model.par.dp.size == 1))
        # Prompts' forward merged with the round's verify (`_arrival_round`): on a CPU (arrival
        # steps 24% shorter at c=4, docs/perf.md session 28); on a GPU opt-in until an A/B
        # there says it pays. TANDEM_MERGED_ARRIVALS=1 or 0 forces it.
        merge = os.environ.get("TANDEM_MERGED_ARRIVALS", "")
        self.merge_arrivals = merge == "1" or (merge != "0" and self.device.type == "cpu")
        self.set_draft_ahead(enabled_by_env())
        if policy is None and spec.adaptive:  # after the graphs: profiling times them
            from tandem.spec.cost_profile import adaptive_policy

            self.spec_scheduler.policy = adaptive_policy(self)

    @staticmethod
    def from_config(engine_cfg: EngineConfig, spec: SpecConfig,  # type: ignore[override]
                    parallel: ParallelContext | None = None, head: EagleHead | None = None
                    ) -> SpecEngine:
        from tandem.spec.head import load_head

        model_cfg, path = resolve_model(engine_cfg)
        max_len = min(engine_cfg.max_model_len or model_cfg.max_context, model_cfg.max_context)
        model = build_model(model_cfg, path, engine_cfg, parallel or ParallelContext(), max_len)
        if head is None:
            from tandem.spec.shipped import resolve_head_dir

            head = load_head(resolve_head_dir(spec.draft_model, engine_cfg.model), model,
                             DTYPES[engine_cfg.dtype], torch.device(engine_cfg.device), max_len)
        tokenizer = None
        if path is not None and (path / "tokenizer.json").is_file():
            from tandem.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(path)
        return SpecEngine(engine_cfg, spec, model, head, tokenizer)

    def set_draft_ahead(self, on: bool) -> None:
        """Drafting ahead (spec/ahead.py) on or off; on only where graphs replay rounds."""
        self.draft_ahead.enabled = on and self.spec_graphs is not None
        self.spec_scheduler.spare_slots = (self.spec.num_steps + 1 if self.draft_ahead.enabled
                                           else 0)

    @property
    def seeds(self) -> Mapping[str, DraftSeed]:
        """req_id -> draft seed of each request decoding by rounds (the SpecScheduler's)."""
        return self.spec_scheduler.seeds

    def abort(self, req_id: str) -> bool:
        self.spec_scheduler.drop_seed(req_id)
        self.handoff_only.discard(req_id)
        return super().abort(req_id)

    def _fail_request(self, req: Request, error: str) -> RequestOutput:
        """As LLMEngine's; a prefill-only request that fails is never handed off: a prefill
        worker learns of it from this step's ERROR output."""
        self.spec_scheduler.drop_seed(req.req_id)
        self.handoff_only.discard(req.req_id)
        return super()._fail_request(req, error)

    def _finished(self, req: Request, reason: FinishReason) -> None:
        """Its length to the k policy (`finished`: what a round's arrival cost spreads over)."""
        told = getattr(self.spec_scheduler.policy, "finished", None)
        if told is not None:
            told(len(req.output_ids))

    # Disaggregation (add_prefill_request, take_handoffs, free_pages, admit_prefilled):
    # spec/handoff_side.py.

    # ---- the loop ---------------------------------------------------------------------------

    @torch.inference_mode()  # as LLMEngine.step
    def step(self) -> list[RequestOutput]:
        spec_sched = self.spec_scheduler
        # The policy hears what steps take; not on a worker of ranks, which must choose alike.
        timed = self.model.par.every_rank.size == 1
        if spec_sched.plain_held():  # the plain regime, nothing changed: no walk, no policy
            t0, batch = time.perf_counter(), len(self.scheduler.running)
            outputs = self.plain_step()
            spec_sched.defer_plain(batch, time.perf_counter() - t0 if timed else None)
            return outputs
        spec_sched.drop_unrunnable()  # (first tells the policy of the steps `plain_held` ran)
        t0 = time.perf_counter()
        shape = spec_sched.step_shape() if timed else None
        if spec_sched.plain_regime(allowed=not self.handoff_only and self.model.par.dp.size == 1):
            outputs = self.plain_step()
            if shape is not None:
                spec_sched.served(shape[0], time.perf_counter() - t0, None, shape[1])
            return outputs
        shape = shape if self._inflight is None else None  # (reads a plain step: unpriced)
        outputs = self.leave_overlap()
        plan = self.scheduler.schedule(exclude=frozenset(spec_sched.seeds))
        finish = None  # the prompts' read and commit: after the round (spec/prompt_side.py)
        merge = False  # the prompts' forward waits for the round's verify rows (`_arrival_round`)
        if plan.chunks and all(spec_sched.is_plain(c.req_id) and len(c.token_ids) == 1
                               for c in plan.chunks):  # decode rows of plain requests only
            outputs += self._run_plan(plan)  # their decode graph; no draft work
        elif self.merge_arrivals and plan.chunks and self.spec.topk == 1 and \
                not self.handoff_only and self.model.par.dp.size == 1:
            merge = True
        elif self.dp_join(bool(plan.chunks)):  # DP attention: idle ranks join (engine/llm.py)
            finish = self._prefill_step(plan)
        # Pages for the round (may preempt, never this step's prompts); a prompt completed in
        # this step decodes from the next.
        reqs = spec_sched.reserve(exclude=frozenset(c.req_id for c in plan.chunks))
        rounds = []
        if self.dp_join(bool(reqs)):  # DP: a rank without a round runs an empty verify
            # One round, or two when the k policy splits the batch (spec/adaptive.py): then
            # the step reads the host twice, once per round -- the price of the split, which
            # the policy takes only where two forwards cost less than one over everybody.
            rounds = spec_sched.round_inputs(reqs, allow_split=self.model.par.dp.size == 1)
            for rows, inp in rounds:  # a step's only round may draft the next one ahead
                ahead = rows if len(rounds) == 1 else ()
                if merge:  # the first round's verify rides in the prompts' forward
                    merge, (finish, drafted, verified) = False, self._arrival_round(plan, inp)
                    result, nxt = self._spec_round(inp, ahead=ahead, drafted=drafted,
                                                   verified=verified)
                else:
                    result, nxt = self._spec_round(inp, ahead=ahead)
                outputs += self._commit(rows, result, nxt, inp.num_drafts)
        if merge:  # no round to merge with: the prompts alone
            finish = self._prefill_step(plan)
        if finish is not None:
            outputs += finish()
        if shape is not None and len(rounds) <= 1:  # (a split step: unpriced)
            prompts = sum(c.samples and not spec_sched.is_plain(c.req_id) for c in plan.chunks)
            if prompts if shape[1] else not plan.chunks:
                k = rounds[0][1].num_drafts if rounds else self.spec.num_steps
                spec_sched.served(len(reqs), time.perf_counter() - t0, k, prompts)
        return outputs

    def _arrival_round(self, plan: StepPlan, inp: RoundInput
                       ) -> tuple[Callable[[], list[RequestOutput]], VerifyInput | DraftedTree,
                                  ForwardOutput | None]:
        """A step with prompts and a round (`merge_arrivals`): the round drafts first, then
        its chain's verify rows ride in the prompts' target forward (a chain verify is a
        prefill chunk of root + drafts at num_cached: spec/prompt_side.py), one forward where
        there were two. -> (the prompts' `finish`, the drafting, its verify's output); a
        verify queued ahead, or a tree, keeps the prompts' forward apart."""
        drafted = self._propose(list(inp.req_ids), inp.draft, inp.num_drafts)
        verified = self.draft_ahead.verified(drafted)  # queued ahead by the round before
        if (verified is None and isinstance(drafted, VerifyInput) and drafted.is_chain
                and self._merge_fits(plan, drafted)):
            finish, verified = self._merged_prefill_step(plan, drafted)
        else:
            finish = self._prefill_step(plan)
        return finish, drafted, verified

    def _prompts_pending(self) -> bool:
        """A prompt waits or is part-done: the next step has prompt rows, so (merging) its
        round's verify rides in their forward rather than being queued ahead."""
        return bool(self.scheduler.waiting) or self.scheduler.num_partial > 0

    def plain_step(self) -> list[RequestOutput]:
        """One step of the plain engine's own path (overlapped where `overlap_ok`), over
        requests without seeds; `leave_overlap` before the next speculative step."""
        self.overlap = self.overlap_ok
        return super().step()

    def _spec_round(self, inp: RoundInput, ahead: Sequence[Request] = (),
                    drafted: VerifyInput | DraftedTree | None = None,
                    verified: ForwardOutput | None = None) -> tuple[VerifyResult, DraftInput]:
        """One speculative round, phase value to phase value: draft -> verify -> accept ->
        draft-extend (drafted / verified: done already, `_arrival_round`). Returns what the
        target accepted per request and the next round's draft input; committing is the
        caller's (`_commit`), and so was the scheduling (pages for every slot written here, DP
        join: `step`). For a request, x_L is its last committed token (the root, not yet in
        the target KV) and p_j the target's distribution for the token after node j, given
        x_0 .. x_L and the path down to j."""
        # Draft: from its seed the draft guesses ahead, num_steps deep; a chain (topk = 1) or a
        # tree of topk children per node. A node at depth d guesses x_{L+d}; node 0 is x_L.
        if drafted is None:
            drafted = self._propose(list(inp.req_ids), inp.draft, inp.num_drafts)
        # Verify: ONE target forward over all the nodes, each attending to the cache and its own
        # ancestors only, gives p_j for every node j at once (and writes their target KV).
        out = self._verify_forward(drafted) if verified is None else verified  # (trees: after)
        verify = drafted.resolve() if isinstance(drafted, DraftedTree) else drafted
        features = target_features(out, self.head)  # [bs * N, F] what draft-extend reads
        # Accept (spec/accept.py), walking down from the root:
        # - greedy: step to the child whose token is argmax p_j; the bonus is argmax p at the
        #   last node reached: token for token what plain greedy decoding emits;
        # - sampling: try the children in draft order, accepting child t with probability
        #   p_j(t); a rejection sets p_j(t) = 0 and renormalises, and the bonus is drawn from
        #   what is left, so P(emit t) = p_j(t) -- the target's own distribution, lossless
        #   (chains on the device, trees walked on the host).
        # a accepted drafts + 1 bonus = a + 1 new tokens, 1 <= a + 1 <= num_steps + 1.
        graphs, fault = self._graphs_for(inp.num_drafts), self.cfg.sampling_fault
        pending = None
        if graphs is not None and graphs.can_extend(verify):
            # On the device (greedy, or sampled chains: spec/device_accept.py): acceptance
            # and the draft-extend graph queued before the round's one host read (the same
            # tokens and draft inputs as the path below).
            pending = graphs.accept(verify, out.logits, inp.params) or launch_device_accept(
                verify, out.logits, inp.params, self.sampler.or_shared(inp.generators))
        if pending is not None and graphs is not None:
            ext = graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus,
                                features)
            if ahead:  # the next round's drafting (and verify), before this round's host read
                self.draft_ahead.launch(graphs, ahead, verify, pending.num_accepted, ext,
                                        not (self.merge_arrivals and self._prompts_pending()))
            result = with_row_faults(pending.result(), inp.req_ids, fault)  # SYNC inside
            compact_accepted_path(self.kv_pool, "target", verify, result)  # trees; target KV
            nxt = next_draft_input(verify, result, ext.hidden, ext.topk_ids, ext.topk_logp,
                                   ext.last_tokens)
            self.draft_ahead.arm(nxt)
            return result, nxt
        result = accept(verify, out.logits, inp.params, self.sampler.or_shared(inp.generators),
                        inp.req_ids, fault)  # SYNC inside: the round's one host read
        # Compact: a tree's accepted nodes sit anywhere among its verify slots; their target
        # K/V moves right after the root, so the cache holds x_0 .. x_{L+a} in order.
        compact_accepted_path(self.kv_pool, "target", verify, result)
        # Draft-extend: the draft runs over the a + 1 new tokens, paired with the target features
        # of the root and the accepted nodes, so its KV follows the accepted path; the last row
        # (the bonus token's) proposes the next round's first level.
        ext_in = make_extend_input(verify, result, features)
        return result, draft_extend(self.draft, ext_in, self.spec.topk)

    def _propose(self, req_ids: list[str], inp: DraftInput, num_drafts: int
                 ) -> VerifyInput | DraftedTree:
        """Drafting k = num_drafts tokens. A seam for tests that force acceptance patterns with
        scripted drafts. Through the graphs of this k when captured (k = num_steps always; the
        other k with a k policy), else eagerly (k = 0 proposes nothing either way); a
        drafting queued ahead for exactly this round is used instead (spec/ahead.py)."""
        graphs = self._graphs_for(num_drafts)
        if graphs is not None and graphs.can_propose(inp):
            return self.draft_ahead.take(graphs, req_ids, inp) or graphs.propose(inp)
        tree = self.tree_graphs
        if tree is not None and num_drafts == self.spec.num_steps and tree.can_propose(inp):
            return tree.launch(inp)  # shape still on the device: verify first, read after
        return propose(self.draft, inp, self.spec, num_drafts)

    def _graphs_for(self, num_drafts: int) -> SpecGraphRunner | None:
        """The CUDA graphs of a round of `num_drafts` drafts, or None (it runs eagerly)."""
        return graphs_for(self.spec_graphs, self.k_graphs, num_drafts)

    def _verify_forward(self, verify: VerifyInput | DraftedTree) -> ForwardOutput:
        if (queued := self.draft_ahead.verified(verify)) is not None:
            return queued  # queued ahead by the round before (spec/ahead.py)
        graphs = self._graphs_for(verify_drafts(self.spec, verify.num_nodes))
        if graphs is not None and graphs.can_verify(verify):
            return graphs.verify(verify)
        if isinstance(verify, DraftedTree):
            verify = verify.resolve()
        layout = verify_layout(verify, self.cfg.page_size, self.device)
        n = verify.batch_size * verify.num_nodes
        return self.runner.forward(ForwardBatch(
            input_ids=verify.tokens.reshape(-1), positions=layout.positions, attn=layout.attn,
            logits_indices=torch.arange(n, device=self.device), capture_layers=self.capture))

    def _commit(self, reqs, result: VerifyResult, nxt: DraftInput, num_drafts: int) -> list:
        """Append each request's accepted tokens + bonus (through the usual stop checks, one by
        one) and report them as ONE output per request: a round is one streaming chunk. A row
        that failed acceptance, or whose stop checks raise, fails its own request only."""
        outputs, next_seeds = [], nxt.seeds()
        self.spec_scheduler.observe_round(num_drafts, [  # (every row acceptance did not fail)
            (req.req_id, len(t) - 1) for r, (req, t) in enumerate(zip(reqs, result.new_tokens))
            if not result.error_of(r)])
        for r, (req, toks, seed) in enumerate(zip(reqs, result.new_tokens, next_seeds)):
            if result.error_of(r):
                outputs.append(self._fail_request(req, result.error_of(r)))
                continue
            try:
                outputs.append(self._commit_row(req, toks, seed, num_drafts,
                                                result.logprobs_of(r)))
            except Exception as exc:  # noqa: BLE001 -- this request fails, the batch goes on
                log.warning("request '%s' failed after acceptance", req.req_id, exc_info=exc)
                outputs.append(self._fail_request(req, row_error("detokenizer/stop checks", exc)))
        return outputs

    def _commit_row(self, req: Request, toks: tuple[int, ...], seed: DraftSeed, num_drafts: int,
                    logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
        """logprobs: [len(toks)] when the request asks, else ()."""
        # tau measures the draft: what verification accepted, even when a stop condition then
        # ends the request inside the accepted run; a k = 0 round proposed nothing (no round).
        if num_drafts > 0:  # (the policy heard of it: `_commit`)
            self.spec_stats.record(len(toks) - 1, num_drafts)
        # Without stop strings no token but the last needs its text: the others go by their
        # ids alone (`token_end`: not one ends the request) and the detokenizer decodes the
        # run once, with the last one's `_append` (its text as one feed of the run, the same).
        parts, held, held_lps = [], [], []
        quiet = not req.params.stop
        detok = self._detok.get(req.req_id)
        for i, tok in enumerate(toks):  # an EOS or stop string ends the request at its token
            lp = logprobs[i] if logprobs else None
            if quiet and i + 1 < len(toks) and token_end(req, tok, self.eos_ids, 1) is None:
                req.output_ids.append(tok)
                held.append(tok)
                if lp is not None:
                    req.output_logprobs.append(lp)
                    held_lps.append(lp)
                if detok is not None:
                    detok.hold((tok,))
                continue
            parts.append(self._append(req, tok, lp))
            if parts[-1].finished:
                break
        last = parts[-1]
        self.spec_scheduler.commit_round(req, None if last.finished else seed)
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=(*held, *(t for o in parts for t in o.new_token_ids)),
            text_delta="".join(o.text_delta for o in parts), finished=last.finished,
            finish_reason=last.finish_reason,
            logprobs=(*held_lps, *(lp for o in parts for lp in o.logprobs)))
