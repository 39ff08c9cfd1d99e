#!/usr/bin/env bash
# Serving benchmark on the GPU machine (2 GPUs of one host: kind nvidia-h100-x2 or
# nvidia-h200-x2), from the repository root:
#
#   MODEL=smollm2 bash benchmarks/gpu_serving.sh
#   MODEL=8b bash benchmarks/gpu_serving.sh
# (benchmarks/gpu_env.sh sets up the bundle and a grpcio new enough for the stubs: see there.)
#
# `tandem bench` starts each bundled config of MODEL in turn on a local Ray instance, benchmarks
# it and stops it (tandem/deploy/bench/gpu-$MODEL-*.yaml: random prompts of 2048-4096 tokens,
# 256 new tokens, concurrency 1, 16, 64; dummy bf16 weights and a random EAGLE head, so tau ~ 1):
#   colocated-plain  one GPU, one engine, no speculation   (the reference)
#   colocated        one GPU, one engine, EAGLE chain k=4  (what speculation costs)
#   disagg-nixl      1 prefill + 1 decode GPU, KV over NIXL (what disaggregation costs)
# and writes $OUT/bench-$MODEL.json (schema: tandem/bench/results.py), bench-$MODEL.png and
# bench-$MODEL.log (the console report: TTFT/ITL/TPOT percentiles next to the HBM floor,
# goodput, tau, and the TTFT that disaggregation adds next to the NVLink floor).
#
# RUNS picks configs (default: all three); EXTRA passes flags, e.g. EXTRA="--num-requests 4,16,64"
# to fit a 10-minute call. Every run's results are in the JSON as soon as it finishes.
source benchmarks/gpu_env.sh
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODEL=${MODEL:-smollm2}
RUNS=${RUNS:-colocated-plain colocated disagg-nixl}
ARGS=()
for run in $RUNS; do
  ARGS+=(--config "gpu-$MODEL-$run")
done
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
# shellcheck disable=SC2086  # EXTRA is a list of flags
python3 -m tandem.cli --log-level INFO bench "${ARGS[@]}" --out "$OUT/bench-$MODEL.json" \
  --no-progress ${EXTRA:-} 2>&1 | tee "$OUT/bench-$MODEL.log"
ls -l "$OUT"
