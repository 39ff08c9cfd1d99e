"""The stop rules of docs/architecture.md, "Request semantics", in the plain engine and in the
speculative one (scripted all-correct drafts, so the stop falls inside an accepted run):

- a stop string ends the text where it begins, whatever else the token that completed it ends
  the request by too (a stop token, EOS): with both, the answer is the stop string's alone;
- the token that completed the stop string is not returned: not in the output's token ids, not
  in the streamed ones (so not in completion_tokens, which counts those); the tokens before it
  are, even where the stop string began inside them;
- a stop token alone is returned with its text;
- a prefill-only request its first token ends by a stop string hands off no first token, and
  the router streams none (disaggregated mode)."""

from __future__ import annotations

import asyncio
from functools import cache

import pytest
from spec_helpers import (
    VOCAB,
    assert_pages_free,
    chain,
    engine_cfg,
    letter_tokenizer,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    scripted_engine,
    tiny_head,
    tiny_target,
)

from tandem.engine import FinishReason, LLMEngine, SamplingParams
from tandem.messages import PrefillResult
from tandem.spec import SpecConfig, SpecEngine

K = 4  # drafts per round: after the prefill token, rounds commit tokens 1-5, 6-10, ...
SPEC = SpecConfig(num_steps=K)


@cache
def _setup():
    """The tiny target, a prompt, its greedy continuation (no stops) and the index j >= 3 of
    a token inside a speculative round whose word is not in the text before it."""
    model = tiny_target("llama", live=None)
    prompt = tuple(prompts(1, seed=410, lo=4)[0])
    ref = reference(model, [prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    out, tok = ref.output_ids, letter_tokenizer()
    j = next(j for j in range(3, len(out) - 1)
             if j % (K + 1) != 0 and tok.decode([out[j]]) not in tok.decode(out[:j]))
    return model, prompt, out, j


def _run(kind: str, model, prompt, params: SamplingParams, ref):
    """(the completion, every token id streamed) from the plain or the speculative engine."""
    tok = letter_tokenizer()
    if kind in ("plain", "overlap"):  # overlap: engine/overlap.py, outputs read a step late
        eng = LLMEngine(engine_cfg(overlap_schedule=kind == "overlap"), model, tok)
    else:
        eng = scripted_engine(model, tiny_head(model, "eagle", live=None), SPEC,
                              lambda rid, out: chain((ref + (0,) * 8)[len(out):], K, K),
                              tokenizer=tok)
    rid = eng.add_request(list(prompt), params, req_id="req-0")
    req = eng.scheduler.requests[rid]
    streamed: list[int] = []
    text = ""
    while eng.has_unfinished():
        for o in eng.step():
            streamed += o.new_token_ids
            text += o.text_delta
    assert text == req.text
    assert_pages_free(eng)
    return req, streamed


@pytest.mark.parametrize("kind", ["plain", "overlap", "speculative"])
@pytest.mark.parametrize("also", ["stop token", "eos", "nothing"])
def test_a_stop_string_cuts_text_and_token_whatever_else_the_token_ends(kind, also):
    model, prompt, out, j = _setup()
    tok = letter_tokenizer()
    word = tok.decode([out[j]])
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(word,))
    if also == "stop token":
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(word,),
                                stop_token_ids=(out[j],))
    elif also == "eos":  # the same weights with out[j] as the EOS id
        model = tiny_target("llama", live=None, eos_token_id=out[j])
        params = SamplingParams(max_new_tokens=30, stop=(word,))
    req, streamed = _run(kind, model, prompt, params, out)
    full = tok.decode(out[: j + 1])
    assert req.text == full[: full.index(word)] == tok.decode(out[:j]) + " "
    assert tuple(req.output_ids) == tuple(streamed) == out[:j]
    assert req.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("kind", ["plain", "overlap", "speculative"])
def test_a_stop_string_that_begins_in_an_earlier_token_drops_only_the_last(kind):
    model, prompt, out, j = _setup()
    tok = letter_tokenizer()
    stop = tok.decode(out[j - 1 : j + 1])[1:]  # "<digit of x_{j-1}> x_j": two tokens
    assert stop not in tok.decode(out[:j])
    req, streamed = _run(kind, model, prompt,
                         SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)), out)
    assert req.text == tok.decode(out[:j])[:-1]  # x_{j-1}'s text is cut, its token returned
    assert tuple(req.output_ids) == tuple(streamed) == out[:j]


@pytest.mark.parametrize("kind", ["plain", "overlap", "speculative"])
def test_a_stop_token_alone_is_returned_with_its_text(kind):
    model, prompt, out, j = _setup()
    tok = letter_tokenizer()
    req, streamed = _run(kind, model, prompt, SamplingParams(
        max_new_tokens=30, ignore_eos=True, stop_token_ids=(out[j],)), out)
    assert tuple(req.output_ids) == tuple(streamed) == out[: j + 1]
    assert req.text == tok.decode(out[: j + 1])
    assert req.finish_reason == FinishReason.STOP


def test_a_first_token_that_completes_a_stop_string_is_not_handed_off():
    """Prefill-only: the hand-off of a request its first token ended by a stop string carries
    no first token for the client (the prefill worker's result has none), and the router's
    disaggregated dispatcher streams none; it still carries the sampled token in its seed."""
    from tandem.prefill_node.worker import _finished_here
    from tandem.router.disagg import DisaggregatedDispatcher
    from tandem.router.flight import Flight
    from tandem.router.flight import follow as follow_events
    from tandem.router.dispatch import ModelInfo, Placement, RoutedRequest

    model, prompt, out, _ = _setup()
    tok = letter_tokenizer()
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle", live=None), tok)
    word = tok.decode([out[0]])
    eng.add_prefill_request(list(prompt), SamplingParams(max_new_tokens=30, stop=(word,)), "7")
    while eng.has_unfinished():
        eng.step()
    (h,) = eng.take_handoffs()
    assert h.finished and not h.first_token_returned and h.first_token == out[0]
    assert h.first_text == "" and h.finish_reason == "stop"
    result = _finished_here(h)
    assert result.first_token is None and result.finished
    assert_pages_free(eng)

    dispatcher = DisaggregatedDispatcher({}, {}, {}, ModelInfo(
        name="m", vocab_size=VOCAB, max_model_len=512, max_request_tokens=400), num_steps=K)
    request = RoutedRequest(request_id="r", room=7, model="m", prompt_ids=prompt,
                            params=SamplingParams(), deadline=None,
                            placement=Placement(prefill_worker="p", decode_worker="d"))

    async def follow(ev: PrefillResult):
        events: asyncio.Queue = asyncio.Queue()
        events.put_nowait(("p", ev))
        flight = Flight(prefill="p", decode="d", room=7)
        return [c async for c in follow_events(request, flight, events, num_steps=K,
                                               table=dispatcher.table)]

    (chunk,) = asyncio.run(follow(result))
    assert chunk.token_ids == () and chunk.text_delta == ""
    assert chunk.finish_reason == FinishReason.STOP
    returned = PrefillResult(room=7, ok=True, first_token=5, first_text="f0", finished=True,
                             finish_reason="length")
    (chunk,) = asyncio.run(follow(returned))
    assert chunk.token_ids == (5,) and chunk.finish_reason == FinishReason.LENGTH
