"""Load levels, Poisson arrivals and workloads: deterministic for a seed, shaped as asked."""

from __future__ import annotations

import math
import statistics

import pytest

from tandem.bench.load import LoadLevel, parse_levels, poisson_arrivals
from tandem.bench.workload import FIRST_TOKEN_ID, LengthRange, WorkloadConfig, build_requests


def test_poisson_deterministic_for_a_seed():
    a = poisson_arrivals(4.0, 200, seed=7)
    assert a == poisson_arrivals(4.0, 200, seed=7)
    assert a != poisson_arrivals(4.0, 200, seed=8)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))


def test_poisson_rate():
    times = poisson_arrivals(10.0, 5001, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.08)


def test_infinite_rate_sends_at_once():
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(1.0, 0, seed=0) == []


def test_parse_levels():
    levels = parse_levels("1, 16,64", "0.5,inf", max_concurrency=8)
    assert [lv.concurrency for lv in levels[:3]] == [1, 16, 64]
    assert levels[3].request_rate == 0.5 and levels[3].max_concurrency == 8
    assert math.isinf(levels[4].request_rate)
    assert levels[0].default_num_requests() == 16 and levels[2].default_num_requests() == 256
    for bad, rate, match in (("0", None, "concurrency"), ("x", None, "concurrency"),
                             (None, "-1", "request_rate"), (None, None, "at least one")):
        with pytest.raises(ValueError, match=match):
            parse_levels(bad, rate)
    with pytest.raises(ValueError, match="exactly one"):
        LoadLevel(concurrency=1, request_rate=1.0)


def test_length_range_parse():
    assert LengthRange.parse("2048:4096", "input-len") == LengthRange(lo=2048, hi=4096)
    assert LengthRange.parse(128, "x") == LengthRange(lo=128, hi=128)
    assert LengthRange.parse([1, 2], "x") == LengthRange(lo=1, hi=2)
    with pytest.raises(ValueError, match="input-len"):
        LengthRange.parse("9:3", "input-len")
    with pytest.raises(ValueError, match="output-len"):
        LengthRange.parse("a", "output-len")


def test_random_workload_lengths_and_determinism():
    cfg = WorkloadConfig(kind="random", input_len=LengthRange(lo=5, hi=9),
                         output_len=LengthRange(lo=3, hi=4), vocab_size=1000, seed=3)
    reqs = build_requests(cfg, 50, stream=1)
    assert reqs == build_requests(cfg, 50, stream=1)
    assert reqs != build_requests(cfg, 50, stream=2)  # another level: other prompts
    assert {len(r.prompt_token_ids) for r in reqs} <= set(range(5, 10))
    assert len({len(r.prompt_token_ids) for r in reqs}) > 1
    assert {r.max_tokens for r in reqs} == {3, 4}
    assert all(FIRST_TOKEN_ID <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    assert all(r.ignore_eos and r.question is None for r in reqs)


def test_fixed_workload():
    cfg = WorkloadConfig(kind="fixed", input_len=LengthRange(lo=7, hi=7),
                         output_len=LengthRange(lo=2, hi=2))
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in build_requests(cfg, 5)} == {(7, 2)}
    with pytest.raises(ValueError, match="fixed"):
        WorkloadConfig(kind="fixed", input_len=LengthRange(lo=1, hi=2))


def test_chat_workload():
    cfg = WorkloadConfig(kind="chat", output_len=LengthRange(lo=8, hi=8))
    reqs = build_requests(cfg, 4)
    assert all(r.question and not r.prompt_token_ids and not r.ignore_eos for r in reqs)
    from tandem.spec.train_data import HELD_OUT_QUESTIONS

    assert reqs[0].question == HELD_OUT_QUESTIONS[0]  # held-out questions first
    assert len({r.question for r in reqs}) == 4
