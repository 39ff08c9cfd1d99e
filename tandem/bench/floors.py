"""Hardware floors: the best time a decode step or a KV transfer could take on this hardware,
printed next to what was measured.

- Decode floor (per output token, non-speculative): a decode step reads every weight the step
  uses once and the KV cache of every sequence in the batch, so
      TPOT_floor(batch b, context L) = (weight_bytes(b) + b * L * kv_bytes_per_token) / HBM BW.
  Each sequence gets one token per step, so this is a floor on TPOT. A speculative step commits
  tau tokens per sequence, so its floor is about TPOT_floor / tau (verify reads the same bytes).
  A decode step of `tp` ranks reads 1/tp of those bytes on each GPU at once: TPOT_floor / tp
  (nothing added for the all-reduces). Under DP attention (`dp` DP ranks of `tp` ranks each)
  a GPU reads 1/tp of the attention and other non-MLP weights (each DP rank holds them), 1/(dp
  tp) of the feed-forward weights (sharded over every rank, run on the whole batch's tokens)
  and 1/tp of the KV of its DP rank's ceil(b/dp) sequences; the floor is the busiest GPU's.
- Link floor (per request): the prompt's KV cache over the measured link bandwidth.

Bandwidths are measured, not taken from a data sheet: on CUDA a device-to-device copy
(bytes read + bytes written per second, which is what a kernel streaming weights sees); on the
CPU a memcpy of host memory (said so in the output); the link between two GPUs of one host as a
peer copy cuda:0 -> cuda:1. Byte counts are pure functions of a `ModelConfig`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of `batch` tokens reaches under uniform routing:
    E * (1 - (1 - k/E)^b). 1 token -> k experts; many tokens -> all E."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_per_step(cfg: ModelConfig, dtype_bytes: int, batch: int = 1) -> float:
    """Weight bytes one decode step of `batch` tokens reads: every parameter except the input
    embedding table (a step reads only `batch` of its rows; a tied table is read whole as the
    lm_head), and of a MoE layer's experts only those the batch reaches."""
    h = cfg.hidden_size
    params = float(cfg.num_params())
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * h - batch * h  # embedding: only the looked-up rows
    if cfg.is_moe:
        per_expert = 3 * h * cfg.moe_intermediate_size
        touched = expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch)
        params -= len(cfg.moe_layer_ids) * per_expert * (cfg.num_experts - touched)
    return params * dtype_bytes


def mlp_weight_bytes_per_step(cfg: ModelConfig, dtype_bytes: int, batch: int = 1) -> float:
    """The feed-forward part of `weight_bytes_per_step`: every dense MLP, and of a MoE layer the
    experts the batch reaches (its router counts with the rest: every rank runs it whole)."""
    h = cfg.hidden_size
    dense = 3 * h * cfg.intermediate_size
    moe = 3 * h * cfg.moe_intermediate_size * expected_experts_touched(
        cfg.num_experts, cfg.num_experts_per_tok, batch) if cfg.is_moe else 0.0
    return sum(moe if i in cfg.moe_layer_ids else dense
               for i in range(cfg.num_layers)) * dtype_bytes


def per_gpu_decode_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int,
                         context_tokens: float, tp: int = 1, dp: int = 1) -> float:
    """Bytes the busiest GPU reads in a decode step of `batch` sequences on `dp` DP ranks of
    `tp` ranks each (module docstring); tp = dp = 1 is `decode_bytes_per_step`."""
    weights = weight_bytes_per_step(cfg, dtype_bytes, batch)
    mlp = mlp_weight_bytes_per_step(cfg, dtype_bytes, batch)
    own = -(-batch // dp)  # the most sequences one DP rank holds
    return ((weights - mlp) / tp + mlp / (dp * tp)
            + own * context_tokens * kv_bytes_per_token(cfg, dtype_bytes) / tp)


def decode_bytes_per_step(cfg: ModelConfig, dtype_bytes: int, batch: int,
                          context_tokens: float) -> float:
    """Weights + the KV of `batch` sequences of `context_tokens` each."""
    return (weight_bytes_per_step(cfg, dtype_bytes, batch)
            + batch * context_tokens * kv_bytes_per_token(cfg, dtype_bytes))


def tpot_floor_s(cfg: ModelConfig, dtype_bytes: int, batch: int, context_tokens: float,
                 bandwidth_bytes_s: float) -> float:
    return decode_bytes_per_step(cfg, dtype_bytes, batch, context_tokens) / bandwidth_bytes_s


def transfer_floor_s(cfg: ModelConfig, dtype_bytes: int, prompt_tokens: float,
                     link_bytes_s: float) -> float:
    return prompt_tokens * kv_bytes_per_token(cfg, dtype_bytes) / link_bytes_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Bandwidth:
    bytes_per_s: float | None  # None: not measured
    method: str  # how it was measured, or why it was not

    def to_json(self) -> dict[str, object]:
        gbs = None if self.bytes_per_s is None else self.bytes_per_s / 1e9
        return {"gb_per_s": gbs, "method": self.method}

    def __str__(self) -> str:
        if self.bytes_per_s is None:
            return f"n/a ({self.method})"
        return f"{self.bytes_per_s / 1e9:.1f} GB/s ({self.method})"


def measure_memory_bandwidth(device: str = "cpu", nbytes: int = 256 << 20,
                             repeats: int = 5) -> Bandwidth:
    """Copy bandwidth of one device's memory, counting bytes read + bytes written; the best of
    `repeats` copies after one warm-up copy."""
    import torch

    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    src.fill_(1)
    best = float("inf")
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # SYNC: timing the copy
        if i:
            best = min(best, time.perf_counter() - t0)
    method = ("CUDA device-to-device copy, read + write, "
              f"{torch.cuda.get_device_name(dev)}" if dev.type == "cuda"
              else "CPU memcpy, read + write (host memory, not HBM)")
    return Bandwidth(bytes_per_s=2 * nbytes / best, method=method)


def measure_link_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> Bandwidth:
    """cuda:0 -> cuda:1 peer copy (NVLink or PCIe) when two GPUs are visible; else n/a."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return Bandwidth(bytes_per_s=None, method="needs 2 GPUs visible to one process")
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    best = float("inf")
    for i in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:0")  # SYNC: timing the copy
        torch.cuda.synchronize("cuda:1")
        if i:
            best = min(best, time.perf_counter() - t0)
    p2p = torch.cuda.can_device_access_peer(0, 1)
    return Bandwidth(bytes_per_s=nbytes / best,
                     method=f"cuda:0 -> cuda:1 copy ({'peer access' if p2p else 'no peer access'})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFloors:
    """What the floors of one deployment need: its model's shape, dtype and bandwidths."""

    model: ModelConfig | None  # None: the model's config could not be read here
    dtype_bytes: int
    memory: Bandwidth
    link: Bandwidth
    # The decode step's ranks (TP): each GPU reads its 1/tp of the weights and of the KV, at
    # the same time, so the floor is the per-GPU bytes over one GPU's bandwidth.
    decode_tp: int = 1
    # DP attention ranks of the decode worker, each of decode_tp ranks (per_gpu_decode_bytes).
    decode_dp: int = 1

    def to_json(self) -> dict[str, object]:
        m = self.model
        return {
            "memory_bandwidth": self.memory.to_json(), "link_bandwidth": self.link.to_json(),
            "dtype_bytes": self.dtype_bytes, "decode_tp": self.decode_tp,
            "decode_dp": self.decode_dp,
            "weight_bytes_batch1": None if m is None else weight_bytes_per_step(
                m, self.dtype_bytes, 1),
            "kv_bytes_per_token": None if m is None else kv_bytes_per_token(m, self.dtype_bytes),
        }

    def tpot_floor(self, batch: float, context_tokens: float) -> float | None:
        if self.model is None or self.memory.bytes_per_s is None:
            return None
        b = max(1, round(batch))
        return per_gpu_decode_bytes(self.model, self.dtype_bytes, b, context_tokens,
                                    self.decode_tp, self.decode_dp) / self.memory.bytes_per_s

    def transfer_floor(self, prompt_tokens: float) -> float | None:
        if self.model is None or self.link.bytes_per_s is None:
            return None
        return transfer_floor_s(self.model, self.dtype_bytes, prompt_tokens, self.link.bytes_per_s)
