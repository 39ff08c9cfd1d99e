#!/usr/bin/env bash
# Prompt steps in CUDA graphs, one GPU (carry .devbundle-fi): the GPU tests of the draft's
# prefill graphs (spec/draft_prefill.py, TANDEM_DRAFT_PREFILL_GRAPHS, default on) and of prompt
# graphs under overlap, then benchmarks/gpu_prompt_step.py three ways: prompt graphs off,
# on (the default), on with the draft's prefill in graphs too.
#   bash benchmarks/gpu_prompt_graphs.sh              # PART=tests or PART=steps: one half (a
#                                                     # cold machine's first call builds kernels)
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT"
PART=${PART:-all}
if [ "$PART" != steps ]; then
timeout 300 python3 -m pytest -q tests/gpu/test_spec_graphs.py -k "draft_prefill or \
(lossless_up_to_bf16 and chain and default)" --tb=short -p no:cacheprovider 2>&1 | tail -6
timeout 120 python3 -m pytest -q tests/gpu/test_cuda_graphs.py tests/gpu/test_overlap_gpu.py \
  --tb=short -p no:cacheprovider 2>&1 | tail -4
fi
[ "$PART" = tests ] || for mode in off on draft; do
  case $mode in
    off) env=(TANDEM_PREFILL_GRAPHS=0 TANDEM_DRAFT_PREFILL_GRAPHS=0) ;;
    on) env=(TANDEM_PREFILL_GRAPHS=1 TANDEM_DRAFT_PREFILL_GRAPHS=0) ;;
    draft) env=(TANDEM_PREFILL_GRAPHS=1 TANDEM_DRAFT_PREFILL_GRAPHS=1) ;;
  esac
  echo "== prompt graphs: $mode"
  env "${env[@]}" timeout 120 python3 benchmarks/gpu_prompt_step.py --out "$OUT/$mode" 2>&1 \
    | grep -E "arriving|Error" | tail -10
done
# One 512-token prompt on the 8B shape: each prompt row of a graph reads its whole prefix, so
# a long prompt may cost more through a graph than through the eager paged prefill.
[ "$PART" = tests ] || for mode in off on; do
  echo "== 8B, one 512-token prompt, prompt graphs: $mode"
  TANDEM_PREFILL_GRAPHS=$([ $mode = on ] && echo 1 || echo 0) timeout 150 python3 \
    benchmarks/gpu_prompt_step.py --model llama-3.1-8b --prompt-len 512 --engines plain \
    --cases "1,0;1,15" --out "$OUT/8b-$mode" 2>&1 | grep -E "arriving|Error" | tail -4
done
[ -f .devbundle-fi/stash_flashinfer.py ] && python3 .devbundle-fi/stash_flashinfer.py
