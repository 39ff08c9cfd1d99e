#!/usr/bin/env bash
# Issue 22 on 1 GPU, one call: chain verify and draft-extend through device-side metadata
# (TANDEM_DEVICE_VERIFY=1, spec/cuda_graphs.py device_metadata) against the host-planned
# FlashInfer path, same host: the GPU tests, then benchmarks/gpu_spec.py twice.
#   bash benchmarks/gpu_device_verify.sh        # on the device machine, carrying .devbundle-fi
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
TANDEM_DEVICE_VERIFY=1 timeout 200 python3 -m pytest -q tests/gpu/test_spec_graphs.py \
  --tb=short -k "drafting_ahead or (lossless_up_to_bf16 and chain and default)" 2>&1 | tail -6
for dv in 0 1; do
  mkdir -p "$OUT/dv$dv"
  TANDEM_DEVICE_VERIFY=$dv timeout 150 python3 benchmarks/gpu_spec.py --out "$OUT/dv$dv" \
    --skip-fp32 --batches 1 --configs chain4_dv8k,chain4_dv32k > "$OUT/dv$dv/log.txt" 2>&1
  echo "TANDEM_DEVICE_VERIFY=$dv"; grep -E "^(smollm2|llama).*chain4_dv[0-9]+k +1 " "$OUT/dv$dv/log.txt" \
    | cut -c1-200
done
