"""What a request's root span (`tandem.request`, started by `Router.generate`) says about it:
the attributes set once it is prepared, and how it ends. Every call is a no-op on an untraced
request's span (tandem/otel.py)."""

from __future__ import annotations

from tandem import otel
from tandem.router.errors import Code, RouterError
from tandem.router.request_table import PreparedRequest


def describe(span: otel.Span, prepared: PreparedRequest) -> None:
    """The request as prepared: its ids, model, prompt length and workers."""
    req = prepared.routed
    span.set("tandem.request_id", prepared.request_id)
    span.set("tandem.room", str(req.room))  # 64-bit unsigned: beyond an int attribute's range
    span.set("gen_ai.request.model", req.model)
    span.set("gen_ai.usage.input_tokens", len(req.prompt_ids))
    span.set("tandem.prefill_worker", req.placement.prefill_worker)
    span.set("tandem.decode_worker", req.placement.decode_worker)


def refused(span: otel.Span, exc: RouterError) -> str:
    """A request refused before dispatch (validation, placement, capacity): it ends failed.
    Returns its outcome: "refused" when for capacity (more KV cache than a worker has, a full
    router), else "rejected" (the router's counters take the same name)."""
    outcome = "refused" if exc.code is Code.RESOURCE_EXHAUSTED else "rejected"
    span.fail(exc)
    ended(span, outcome, exc.code.value)
    return outcome


def ended(span: otel.Span, outcome: str, code: str) -> None:
    span.set("tandem.outcome", outcome)  # finished | aborted | failed | refused | rejected
    span.set("tandem.status", code)  # "OK", or the status code the client got
    span.end()
