"""The engine: one model on one device group with a paged KV cache.

Public API (other packages import only these names):
"""

from tandem.engine.attention import (
    AttentionMetadata,
    BatchLayout,
    SeqSlice,
    build_metadata,
    causal_mask,
    create_backend,
    tree_mask,
)
from tandem.engine.config import ConfigError, EngineConfig, ModelConfig, SamplingFault
from tandem.engine.kv_cache import (
    KVGroupSpec,
    KVPool,
    KVRegionInfo,
    OutOfPages,
    PageAllocator,
    PageError,
)
from tandem.engine.llm import LLMEngine, validate_prompt
from tandem.engine.loader import WeightLoadError, build_model, resolve_model
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.parallel import ParallelContext, ParallelGroup
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import Completion, FinishReason, RequestOutput
from tandem.engine.runner import ForwardBatch, ForwardOutput, ModelRunner
from tandem.engine.sampling import (
    GREEDY_TEMPERATURE,
    InjectedFault,
    SampleOutput,
    Sampler,
    SamplingParams,
    target_probs,
)

__all__ = [
    "GREEDY_TEMPERATURE", "AttentionMetadata", "BatchLayout", "Completion", "ConfigError",
    "DecoderLM", "EngineConfig", "FinishReason", "ForwardBatch", "ForwardOutput",
    "InjectedFault", "KVGroupSpec", "KVPool", "KVRegionInfo", "LLMEngine", "ModelConfig",
    "ModelRunner", "OutOfPages", "PageAllocator", "PageError", "ParallelContext",
    "ParallelGroup", "PrefixCache", "RequestOutput", "SampleOutput", "Sampler",
    "SamplingFault", "SamplingParams", "SeqSlice", "WeightLoadError", "build_metadata",
    "build_model", "causal_mask", "create_backend", "resolve_model", "target_probs",
    "tree_mask", "validate_prompt",
]
