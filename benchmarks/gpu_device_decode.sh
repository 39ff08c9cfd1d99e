#!/usr/bin/env bash
# Plain decode graphs planned on the device (engine/attention/device_decode.py
# DeviceDecodePlanner, TANDEM_DEVICE_DECODE=1, the default) against FlashInfer's host-planned
# graphs (=0), same host.
#   bash benchmarks/gpu_device_decode.sh          # one GPU: GPU tests, gpu_attn_micro.py,
#                                                 # then gpu_spec.py twice
#   TP=2 bash benchmarks/gpu_device_decode.sh     # two GPUs: test_tp_graphs, gpu_tp.py twice
#   AB=TANDEM_PLAN_KERNELS bash benchmarks/gpu_device_decode.sh   # the same A/B over another
#                                                 # switch (here the one-launch round plans)
#   SKIP_TESTS=1 ...                              # the timings alone
# (carrying .devbundle-fi)
set -u
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
AB=${AB:-TANDEM_DEVICE_DECODE}  # the switch the two timed runs set to 1 and 0
mkdir -p "$OUT"
if [ "${TP:-1}" = 1 ]; then
  [ -n "${SKIP_TESTS:-}" ] || {
  env "$AB=1" timeout 120 python3 -m pytest -q tests/gpu/test_cuda_graphs.py tests/gpu/test_overlap_gpu.py \
    --tb=short 2>&1 | tail -6
  env "$AB=1" timeout 90 python3 -m pytest -q tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_spec_kernels_gpu.py -k "paged_decode or spec_kernels" --tb=short 2>&1 \
    | tail -3
  env "$AB=1" timeout 150 python3 -m pytest -q tests/gpu/test_spec_graphs.py --tb=short \
    -k "lossless_up_to_bf16 and chain and default" 2>&1 | tail -4
  timeout 200 python3 benchmarks/gpu_attn_micro.py --out "$OUT" 2>&1 | grep -v "^    "; }
  for dd in 1 0; do
    mkdir -p "$OUT/dd$dd"
    env "$AB=$dd" timeout 150 python3 benchmarks/gpu_spec.py --out "$OUT/dd$dd" \
      --skip-fp32 --batches 1 --configs chain4_dv8k,chain4_dv32k > "$OUT/dd$dd/log.txt" 2>&1
    echo "$AB=$dd"; grep -E "^(smollm2|llama).*chain4_dv[0-9]+k +1 " \
      "$OUT/dd$dd/log.txt" | cut -c1-200
  done
else
  [ -n "${SKIP_TESTS:-}" ] || env "$AB=1" timeout 300 python3 -m pytest -q \
    tests/gpu/test_tp_graphs.py --tb=short 2>&1 | tail -4
  for dd in 1 0; do
    mkdir -p "$OUT/dd$dd"
    env "$AB=$dd" timeout 240 python3 benchmarks/gpu_tp.py --out "$OUT/dd$dd" \
      --label dd$dd --batch 1 8 > "$OUT/dd$dd/log.txt" 2>&1
    echo "$AB=$dd"
    grep -E "^TP=|EAGLE|back to back|graph_vs" "$OUT/dd$dd/log.txt" | cut -c1-220
  done
fi
