"""Parity with HF transformers (the reference implementation) on tiny random checkpoints of
every supported architecture: logits and greedy generations, float32, batched, chunked."""

from __future__ import annotations

import random

import pytest
import torch

from hf_tiny import ARCHS, save_tiny
from tandem.engine import EngineConfig, ForwardBatch, LLMEngine, SamplingParams, SeqSlice, build_metadata


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path, hf = save_tiny(request.param, tmp_path_factory.mktemp("hf"))
    return request.param, path, hf


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", num_pages=128, page_size=4)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 23))] for _ in range(num)]


def test_prefill_and_decode_logits_match_hf(tiny):
    arch, path, hf = tiny
    eng = make_engine(path)
    prompt = prompts(1, 1)[0] + [7, 9, 11]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]  # [L, V]
    pages = eng.allocator.alloc(8)
    # Prefill all but the last 3 tokens, then three single-token decode forwards.
    split = len(prompt) - 3
    got = []
    for start, end in [(0, split), (split, split + 1), (split + 1, split + 2), (split + 2, split + 3)]:
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=start, num_new=end - start)], 4)
        out = eng.runner.forward(ForwardBatch(
            input_ids=torch.tensor(prompt[start:end]), positions=lay.positions, attn=lay.attn,
            logits_indices=torch.arange(end - start)))
        got.append(out.logits)
    got = torch.cat(got)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"{arch}: logits differ")


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_generation_matches_hf(tiny, batch_size):
    arch, path, hf = tiny
    # A small token budget forces chunked prefill interleaved with decode steps.
    eng = make_engine(path, max_num_batched_tokens=8 if batch_size > 1 else 512)
    ps = prompts(batch_size, seed=batch_size)
    n = 12
    got = eng.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for p, c in zip(ps, got):
        assert list(c.output_ids) == hf_greedy(hf, p, n), f"{arch}: prompt {p}"
    assert eng.allocator.num_free == eng.allocator.num_usable  # every page back


def test_page_size_does_not_change_output(tiny):
    arch, path, _ = tiny
    ps = prompts(3, seed=5)
    outs = []
    for page_size in (1, 4, 16):
        eng = make_engine(path, page_size=page_size, num_pages=256)
        outs.append([c.output_ids for c in eng.generate(ps, SamplingParams(max_new_tokens=8,
                                                                            ignore_eos=True))])
    assert outs[0] == outs[1] == outs[2]


def test_bf16_logits_close_to_hf(tiny):
    arch, path, hf = tiny
    eng = make_engine(path, dtype="bfloat16")
    prompt = prompts(1, 2)[0]
    with torch.no_grad():
        ref = hf.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    hf.to(torch.float32)
    pages = eng.allocator.alloc(8)
    lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=len(prompt))], 4)
    out = eng.runner.forward(ForwardBatch(input_ids=torch.tensor(prompt), positions=lay.positions,
                                          attn=lay.attn, logits_indices=torch.arange(len(prompt))))
    # bf16 has 8 mantissa bits; logits of magnitude ~3 agree to a few hundredths.
    assert (out.logits - ref).abs().max().item() < 0.1, arch
