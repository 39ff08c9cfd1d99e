"""Serving metrics on hand-made timelines: every number is worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.bench.metrics import (SLO, RequestRecord, SpecRecord, acceptance, duration, itls,
                                  latency, percentile, summarize, tpot, ttft)


def rec(times, tokens, start=0.0, prompt=10, error=None, spec=None) -> RequestRecord:
    return RequestRecord(chunk_times_s=tuple(times), chunk_tokens=tuple(tokens),
                         prompt_tokens=prompt, start_s=start, error=error, spec=spec)


def test_ttft_tpot_latency_one_token_per_chunk():
    r = rec([0.5, 0.7, 0.8, 1.1], [1, 1, 1, 1])
    assert ttft(r) == 0.5
    assert latency(r) == 1.1
    assert tpot(r) == pytest.approx((1.1 - 0.5) / 3)  # 3 gaps after the first token
    assert itls(r) == pytest.approx([0.2, 0.1, 0.3])


def test_itl_splits_multi_token_chunks_and_its_mean_is_tpot():
    # A speculative stream: first chunk 2 tokens at 1.0, then 3 tokens at 1.6, 1 token at 1.7.
    r = rec([1.0, 1.6, 1.7], [2, 3, 1])
    assert r.output_tokens == 6
    # first chunk's extra token: gap 0; 0.6 over 3 tokens: 0.2 each; then 0.1.
    assert itls(r) == pytest.approx([0.0, 0.2, 0.2, 0.2, 0.1])
    assert len(itls(r)) == r.output_tokens - 1
    assert tpot(r) == pytest.approx(0.7 / 5)
    assert sum(itls(r)) / len(itls(r)) == pytest.approx(tpot(r))


def test_tpot_undefined_for_one_token():
    r = rec([0.3], [1])
    assert tpot(r) is None and itls(r) == []


def test_record_validation():
    with pytest.raises(ValueError, match="lengths"):
        rec([0.1, 0.2], [1])
    with pytest.raises(ValueError, match="decrease"):
        rec([0.2, 0.1], [1, 1])


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    xs = [0.3, 0.1, 0.9, 0.4, 0.5, 0.2, 2.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_by_hand():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)  # pos 3.6
    assert math.isnan(percentile([], 50))


def test_summarize_two_requests_and_a_failure():
    # Level starts at 0. A: sent at 0, tokens at 0.5, 1.0, 1.5 (3 tokens, 10 prompt).
    # B: sent at 0.2, tokens at +0.3, +0.5 (2 tokens), i.e. done at 0.7. C: failed.
    a = rec([0.5, 1.0, 1.5], [1, 1, 1], start=0.0)
    b = rec([0.3, 0.5], [1, 1], start=0.2, prompt=20)
    c = rec([], [], start=0.4, error="UNAVAILABLE: worker died")
    m = summarize([a, b, c], SLO(ttft_s=0.4, tpot_s=1.0))
    assert (m.num_requests, m.num_completed, m.num_failed) == (3, 2, 1)
    assert m.duration_s == pytest.approx(1.5)  # first send 0 -> last token 1.5
    assert m.request_throughput == pytest.approx(2 / 1.5)
    assert m.output_throughput == pytest.approx(5 / 1.5)
    assert m.total_token_throughput == pytest.approx((5 + 30) / 1.5)
    # SLO: A's TTFT 0.5 > 0.4 misses; B's TTFT 0.3, TPOT 0.2 meets.
    assert m.goodput == pytest.approx(1 / 1.5)
    assert m.slo_attainment == 0.5
    assert m.ttft_s.mean == pytest.approx(0.4)
    assert m.ttft_s.p50 == pytest.approx(0.4)
    assert m.ttft_s.p99 == pytest.approx(0.3 + 0.2 * 0.99)
    assert m.tpot_s.mean == pytest.approx((0.5 + 0.2) / 2)
    assert sorted([0.5, 0.5, 0.2]) == pytest.approx(sorted([0.5, 0.5, 0.2]))
    assert m.itl_s.mean == pytest.approx((0.5 + 0.5 + 0.2) / 3)
    assert m.latency_s.p50 == pytest.approx((1.5 + 0.5) / 2)
    assert m.mean_prompt_tokens == 15 and m.mean_output_tokens == 2.5
    assert m.effective_concurrency == pytest.approx((1.5 + 0.5) / 1.5)  # Little's law
    assert m.acceptance is None


def test_goodput_needs_both_slos():
    fast_first = rec([0.1, 1.1], [1, 1])  # TTFT 0.1, TPOT 1.0
    slow_first = rec([0.9, 1.0], [1, 1])  # TTFT 0.9, TPOT 0.1
    both = rec([0.1, 0.2], [1, 1])
    single = rec([0.1], [1])  # no TPOT: only the TTFT SLO applies
    slo = SLO(ttft_s=0.5, tpot_s=0.5)
    assert [slo.met(r) for r in (fast_first, slow_first, both, single)] == [
        False, False, True, True]
    m = summarize([fast_first, slow_first, both, single], slo)
    assert m.goodput == pytest.approx(2 / duration([fast_first, slow_first, both, single]))


def test_acceptance_is_round_weighted():
    a = SpecRecord(mean_acceptance_length=3.0, per_position=(0.9, 0.6, 0.3), num_rounds=10)
    b = SpecRecord(mean_acceptance_length=1.5, per_position=(0.4, 0.1, 0.0), num_rounds=30)
    acc = acceptance([rec([0.1, 0.2], [1, 1], spec=a), rec([0.1, 0.2], [1, 1], spec=b),
                      rec([0.1, 0.2], [1, 1])])
    assert acc is not None
    assert acc.num_rounds == 40
    assert acc.mean_length == pytest.approx((3.0 * 10 + 1.5 * 30) / 40)
    assert acc.per_position == pytest.approx(((9 + 12) / 40, (6 + 3) / 40, 3 / 40))


def test_nothing_completed():
    m = summarize([rec([], [], error="DEADLINE_EXCEEDED: x")], SLO(ttft_s=1, tpot_s=1))
    assert m.num_completed == 0 and m.duration_s == 0 and m.request_throughput == 0
    assert math.isnan(m.ttft_s.p50)
