"""Measuring a draft head: mean acceptance length tau (tokens per round = accepted drafts + 1)
and per-position acceptance on held-out chat prompts, with the speculative output checked
against the target alone."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.engine.tokenizer import ChatMessage
from tandem.spec.config import SpecConfig
from tandem.spec.engine import SpecEngine
from tandem.spec.train_data import HELD_OUT_QUESTIONS


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
