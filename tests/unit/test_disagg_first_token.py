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
