#!/usr/bin/env bash
# One GPU, one call: the device-metadata paged decode with its merge in the split kernel.
# The GPU kernel test, then benchmarks/gpu_attn_micro.py (FlashInfer against it, merge fused or
# apart), then benchmarks/gpu_spec.py's rounds (SmolLM2 and 8B shapes, chain k=4, batch 1) with
# the merge fused and apart, same host.
#   bash benchmarks/gpu_attn.sh        # on the device machine, carrying .devbundle-fi
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k paged_decode --tb=short 2>&1 \
  | tail -4
timeout 200 python3 benchmarks/gpu_attn_micro.py --out "$OUT" 2>&1 | tail -60
for fm in 1 0; do
  mkdir -p "$OUT/fm$fm"
  TANDEM_FUSED_MERGE=$fm timeout 150 python3 benchmarks/gpu_spec.py --out "$OUT/fm$fm" \
    --skip-fp32 --batches 1 --configs chain4_dv8k,chain4_dv32k > "$OUT/fm$fm/log.txt" 2>&1
  echo "TANDEM_FUSED_MERGE=$fm"; grep -E "^(smollm2|llama).*chain4_dv[0-9]+k +1 " \
    "$OUT/fm$fm/log.txt" | cut -c1-200
done
