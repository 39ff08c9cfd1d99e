"""Log-probabilities in the engines (messages/logprobs.py's rule: the log-softmax of the target's
raw logits, float32, at the token's position, whatever the sampling settings).

- plain engine: each returned token's logprob is the reference value -- `next_token_logits` of
  the committed prefix, log-softmaxed -- greedy (where it is the row's maximum) and sampled
  (where it is NOT the tempered or truncated distribution's); the top-k are that row's k
  largest, sorted; a request that does not ask gets none and a batch where none asks computes
  none; a token a stop string drops takes its logprob with it;
- speculative engine: token for token equal to plain decoding's in float32 (greedy, chain and
  tree, every acceptance pattern: none, some, all; the device acceptance path and the host
  walk of a mixed batch), and equal to the reference when sampling (the bonus token drawn
  from the residual distribution included);
- validation: top_logprobs in [0, 20], and only with logprobs.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from spec_helpers import (
    LIVE,
    chain,
    comb,
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

import tandem.engine.sampling as sampling
from tandem.engine import LLMEngine, SamplingParams
from tandem.messages import TokenLogprob
from tandem.spec import SpecConfig, SpecEngine

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


def test_a_token_dropped_by_a_stop_string_takes_its_logprob_with_it():
    model = _target()
    prompt = _prompts(1)[0]
    free = reference(model, [prompt], _asking(12))[0]
    tok = letter_tokenizer()
    word = tok.decode([free.output_ids[5]])
    done = reference(model, [prompt], _asking(12, stop=(word,)), tokenizer=tok)[0]
    assert len(done.logprobs) == len(done.output_ids) < len(free.output_ids)
    _same_logprobs(done.logprobs, free.logprobs[: len(done.output_ids)])


# ---- speculative engine ---------------------------------------------------------------------

SPECS = {  # drafted by a real head
    "chain3": SpecConfig(num_steps=3),
    "tree3x2n6": SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
}
SCRIPTED = {  # drafted by a script: `comb` trees of 3 levels use 8 of the tree's 10 nodes
    "chain3": SpecConfig(num_steps=3),
    "tree3x3": SpecConfig(num_steps=3, topk=3),
}


def _plain(model, ps, params):
    return reference(model, ps, params, max_num_batched_tokens=16)


@pytest.mark.parametrize("accepted", [0, 1, 3])
@pytest.mark.parametrize("config", SCRIPTED)
def test_speculative_logprobs_equal_plain_decoding_greedy(config, accepted):
    """Scripted drafts: the first `accepted` of each round right (0: only bonus tokens, 3:
    every draft), so the values come from every kind of verify position."""
    model = _target()
    ps = _prompts(3)
    params = [_asking(13 - i, top=5) for i in range(3)]
    want = _plain(model, ps, params)
    refs = {f"req-{i}": c.output_ids for i, c in enumerate(want)}
    spec = SCRIPTED[config]
    k = spec.num_steps

    def script(rid, out):
        ref = list(refs[rid][len(out):]) + [0] * (k + 1)
        if spec.topk == 1:
            return chain(ref, k, accepted)
        return comb(ref, 3, 2, accepted, sibling=(1, 0, 1))

    eng = scripted_engine(model, tiny_head(model, live=None), spec, script,
                          max_num_batched_tokens=16)
    _, reqs = run_ids(eng, ps, params)
    for c, req in zip(want, reqs):
        assert tuple(req.output_ids) == c.output_ids
        _same_logprobs(tuple(req.output_logprobs), c.logprobs)
    assert any(len(path) == accepted for _, path, _ in eng.rounds)


@pytest.mark.parametrize("config", SPECS)
def test_speculative_logprobs_equal_plain_with_a_real_head(config):
    """The live-restricted target and a random head: natural acceptance patterns. Tied logits
    (the target's zero rows) make the order of equal alternatives arbitrary: values compared,
    ids where the value is not tied."""
    model = _target(live=True)
    ps = _prompts(4)
    params = [_asking(16, top=3)] * 4
    want = _plain(model, ps, params)
    eng = SpecEngine(engine_cfg(max_num_batched_tokens=16), SPECS[config], model,
                     tiny_head(model))
    got = eng.generate(ps, params)
    assert eng.spec_stats.num_tokens > eng.spec_stats.num_rounds  # some drafts accepted
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=TOL)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=TOL)
            if a.top_logprobs[0] - a.top_logprobs[1] > 1e-4:
                assert a.top_ids[0] == b.top_ids[0]


def test_speculative_rounds_compute_no_logprobs_when_none_asks(monkeypatch):
    """The speculative hot path: with no request asking, neither the device acceptance nor
    the host walk computes a log-softmax or a top-K (greedy and sampled batches alike)."""
    import importlib

    calls = []
    # The modules, not the function `accept`: the host walk's and the device acceptance's.
    for module, name in (("tandem.spec.accept", "pick_logprobs"),
                         ("tandem.spec.device_accept", "gather_logprobs")):
        mod = importlib.import_module(module)
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, **kw: calls.append(1) or _r(*a, **kw))
    model = _target()
    eng = SpecEngine(engine_cfg(max_num_batched_tokens=16), SPECS["tree3x2n6"], model,
                     tiny_head(model))
    eng.generate(_prompts(2), [SamplingParams(max_new_tokens=8, ignore_eos=True),
                               SamplingParams(max_new_tokens=8, ignore_eos=True,
                                              temperature=0.9, seed=1)])
    eng.generate(_prompts(2), SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert eng.spec_stats.num_rounds > 0 and calls == []
    eng.generate(_prompts(2), _asking(4))  # the spies see an asking batch
    assert calls


def test_speculative_mixed_batch_host_walk():
    """A sampled request in the batch sends every row through the host walk: greedy rows there
    still equal plain decoding; the sampled row (a request that does not ask beside it too)
    equals the reference, whether its bonus was drawn from the residual distribution or not."""
    model = _target()
    ps = _prompts(3)
    greedy = _asking(12, top=4)
    sampled = _asking(12, top=4, temperature=0.9, seed=11)
    silent = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=3)
    want = _plain(model, ps[:1], [greedy])[0]
    eng = SpecEngine(engine_cfg(max_num_batched_tokens=16), SPECS["tree3x2n6"], model,
                     tiny_head(model))
    got = eng.generate(ps, [greedy, sampled, silent])
    assert got[0].output_ids == want.output_ids
    _same_logprobs(got[0].logprobs, want.logprobs)
    _check_against_reference(model, ps[1], got[1].output_ids, got[1].logprobs, top=4)
    assert got[2].logprobs == ()


def test_speculative_sampled_logprobs_equal_the_reference():
    # top_k 4: the live tokens the random head proposes, so drafts get accepted and rejected
    # (then the bonus is drawn from the residual distribution)
    model = _target(live=True)
    ps = _prompts(2)
    params = [_asking(14, top=2, temperature=1.0, top_k=4, seed=s) for s in (1, 2)]
    eng = SpecEngine(engine_cfg(max_num_batched_tokens=16), SPECS["chain3"], model,
                     tiny_head(model))
    got = eng.generate(ps, params)
    assert eng.spec_stats.num_tokens > eng.spec_stats.num_rounds
    for prompt, c in zip(ps, got):
        ref = _reference_rows(model, prompt, c.output_ids)
        for i, (t, lp) in enumerate(zip(c.output_ids, c.logprobs)):
            assert lp.logprob == pytest.approx(ref[i, t].item(), abs=TOL)
            assert lp.top_logprobs == pytest.approx(ref[i].topk(2).values.tolist(), abs=TOL)


# ---- validation ------------------------------------------------------------------------------


def test_top_logprobs_is_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"^top_logprobs: must be in \[0, 20\], got 21"):
        SamplingParams(logprobs=True, top_logprobs=21)
    with pytest.raises(ValueError, match=r"^top_logprobs: must be in \[0, 20\], got -1"):
        SamplingParams(logprobs=True, top_logprobs=-1)
    with pytest.raises(ValueError, match=r"^top_logprobs: needs logprobs"):
        SamplingParams(top_logprobs=2)
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20


# ---- hand-off: the first token's logprob travels with the seed -------------------------------


def test_seed_carries_the_first_logprob_only_when_asked():
    from tandem.spec.handoff import decode_first_logprob, decode_seed, encode_seed, seed_nbytes
    from tandem.spec.phases import DraftSeed

    seed = DraftSeed(num_cached=7, last_token=42, topk_ids=torch.tensor([1, 2, 3]),
                     topk_logp=torch.tensor([-0.1, -0.2, -0.3]), hidden=torch.randn(64))
    plain = encode_seed(seed, b"\x01\x02")
    assert decode_first_logprob(plain) is None
    lp = TokenLogprob(token_id=42, logprob=-0.5, top_ids=tuple(range(20)),
                      top_logprobs=tuple(-0.25 * i for i in range(20)))
    full = encode_seed(seed, b"\x01\x02", lp)
    assert decode_first_logprob(full) == lp
    got, gen_state = decode_seed(full, torch.device("cpu"), torch.float32)
    assert gen_state == b"\x01\x02" and got.last_token == 42
    assert len(encode_seed(seed, b"\x00" * 5056, lp)) <= seed_nbytes(3, 64)
    with pytest.raises(ValueError, match="seed: bad logprob section"):
        decode_first_logprob(full[:-4])


def test_handoff_logprobs_equal_colocated():
    """A request prefilled in one SpecEngine and decoded in another (pages copied, the seed as
    bytes) returns the colocated engine's logprobs; the decode side's first output carries the
    first token's from the seed, equal to the prefill side's."""
    from tandem.spec.handoff import decode_first_logprob, decode_seed

    model = _target()
    spec = SPECS["chain3"]
    ps = _prompts(3)
    params = [_asking(10, top=3), _asking(8, top=0, temperature=0.8, seed=4),
              SamplingParams(max_new_tokens=8, ignore_eos=True)]
    colocated = SpecEngine(engine_cfg(), spec, model, tiny_head(model)).generate(ps, params)
    pre = SpecEngine(engine_cfg(), spec, model, tiny_head(model))
    dec = SpecEngine(engine_cfg(), spec, model, tiny_head(model))
    for i, p in enumerate(ps):
        pre.add_prefill_request(p, params[i], f"r{i}")
    while pre.has_unfinished():
        pre.step()
    got: dict[str, list[TokenLogprob]] = {}
    for h in pre.take_handoffs():
        payload = h.seed_bytes()
        seed, gen_state = decode_seed(payload, torch.device("cpu"), torch.float32)
        first = decode_first_logprob(payload)
        assert first == h.first_logprob
        pages = dec.allocator.alloc(len(h.page_ids) + 4)
        for group in ("target", "draft"):
            dst, src = dec.kv_pool.group_tensor(group), pre.kv_pool.group_tensor(group)
            dst[:, pages[: len(h.page_ids)]] = src[:, list(h.page_ids)]
        pre.free_pages(h.page_ids)
        out = dec.admit_prefilled(h.req_id, h.prompt_ids, params[int(h.req_id[1:])],
                                  h.first_token, seed, pages, gen_state, first)
        assert out.logprobs == ((first,) if first is not None else ())
        got[h.req_id] = list(out.logprobs)
    while dec.has_unfinished():
        for o in dec.step():
            got[o.req_id] += o.logprobs
    for i, c in enumerate(colocated):
        _same_logprobs(tuple(got[f"r{i}"]), c.logprobs)
    assert colocated[2].logprobs == () and len(colocated[0].logprobs) == 10
