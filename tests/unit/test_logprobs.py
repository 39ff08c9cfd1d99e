"""Log-probabilities in the engines (messages/logprobs.py's rule: the log-softmax of the target's
raw logits, float32, at the token's position, whatever the sampling settings).

- plain engine: each returned token's logprob is the reference value -- `next_token_logits` of
  the committed prefix, log-softmaxed -- greedy (where it is the row's maximum) and sampled
  (where it is NOT the tempered or truncated distribution's); the top-k are that row's k
  largest, sorted; a request that does not ask gets none and a batch where none asks computes
  none; a token a stop string drops takes its logprob with it;
- validation: top_logprobs in [0, 20], and only with logprobs.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from spec_helpers import (
    LIVE,
    VOCAB,
    engine_cfg,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    tiny_target,
)

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

import tandem.engine.sampling as sampling
from tandem.engine import LLMEngine, SamplingParams
from tandem.messages import TokenLogprob
from tandem.tokenizer import Tokenizer

TOL = 1e-5  # float32: a verify forward is not bit-identical to one-token forwards


@cache
def _target(live: bool = False):
    return tiny_target("llama", live=LIVE if live else None)


@cache
def _prompts(n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in prompts(n, seed=700 + n, lo=3, hi=12))


def _asking(n: int, top: int = 5, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_new_tokens=n, logprobs=True, top_logprobs=top, **kw)


def _reference_rows(model, prompt, output_ids) -> torch.Tensor:
    """[len(output_ids), V] float32: log-softmax of the target's raw logits before each output
    token, from one prefill forward per prefix (the oracle)."""
    eng = LLMEngine(engine_cfg(), model)
    return torch.stack([torch.log_softmax(eng.next_token_logits(list(prompt) + list(
        output_ids[:i])), dim=-1) for i in range(len(output_ids))])


def _check_against_reference(model, prompt, output_ids, lps: tuple[TokenLogprob, ...],
                             top: int) -> None:
    assert len(lps) == len(output_ids)
    ref = _reference_rows(model, prompt, output_ids)
    for i, (tok, lp) in enumerate(zip(output_ids, lps)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=TOL), f"token {i}"
        want_lp, _ = ref[i].topk(top)
        assert len(lp.top_ids) == len(lp.top_logprobs) == top
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_logprobs == pytest.approx(want_lp.tolist(), abs=TOL)
        # the ids name the values (ties aside: the tiny model has none among its top few)
        assert [ref[i, t].item() for t in lp.top_ids] == pytest.approx(lp.top_logprobs, abs=TOL)


def _same_logprobs(got: tuple[TokenLogprob, ...], want: tuple[TokenLogprob, ...]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_id == w.token_id, f"token {i}"
        assert g.logprob == pytest.approx(w.logprob, abs=TOL), f"token {i}"
        assert g.top_ids == w.top_ids, f"token {i}"
        assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=TOL), f"token {i}"


# ---- plain engine ---------------------------------------------------------------------------


def test_greedy_token_logprob_is_the_row_maximum_and_top_k_sorted():
    model = _target()
    ps = _prompts(3)
    done = reference(model, ps, _asking(10, top=4))
    for prompt, c in zip(ps, done):
        _check_against_reference(model, prompt, c.output_ids, c.logprobs, top=4)
        for lp in c.logprobs:  # greedy: the token is the most likely one
            assert lp.top_ids[0] == lp.token_id
            assert lp.logprob == lp.top_logprobs[0]


def test_sampled_token_logprob_is_the_raw_distribution_not_the_processed_one():
    model = _target()
    ps = _prompts(2)
    params = _asking(12, top=3, temperature=0.7, top_p=0.8, top_k=20, seed=5)
    done = reference(model, ps, params)
    for prompt, c in zip(ps, done):
        _check_against_reference(model, prompt, c.output_ids, c.logprobs, top=3)
    # the processed distribution would put most tokens above their raw logprob: proves the
    # check can tell the two apart
    lps = [lp.logprob for c in done for lp in c.logprobs]
    ref = _reference_rows(model, ps[0], done[0].output_ids)
    processed = torch.log_softmax(ref / 0.7, dim=-1)
    assert any(abs(processed[i, t].item() - lp.logprob) > 1e-2
               for i, (t, lp) in enumerate(zip(done[0].output_ids, done[0].logprobs)))
    assert all(v <= 0 for v in lps)


def test_logprobs_without_alternatives_and_requests_that_do_not_ask():
    model = _target()
    ps = _prompts(3)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True),
              _asking(6, top=20)]
    done = reference(model, ps, params)
    assert all(lp.top_ids == () and lp.top_logprobs == () for lp in done[0].logprobs)
    assert len(done[0].logprobs) == 6
    assert done[1].logprobs == ()
    assert all(len(lp.top_ids) == 20 for lp in done[2].logprobs)
    _check_against_reference(model, ps[2], done[2].output_ids, done[2].logprobs, top=20)


def test_a_batch_where_none_asks_computes_none(monkeypatch):
    calls = []
    real = sampling.gather_logprobs
    monkeypatch.setattr(sampling, "gather_logprobs",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = _target()
    reference(model, _prompts(2), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert calls == []
    logits = torch.randn(3, 256)
    tokens = logits.argmax(-1)
    plain = SamplingParams()
    assert sampling.sampled_logprobs(logits, tokens, [plain] * 3) is None
    rows = sampling.sampled_logprobs(logits, tokens, [plain, _asking(1, top=2), plain])
    assert rows is not None and rows.rows == (1,) and rows.chosen.shape == (1,)
    assert calls == [1]


def _word_tokenizer() -> Tokenizer:
    """One two-character word per id ("a0", "b0", ...), joined by spaces when decoded."""
    vocab = {f"{chr(97 + i % 26)}{i // 26}": i for i in range(VOCAB)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="a0"))
    return Tokenizer(tokenizer=hf, chat_template=None, special_tokens={})


def test_a_token_dropped_by_a_stop_string_takes_its_logprob_with_it():
    model = _target()
    prompt = _prompts(1)[0]
    free = reference(model, [prompt], _asking(12))[0]
    tok = _word_tokenizer()
    word = tok.decode([free.output_ids[5]])
    done = reference(model, [prompt], _asking(12, stop=(word,)), tokenizer=tok)[0]
    assert len(done.logprobs) == len(done.output_ids) < len(free.output_ids)
    _same_logprobs(done.logprobs, free.logprobs[: len(done.output_ids)])


# ---- validation ------------------------------------------------------------------------------


def test_top_logprobs_is_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"^top_logprobs: must be in \[0, 20\], got 21"):
        SamplingParams(logprobs=True, top_logprobs=21)
    with pytest.raises(ValueError, match=r"^top_logprobs: must be in \[0, 20\], got -1"):
        SamplingParams(logprobs=True, top_logprobs=-1)
    with pytest.raises(ValueError, match=r"^top_logprobs: needs logprobs"):
        SamplingParams(top_logprobs=2)
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20
