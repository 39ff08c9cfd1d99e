"""What a prefill or decode worker is built from, and the pieces both kinds build the same way:
the speculative engine, the KV layout the transfer layer registers, and the CompatInfo the
handshake compares. Validated at the edge (YAML / CLI)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.parallel import ParallelContext
from tandem.kvtransfer import AuxRegion, CompatInfo, EndpointConfig, FailureInjection, KVLayout, KVRegion
from tandem.kvtransfer.aux_slot import HEADER_BYTES
from tandem.spec.config import SpecConfig
from tandem.spec.draft_runner import DRAFT_GROUP
from tandem.spec.engine import SpecEngine
from tandem.spec.handoff import seed_nbytes

TRANSFER_BACKENDS = ("mooncake", "nixl", "fake")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    name: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    transfer_backend: str = "mooncake"
    aux_slots: int = 64  # seeds in flight at once (decode: receptions; prefill: staging)
    transfer_timeout_s: float = 30.0  # a request's KV must land within this after reserve
    endpoint: EndpointConfig | None = None  # deadlines; None = production defaults
    faults: FailureInjection | None = None  # test knob: break transfers on purpose
    torch_threads: int = 0  # 0 = torch's default; Ray CPU workers sharing cores want 1
    # Prefill only: push target layer l's pages while layer l+1 computes, in the forward that
    # completes a prompt (prefill_node/layerwise.py); off = push after the whole prefill.
    layerwise_push: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: a worker needs a name")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend: '{self.transfer_backend}' is not one of "
                             f"{', '.join(TRANSFER_BACKENDS)}")
        if self.aux_slots <= 0:
            raise ValueError(f"aux_slots: must be positive, got {self.aux_slots}")
        if not isinstance(self.layerwise_push, bool):
            raise ValueError(f"layerwise_push: must be true or false, got {self.layerwise_push!r}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be positive, got {self.transfer_timeout_s}")


def build_engine(cfg: WorkerConfig, parallel: ParallelContext | None = None) -> SpecEngine:
    """The speculative engine of one rank: the target sharded over `parallel` (TP/EP), the
    draft head too where it can (spec/head.py `draft_tp`), else replicated."""
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    return SpecEngine.from_config(cfg.engine, cfg.spec, parallel)


def aux_buffer(engine: SpecEngine, num_slots: int) -> torch.Tensor:
    """[num_slots, slot_bytes] uint8 host buffer for seeds (header + the largest seed)."""
    slot_bytes = HEADER_BYTES + seed_nbytes(engine.spec.topk, engine.head.cfg.hidden_size)
    slot_bytes = -(-slot_bytes // 64) * 64
    return torch.zeros(num_slots, slot_bytes, dtype=torch.uint8)


def kv_layout(engine: SpecEngine, aux: torch.Tensor) -> KVLayout:
    # The target's KV heads are this rank's slice; the draft's too where the head shards like
    # the target (EagleHead.kv_heads), else it holds all of its own (num_heads 0: replicated).
    heads = engine.model.heads
    split = {"target": (heads.kv_part.local_start // heads.head_dim, heads.local_kv_heads),
             DRAFT_GROUP: engine.head.kv_heads}
    regions = tuple(
        KVRegion.from_tensor(name, engine.kv_pool.group_tensor(name),
                             **(dict(head_start=split[name][0], num_heads=split[name][1])
                                if split.get(name) else {}))
        for name in engine.kv_pool.specs)
    return KVLayout(regions=regions, aux=AuxRegion.from_tensor(aux))


def compat_info(engine: SpecEngine, cfg: WorkerConfig) -> CompatInfo:
    """What both sides must agree on. The model is named by a digest of its config, so two
    copies of the same checkpoint in different directories still match. `tp_size`/`tp_rank`
    describe the KV head slice this rank's pages hold (the attention TP group): a decode rank
    of DP attention (tp 1 per DP rank) holds every head, exactly like a prefill rank of tp 1,
    so the two hash alike and a prefill of tp 2 is refused against it."""
    mc = engine.model_cfg
    model_id = hashlib.sha256(repr(mc).encode()).hexdigest()[:16]
    head = engine.head.cfg
    tp = engine.model.par.tp
    draft_id = hashlib.sha256(repr(head).encode()).hexdigest()[:16]
    return CompatInfo(
        model=f"{mc.architecture}:{model_id}", dtype=cfg.engine.dtype,
        page_size=cfg.engine.page_size, kv_layout="NHD", tp_size=tp.size, tp_rank=tp.rank,
        draft_model=f"{head.kind}:{draft_id}", draft_hidden_size=head.hidden_size,
        topk=engine.spec.topk, feature_layers=head.feature_layers,
        num_kv_heads=mc.num_kv_heads,  # lets the handshake judge KV head re-slicing
        draft_kv="sliced" if engine.head.tp.size > 1 else "all",  # the head sharded or not
    )
