"""Typed, frozen configuration of a model and of the engine that runs it.

`ModelConfig.from_hf(dict)` is the one place an HF `config.json` is interpreted; everything
after it reads typed fields. Errors name the offending field so a user can fix their file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# HF architecture name -> the model family flags we need. One decoder implementation covers
# all of them; the differences are biases, q/k norms and MoE blocks.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or unsupported; the message names it."""


# EngineConfig.all_reduce (engine/allreduce.py MODES)
ALL_REDUCE_MODES = ("auto", "nccl", "one_shot", "two_shot", "flag_one_shot")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of one decoder-only transformer."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # MoE (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_ids: frozenset[int] = field(default_factory=frozenset)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def max_context(self) -> int:
        """Longest sequence the engine serves: sliding-window attention is not implemented, so
        a window caps the context instead of silently attending too far."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def num_params(self) -> int:
        """Parameter count (for the bandwidth floor in benchmarks)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        mlp_total = sum(
            moe_mlp if i in self.moe_layer_ids else dense_mlp for i in range(self.num_layers)
        )
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlp_total + embed + h

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> ModelConfig:
        return _parse_hf_config(raw)

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return _parse_hf_config(raw)


def _req(raw: dict[str, Any], key: str, typ: type) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"config.json: missing required field '{key}'")
    value = raw[key]
    if typ is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise ConfigError(f"config.json: field '{key}' must be {typ.__name__}, got {value!r}")
    return value


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters`; older files have `rope_theta` + `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in ("default", None):
        return float(theta), None
    if rope_type == "llama3":
        try:
            return float(theta), RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json: rope scaling 'llama3' lacks field {exc}") from exc
    raise ConfigError(f"config.json: rope_type '{rope_type}' is not supported (default, llama3)")


def _parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError("config.json: missing field 'architectures'")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"config.json: unknown architecture '{arch}' "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("mlp_bias"):
        raise ConfigError("config.json: 'mlp_bias: true' is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act '{raw['hidden_act']}' is not supported (silu)")
    hidden = _req(raw, "hidden_size", int)
    num_heads = _req(raw, "num_attention_heads", int)
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    head_dim = raw.get("head_dim") or hidden // num_heads
    num_layers = _req(raw, "num_hidden_layers", int)
    theta, scaling = _parse_rope(raw)

    sliding = None
    if family == "llama" or family == "mixtral":
        sliding = raw.get("sliding_window")
    elif raw.get("use_sliding_window"):
        sliding = raw.get("sliding_window")

    num_experts, moe_ids, moe_inter, top_k, norm_topk = 0, frozenset(), 0, 0, True
    if family in ("mixtral", "qwen3_moe"):
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        if num_experts <= 0:
            raise ConfigError("config.json: MoE model without 'num_local_experts'/'num_experts'")
        top_k = _req(raw, "num_experts_per_tok", int)
        if family == "mixtral":
            moe_inter = _req(raw, "intermediate_size", int)
            moe_ids = frozenset(range(num_layers))
        else:
            moe_inter = _req(raw, "moe_intermediate_size", int)
            norm_topk = bool(raw.get("norm_topk_prob", False))
            step = int(raw.get("decoder_sparse_step", 1) or 1)
            dense_only = set(raw.get("mlp_only_layers") or [])
            moe_ids = frozenset(
                i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0
            )

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attn_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=_req(raw, "vocab_size", int),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        sliding_window=int(sliding) if sliding else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (no flag); Llama/Qwen3 use `attention_bias` for all four.
        qkv_bias=True if family == "qwen2" else attn_bias,
        o_bias=False if family == "qwen2" else attn_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk,
        moe_layer_ids=moe_ids,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingFault:
    """Test only (`EngineConfig.sampling_fault`): drawing a token for a row of one of `req_ids`
    raises `sampling.InjectedFault` -- in the sampler and in speculative acceptance alike,
    greedy rows included -- to prove that one failing row fails only its request. Set in code,
    never from YAML; a worker's requests are named by their room (`str(room)`)."""

    req_ids: frozenset[str]

    def __post_init__(self) -> None:
        if not isinstance(self.req_ids, frozenset):
            raise ConfigError(f"sampling_fault.req_ids: must be a frozenset, got {self.req_ids!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How one engine instance runs a model. Validated at construction (CLI/YAML edge)."""

    model: str = "default"  # a checkpoint directory, a preset name (see presets.py) or "default"
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: DType = "bfloat16"
    device: str = "cpu"
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # chunked-prefill token budget per forward
    max_model_len: int | None = None  # None: the model's own context
    seed: int = 0
    cuda_graphs: bool = True  # replay pure-decode steps from CUDA graphs (CUDA + FlashInfer only)
    # TP all-reduce on GPUs (allreduce.py): "auto" measures NCCL and the symmetric-memory
    # one-shot/two-shot and flag one-shot kernels at start-up and gives each message size the
    # fastest; "nccl" never uses symmetric memory; "one_shot"/"two_shot"/"flag_one_shot" force
    # that kernel wherever a message fits its buffer (tests, benchmarks). No effect on the CPU,
    # with TP 1 or DP attention.
    all_reduce: Literal["auto", "nccl", "one_shot", "two_shot", "flag_one_shot"] = "auto"
    # Reuse the KV pages of prompt prefixes computed before (prefix_cache.py); off by default.
    enable_prefix_caching: bool = False
    # How expert-parallel MoE moves tokens (layers/moe_dispatch.py): "allreduce" (every rank
    # runs every token, partial outputs summed), "alltoall" (tokens travel to their experts'
    # ranks, variable splits: one host read per MoE layer) or "alltoall_padded" (fixed
    # capacity, no host read: for decode CUDA graphs). A no-op without EP.
    moe_dispatch: Literal["allreduce", "alltoall", "alltoall_padded"] = "allreduce"
    # Decode CUDA graphs under DP attention (plain engine; cuda_graphs.py): every rank replays
    # the size the ranks agree on. Off by default until run on GPUs (CPU-tested in eager mode).
    dp_decode_graphs: bool = False
    # Overlap scheduling (overlap.py): launch step n+1 before reading step n's tokens, so the
    # host's work hides behind the GPU's. None: on for CUDA devices (plain engine, no DP).
    overlap_schedule: bool | None = None
    sampling_fault: SamplingFault | None = None  # test only: make chosen rows fail sampling

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: '{self.dtype}' is not one of float32, bfloat16, float16")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format: '{self.load_format}' is not one of auto, dummy")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ConfigError(f"attention_backend: unknown backend '{self.attention_backend}'")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages: need at least 2 pages, got {self.num_pages}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs: must be true or false, got {self.cuda_graphs!r}")
        if not isinstance(self.dp_decode_graphs, bool):
            raise ConfigError(f"dp_decode_graphs: must be true or false, "
                              f"got {self.dp_decode_graphs!r}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise ConfigError(f"overlap_schedule: must be true, false or null (auto), "
                              f"got {self.overlap_schedule!r}")
        if self.all_reduce not in ALL_REDUCE_MODES:
            raise ConfigError(f"all_reduce: '{self.all_reduce}' is not one of "
                              f"{', '.join(ALL_REDUCE_MODES)}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching: must be true or false, "
                              f"got {self.enable_prefix_caching!r}")
        if self.sampling_fault is not None and not isinstance(self.sampling_fault, SamplingFault):
            raise ConfigError("sampling_fault: a test-only hook, set in code (a SamplingFault)")
        if self.moe_dispatch not in ("allreduce", "alltoall", "alltoall_padded"):
            raise ConfigError(f"moe_dispatch: '{self.moe_dispatch}' is not one of allreduce, "
                              "alltoall, alltoall_padded")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len: must be positive, got {self.max_model_len}")
