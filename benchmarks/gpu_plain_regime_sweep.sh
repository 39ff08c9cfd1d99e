#!/usr/bin/env bash
# Why the adaptive engine's plain-regime steps run 2-10% slower than the plain engine's at
# c=16 and c=50 (issue 22; sessions 18-24, every host; the same `LLMEngine.step`, the same
# kernels), in one call after `PHASE=import` of gpu_train_eagle.sh (real weights in
# /tmp/gc/smollm2). Three sweeps of plain against adaptive at c=16,50, paired per repeat:
#   1. as every sweep so far (the adaptive engine loads its own copy of the weights);
#   2. the adaptive engine over the plain engine's weights (--adaptive-shares-model);
#   3. as 2, the process pinned to the first NUMA node's cores (--pin-cpus).
# Compare the "adaptive / plain per repeat" lines. Then the prompt-step timing of status.md
# item 2c. ~5-7 minutes (start-up dominates: c=16 and c=50 runs take < 1 s each).
#     PHASE=import bash benchmarks/gpu_train_eagle.sh && bash benchmarks/gpu_plain_regime_sweep.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh >/dev/null 2>&1
(lscpu; numactl -H 2>/dev/null || echo "numactl: not installed") > "$OUT/topology.txt" 2>&1
node0=$(lscpu -p=CPU,NODE 2>/dev/null | awk -F, '!/^#/ && $2 == 0 {print $1}' | paste -sd, -)
echo "NUMA node 0 CPUs: ${node0:-unknown}"
run() {  # name, extra args
  local name=$1; shift
  timeout 170 python3 benchmarks/gpu_spec_chat.py --model /tmp/gc/smollm2 --engines plain,adaptive \
    --concurrency 16,50 --skip-batch1 --gc-freeze --repeats 12 --out "$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "== $name $*"
  grep -E "^(plain|adaptive) +(-|[0-9])|per repeat|^  (plain|adaptive): c=" "$OUT/$name.log" | cut -c1-300
}
run own_weights
run shared_weights --adaptive-shares-model
if [ -n "$node0" ]; then run shared_pinned --adaptive-shares-model --pin-cpus "$node0"; fi
# And, while the machine is up, status.md item 2c: what a prompt's arrival step costs, plain
# against speculative (dummy weights; a cProfile of the 1-prompt step in prompt_step/).
echo "== prompt steps (dummy SmolLM2)"
timeout 150 python3 benchmarks/gpu_prompt_step.py --out "$OUT/prompt_step" --cases "1,0;1,15" \
  > "$OUT/prompt_step.log" 2>&1
grep -E "arriving next to" "$OUT/prompt_step.log"
