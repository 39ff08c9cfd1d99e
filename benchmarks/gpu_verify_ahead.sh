#!/usr/bin/env bash
# Session 23's open GPU questions in one call (one GPU, dummy weights, `.devbundle-fi` only):
#   1. why the start-up cost profile prices batch-1 rounds that verify ahead ~0.3 ms above what
#      they serve (`gpu_adaptive.py --debug` with the profile verifying ahead, alternating
#      with it off; the debug lines say each k's time and what was queued / used / dropped);
#   2. GridConfig for SmolLM2's verify rows (`gpu_micro.py --skinny --model smollm2`);
#   3. rounds back to back with all of it (`gpu_spec.py`, SmolLM2 and the 8B shape).
#     bash benchmarks/gpu_verify_ahead.sh          # ~4-6 minutes on a fresh machine
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh >/dev/null 2>&1
export TANDEM_SPEC_COST_CACHE=0
# (Session 24: 1.72 / 1.37 / 1.24 ms at batch 1, k=4, in that order: each process on a fresh
# machine ran faster than the one before, whichever setting -- warm-up, not verifying ahead.)
i=0
for va in 1 0 1; do
  i=$((i + 1))
  echo "== profile verifying ahead: $va (run $i)"
  TANDEM_PROFILE_VERIFY_AHEAD=$va timeout 150 python3 benchmarks/gpu_adaptive.py \
    --model smollm2-135m --load-format dummy --debug > "$OUT/adaptive_run${i}_va$va.log" 2>&1
  grep -E "spec cost, batch (1|2)|^ +(1|2) \|" "$OUT/adaptive_run${i}_va$va.log" | head -16
done
timeout 200 python3 benchmarks/gpu_micro.py --skinny --model smollm2 --rows 1 2 5 \
  --out "$OUT/micro" > "$OUT/micro.log" 2>&1
tail -25 "$OUT/micro.log"
timeout 240 python3 benchmarks/gpu_spec.py --out "$OUT/spec" --models smollm2-135m,llama-3.1-8b \
  --batches 1 --configs chain4_dv8k,chain4_dv32k --skip-fp32 --iters 30 > "$OUT/spec.log" 2>&1
tail -4 "$OUT/spec.log" | cut -c1-400
