# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
# Prefill/decode workers on GPUs, TP inside the workers (benchmarks/gpu_workers.py has the
# details):
#   2 GPUs (nvidia-h100-x2):  bash benchmarks/gpu_workers.sh --deploy 2gpu
#   4 GPUs (nvidia-h100-x4):  bash benchmarks/gpu_workers.sh --deploy 2gpu,4gpu-tp2
#   exact float32 check:      bash benchmarks/gpu_workers.sh --deploy 4gpu-tp2 --dtype float32 \
#                                 --attention-backend torch --concurrency 1,8
# Prints a table and writes $OUT/gpu_workers.json; exit code 1 if an equality check failed.
# Budget: < 5 minutes per deployment (the first FlashInfer JIT build can take ~2 of them).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 benchmarks/gpu_workers.py --out "${OUT:-/tmp/out}" "$@"
