"""Proto messages <-> router values. Pure functions; the only module of the router's logic that
knows the generated `router_pb2` types (the servicer and the client use it)."""

from __future__ import annotations

from tandem.messages import FinishReason, TokenLogprob
from tandem.proto import router_pb2 as pb
from tandem.router.dispatch import SpecAcceptance, WorkerRole
from tandem.router.policy import WorkerState
from tandem.router.router import GenerateOutput, RouterStats
from tandem.router.validate import GenerateInput, SamplingInput
from tandem.tokenizer import ChatMessage

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
ROLES = {
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
    WorkerRole.COLOCATED: pb.WORKER_ROLE_COLOCATED,
}


def _opt(msg, field: str):
    return getattr(msg, field) if msg.HasField(field) else None


def generate_input(req: pb.GenerateRequest) -> GenerateInput:
    s = req.sampling
    return GenerateInput(
        prompt=_opt(req, "prompt"),
        prompt_token_ids=tuple(req.prompt_token_ids),
        messages=tuple(ChatMessage(role=m.role, content=m.content) for m in req.messages),
        sampling=SamplingInput(
            max_tokens=_opt(s, "max_tokens"), temperature=_opt(s, "temperature"),
            top_k=_opt(s, "top_k"), top_p=_opt(s, "top_p"), min_p=_opt(s, "min_p"),
            seed=_opt(s, "seed"), stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos, logprobs=s.logprobs,
            top_logprobs=_opt(s, "top_logprobs")),
        model=req.model, prefill_worker=req.prefill_worker, decode_worker=req.decode_worker,
        request_id=req.request_id)


def spec_stats(spec: SpecAcceptance) -> pb.SpecStats:
    return pb.SpecStats(mean_acceptance_length=spec.mean_acceptance_length,
                        per_position_acceptance=list(spec.per_position),
                        num_rounds=spec.num_rounds)


def token_logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v)
                      for t, v in zip(lp.top_ids, lp.top_logprobs)])


def generate_response(out: GenerateOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=list(out.token_ids),
                              text_delta=out.text_delta,
                              logprobs=[token_logprob(lp) for lp in out.logprobs])
    if out.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[out.finish_reason]
    if out.usage is not None:
        msg.usage.prompt_tokens = out.usage.prompt_tokens
        msg.usage.completion_tokens = out.usage.completion_tokens
    if out.ttft_s is not None:
        msg.ttft_s = out.ttft_s
    if out.latency_s is not None:
        msg.latency_s = out.latency_s
    if out.spec is not None:
        msg.spec_stats.CopyFrom(spec_stats(out.spec))
    return msg


def worker_status(state: WorkerState) -> pb.WorkerStatus:
    w = state.info
    return pb.WorkerStatus(
        name=w.name, role=ROLES[w.role], model=w.model, healthy=state.healthy, error=w.error,
        address=w.address, num_running=w.num_running, num_waiting=w.num_waiting,
        num_free_pages=w.num_free_pages, num_pages=w.num_pages, speculative=w.speculative,
        health_p50_ms=w.health_p50_ms, health_p99_ms=w.health_p99_ms)


def stats_response(stats: RouterStats) -> pb.StatsResponse:
    msg = pb.StatsResponse(
        num_requests=stats.num_requests, num_rejected=stats.num_rejected,
        num_in_flight=stats.num_in_flight, num_finished=stats.num_finished,
        num_aborted=stats.num_aborted, num_failed=stats.num_failed,
        num_refused=stats.num_refused,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_completion_tokens=stats.num_completion_tokens,
        workers=[worker_status(w) for w in stats.workers])
    if stats.spec is not None:
        msg.spec_stats.CopyFrom(spec_stats(stats.spec))
    return msg
