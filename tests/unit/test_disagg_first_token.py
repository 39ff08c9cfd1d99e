"""The router's handling of decode's first output once the first token came from prefill
(`router/flight.py`): the repeated token and its text are dropped, an output without tokens
(an aborted request's end) passes as it is, and a mismatch -- a bug somewhere -- is logged and
kept rather than silently losing a token."""

from __future__ import annotations

import logging

from tandem.router.flight import drop_first


def test_the_repeat_of_the_first_token_is_dropped_with_its_text():
    assert drop_first((11, 12, 13), "Hi there", (11, "Hi"), "r") == ((12, 13), " there")
    assert drop_first((11,), "Hi", (11, "Hi"), "r") == ((), "")
    assert drop_first((11,), "", (11, ""), "r") == ((), "")  # text held back on both sides


def test_an_output_without_tokens_passes_silently(caplog):
    with caplog.at_level(logging.ERROR):
        assert drop_first((), "", (11, "Hi"), "r") == ((), "")
    assert not caplog.records


def test_a_mismatch_is_logged_and_kept(caplog):
    with caplog.at_level(logging.ERROR):
        assert drop_first((12, 13), "yo", (11, "Hi"), "r7") == ((12, 13), "yo")
        assert drop_first((11,), "Ho", (11, "Hi"), "r8") == ((11,), "Ho")
    assert len(caplog.records) == 2 and "r7" in caplog.records[0].getMessage()


def _follow(events: list, aborted: bool = False) -> list:
    """The finish reasons `router.flight.follow` yields for a flight of room 7 (prefill "p",
    decode "d") whose workers send `events` ((worker, event) pairs); what it raises, it
    raises."""
    import asyncio
    import time

    from tandem.messages import SamplingParams
    from tandem.router.dispatch import Placement, RoutedRequest
    from tandem.router.flight import Flight, follow

    async def main():
        req = RoutedRequest(request_id="r", room=7, model="m", prompt_ids=(1, 2),
                            params=SamplingParams(max_new_tokens=4),
                            placement=Placement(prefill_worker="p", decode_worker="d"),
                            deadline=time.time() + 60)
        queue: asyncio.Queue = asyncio.Queue()
        for ev in events:
            queue.put_nowait(ev)
        flight = Flight(prefill="p", decode="d", room=7, aborted=aborted)
        return [c.finish_reason async for c in follow(req, flight, queue, num_steps=4,
                                                       table=None)]

    return asyncio.run(asyncio.wait_for(main(), 5))


def test_a_finish_reason_the_router_does_not_know_fails_the_request_at_once():
    """A decode output that ends the request with a reason the router has no name for fails
    the request right away (it used to wait for the request's deadline)."""
    import pytest

    from tandem.messages import DecodeOutput
    from tandem.router.dispatch import RequestFailed

    with pytest.raises(RequestFailed, match="unknown finish reason 'timeout'"):
        _follow([("d", DecodeOutput(room=7, token_ids=(5,), text_delta="x", finished=True,
                                    finish_reason="timeout"))])


def test_an_abort_that_decode_reports_first_ends_the_request_as_aborted():
    """abort() of a flight whose decode side reports the abort (an error output: its transfer
    was aborted by prefill) before the prefill side's outcome arrives: the request ends as
    aborted, not as a failed transfer (CI saw this race once)."""
    from tandem.messages import DecodeOutput

    reasons = _follow([("d", DecodeOutput(
        room=7, token_ids=(), text_delta="", finished=False, finish_reason="error",
        error="[aborted] (room 7) prefill: aborted by prefill", error_kind="aborted"))],
        aborted=True)
    assert len(reasons) == 1 and reasons[0] is not None and reasons[0].value == "abort"
