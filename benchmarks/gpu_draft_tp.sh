#!/usr/bin/env bash
# Issue 26 on 2 GPUs, one call: the EAGLE head sharded over TP (spec/head.py draft_tp) against
# the replicated head (--draft-ab) or against verify planned on the host (--verify-ab), on the same host. First the 2-GPU TP tests (the sharded head in graphs,
# bf16), then benchmarks/gpu_tp.py with --draft-ab (plain TP steps, and the round back to back
# with and without drafting ahead, sharded and replicated) and kernel profiles.
#   bash benchmarks/gpu_draft_tp.sh        # on the device machine, carrying .devbundle-fi
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
OUT=${OUT:-results}
mkdir -p "$OUT"
for case in plain spec; do  # one process each: NCCL captured in graphs never tears down
  timeout 150 python3 -m pytest -q tests/gpu/test_colocated_tp_gpu.py -k $case --tb=short 2>&1 \
    | tail -4
done
timeout 150 python3 -m pytest -q tests/gpu/test_tp_graphs.py --tb=short 2>&1 | tail -4
timeout 300 python3 benchmarks/gpu_tp.py --out "$OUT" --label drafttp --batch 1 8 --verify-ab \
  --profile > "$OUT/log.txt" 2>&1
grep -E "^TP=|EAGLE|back to back|flag_stress \(" "$OUT/log.txt" | cut -c1-220
