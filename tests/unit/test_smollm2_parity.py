"""The real default model against HF transformers: float32 greedy generations are
token-identical for chat prompts at batch sizes 1, 3 and 8 (mixed lengths, chunked prefill),
and bf16 logits stay close."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.tokenizer import ChatMessage, Tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "How do I reverse a list in Python?",
    "Name three primary colors.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give one tip for better sleep.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    return [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, chat_prompts):
    out = []
    for p in chat_prompts:
        ids = hf_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def engine_fp32(smollm2_dir):
    return LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                              num_pages=512, max_num_batched_tokens=48))


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_float32_greedy_equals_hf(engine_fp32, chat_prompts, hf_greedy, batch_size):
    got = engine_fp32.generate(chat_prompts[:batch_size],
                               SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for i, c in enumerate(got):
        assert list(c.output_ids) == hf_greedy[i], QUESTIONS[i]
    assert engine_fp32.allocator.num_free == engine_fp32.allocator.num_usable


def test_bfloat16_logits_close(smollm2_dir, hf_model, chat_prompts):
    from tandem.engine import ForwardBatch, SeqSlice, build_metadata

    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="bfloat16",
                                             num_pages=64))
    p = chat_prompts[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([p])).logits[0]  # float32 reference
    lay = build_metadata([SeqSlice(page_ids=eng.allocator.alloc(8), num_cached=0,
                                   num_new=len(p))], 16)
    out = eng.runner.forward(ForwardBatch(input_ids=torch.tensor(p), positions=lay.positions,
                                          attn=lay.attn, logits_indices=torch.arange(len(p))))
    # bf16 weights and activations vs the float32 model: relative error of a few percent of the
    # logit scale, and the same argmax at every position where float32 has a clear winner.
    scale = ref.abs().max().item()
    assert (out.logits - ref).abs().max().item() < 0.05 * scale
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert torch.equal(out.logits.argmax(-1)[clear], ref.argmax(-1)[clear])
