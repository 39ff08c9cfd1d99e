"""The engine: one model on one device group with a paged KV cache.

Public API (other packages import only these names). The names load on first use (PEP 562), so
that importing one module of the engine does not load the model code through this file. The
request vocabulary (`SamplingParams`, `FinishReason`) is defined in `tandem.messages` and offered
here too; the tokenizer (`tandem.tokenizer`) and the request timelines (`tandem.trace`), which
the router shares, live outside the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {  # public name -> the module that defines it
    "AttentionMetadata": "tandem.engine.attention",
    "BatchLayout": "tandem.engine.attention",
    "Completion": "tandem.engine.request",
    "ConfigError": "tandem.engine.config",
    "DecoderLM": "tandem.engine.models.decoder",
    "EngineConfig": "tandem.engine.config",
    "FinishReason": "tandem.engine.request",
    "ForwardBatch": "tandem.engine.runner",
    "ForwardOutput": "tandem.engine.runner",
    "GREEDY_TEMPERATURE": "tandem.engine.sampling",
    "HostCopy": "tandem.engine.d2h",
    "HostLogprobs": "tandem.engine.logprobs",
    "InjectedFault": "tandem.engine.sampling",
    "KVGroupSpec": "tandem.engine.kv_cache",
    "KVPool": "tandem.engine.kv_cache",
    "KVRegionInfo": "tandem.engine.kv_cache",
    "LLMEngine": "tandem.engine.llm",
    "LogprobRows": "tandem.engine.logprobs",
    "ModelConfig": "tandem.engine.config",
    "ModelRunner": "tandem.engine.runner",
    "OutOfPages": "tandem.engine.kv_cache",
    "PageAllocator": "tandem.engine.kv_cache",
    "PageError": "tandem.engine.kv_cache",
    "PoolTooSmall": "tandem.engine.request",
    "ParallelContext": "tandem.engine.parallel",
    "ParallelGroup": "tandem.engine.parallel",
    "PrefixCache": "tandem.engine.prefix_cache",
    "RequestOutput": "tandem.engine.request",
    "SampleOutput": "tandem.engine.sampling",
    "Sampler": "tandem.engine.sampling",
    "SamplingFault": "tandem.engine.config",
    "SamplingParams": "tandem.engine.sampling",
    "SeqSlice": "tandem.engine.attention",
    "WeightLoadError": "tandem.engine.loader",
    "build_metadata": "tandem.engine.attention",
    "build_model": "tandem.engine.loader",
    "causal_mask": "tandem.engine.attention",
    "create_backend": "tandem.engine.attention",
    "gather_logprobs": "tandem.engine.logprobs",
    "resolve_model": "tandem.engine.loader",
    "target_probs": "tandem.engine.sampling",
    "tree_mask": "tandem.engine.attention",
    "validate_prompt": "tandem.engine.request",
}

__all__ = [
    "GREEDY_TEMPERATURE", "AttentionMetadata", "BatchLayout", "Completion", "ConfigError",
    "DecoderLM", "EngineConfig", "FinishReason", "ForwardBatch", "ForwardOutput", "HostCopy",
    "HostLogprobs", "InjectedFault", "KVGroupSpec", "KVPool", "KVRegionInfo", "LLMEngine",
    "LogprobRows", "ModelConfig", "ModelRunner", "OutOfPages", "PageAllocator", "PageError",
    "ParallelContext", "ParallelGroup", "PoolTooSmall", "PrefixCache", "RequestOutput",
    "SampleOutput", "Sampler", "SamplingFault", "SamplingParams", "SeqSlice",
    "WeightLoadError", "build_metadata", "build_model", "causal_mask", "create_backend",
    "gather_logprobs", "resolve_model", "target_probs", "tree_mask", "validate_prompt",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem.engine' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
