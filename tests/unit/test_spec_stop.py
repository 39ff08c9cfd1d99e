"""Stop conditions inside an accepted run: with scripted all-correct drafts a round commits
k + 1 tokens at once; an EOS, stop token, stop string or max_new_tokens that falls in the
middle of them must end the request exactly there -- same tokens, text and finish reason as
the non-speculative engine -- and free its pages. Also the context limit, which a round's
verify tree would otherwise run past."""

from __future__ import annotations

from functools import cache

import pytest
from spec_helpers import (
    assert_pages_free,
    chain,
    engine_cfg,
    letter_tokenizer,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    run_ids,
    scripted_engine,
    tiny_head,
    tiny_target,
)

from tandem.engine import FinishReason, SamplingParams
from tandem.spec import SpecConfig, SpecEngine
from tandem.tokenizer import Tokenizer

K = 4  # drafts per round: after the prefill token, rounds commit tokens 1-5, 6-10, 11-15, ...
SPEC = SpecConfig(num_steps=K)


def _run_end(j: int) -> bool:
    """Whether output token j is the last of its round (so not *inside* an accepted run)."""
    return j % (K + 1) == 0


@cache
def _setup():
    model = tiny_target("llama", live=None)
    ps = tuple(tuple(p) for p in prompts(3, seed=400, lo=4))
    long = reference(model, ps, SamplingParams(max_new_tokens=40, ignore_eos=True))
    return model, ps, tuple(c.output_ids for c in long)


def _first_new_token_inside_a_run(out, start: int = 2, span: int = 1) -> int:
    """Index j >= start of a token seen for the first time at j, such that tokens j ..
    j + span - 1 are all inside one round and none ends it."""
    for j in range(start, len(out) - span):
        if out[j] not in out[:j] and not any(_run_end(i) for i in range(j, j + span)) and (
                j // (K + 1) == (j + span - 1) // (K + 1)):
            return j
    raise AssertionError(f"no fresh token inside a run in {out}")


def _compare(model, ps, params_list, refs, tokenizer=None):
    """Spec (scripted all-correct drafts) vs plain, request by request."""
    want = reference(model, ps, params_list, tokenizer=tokenizer)
    eng = scripted_engine(model, tiny_head(model, "eagle", live=None), SPEC,
                          lambda rid, out: chain(refs[int(rid.split("-")[1])][len(out):], K, K),
                          tokenizer=tokenizer)
    _, got = run_ids(eng, [list(p) for p in ps], params_list)
    for w, g in zip(want, got):
        assert tuple(g.output_ids) == w.output_ids
        assert g.text == w.text
        assert g.finish_reason == w.finish_reason
    assert all(p == tuple(range(1, K + 1)) for _, p, _ in eng.rounds)  # really all accepted
    assert_pages_free(eng)
    return want, eng


@pytest.mark.parametrize("max_new", [2, 7, 8, 9, 13])
def test_max_new_tokens_inside_an_accepted_run(max_new):
    model, ps, refs = _setup()
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    want, eng = _compare(model, ps, [params] * len(ps), refs)
    assert all(len(w.output_ids) == max_new for w in want)
    assert all(w.finish_reason == FinishReason.LENGTH for w in want)
    assert eng.spec_stats.num_rounds == len(ps) * -(-(max_new - 1) // (K + 1))


def test_a_round_feeds_its_accepted_run_to_the_detokenizer_once(monkeypatch):
    """Without stop strings a round's tokens reach the detokenizer in one feed (all but the
    last held: `SpecEngine._commit_row`): two decodes a request a round, not two a token, and
    the text is still plain decoding's (this tokenizer joins words with spaces: the decode of
    a run is not its tokens' decodes end to end)."""
    model, ps, refs = _setup()
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * len(ps)
    _compare(model, ps, params, refs, tokenizer=letter_tokenizer())  # the same text
    calls = []
    real = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, skip_special_tokens=True: (
        calls.append(len(ids)), real(self, ids, skip_special_tokens))[1])
    eng = scripted_engine(model, tiny_head(model, "eagle", live=None), SPEC,
                          lambda rid, out: chain(refs[int(rid.split("-")[1])][len(out):], K, K),
                          tokenizer=letter_tokenizer())
    _, got = run_ids(eng, [list(p) for p in ps], params)
    assert all(len(g.output_ids) == 16 for g in got)
    rounds = eng.spec_stats.num_rounds
    assert rounds == 3 * len(ps)  # 1 + 5 + 5 + 5 tokens each
    # the first token's feed, each round's, the end's flush: two decodes each at most
    assert len(calls) <= 2 * (rounds + 2 * len(ps)) < 2 * 16 * len(ps)


def test_stop_token_inside_an_accepted_run():
    model, ps, refs = _setup()
    stops = [_first_new_token_inside_a_run(out) for out in refs]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(refs[r][j],))
              for r, j in enumerate(stops)]
    want, _ = _compare(model, ps, params, refs)
    for w, j in zip(want, stops):
        assert len(w.output_ids) == j + 1 and w.finish_reason == FinishReason.STOP


def test_eos_inside_an_accepted_run():
    _, ps, refs = _setup()
    j = _first_new_token_inside_a_run(refs[0], start=3)
    eos = refs[0][j]
    model = tiny_target("llama", live=None, eos_token_id=eos)  # same weights, an EOS id
    params = SamplingParams(max_new_tokens=30)
    want, _ = _compare(model, ps, [params] * len(ps), refs)
    assert len(want[0].output_ids) == j + 1 and want[0].finish_reason == FinishReason.STOP
    # ignore_eos still runs through it
    want, _ = _compare(model, ps[:1], [SamplingParams(max_new_tokens=j + 4, ignore_eos=True)],
                       refs[:1])
    assert want[0].output_ids == refs[0][: j + 4]


def test_stop_string_inside_an_accepted_run():
    model, ps, refs = _setup()
    tok = letter_tokenizer()
    params = []
    for out in refs:
        j = _first_new_token_inside_a_run(out, span=2)
        stop = tok.decode(out[j : j + 2])[1:]  # spans two tokens: "<0 of x_j> x_{j+1}"
        assert stop not in tok.decode(out[: j + 1])
        params.append(SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
    want, _ = _compare(model, ps, params, refs, tokenizer=tok)
    for w, p in zip(want, params):
        assert w.finish_reason == FinishReason.STOP
        assert p.stop[0] not in w.text


@pytest.mark.parametrize("scripted", [True, False], ids=["all-correct", "real-drafts"])
@pytest.mark.parametrize("spec", [SPEC, SpecConfig(num_steps=3, topk=2)], ids=["chain", "tree"])
def test_context_limit_inside_a_round(spec, scripted):
    """Near max_model_len a round's verify tree would reach positions past the context --
    past the rope table, which `build_model` sizes to max_model_len (IndexError on CPU, an
    out-of-bounds read on GPU). The request must end exactly where the plain engine ends."""
    max_len = 32
    model = tiny_target("llama", live=None, max_position=max_len)  # as SpecEngine.from_config
    ps = [list(p) for p in prompts(3, seed=401, lo=10, hi=20)]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    want = reference(model, ps, params, max_model_len=max_len)
    refs = [c.output_ids + (0,) * 8 for c in want]  # drafts past the end are never verified
    script = (lambda rid, out: chain(refs[int(rid.split("-")[1])][len(out):],
                                     spec.num_steps, spec.num_steps)) if scripted else None
    head = tiny_head(model, "eagle", live=None, max_position=max_len)
    eng = scripted_engine(model, head, spec, script, max_model_len=max_len)
    _, got = run_ids(eng, ps, params)
    for w, g in zip(want, got):
        assert tuple(g.output_ids) == w.output_ids
        assert g.finish_reason == FinishReason.LENGTH
        assert len(g.prompt_ids) + len(g.output_ids) == max_len
    assert_pages_free(eng)


def test_abort_mid_generation_frees_pages_and_seeds():
    model, ps, _ = _setup()
    eng = SpecEngine(engine_cfg(), SPEC, model, tiny_head(model, "eagle", live=None))
    ids = [eng.add_request(list(p), SamplingParams(max_new_tokens=30, ignore_eos=True))
           for p in ps]
    for _ in range(3):
        eng.step()
    assert eng.seeds  # requests are mid-speculation
    assert eng.abort(ids[1])
    assert ids[1] not in eng.seeds
    while eng.has_unfinished():
        eng.step()
    assert_pages_free(eng)
