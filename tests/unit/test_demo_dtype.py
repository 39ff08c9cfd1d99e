"""`tandem demo`: float32 by default on the CPU (speculative answers then equal the plain ones
token for token), bf16 on a GPU; an answer that parts from the plain one is explained in words
under the table -- a near-tie (both tokens scored within NEAR_TIE of the best) as rounding, any
other difference as a bug to report."""

from __future__ import annotations

import io

from tandem.cli.app import build_parser
from tandem.deploy.demo import (
    NEAR_TIE,
    DemoOptions,
    DemoRow,
    Parting,
    _deploy_config,
    _print_table,
    demo_dtype,
)


def test_float32_on_the_cpu_bf16_on_a_gpu():
    assert demo_dtype("cpu") == "float32"
    assert demo_dtype("cuda") == demo_dtype("cuda:1") == "bfloat16"
    assert build_parser().parse_args(["demo"]).dtype is None  # resolved from the device
    assert _deploy_config(DemoOptions()).engine.device == "cpu"
    assert _deploy_config(DemoOptions()).engine.dtype == "float32"
    assert _deploy_config(DemoOptions(dtype="bfloat16")).engine.dtype == "bfloat16"


def _parting(plain: float, spec: float, top: float) -> Parting:
    return Parting(index=35, plain_text=" sea", spec_text=" waves", plain_logit=plain,
                   spec_logit=spec, top_logit=top)


def test_near_tie_means_both_tokens_scored_close_to_the_best():
    assert _parting(17.75, 18.0, 18.0).near_tie  # the "logit gap -0.250" of a bf16 demo
    assert _parting(18.0, 18.0, 18.0).near_tie
    assert not _parting(18.0, 18.0 - 0.4, 18.0).near_tie  # 2.2 % below the best
    assert not _parting(18.0, 17.9, 18.5).near_tie  # the best is a third token
    assert _parting(0.5, 0.5 - NEAR_TIE, 0.5).near_tie  # small logits: an absolute margin


def _row(question: str, parting: Parting | None, same: bool) -> DemoRow:
    return DemoRow(question=question, token_ids=(1, 2, 3), ttft_s=0.1, tpot_s=0.05,
                   acceptance=2.0, same_as_plain=same,
                   first_difference=None if same else 35, parting=parting)


def test_the_table_explains_a_difference_in_words():
    out = io.StringIO()
    _print_table([_row("What is the capital of France?", None, True),
                  _row("Write a haiku about the sea.", _parting(17.75, 18.0, 18.0), False),
                  _row("Explain a CPU.", _parting(12.0, 18.0, 18.0), False)], out, 9.0,
                 "bfloat16")
    text = out.getvalue()
    assert "no, from token 35: near-tie (note 1)" in text
    assert "no, from token 35: NOT a near-tie (note 2)" in text
    assert "logit gap" not in text
    notes = text[text.index("note 1:"):]
    assert "note 1: 'Write a haiku about the sea.', token 35: the plain answer has ' sea', " \
           "the speculative one ' waves'; the model scored them 17.750 and 18.000 -- a " \
           "near-tie." in notes
    assert "-- NOT a near-tie." in notes
    assert "almost equally" in notes and "In bfloat16" in notes
    assert "same token for token" in notes and "bug" in notes
    out = io.StringIO()
    _print_table([_row("Q", None, True)], out, 9.0, "float32")
    assert "note" not in out.getvalue()
