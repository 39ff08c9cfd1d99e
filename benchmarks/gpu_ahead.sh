#!/usr/bin/env bash
# Drafting ahead (spec/ahead.py) on 2 GPUs, one call: its GPU tests, then the EAGLE round back
# to back with and without it -- under TP=2 (benchmarks/gpu_tp.py, 8B shape) and on one GPU
# (benchmarks/gpu_spec.py, SmolLM2 and 8B shapes, batch 1) -- all on the same host.
#   bash benchmarks/gpu_ahead.sh        # on the device machine, carrying .devbundle-fi
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT/tp" "$OUT/one"
timeout 200 python3 -m pytest -q tests/gpu/test_spec_graphs.py --tb=short \
  -k "drafting_ahead or (lossless_up_to_bf16 and chain and default)" 2>&1 | tail -8
timeout 200 python3 benchmarks/gpu_tp.py --out "$OUT/tp" --label ahead --batch 1 8 \
  > "$OUT/tp/log.txt" 2>&1
grep -E "^TP=|EAGLE|back to back" "$OUT/tp/log.txt" | cut -c1-200
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/gpu_spec.py --out "$OUT/one" \
  --skip-fp32 --batches 1 --configs chain4_dv8k,chain4_dv32k > "$OUT/one/log.txt" 2>&1
tail -25 "$OUT/one/log.txt" | cut -c1-220
