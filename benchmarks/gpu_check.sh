#!/usr/bin/env bash
# After a refactor: the GPU tests that cover the engine's GPU-only paths (FlashInfer, CUDA
# graphs for plain and speculative decoding, on-device acceptance), on one GPU, from the
# repository root (benchmarks/gpu_env.sh brings the packages):
#
#   bash benchmarks/gpu_check.sh              # ~4-6 min on an H100
#   FILES="tests/gpu/test_kernels_gpu.py" bash benchmarks/gpu_check.sh
#
# Writes $OUT/gpu-check.log (pytest's output, the slowest tests last).
source benchmarks/gpu_env.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# (tests/gpu/test_tp_graphs.py needs 2 GPUs: run it on its own there)
FILES=${FILES:-tests/gpu/test_spec_graphs.py tests/gpu/test_cuda_graphs.py tests/gpu/test_flashinfer_backend.py tests/gpu/test_spec_kernels_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_tree_graphs_gpu.py tests/gpu/test_fused_moe_gpu.py}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu-check.log"
# shellcheck disable=SC2086  # FILES is a list
python3 -m pytest -q -p no:cacheprovider --durations=8 $FILES 2>&1 | tee -a "$OUT/gpu-check.log" \
  | tail -40
