"""Prefill -> decode hand-off at the engine level: a request prefilled in one SpecEngine and
decoded in another (KV pages copied between their pools, the seed passed as bytes) yields
exactly the tokens of the colocated SpecEngine -- greedy and seeded sampling, chain and tree."""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import save_tiny
from tandem.engine import EngineConfig, SamplingParams, build_model, resolve_model
from tandem.engine.parallel import ParallelContext
from tandem.spec import DraftHeadConfig, SpecConfig, SpecEngine, dummy_head
from tandem.spec.handoff import decode_seed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path, _ = save_tiny("llama", tmp_path_factory.mktemp("hf"))
    return path


def _engine(path, spec, num_pages=128, page_size=4):
    ecfg = EngineConfig(model=str(path), dtype="float32", num_pages=num_pages, page_size=page_size)
    mcfg, p = resolve_model(ecfg)
    model = build_model(mcfg, p, ecfg, ParallelContext(), 512)
    head = dummy_head(DraftHeadConfig.like_target(mcfg, "eagle"), model, torch.float32,
                      torch.device("cpu"), 512, seed=1)
    return SpecEngine(ecfg, spec, model, head)


def _copy_pages(src: SpecEngine, src_pages, dst: SpecEngine, dst_pages) -> None:
    for group in ("target", "draft"):
        s, d = src.kv_pool.group_tensor(group), dst.kv_pool.group_tensor(group)
        d[:, list(dst_pages[: len(src_pages)])] = s[:, list(src_pages)]


def _disaggregated(path, spec, prompts, params):
    pre, dec = _engine(path, spec), _engine(path, spec, num_pages=200)
    for i, p in enumerate(prompts):
        pre.add_prefill_request(p, params[i], f"r{i}")
    results = {f"r{i}": [] for i in range(len(prompts))}
    while pre.has_unfinished():
        pre.step()
    for h in pre.take_handoffs():
        if h.finished:
            results[h.req_id] = [h.first_token]
            continue
        seed, gen_state = decode_seed(h.seed_bytes(), torch.device("cpu"), torch.float32)
        pages = dec.allocator.alloc(len(h.page_ids) + 4)
        _copy_pages(pre, h.page_ids, dec, pages)
        pre.free_pages(h.page_ids)
        idx = int(h.req_id[1:])
        out = dec.admit_prefilled(h.req_id, h.prompt_ids, params[idx], h.first_token, seed,
                                  pages, gen_state)
        results[h.req_id].extend(out.new_token_ids)
    while dec.has_unfinished():
        for o in dec.step():
            results[o.req_id].extend(o.new_token_ids)
    assert pre.allocator.num_free == pre.allocator.num_usable
    assert dec.allocator.num_free == dec.allocator.num_usable
    return [tuple(results[f"r{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("spec", [SpecConfig(num_steps=3), SpecConfig(num_steps=3, topk=2,
                                                                       num_draft_tokens=5)],
                         ids=["chain", "tree"])
def test_handoff_equals_colocated(llama_dir, spec):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 17))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_new_tokens=1, ignore_eos=True),  # finishes at prefill
              SamplingParams(max_new_tokens=15, temperature=1.2, top_k=20, seed=3,
                             ignore_eos=True)]
    colocated = [c.output_ids for c in _engine(llama_dir, spec).generate(prompts, params)]
    assert _disaggregated(llama_dir, spec, prompts, params) == colocated


def test_unseeded_sampled_requests_do_not_share_one_stream_after_the_handoff(llama_dir):
    """A seeded request goes on with the generator state it started on the prefill side; an
    unseeded one draws from the shared RNG on the decode side like any unseeded row (decode
    once seeded every unseeded request with 0: two such requests with one prompt drew the same
    tokens)."""
    spec = SpecConfig(num_steps=3)
    prompt = [5, 9, 17, 3, 8, 2, 11]
    params = [SamplingParams(max_new_tokens=24, temperature=1.5, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=1.5, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=1.5, seed=11, ignore_eos=True)]
    pre, dec = _engine(llama_dir, spec), _engine(llama_dir, spec, num_pages=200)
    for i, p in enumerate(params):
        pre.add_prefill_request(prompt, p, f"r{i}")
    while pre.has_unfinished():
        pre.step()
    gens = {}
    for h in pre.take_handoffs():
        seed, gen_state = decode_seed(h.seed_bytes(), torch.device("cpu"), torch.float32)
        assert bool(gen_state) == (h.req_id == "r2")  # only the seeded one carries a state
        pages = dec.allocator.alloc(len(h.page_ids) + 8)
        _copy_pages(pre, h.page_ids, dec, pages)
        pre.free_pages(h.page_ids)
        dec.admit_prefilled(h.req_id, h.prompt_ids, params[int(h.req_id[1:])], h.first_token,
                            seed, pages, gen_state)
        gens[h.req_id] = dec.scheduler.requests[h.req_id].generator
    assert gens["r0"] is None and gens["r1"] is None
    assert isinstance(gens["r2"], torch.Generator)
    out = {f"r{i}": [] for i in range(3)}
    torch.manual_seed(0)
    while dec.has_unfinished():
        for o in dec.step():
            out[o.req_id].extend(o.new_token_ids)
    assert out["r0"] != out["r1"]  # 24 tokens at temperature 1.5 from a 256-token vocabulary
