"""Bytes a decode step reads, from a ModelConfig, checked against hand counts; bandwidth
measurement returns a sane number on the CPU and says what it measured."""

from __future__ import annotations

import pytest

from tandem.bench.floors import (Bandwidth, ModelFloors, decode_bytes_per_step,
                                 expected_experts_touched, kv_bytes_per_token,
                                 measure_link_bandwidth, measure_memory_bandwidth,
                                 mlp_weight_bytes_per_step, tpot_floor_s, transfer_floor_s,
                                 weight_bytes_per_step)
from tandem.engine.config import ModelConfig
from tandem.engine.presets import PRESETS

SMALL = {  # hand-countable: h=8, 2 layers, 2 heads of 4 (1 kv head), mlp 16, vocab 32
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8,
    "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "tie_word_embeddings": False,
}


def small(**kw) -> ModelConfig:
    return ModelConfig.from_hf({**SMALL, **kw})


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(small(), 2) == 2 * 2 * 1 * 4 * 2  # K+V, 2 layers, 1 head of 4, bf16
    llama = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    assert kv_bytes_per_token(llama, 2) == 131072  # 128 KiB per token: the known 8B number


def test_weight_bytes_by_hand():
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, mlp 3x8x16 = 384, 2 norms 16 -> 592
    # two layers 1184, final norm 8, lm_head 32x8 = 256; the embedding (256) is not read, but
    # the batch's rows (8 each) are.
    assert weight_bytes_per_step(small(), 1, batch=1) == 1184 + 8 + 256 + 8
    assert weight_bytes_per_step(small(), 2, batch=3) == 2 * (1184 + 8 + 256 + 24)
    # Tied: the one table is read whole as the lm_head.
    assert weight_bytes_per_step(small(tie_word_embeddings=True), 1) == 1184 + 8 + 256


def test_llama_8b_weight_bytes():
    llama = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    w = weight_bytes_per_step(llama, 2, batch=1)
    # 8.03B params, minus the 525M-parameter input embedding, in bf16: ~15.0 GB.
    assert w == pytest.approx(2 * (llama.num_params() - 128256 * 4096 + 4096))
    assert 14.9e9 < w < 15.1e9


def test_moe_reads_only_the_experts_a_batch_reaches():
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(8, 2, 1000) == pytest.approx(8.0)
    moe = ModelConfig.from_hf(PRESETS["qwen3-30b-a3b"])
    one, many = weight_bytes_per_step(moe, 2, 1), weight_bytes_per_step(moe, 2, 4096)
    per_expert = 3 * moe.hidden_size * moe.moe_intermediate_size * 2
    assert many - one == pytest.approx(
        per_expert * 48 * (expected_experts_touched(128, 8, 4096) - 8) + 2 * 4095 * 2048)
    assert one < 0.2 * many  # batch 1 touches 8 of 128 experts per layer


def test_decode_and_transfer_floors():
    cfg = small()
    step = decode_bytes_per_step(cfg, 2, batch=4, context_tokens=100)
    assert step == weight_bytes_per_step(cfg, 2, 4) + 4 * 100 * 32
    assert tpot_floor_s(cfg, 2, 4, 100, bandwidth_bytes_s=1e6) == pytest.approx(step / 1e6)
    assert transfer_floor_s(cfg, 2, 1000, link_bytes_s=32e3) == pytest.approx(1.0)
    floors = ModelFloors(model=cfg, dtype_bytes=2, memory=Bandwidth(bytes_per_s=1e6, method="x"),
                         link=Bandwidth(bytes_per_s=None, method="n/a here"))
    assert floors.tpot_floor(4.4, 100) == pytest.approx(step / 1e6)  # batch rounds to 4
    assert floors.transfer_floor(1000) is None
    assert floors.to_json()["kv_bytes_per_token"] == 32


def test_cpu_memory_bandwidth_is_measured_and_labelled():
    bw = measure_memory_bandwidth("cpu", nbytes=8 << 20, repeats=2)
    assert bw.bytes_per_s is not None and 1e8 < bw.bytes_per_s < 1e13
    assert "CPU memcpy" in bw.method and "not HBM" in bw.method


def test_link_bandwidth_na_without_two_gpus():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here")
    bw = measure_link_bandwidth()
    assert bw.bytes_per_s is None and "2 GPUs" in str(bw)


def test_tp_and_dp_floors_are_the_busiest_gpus_bytes():
    """TP divides every byte; DP attention divides the MLP by every rank and the KV by the DP
    rank holding the most sequences, while each DP rank keeps its attention weights."""
    cfg = small()
    mem = Bandwidth(bytes_per_s=1e6, method="x")
    na = Bandwidth(bytes_per_s=None, method="n/a")
    w, mlp = weight_bytes_per_step(cfg, 2, 5), mlp_weight_bytes_per_step(cfg, 2, 5)
    assert mlp == cfg.num_layers * 3 * cfg.hidden_size * cfg.intermediate_size * 2
    kv = kv_bytes_per_token(cfg, 2)
    one = ModelFloors(model=cfg, dtype_bytes=2, memory=mem, link=na)
    assert one.tpot_floor(5, 100) == pytest.approx(decode_bytes_per_step(cfg, 2, 5, 100) / 1e6)
    tp2 = ModelFloors(model=cfg, dtype_bytes=2, memory=mem, link=na, decode_tp=2)
    assert tp2.tpot_floor(5, 100) == pytest.approx(one.tpot_floor(5, 100) / 2)
    dp2 = ModelFloors(model=cfg, dtype_bytes=2, memory=mem, link=na, decode_dp=2)
    want = (w - mlp) + mlp / 2 + 3 * 100 * kv  # ceil(5 / 2) = 3 sequences on the busier rank
    assert dp2.tpot_floor(5, 100) == pytest.approx(want / 1e6)
    dp2tp2 = ModelFloors(model=cfg, dtype_bytes=2, memory=mem, link=na, decode_tp=2,
                         decode_dp=2)
    assert dp2tp2.tpot_floor(5, 100) == pytest.approx(((w - mlp) / 2 + mlp / 4
                                                       + 3 * 100 * kv / 2) / 1e6)
    assert dp2tp2.to_json()["decode_dp"] == 2


def test_moe_mlp_bytes_are_the_experts_the_batch_reaches():
    moe = ModelConfig.from_hf(PRESETS["qwen3-30b-a3b"])
    per_expert = 3 * moe.hidden_size * moe.moe_intermediate_size * 2
    for b in (1, 64):
        assert mlp_weight_bytes_per_step(moe, 2, b) == pytest.approx(
            48 * per_expert * expected_experts_touched(128, 8, b))
