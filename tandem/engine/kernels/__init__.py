"""Fused kernels for the layers: Triton on CUDA, torch twins elsewhere (see `ops`)."""

from tandem.engine.kernels.ops import (
    KernelPolicy,
    add_rms_norm,
    current_policy,
    decode_fusion_ok,
    decode_rows_plan,
    fused_linear,
    gemv_applies,
    kernel_policy,
    linear,
    moe_experts,
    moe_weighted_sum,
    paged_decode,
    rms_norm,
    rotary,
    rotary_store,
    row_max,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "KernelPolicy", "add_rms_norm", "current_policy", "decode_fusion_ok", "decode_rows_plan",
    "fused_linear", "gemv_applies",
    "kernel_policy", "linear", "moe_experts", "moe_weighted_sum", "paged_decode", "rms_norm",
    "rotary", "rotary_store", "row_max", "silu_and_mul", "store_kv",
]
