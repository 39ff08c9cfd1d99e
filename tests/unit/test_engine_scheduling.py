"""Continuous batching, page pressure (preemption), sampling and stop conditions."""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import save_tiny
from tandem.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path, _ = save_tiny("llama", tmp_path_factory.mktemp("hf"))
    return path


def _engine(path, **kw):
    cfg = dict(model=str(path), dtype="float32", num_pages=256, page_size=4)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(n)]


def test_alone_equals_batched_with_late_arrivals(llama_dir):
    ps = _prompts(6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = [_engine(llama_dir).generate([p], params)[0].output_ids for p in ps]
    eng = _engine(llama_dir, max_num_batched_tokens=16)
    ids = [eng.add_request(p, params) for p in ps[:3]]
    results: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            results[out.req_id].extend(out.new_token_ids)
        steps += 1
        if steps == 4:  # requests arriving while others run
            for p in ps[3:]:
                i = eng.add_request(p, params)
                ids.append(i)
                results[i] = []
    assert [tuple(results[i]) for i in ids] == alone


def test_page_pressure_preempts_and_every_request_finishes(llama_dir):
    ps = _prompts(8, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    roomy = _engine(llama_dir).generate(ps, params)
    # 24 usable pages of 4 tokens cannot hold 8 requests of up to 36 tokens at once.
    tight = _engine(llama_dir, num_pages=25)
    got = tight.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in roomy]
    assert all(c.finish_reason == FinishReason.LENGTH for c in got)
    assert tight.scheduler.num_preemptions > 0  # the pressure was real
    assert tight.allocator.num_free == tight.allocator.num_usable


def test_abort_frees_pages(llama_dir):
    eng = _engine(llama_dir)
    a = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=50))
    b = eng.add_request([4, 5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.abort(a) and not eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.num_usable
    assert b not in eng.scheduler.requests


def test_seeded_sampling_is_reproducible_and_batch_independent(llama_dir):
    ps = _prompts(3, seed=7)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _engine(llama_dir).generate([ps[0]], sp)[0].output_ids
    batched = _engine(llama_dir).generate(ps, [sp, SamplingParams(max_new_tokens=5, temperature=0.7),
                                               SamplingParams(max_new_tokens=9)])
    assert batched[0].output_ids == alone
    other = _engine(llama_dir).generate([ps[0]], SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0].output_ids
    assert other != alone


def test_only_seeded_requests_get_their_own_generator(llama_dir):
    """An unseeded sampled request has no generator, so the sampler draws it with the other
    unseeded rows in one batched draw (the engine once gave every sampled request a generator
    seeded from a base generator: no row was ever batched, and on CUDA the base draw failed --
    torch.randint with a CUDA generator needs device=)."""
    eng = _engine(llama_dir)
    p = _prompts(1, seed=3)[0]
    unseeded = eng.add_request(p, SamplingParams(max_new_tokens=4, temperature=0.8))
    seeded = eng.add_request(p, SamplingParams(max_new_tokens=4, temperature=0.8, seed=5))
    greedy = eng.add_request(p, SamplingParams(max_new_tokens=4))
    gens = {r: eng.scheduler.requests[r].generator for r in (unseeded, seeded, greedy)}
    assert gens[unseeded] is None and gens[greedy] is None
    assert isinstance(gens[seeded], torch.Generator)
    while eng.has_unfinished():
        eng.step()


def test_top_k_one_is_greedy_and_stop_token_stops(llama_dir):
    p = _prompts(1, seed=11)[0]
    greedy = _engine(llama_dir).generate([p], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    topk1 = _engine(llama_dir).generate([p], SamplingParams(
        max_new_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert topk1.output_ids == greedy.output_ids
    stop_tok = greedy.output_ids[3]
    first = greedy.output_ids.index(stop_tok)
    stopped = _engine(llama_dir).generate([p], SamplingParams(
        max_new_tokens=8, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert stopped.output_ids == greedy.output_ids[: first + 1]
    assert stopped.finish_reason == FinishReason.STOP


def test_target_probs_filters():
    from tandem.engine import target_probs

    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert p.tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p.tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.4))
    assert p.tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    p = target_probs(logits, SamplingParams(temperature=0.0))
    assert p.tolist() == [1, 0, 0, 0]


def test_unseeded_rows_sample_together_each_from_its_own_distribution():
    """Sampler: rows without a generator are drawn in one batched draw per setting; each row
    still follows its own filtered distribution (a chi-square-like bound on 6,000 draws), a
    seeded row in the same batch draws alone (same tokens as without the others), greedy rows
    take the argmax."""
    from tandem.engine.sampling import Sampler, target_probs

    torch.manual_seed(0)
    dists = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    logits = torch.log(dists)
    warm = SamplingParams(temperature=1.0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.7)
    params = [warm, nucleus, warm, SamplingParams(temperature=0.0)]
    rows = torch.cat([logits, logits[:1]])  # row 3: greedy over dists[0]
    counts = torch.zeros(3, 4)
    n = 6000
    sampler = Sampler()
    for _ in range(n):
        tok = sampler.sample(rows, params, [None] * 4).tokens
        assert tok[3] == 0  # greedy
        counts[torch.arange(3), tok[:3]] += 1
    expect = torch.stack([target_probs(logits[i], params[i]) for i in range(3)]) * n
    assert expect[1].tolist() == pytest.approx([0, 0, 3 / 7 * n, 4 / 7 * n])  # top_p 0.7
    chi2 = ((counts - expect) ** 2 / expect.clamp(min=1e-9)).masked_fill(expect == 0, 0).sum(1)
    assert (counts[expect == 0] == 0).all()  # a filtered token is never drawn
    assert (chi2 < 16.3).all(), chi2  # 3 degrees of freedom, p = 0.001

    def seeded_alone_and_mixed():
        g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        alone = [sampler.sample(logits[1:2], [warm], [g1]).tokens[0].item() for _ in range(50)]
        mixed = [sampler.sample(logits, [warm, warm, warm], [None, g2, None]).tokens[1].item()
                 for _ in range(50)]
        return alone, mixed

    alone, mixed = seeded_alone_and_mixed()
    assert alone == mixed


@pytest.mark.parametrize("num_pages", [256, 14])  # 14: page pressure, rows left out
def test_the_count_of_prompts_left_part_done_is_exact_after_every_step(llama_dir, num_pages):
    """`Scheduler.num_partial` (what decides whether the next plan sorts decoding rows before
    prefill chunks, and what the speculative scheduler prices a step by) equals the running
    requests still mid-prompt after each step: chunked prompts, budgets that run out, rows
    left out for pages, preemption."""
    eng = _engine(llama_dir, num_pages=num_pages, max_num_batched_tokens=7)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ps = _prompts(8, seed=4)
    for p in ps[:5]:
        eng.add_request(p, params)
    seen = set()
    for step in range(400):
        if not eng.has_unfinished():
            break
        if step == 3:
            for p in ps[5:]:
                eng.add_request(p, params)
        eng.step()
        s = eng.scheduler
        partial = sum(r.num_tokens - r.num_computed > 1 for r in s.running)
        assert s.num_partial == partial, step
        seen.add(partial)
    assert not eng.has_unfinished() and max(seen) >= 1  # prompts were left part-done
    assert (eng.scheduler.num_preemptions > 0) == (num_pages == 14)
    assert eng.allocator.num_free == eng.allocator.num_usable
