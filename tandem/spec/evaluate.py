"""Measuring a draft head: mean acceptance length tau (tokens per round = accepted drafts + 1)
and per-position acceptance on held-out chat prompts, with the speculative output checked
against the target alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.spec.config import SpecConfig
from tandem.spec.engine import SpecEngine
from tandem.spec.train_data import HELD_OUT_QUESTIONS
from tandem.tokenizer import ChatMessage


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadEval:
    tau: float
    tau_stderr: float  # rounds taken as independent (see SpecStats.tau_stderr)
    per_position: tuple[float, ...]
    num_rounds: int
    num_prompts: int
    num_identical: int  # answers token-identical to the target alone


def evaluate_head(engine_cfg: EngineConfig, spec: SpecConfig, max_new_tokens: int = 128,
                  questions: tuple[str, ...] = HELD_OUT_QUESTIONS) -> HeadEval:
    eng = SpecEngine.from_config(engine_cfg, spec)
    tok = eng.tokenizer
    if tok is None:
        raise ValueError("model: the target has no tokenizer.json")
    prompts = [tok.encode_chat([ChatMessage(role="user", content=q)]) for q in questions]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    spec_out = eng.generate(prompts, params)
    plain = LLMEngine(engine_cfg, eng.model, tok).generate(prompts, params)
    same = sum(a.output_ids == b.output_ids for a, b in zip(spec_out, plain))
    st = eng.spec_stats
    return HeadEval(tau=st.mean_acceptance_length, tau_stderr=st.tau_stderr(),
                    per_position=tuple(st.per_position()),
                    num_rounds=st.num_rounds, num_prompts=len(prompts), num_identical=same)


@dataclass(frozen=True, slots=True, kw_only=True)
class PartingGap:
    """How close the target's two best next tokens were where two greedy runs parted."""

    rel_gap: float  # (top-1 - top-2 logit) / max(1, |top-1 logit|)
    both_in_top2: bool  # the two runs' tokens are the two best


def parting_gap(engine: LLMEngine, context: Sequence[int], pair: tuple[int, int]) -> PartingGap:
    """After `context` the runs chose the tokens of `pair`. In bf16 a verify over N tokens and a
    1-token decode round differently, so greedy runs may part where the gap is a small fraction
    of the logit scale (docs/architecture.md, "Lossless"); anything else is a bug."""
    top = engine.next_token_logits(context).topk(2)
    gap = float(top.values[0] - top.values[1]) / max(1.0, float(top.values[0].abs()))
    return PartingGap(rel_gap=gap, both_in_top2=set(pair) <= set(top.indices.tolist()))
