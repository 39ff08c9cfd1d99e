"""EAGLE speculative decoding: draft heads, phase values, drafting (chain and tree),
verification (greedy and lossless rejection sampling), draft-extend, the scheduling of rounds,
and the colocated speculative engine."""

from tandem.spec.accept import accept
from tandem.spec.config import SpecConfig
from tandem.spec.cuda_graphs import SpecGraphRunner
from tandem.spec.draft_runner import DRAFT_GROUP, DraftRunner, draft_kv_group
from tandem.spec.engine import SpecEngine, target_features
from tandem.spec.extend import (
    compact_accepted_path,
    draft_extend,
    draft_prefill,
    make_extend_input,
)
from tandem.spec.head import EagleHead, dummy_head, load_head
from tandem.spec.head_config import DraftHeadConfig, DraftHeadError
from tandem.spec.phases import (
    DraftExtendInput,
    DraftInput,
    DraftSeed,
    RoundInput,
    VerifyInput,
    VerifyResult,
)
from tandem.spec.propose import propose
from tandem.spec.scheduler import SpecScheduler
from tandem.spec.stats import SpecStats

__all__ = [
    "DRAFT_GROUP", "DraftExtendInput", "DraftHeadConfig", "DraftHeadError", "DraftInput",
    "DraftRunner", "DraftSeed", "EagleHead", "RoundInput", "SpecConfig", "SpecEngine",
    "SpecGraphRunner", "SpecScheduler", "SpecStats",
    "VerifyInput", "VerifyResult", "accept", "compact_accepted_path", "draft_extend",
    "draft_kv_group", "draft_prefill", "dummy_head", "load_head", "make_extend_input",
    "propose", "target_features",
]
