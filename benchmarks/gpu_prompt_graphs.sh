#!/usr/bin/env bash
# Prompt steps in CUDA graphs, one GPU (carry .devbundle-fi): the GPU tests of the draft's
# prefill graphs (spec/draft_prefill.py, opt-in TANDEM_DRAFT_PREFILL_GRAPHS=1) and of prompt
# graphs under overlap, then benchmarks/gpu_prompt_step.py three ways: prompt graphs off,
# on (the default), on with the draft's prefill in graphs too.
#   bash benchmarks/gpu_prompt_graphs.sh
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT"
timeout 200 python3 -m pytest -q tests/gpu/test_spec_graphs.py -k "draft_prefill or \
(lossless_up_to_bf16 and chain and default)" --tb=short -p no:cacheprovider 2>&1 | tail -6
timeout 120 python3 -m pytest -q tests/gpu/test_cuda_graphs.py tests/gpu/test_overlap_gpu.py \
  --tb=short -p no:cacheprovider 2>&1 | tail -4
for mode in off on draft; do
  case $mode in
    off) env=(TANDEM_PREFILL_GRAPHS=0 TANDEM_DRAFT_PREFILL_GRAPHS=0) ;;
    on) env=(TANDEM_PREFILL_GRAPHS=1 TANDEM_DRAFT_PREFILL_GRAPHS=0) ;;
    draft) env=(TANDEM_PREFILL_GRAPHS=1 TANDEM_DRAFT_PREFILL_GRAPHS=1) ;;
  esac
  echo "== prompt graphs: $mode"
  env "${env[@]}" timeout 120 python3 benchmarks/gpu_prompt_step.py --out "$OUT/$mode" 2>&1 \
    | grep -E "arriving|Error" | tail -10
done
