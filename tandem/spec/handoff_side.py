"""The speculative engine's side of disaggregation (a mixin of `SpecEngine`): prefill-only
requests leave it as `PrefillHandoff`s once their prompt is done, and prefilled requests come
in with their KV already in its pool (`admit_prefilled`)."""

from __future__ import annotations

from tandem.engine.llm import validate_prompt
from tandem.engine.request import Request, RequestOutput
from tandem.messages import TokenLogprob
from tandem.spec.handoff import PrefillHandoff, restore_generator
from tandem.spec.phases import DraftSeed


class HandoffSide:
    """Methods only: the state is SpecEngine's (`handoff_only`, `handoffs`, its scheduler,
    pool and spec scheduler)."""

    def add_prefill_request(self, prompt_ids, params, req_id: str) -> str:
        """Prefill only: when the prompt is done (first token sampled, draft prefilled) the
        request leaves this engine as a `PrefillHandoff` (see `take_handoffs`) and its pages
        stay allocated until `free_pages` -- the transfer may still be reading them."""
        self.add_request(prompt_ids, params, req_id)
        self.handoff_only.add(req_id)
        return req_id

    def _hand_off(self, req, seed: DraftSeed, first: RequestOutput) -> None:
        finished = first.finished
        self.handoff_only.discard(req.req_id)
        gen_state = b""
        if req.generator is not None:
            gen_state = bytes(req.generator.get_state().numpy().tobytes())
        pages: tuple[int, ...] = ()
        if not finished:  # a finished request already gave its pages back
            pages = tuple(self.scheduler.detach(req))
            self._detok.pop(req.req_id, None)
        self.handoffs[req.req_id] = PrefillHandoff(
            req_id=req.req_id, prompt_ids=tuple(req.prompt_ids), first_token=seed.last_token,
            seed=seed, page_ids=pages, generator_state=gen_state, finished=finished,
            first_text=first.text_delta, first_token_returned=bool(first.new_token_ids),
            finish_reason=first.finish_reason.value if first.finish_reason else None,
            first_logprob=first.logprobs[0] if first.logprobs else None)

    def take_handoffs(self) -> list[PrefillHandoff]:
        out = list(self.handoffs.values())
        self.handoffs.clear()
        return out

    def free_pages(self, page_ids) -> None:
        """Return a handed-off request's pages once its transfer can no longer read them."""
        self.allocator.free(page_ids)

    def admit_prefilled(
        self, req_id: str, prompt_ids, params, first_token: int, seed: DraftSeed,
        page_ids, generator_state: bytes = b"", first_logprob: TokenLogprob | None = None,
    ) -> RequestOutput:
        """Take in a request whose prompt KV (target and draft) already sits in `page_ids` of
        this engine's pool: it joins the speculative loop at position len(prompt_ids). The
        first token goes through the same stop checks and streaming as any other, with its
        logprob from the prefill side (`first_logprob`, when the request asks)."""
        prompt_ids = list(prompt_ids)
        validate_prompt(prompt_ids, self.model_cfg.vocab_size, self.max_model_len)
        if seed.num_cached != len(prompt_ids) or seed.last_token != first_token:
            raise ValueError(
                f"seed: describes {seed.num_cached} cached tokens / last token "
                f"{seed.last_token}, the request has {len(prompt_ids)} / {first_token}"
            )
        gen = restore_generator(params, generator_state, self.device)
        max_total = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        req = Request(req_id=req_id, prompt_ids=prompt_ids, params=params,
                      max_total_len=max_total, generator=gen, page_ids=list(page_ids),
                      num_computed=len(prompt_ids))
        self.scheduler.add_running(req)
        if self.tokenizer is not None:
            from tandem.tokenizer import IncrementalDetokenizer

            self._detok[req_id] = IncrementalDetokenizer(self.tokenizer)
        # A failure ends this request (pages freed).
        out = self._append_row(req, first_token, "", first_logprob)
        if not out.finished:
            self.spec_scheduler.set_seed(req_id, seed)
        return out
