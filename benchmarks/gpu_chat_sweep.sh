#!/usr/bin/env bash
# Issue 22 on one GPU: the real-weights sweep (SmolLM2-135M-Instruct + the shipped EAGLE head,
# the 50 chat prompts, greedy bf16, 128 new tokens; plain / spec / tree / adaptive at
# concurrency 1, 4, 16, 50) in four calls on one warm machine. The GGUF (98 MB) is over what
# one call can carry, so it travels as four 24.6 MB pieces (`split -b 24590608 -d GGUF
# .gpucache/q`), and the pure-Python `gguf` package in .gpucache/py:
#   PHASE=a  carry .devbundle-fi .gpucache/q00     -> /tmp/gc/q00 (and FlashInfer unpacked)
#   PHASE=b1 carry .gpucache/q01                   -> /tmp/gc/q01
#   PHASE=b2 carry .gpucache/q02                   -> /tmp/gc/q02 (two pieces and the tree pass
#                                                     the 64 MiB a call carries)
#   PHASE=c  carry .gpucache/q03 .gpucache/py      -> join, check md5, import, run the sweep
# Issue each call within 30 s of the last (an idle machine goes back, and /tmp with it).
# ENGINES picks engines, EXTRA adds gpu_spec_chat.py options (e.g. "--concurrency 16
# --skip-batch1 --repeats 1").
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/gc
OUT=${OUT:-results}
mkdir -p "$OUT"
case "${PHASE:?set PHASE=a, b1, b2 or c}" in
  a) source benchmarks/gpu_env.sh; cp .gpucache/q00 /tmp/gc/; ls -la /tmp/gc ;;
  b1) cp .gpucache/q01 /tmp/gc/; ls -la /tmp/gc ;;
  b2) cp .gpucache/q02 /tmp/gc/; ls -la /tmp/gc ;;
  c)
    source benchmarks/gpu_env.sh
    cp .gpucache/q03 /tmp/gc/
    cat /tmp/gc/q00 /tmp/gc/q01 /tmp/gc/q02 /tmp/gc/q03 > /tmp/gc/smollm2.gguf
    sum=$(md5sum /tmp/gc/smollm2.gguf | cut -d' ' -f1)
    [ "$sum" = a1231443440b107ff29f02bdb38c9d0a ] || { echo "GGUF md5 $sum: a piece is missing"; exit 1; }
    export PYTHONPATH="$PWD/.gpucache/py:$PWD:${PYTHONPATH:-}"
    rm -rf /tmp/gc/smollm2
    python3 -c "from pathlib import Path; from tandem.engine.model_import import import_gguf; \
import_gguf(Path('/tmp/gc/smollm2.gguf'), Path('/tmp/gc/smollm2'))" || exit 1
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout ${SWEEP_TIMEOUT:-540} python3 benchmarks/gpu_spec_chat.py --model /tmp/gc/smollm2 \
      --engines ${ENGINES:-plain,spec,tree,adaptive} --out "$OUT" ${EXTRA:-} > "$OUT/log.txt" 2>&1
    echo "rc=$?"; tail -40 "$OUT/log.txt" | cut -c1-200
    ;;
esac
