#!/usr/bin/env bash
# Before and after in one device call: the same benchmark from an earlier commit's tree and
# from this one, alternating, so that the host's drift (up to 2x within a minute on the
# lent H200s, docs/perf.md "Session 26") falls on both alike.
#
# Here, once (writes `.old/`: REV's tandem/ and benchmarks/ without the bundled weights,
# ~6 MiB; `.old/` must be ignored, e.g. `echo /.old/ >> .git/info/exclude`):
#
#   bash benchmarks/gpu_ab.sh --make a1ff6e4
#
# On the device (carry `.old` with the call):
#
#   source benchmarks/gpu_env.sh
#   REPEATS=3 bash benchmarks/gpu_ab.sh python3 benchmarks/gpu_spec.py --models smollm2-135m \
#       --batches 1 --configs chain4_dv8k --skip-fp32 --iters 30 --out @OUT@
#
# Runs old1, new1, old2, new2, ... (each command with @OUT@ replaced by $OUT/<run>), each
# run's output in $OUT/<run>.log; RUN_TIMEOUT (default 170 s) bounds a run. Prints each
# log's last lines (TAIL, default 6) at the end.
set -uo pipefail
if [ "${1:-}" = "--make" ]; then
  rev=${2:?usage: gpu_ab.sh --make REV}
  rm -rf .old && mkdir .old
  git archive "$rev" tandem benchmarks | tar -x -C .old
  rm -rf .old/tandem/assets  # linked to this tree's on the device (too large to carry twice)
  du -sh .old
  exit 0
fi
[ $# -gt 0 ] || { echo "usage: gpu_ab.sh COMMAND... (with @OUT@), or --make REV" >&2; exit 2; }
[ -d .old/tandem ] || { echo ".old/ missing: bash benchmarks/gpu_ab.sh --make REV, carry it" >&2; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ln -sfn "$PWD/tandem/assets" .old/tandem/assets
for i in $(seq 1 "${REPEATS:-2}"); do
  for side in old new; do
    run=$side$i
    args=("${@//@OUT@/$OUT/$run}")
    if [ $side = old ]; then
      (cd .old && timeout "${RUN_TIMEOUT:-170}" "${args[@]}") > "$OUT/$run.log" 2>&1
    else
      timeout "${RUN_TIMEOUT:-170}" "${args[@]}" > "$OUT/$run.log" 2>&1
    fi
    echo "$run: exit $?"
  done
done
for f in "$OUT"/old*.log "$OUT"/new*.log; do
  echo "== $f"
  tail -n "${TAIL:-6}" "$f"
done
