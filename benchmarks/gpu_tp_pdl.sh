#!/usr/bin/env bash
# Issue 26 on 2 GPUs, one call: programmatic dependent launch (TANDEM_PDL=1, kernels/pdl.py)
# against the default on the same host. First its equality test (PDL launches == normal ones,
# bitwise) and the TP graph test, then benchmarks/gpu_tp.py twice with kernel profiles.
#   bash benchmarks/gpu_tp_pdl.sh        # on the device machine, carrying .devbundle-fi
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT/base" "$OUT/pdl"
timeout 200 python3 -m pytest -q -x tests/gpu/test_pdl_gpu.py tests/gpu/test_tp_graphs.py \
  --tb=short 2>&1 | tail -15
timeout 280 python3 benchmarks/gpu_tp.py --out "$OUT/base" --profile --label base \
  > "$OUT/base/log.txt" 2>&1
TANDEM_PDL=1 timeout 280 python3 benchmarks/gpu_tp.py --out "$OUT/pdl" --profile --label pdl \
  > "$OUT/pdl/log.txt" 2>&1
grep -E "^TP=|EAGLE|flag_stress \(" "$OUT/base/log.txt" "$OUT/pdl/log.txt" | cut -c1-200
