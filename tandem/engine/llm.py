"""`LLMEngine`: one model on one device group, generating for many requests at once.

The control loop is `step()`: schedule -> build metadata (pure) -> forward -> sample -> commit.
`generate()` is the offline convenience on top. Workers (prefill/decode) compose the same
pieces (runner, pool, allocator, sampler) differently; this class is the colocated reference.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from tandem.engine import h2d
from tandem.engine.attention.backend import AttentionShape, create_backend
from tandem.engine.attention.metadata import SeqSlice, build_metadata
from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.cuda_graphs import (
    DecodeGraphRunner,
    graph_batch_sizes,
    pad_decode_slices,
    padded_batch_size,
    prefill_graph_rows,
)
from tandem.engine.kv_cache import KVGroupSpec, KVPool, PageAllocator
from tandem.engine.loader import DTYPES, build_model, resolve_model
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.overlap import InflightStep, feed_input_ids, is_live
from tandem.engine.parallel import ParallelContext
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import (  # noqa: F401 -- PoolTooSmall, validate_prompt re-exported
    Completion,
    EngineStats,
    FinishReason,
    PoolTooSmall,
    Request,
    RequestOutput,
    completion_of,
    find_stop,
    token_end,
    validate_prompt,
)
from tandem.engine.runner import ForwardBatch, ModelRunner
from tandem.engine.sampling import Sampler, SampledRead, SamplingParams, read_sampled, row_error
from tandem.engine.scheduler import Scheduler, StepPlan
from tandem.messages import TokenLogprob

log = logging.getLogger(__name__)


def kv_groups_for(model: DecoderLM) -> list[KVGroupSpec]:
    cfg, heads = model.cfg, model.heads
    return [KVGroupSpec(name="target", num_layers=cfg.num_layers,
                        num_kv_heads=heads.local_kv_heads, head_dim=cfg.head_dim)]


def attention_shape_for(model: DecoderLM, dtype: torch.dtype) -> AttentionShape:
    heads = model.heads
    return AttentionShape(num_qo_heads=heads.local_heads, num_kv_heads=heads.local_kv_heads,
                          head_dim=heads.head_dim, dtype=dtype, scale=heads.head_dim**-0.5)


class LLMEngine:
    # Tokens after a KV page that the page's content depends on (prefix_cache.py): none for
    # the target's KV; a speculative engine's draft KV looks one token ahead.
    PREFIX_LOOKAHEAD = 0

    def __init__(
        self, engine_cfg: EngineConfig, model: DecoderLM, tokenizer: object | None = None,
        extra_kv_groups: Sequence[KVGroupSpec] = (), reserved_pages: int = 0,
        graph_capture_layers: tuple[int, ...] = (),
    ) -> None:
        """reserved_pages: KV page ids kept out of the allocator for a subclass's own use
        (pages 1 .. reserved_pages, after the scratch page 0; added to the pool's size).
        graph_capture_layers: layers whose streams the graphs keep (`run_forward`)."""
        self.cfg, self.model, self.tokenizer = engine_cfg, model, tokenizer
        self.model_cfg: ModelConfig = model.cfg
        self.device = torch.device(engine_cfg.device)
        self.max_model_len = min(engine_cfg.max_model_len or self.model_cfg.max_context,
                                 self.model_cfg.max_context)
        groups = kv_groups_for(model) + list(extra_kv_groups)
        dtype = DTYPES[engine_cfg.dtype]
        num_pages = engine_cfg.num_pages or max(
            2, engine_cfg.kv_cache_bytes // KVPool.bytes_per_page(groups, engine_cfg.page_size, dtype)
        )
        num_pages += reserved_pages
        self.kv_pool = KVPool(groups, num_pages, engine_cfg.page_size, dtype, self.device)
        self.allocator = PageAllocator(num_pages, reserved=1 + reserved_pages)
        self.runner = ModelRunner(model, self.kv_pool, create_backend(
            engine_cfg.attention_backend, self.device, attention_shape_for(model, dtype)))
        self.graphs: DecodeGraphRunner | None = None
        if (engine_cfg.cuda_graphs and self.device.type == "cuda"
                and hasattr(self.runner.backend, "graph_decode_planner")
                and (model.par.dp.size == 1 or self.dp_graphs_ok(engine_cfg))):
            sizes = graph_batch_sizes(engine_cfg.max_num_seqs)
            self.graphs = DecodeGraphRunner(
                self.runner, sizes, -(-self.max_model_len // engine_cfg.page_size), model.par,
                prefill_rows=prefill_graph_rows(sizes, engine_cfg.max_num_batched_tokens),
                capture_layers=graph_capture_layers)
            self.graphs.capture()
        self.prefix_cache = (PrefixCache(self.allocator, engine_cfg.page_size,
                                         self.PREFIX_LOOKAHEAD)
                             if engine_cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.allocator, engine_cfg.page_size, engine_cfg.max_num_seqs,
                                   engine_cfg.max_num_batched_tokens, self.prefix_cache)
        self.sampler = Sampler(engine_cfg.sampling_fault, self.device, engine_cfg.seed)
        # Overlap scheduling (engine/overlap.py): on CUDA, plain steps, no DP (`overlap_ok`; a
        # decode worker clears it: pages receiving KV must not be reused while a step is in
        # flight); `_inflight` is the launched step not read yet.
        want = (engine_cfg.overlap_schedule if engine_cfg.overlap_schedule is not None
                else self.device.type == "cuda")
        self.overlap_ok = want and model.par.dp.size == 1
        self.overlap = self.overlap_ok and self.PLAIN_STEPS
        self._inflight: InflightStep | None = None
        self._detok: dict[str, object] = {}
        self._ids = itertools.count()
        self.eos_ids = frozenset(self.model_cfg.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ()) or ())
        log.info("engine ready: %s, %d layers, %d KV pages of %d tokens, backend %s",
                 self.model_cfg.architecture, self.model_cfg.num_layers, num_pages,
                 engine_cfg.page_size, self.runner.backend.name)

    @staticmethod
    def from_config(engine_cfg: EngineConfig, parallel: ParallelContext | None = None) -> LLMEngine:
        model_cfg, path = resolve_model(engine_cfg)
        max_len = min(engine_cfg.max_model_len or model_cfg.max_context, model_cfg.max_context)
        model = build_model(model_cfg, path, engine_cfg, parallel or ParallelContext(), max_len)
        tokenizer = None
        if path is not None and (path / "tokenizer.json").is_file():
            from tandem.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(path)
        return LLMEngine(engine_cfg, model, tokenizer)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, req_id: str | None = None
    ) -> str:
        prompt_ids = list(prompt_ids)
        validate_prompt(prompt_ids, self.model_cfg.vocab_size, self.max_model_len)
        max_total = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        need = self.scheduler.pages_needed(max_total)
        if need > self.allocator.num_usable:
            raise PoolTooSmall(f"max_new_tokens: prompt + max_new_tokens needs {need} KV "
                               f"pages; the pool has {self.allocator.num_usable}")
        req_id = req_id or f"req-{next(self._ids)}"
        gen = None
        if not params.greedy and params.seed is not None:
            # A seeded request draws from its own generator (the same tokens whatever shares its
            # batch); the unseeded ones share one batched draw (Sampler.sample).
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self.scheduler.add(Request(req_id=req_id, prompt_ids=prompt_ids, params=params,
                                   max_total_len=max_total, generator=gen))
        if self.tokenizer is not None:
            from tandem.tokenizer import IncrementalDetokenizer

            self._detok[req_id] = IncrementalDetokenizer(self.tokenizer)
        return req_id

    def abort(self, req_id: str) -> bool:
        req = self.scheduler.requests.get(req_id)
        if req is None:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        self._detok.pop(req_id, None)
        return True

    def leave_overlap(self) -> list[RequestOutput]:
        """Read the step in flight (its outputs), if any; later steps run without overlap."""
        prev, self._inflight, self.overlap = self._inflight, None, False
        return self._resolve(prev) if prev is not None else []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def any_rank_has_work(self) -> bool:
        """With DP attention, whether any DP rank has work: every rank keeps stepping (idle
        ones with empty batches) until none has. Without DP, `has_unfinished()`."""
        dp = self.model.par.dp
        return bool(dp.all_reduce_max(int(self.has_unfinished()), self.device))

    def dp_join(self, has_work: bool) -> bool:
        """DP attention, before a phase that runs a target forward (prefill chunk, verify): the
        ranks agree whether any runs it; a rank without work runs the empty forward, so every
        rank issues the same MLP/MoE collectives. Whether this rank runs its own; every rank
        calls it at the same points of its step. Without DP: `has_work`, no communication."""
        dp = self.model.par.dp
        if dp.size == 1:
            return has_work
        # SYNC: one host read per phase (the flag decides the control flow).
        if not dp.all_reduce_max(int(has_work), self.device):
            return False
        if not has_work:
            self.runner.idle_forward(self.device)
        return has_work

    def stats(self) -> EngineStats:
        return EngineStats(num_pages=self.allocator.num_usable,
                           num_free_pages=self.allocator.num_free,
                           num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting),
                           num_cached_pages=self.prefix_cache.num_pages if self.prefix_cache else 0,
                           num_prefix_query_tokens=self.scheduler.num_prefix_query_tokens,
                           num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens)

    # ---- the loop -------------------------------------------------------------------------

    # Every step is this class's `step` (one forward, then sampling): what overlap scheduling
    # and decode graphs under DP attention rely on. SpecEngine runs rounds instead.
    PLAIN_STEPS = True

    def dp_graphs_ok(self, cfg: EngineConfig) -> bool:
        """Whether decode graphs may be captured under DP attention: asked for (`dp_decode_graphs`),
        plain steps, and no MoE dispatch that reads split sizes on the host."""
        return cfg.dp_decode_graphs and self.PLAIN_STEPS and cfg.moe_dispatch != "alltoall"

    # A step never records autograd, whoever calls it (Ray worker loops, the CLI, tests): the
    # kernels' dispatch keeps the Triton kernels (which have no backward) for inference only.
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.overlap:
            # Launch step n+1, then read step n (engine/overlap.py): the host's stop checks
            # and the next step's planning run while the GPU computes.
            prev, self._inflight = self._inflight, self._launch(plan) if plan.chunks else None
            return self._resolve(prev) if prev is not None else []
        return self._run_plan(plan)

    def _run_plan(self, plan: StepPlan) -> list[RequestOutput]:
        """A step of `plan` without overlap: forward (its graph when one fits), sampling, the
        host read, the stop checks."""
        graph_bs = self._graph_batch_size(plan)  # DP attention: agreed by every rank
        if not plan.chunks:
            if self.model.par.dp.size > 1:  # DP attention: the other ranks may have work
                self._dp_idle(graph_bs)
            return []
        reqs, sampled = self._forward_and_sample(plan, graph_bs)
        # SYNC: the one host sync per step (stop checks): the tokens, and the logprobs of the
        # rows that asked, in one read.
        token_list, logprobs = read_sampled(sampled)
        return [self._append_row(r, t, err, lp)
                for r, t, err, lp in zip(reqs, token_list, sampled.errors, logprobs)]

    def _forward_and_sample(self, plan: StepPlan, graph_bs: int | None
                            ) -> tuple[list[Request], object]:
        """The step's forward (the graph of `graph_bs` rows, or eager: None) and sampling,
        committed; no host read. Returns the sampling rows' requests and the `SampleOutput`."""
        batch = self._build_batch(plan, graph_bs or sum(len(c.token_ids) for c in plan.chunks))
        if graph_bs is not None and self.graphs is not None:
            logits = self.graphs.run(batch)
        else:
            logits = self.runner.forward(batch).logits
        sampling = [c for c in plan.chunks if c.samples]
        reqs = [self.scheduler.requests[c.req_id] for c in sampling]
        sampled = self.sampler.sample(logits, [r.params for r in reqs],
                                      [r.generator for r in reqs], [r.req_id for r in reqs])
        self.scheduler.commit(plan)
        return reqs, sampled

    def _launch(self, plan: StepPlan) -> InflightStep:
        """Overlap: run the step up to sampling and queue the read of its tokens; each sampling
        row's request gets a pending token (its next input, taken from the device)."""
        reqs, sampled = self._forward_and_sample(plan, self._graph_batch_size(plan))
        for r in reqs:
            r.num_pending += 1
        return InflightStep(reqs=tuple(reqs), tokens=sampled.tokens, errors=sampled.errors,
                            read=SampledRead.start(sampled),
                            rows={r.req_id: i for i, r in enumerate(reqs)})

    def _resolve(self, step: InflightStep) -> list[RequestOutput]:
        """Overlap: read a launched step's tokens (SYNC: the step's one host read, a step late)
        and run their stop checks; rows of requests that ended meanwhile are dropped."""
        token_list, logprobs = step.read.wait()
        outputs = []
        for req, t, err, lp in zip(step.reqs, token_list, step.errors, logprobs):
            req.num_pending -= 1
            if is_live(self.scheduler.requests, req):
                outputs.append(self._append_row(req, t, err, lp))
        return outputs

    def _graph_batch_size(self, plan: StepPlan) -> int | None:
        """The padded rows of a CUDA graph that can run this step (`rows_for`), or None. With
        DP attention every rank replays the same graph or none: the ranks agree on the largest
        size any needs (SYNC: one small all-reduce a step; an idle rank replays padding)."""
        if self.graphs is None:
            return None
        dp = self.model.par.dp
        own = self.graphs.rows_for([(len(c.token_ids), c.num_cached) for c in plan.chunks],
                                   sum(c.samples for c in plan.chunks), dp.size > 1)
        if dp.size > 1:
            own = dp.all_reduce_max(own, self.device)
        return padded_batch_size(own, self.graphs.batch_sizes) if own else None

    def _dp_idle(self, graph_bs: int | None) -> None:
        """DP attention, a rank with nothing scheduled: the forward the others' collectives
        need -- their graph over padding rows, or the eager empty forward."""
        if graph_bs is None or self.graphs is None:
            self.runner.idle_forward(self.device)
        else:
            self.graphs.run(self._build_batch(StepPlan(chunks=(), preempted=()), graph_bs))

    def _build_batch(self, plan: StepPlan, num_rows: int, busy: bool = False) -> ForwardBatch:
        """The forward of `plan` over `num_rows` token rows (>= its tokens): rows beyond the
        chunks' tokens (CUDA-graph padding) write only the scratch page."""
        slices = [SeqSlice(page_ids=c.page_ids, num_cached=c.num_cached,
                           num_new=len(c.token_ids)) for c in plan.chunks]
        # Plain blocking copies: the stream is idle here (the last step ended on its host
        # read), and on an H200 they cost less than pinned non-blocking ones (docs/perf.md
        # session 9). With overlap, or `busy` (a speculative step's prompts behind the last
        # round's drafting ahead), work is queued: the copies must not wait for it (`h2d`).
        ends = list(itertools.accumulate(len(c.token_ids) for c in plan.chunks))
        pad = num_rows - (ends[-1] if ends else 0)  # graph padding: one-token scratch rows
        seqs = pad_decode_slices(slices, len(slices) + pad) if pad > 0 else slices
        logits_rows = [end - 1 for c, end in zip(plan.chunks, ends) if c.samples]
        if self.overlap or busy:
            layout = h2d.build_layout(seqs, self.cfg.page_size, self.device)
            input_ids = feed_input_ids(plan.chunks, num_rows, self._inflight, self.device)
            logits_idx = h2d.tensor(logits_rows, torch.int64, self.device)
        else:
            layout = build_metadata(seqs, self.cfg.page_size, self.device)
            ids = [t for c in plan.chunks for t in c.token_ids]
            ids += [0] * pad  # padding rows (graph batches only)
            input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
            logits_idx = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        return ForwardBatch(input_ids=input_ids, positions=layout.positions, attn=layout.attn,
                            logits_indices=logits_idx)

    def _append_row(self, req: Request, token: int, error: str = "",
                    logprob: TokenLogprob | None = None) -> RequestOutput:
        """A row's work after the forward, isolated: a row whose sampling failed (`error`), or
        whose stop checks or detokenizer raise, fails its own request and no other -- only a
        failure of the whole forward may stop a worker."""
        if error:
            return self._fail_request(req, error)
        try:
            return self._append(req, token, logprob)
        except Exception as exc:  # noqa: BLE001 -- this request fails, the batch goes on
            log.warning("request '%s' failed after sampling", req.req_id, exc_info=exc)
            return self._fail_request(req, row_error("detokenizer/stop checks", exc))

    def _fail_request(self, req: Request, error: str) -> RequestOutput:
        """End `req` with FinishReason.ERROR: its pages return (the scheduler frees them) and
        its terminal output carries `error`. Whatever its row did to `req` before it raised
        (a token appended, text fed) goes nowhere: the output has no tokens."""
        req.error = error
        if self.scheduler.requests.get(req.req_id) is req:  # not already finished by _append
            self.scheduler.finish(req, FinishReason.ERROR)
        self._detok.pop(req.req_id, None)
        return RequestOutput(req_id=req.req_id, new_token_ids=(), text_delta="", finished=True,
                             finish_reason=FinishReason.ERROR, error=error)

    def _finished(self, req: Request, reason: FinishReason) -> None:
        """A hook: `req` just ended by its stop conditions (`_append`, which runs per row)."""

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None = None
                ) -> RequestOutput:
        """`token` through the stop checks; `logprob` (None: the request did not ask) goes
        with it wherever the token goes."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        detok = self._detok.get(req.req_id)
        prev_len = len(req.text)
        if detok is not None:
            req.text += detok.feed(token)
        p = req.params
        reason: FinishReason | None = None
        visible_end = len(req.text)
        # A stop string comes first: whatever else this token ends the request by too (EOS, a
        # stop token, the length), the text ends where the stop string begins and the token
        # that completed it is not returned (docs/architecture.md, "Request semantics").
        stop_at = find_stop(req.text, prev_len, p.stop)
        if stop_at is not None:
            reason, visible_end = FinishReason.STOP, stop_at
        elif (reason := token_end(req, token, self.eos_ids)) is None and p.stop:
            # Hold back text that could be the start of a stop string still being generated.
            visible_end = max(req.num_emitted_chars, len(req.text) - max(map(len, p.stop)) + 1)
        if reason is not None and stop_at is None and detok is not None:
            req.text += detok.flush()  # bytes of a character the last token left incomplete
            visible_end = len(req.text)
        delta = req.text[req.num_emitted_chars : visible_end]
        req.num_emitted_chars = visible_end
        new_token_ids = (token,)
        logprobs = (logprob,) if logprob is not None else ()
        if stop_at is not None:  # the token that completed a stop string is not returned
            req.output_ids.pop()
            if logprob is not None:
                req.output_logprobs.pop()
            new_token_ids, logprobs = (), ()
        if reason is not None:
            req.text = req.text[:visible_end]
            self.scheduler.finish(req, reason)
            self._detok.pop(req.req_id, None)
            self._finished(req, reason)
        queued = (req.scheduled_time - req.arrival_time
                  if reason is not None and req.scheduled_time is not None else None)
        return RequestOutput(req_id=req.req_id, new_token_ids=new_token_ids, text_delta=delta,
                             finished=reason is not None, finish_reason=reason,
                             logprobs=logprobs, queue_s=queued)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        progress: bool = False,
    ) -> list[Completion]:
        """Run prompts (token ids) to completion; results in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        reqs = {i: self.scheduler.requests[i] for i in ids}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), unit="req", desc="generating")
        num_tokens = 0
        while self.any_rank_has_work():
            outs = self.step()
            num_tokens += len(outs)
            if bar is not None:
                bar.update(sum(o.finished for o in outs))
                bar.set_postfix(tokens=num_tokens, refresh=False)
        if bar is not None:
            bar.close()
        return [completion_of(reqs[i]) for i in ids]

    @torch.inference_mode()
    def next_token_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[V] float32: the model's logits for the token after `ids`, from one prefill forward
        on pages borrowed for it (outside the scheduler; freed before returning). For
        diagnostics -- how close two candidates were where two greedy runs parted."""
        pages = self.allocator.alloc(self.scheduler.pages_needed(len(ids)))
        try:
            lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=len(ids))],
                                 self.cfg.page_size, self.device)
            out = self.runner.forward(ForwardBatch(
                input_ids=torch.tensor(list(ids), dtype=torch.int64, device=self.device),
                positions=lay.positions, attn=lay.attn,
                logits_indices=torch.tensor([len(ids) - 1], device=self.device)))
        finally:
            self.allocator.free(pages)
        return out.logits[0].float()
