"""Automatic prefix caching (engine/prefix_cache.py): requests whose prompts share full pages
with earlier prompts reuse those pages and compute only the rest -- with outputs token-identical
to caching off (float32), pages conserved, idle cached pages evicted under page pressure before
anyone is preempted, and a speculative engine's draft KV reused only where it is valid."""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import LIVE, engine_cfg, one_thread, tiny_head, tiny_target  # noqa: F401

from tandem.engine import (
    ConfigError,
    EngineConfig,
    LLMEngine,
    PageAllocator,
    SamplingParams,
)
from tandem.engine.prefix_cache import PrefixCache
from tandem.spec import SpecConfig, SpecEngine

PS = 4  # page size of every engine here


@pytest.fixture(scope="module")
def model():
    return tiny_target("llama", live=None)  # every token reachable: varied outputs


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _engine(model, caching: bool, **kw) -> LLMEngine:
    return LLMEngine(engine_cfg(enable_prefix_caching=caching, **kw), model)


def _count_forward_tokens(eng: LLMEngine) -> list[int]:
    """Tokens run through the target, summed over forwards (the prefill work saved)."""
    count = [0]
    forward = eng.runner.forward

    def counting(batch):
        count[0] += batch.input_ids.numel()
        return forward(batch)

    eng.runner.forward = counting
    return count


def _assert_conserved(eng: LLMEngine) -> None:
    """Every page free or held by the cache alone; evicting them all frees the pool."""
    alloc, cache = eng.allocator, eng.prefix_cache
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert alloc.num_free + cache.num_pages == alloc.num_usable, "KV pages leaked"
    num_cached = cache.num_pages
    assert cache.num_evictable() == num_cached  # no holder but the cache
    assert cache.clear() == num_cached
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_usable


# ---- the owner class ------------------------------------------------------------------------


def test_keys_chain_and_lookahead():
    cache = PrefixCache(PageAllocator(16), PS)
    a, b = _tokens(10, 1), _tokens(10, 1)
    b[5] += 1  # differs in page 1
    ka, kb = cache.page_keys(a), cache.page_keys(b)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    assert cache.page_keys(a[:8] + [0, 0, 0])[:2] == ka  # later tokens do not matter
    # lookahead 1: page k's key also covers the token after it.
    ahead = PrefixCache(PageAllocator(16), PS, lookahead=1)
    assert len(ahead.page_keys(a[:8])) == 1 and len(ahead.page_keys(a[:9])) == 2
    assert ahead.page_keys(a[:8] + [1])[1] != ahead.page_keys(a[:8] + [2])[1]


def test_match_insert_evict_lru_and_holders():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    keys = cache.page_keys(_tokens(12, 2))
    pages = alloc.alloc(3)
    for k, p in zip(keys, pages):
        assert cache.insert(k, p)
    assert not cache.insert(keys[0], alloc.alloc(1)[0])  # duplicate key: stays private
    assert [alloc.refcount(p) for p in pages] == [2, 2, 2]
    assert cache.match(keys, max_pages=2) == pages[:2]
    assert cache.match([keys[0], b"x", keys[2]], max_pages=3) == pages[:1]  # a chain
    assert cache.num_evictable() == 0 and cache.evict(3) == 0  # the writer still holds them
    alloc.free(pages)
    assert cache.num_evictable() == 3
    cache.touch(pages)
    assert cache.evict(1) == 1 and cache.match(keys, 3) == pages[:2]  # the leaf went first
    assert alloc.refcount(pages[2]) == 0
    alloc.share([pages[0]])  # a request holds page 0: never evicted
    assert cache.evict(5) == 1 and cache.match(keys, 3) == pages[:1]
    assert alloc.refcount(pages[0]) == 2


def test_config_validation_and_cli_flag():
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")  # type: ignore[arg-type]
    assert EngineConfig().enable_prefix_caching is False
    import argparse

    from tandem.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--enable-prefix-caching"])).enable_prefix_caching
    assert not engine_config_from_args(p.parse_args([])).enable_prefix_caching


# ---- the engine -----------------------------------------------------------------------------


def _shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    base = _tokens(24, 3)  # 6 full pages
    batch = [
        base + _tokens(5, 4),  # the whole base cached
        base,  # an exact multiple of the page size: the last page is computed again
        base + _tokens(9, 5),
        base[:13],  # a shorter prefix: 3 pages
        list(base),  # equal to a cached prompt
        _tokens(11, 6),  # nothing in common
        base[:3],  # shorter than a page
    ]
    return base + _tokens(2, 7), batch


def test_outputs_equal_and_prefill_computes_only_the_rest(model):
    warm, batch = _shared_prefix_prompts()
    runs = {}
    for caching in (False, True):
        # A small budget: chunked prefill, several admission steps.
        eng = _engine(model, caching, max_num_batched_tokens=12)
        count = _count_forward_tokens(eng)
        first = eng.generate([warm], _greedy(6))
        before = count[0]
        outs = eng.generate(batch, _greedy(7))
        runs[caching] = (first + outs, count[0] - before, eng)
    (off, off_tokens, _), (on, on_tokens, eng) = runs[False], runs[True]
    assert [c.output_ids for c in on] == [c.output_ids for c in off]
    hits = [c.num_cached_tokens for c in on[1:]]
    # 6 pages; base: 5 (its last token is computed); base[:13]: 3; base[:3]: none. Prompts of
    # the batch can also hit pages written by earlier ones of the same batch.
    assert hits[:5] == [24, 20, 24, 12, 20] and hits[5:] == [0, 0]
    assert on[0].num_cached_tokens == 0 and all(c.num_cached_tokens == 0 for c in off)
    assert off_tokens - on_tokens == sum(hits)  # exactly the cached tokens were not computed
    s = eng.stats()
    assert s.num_prefix_hit_tokens == sum(hits)
    assert s.num_prefix_query_tokens == sum(len(p) for p in [warm] + batch)
    _assert_conserved(eng)


def test_same_batch_and_boundary_prompts(model):
    """Prompts admitted together (no hit between them), then prompts ending on a page boundary
    and one token past it."""
    p = _tokens(16, 8)
    first = [p, p + [5], p[:8]]
    second = [p, p + [5], p + [9, 1], p[:8] + [3]]
    outs = {}
    for caching in (False, True):
        eng = _engine(model, caching)
        outs[caching] = [c.output_ids for c in eng.generate(first, _greedy(5))]
        got = eng.generate(second, _greedy(5))
        outs[caching] += [c.output_ids for c in got]
        if caching:
            assert [c.num_cached_tokens for c in got] == [12, 16, 16, 8]
            _assert_conserved(eng)
    assert outs[True] == outs[False]


def test_eviction_under_page_pressure(model):
    """A pool too small for the cache and the running requests: idle cached pages are evicted
    (before preemption) and the outputs stay those of a roomy pool without caching."""
    base = _tokens(20, 9)
    waves = [[base + _tokens(3, 10 + i) for i in range(3)],
             [_tokens(22, 20 + i) for i in range(3)],  # new prompts push the old pages out
             [base + _tokens(4, 30 + i) for i in range(3)]]
    ref = _engine(model, False)
    want = [[c.output_ids for c in ref.generate(w, _greedy(8))] for w in waves]
    # 26 usable pages of 4 tokens: three requests of up to 31 tokens need 24, so every wave
    # after the first needs pages the cache holds.
    eng = _engine(model, True, num_pages=27)
    evicted = [0]
    evict = eng.prefix_cache.evict

    def counting(n):
        freed = evict(n)
        evicted[0] += freed
        return freed

    eng.prefix_cache.evict = counting
    got = [[c.output_ids for c in eng.generate(w, _greedy(8))] for w in waves]
    assert got == want
    assert evicted[0] > 0  # the pressure was real
    assert eng.scheduler.num_preemptions == 0  # idle cached pages went first
    _assert_conserved(eng)


def test_preemption_with_caching_keeps_outputs(model):
    ps = [_tokens(30, 40 + i) for i in range(4)]
    want = [c.output_ids for c in _engine(model, False).generate(ps, _greedy(16))]
    # 24 usable pages: 4 requests of 46 tokens cannot run together; preemption recomputes,
    # and a recomputed request finds its own prompt pages in the cache.
    eng = _engine(model, True, num_pages=25)
    got = eng.generate(ps, _greedy(16))
    assert [c.output_ids for c in got] == want
    assert eng.scheduler.num_preemptions > 0
    _assert_conserved(eng)


def test_a_shared_page_is_never_written(model):
    eng = _engine(model, True)
    p = _tokens(12, 11)
    eng.generate([p], _greedy(2))
    rid = eng.add_request(p + [1], _greedy(2))
    req = eng.scheduler.requests[rid]
    plan = eng.scheduler.schedule()
    assert plan.chunks[0].num_cached == 12 and plan.chunks[0].token_ids == (1,)
    # The pages it writes are its own; the cached ones have the cache as a second holder.
    assert [eng.allocator.refcount(q) for q in req.page_ids] == [2, 2, 2, 1]


# ---- speculative decoding ---------------------------------------------------------------------


def _record_drafts(eng: SpecEngine) -> tuple[dict[str, list[list[int]]], dict]:
    """Every round's draft tokens, and the draft hidden state of the seed each prefill built,
    per request: both depend on the draft KV of the whole prompt."""
    drafts: dict[str, list[list[int]]] = {}
    seeds: dict[str, torch.Tensor] = {}
    propose, prefill_step, merged_step = eng._propose, eng._prefill_step, eng._merged_prefill_step

    def recorded(finish):
        def finishing():  # the seeds are set when the step commits the prompts' tokens
            outs = finish()
            for rid, seed in eng.seeds.items():
                seeds.setdefault(rid, seed.hidden.clone())
            return outs

        return finishing

    def prefilling(plan):
        return recorded(prefill_step(plan))

    def merged(plan, verify):  # a prompt step merged with the round's verify
        finish, out = merged_step(plan, verify)
        return recorded(finish), out

    def recording(req_ids, inp, num_drafts):
        verify = propose(req_ids, inp, num_drafts)
        for rid, row in zip(req_ids, verify.tokens.tolist()):
            drafts.setdefault(rid, []).append(row)
        return verify

    eng._propose, eng._prefill_step, eng._merged_prefill_step = recording, prefilling, merged
    return drafts, seeds


@pytest.mark.parametrize("spec", [SpecConfig(num_steps=3),
                                  SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)],
                         ids=["chain", "tree"])
def test_spec_engine_with_caching_equals_plain_and_reuses_draft_kv(spec):
    target = tiny_target("llama", live=LIVE)
    head = tiny_head(target, "eagle")
    base = _tokens(24, 12)
    warm = [base + [LIVE[0], 7, 8], base + [LIVE[1]] + _tokens(6, 13)]
    # base + x: base's last page was cached with the token after it being warm's, so it can
    # only be reused by prompts continuing with that same token (lookahead 1).
    batch = [base + [LIVE[0], 9], base + [LIVE[2], 9, 9], base, list(base), base[:14],
             base + [LIVE[1]] + _tokens(6, 13)]
    params = [_greedy(10), _greedy(4), _greedy(9), _greedy(6), _greedy(8), _greedy(7)]
    plain = LLMEngine(engine_cfg(), target)
    want = [c.output_ids for c in plain.generate(warm, _greedy(5))]
    want += [c.output_ids for c in plain.generate(batch, params)]
    runs = {}
    for caching in (False, True):
        eng = SpecEngine(engine_cfg(enable_prefix_caching=caching, max_num_batched_tokens=12),
                         spec, target, head)
        drafts, seeds = _record_drafts(eng)
        outs = eng.generate(warm, _greedy(5)) + eng.generate(batch, params)
        runs[caching] = outs, drafts, seeds, eng
    (off, off_drafts, off_seeds, _), (on, on_drafts, on_seeds, eng) = runs[False], runs[True]
    assert [c.output_ids for c in on] == [c.output_ids for c in off] == want
    # The reused draft KV is the one the prompt itself would compute: the same drafts, and
    # the same seed hidden states up to float32 summation order (chunks differ).
    assert on_drafts == off_drafts
    assert on_seeds.keys() == off_seeds.keys() and len(on_seeds) == len(warm) + len(batch)
    for rid, hidden in off_seeds.items():
        torch.testing.assert_close(on_seeds[rid], hidden, rtol=1e-4, atol=1e-4, msg=rid)
    assert [c.num_cached_tokens for c in on[2:]] == [24, 20, 20, 20, 12, 28]
    assert not eng.seeds
    _assert_conserved(eng)


def test_spec_prefill_handoff_pages_shared_then_released():
    """A prefill-only engine hands off pages that the cache also holds; freeing them after the
    transfer leaves them cached, and every page is accounted for."""
    target = tiny_target("llama", live=LIVE)
    eng = SpecEngine(engine_cfg(enable_prefix_caching=True), SpecConfig(num_steps=2), target,
                     tiny_head(target, "eagle"))
    base = _tokens(17, 14)
    for i, p in enumerate([base + [1], base + [2, 3]]):
        eng.add_prefill_request(p, _greedy(4), f"r{i}")
        while eng.has_unfinished():
            eng.step()
    first, second = eng.take_handoffs()
    assert first.page_ids[:4] == second.page_ids[:4]  # the second prompt reused 4 pages
    assert [eng.allocator.refcount(p) for p in second.page_ids] == [3] * 4 + [1]
    eng.free_pages(first.page_ids)
    eng.free_pages(second.page_ids)
    _assert_conserved(eng)
