"""Overlap scheduling on the GPU (engine/overlap.py): with CUDA graphs and FlashInfer, the
engine that launches step n+1 before reading step n gives the tokens of the engine that reads
every step at once -- greedy, stop tokens, mixed lengths, a context limit, logprobs -- up to
bf16 near-ties (a wasted row changes a step's batch, and so its rounding), seeded sampling is
reproducible, and every page comes back."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from near_ties import assert_parts_only_at_near_ties, first_parting  # noqa: E402


def _engine(overlap: bool) -> LLMEngine:
    eng = LLMEngine.from_config(EngineConfig(
        model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16",
        cuda_graphs=True, max_num_seqs=8, max_model_len=160, kv_cache_bytes=256 << 20,
        max_num_batched_tokens=96, overlap_schedule=overlap))
    assert eng.overlap is overlap and eng.graphs is not None
    return eng


def test_overlap_gives_the_tokens_of_the_synchronous_engine():
    on, off = _engine(True), _engine(False)
    vocab = on.model_cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (4 + 13 * i,), generator=g).tolist() for i in range(7)]
    ref = off.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    stop = ref[1].output_ids[6]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 40)]
    params += [SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(stop,)),
               SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=11),
               SamplingParams(max_new_tokens=200, ignore_eos=True),  # the context ends it
               SamplingParams(max_new_tokens=25, ignore_eos=True, logprobs=True,
                              top_logprobs=2)]
    a, b = on.generate(prompts, params), off.generate(prompts, params)
    greedy_rows = [i for i in range(len(prompts)) if i != 4]  # 4 samples: reproducible below
    assert_parts_only_at_near_ties(off, [prompts[i] for i in greedy_rows],
                                   [a[i].output_ids for i in greedy_rows],
                                   [b[i].output_ids for i in greedy_rows])
    for i in greedy_rows:
        if first_parting(a[i].output_ids, b[i].output_ids) is None:
            assert len(a[i].output_ids) == len(b[i].output_ids)
    assert [len(c.output_ids) for c in a[:3]] == [1, 2, 40]
    assert len(a[5].prompt_ids) + len(a[5].output_ids) == 160
    assert len(a[6].logprobs) == len(a[6].output_ids) == 25
    again = on.generate(prompts, params)
    assert [c.output_ids for c in again] == [c.output_ids for c in a]
    for eng in (on, off):
        assert eng.allocator.num_free == eng.allocator.num_usable and not eng.has_unfinished()
