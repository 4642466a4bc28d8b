#!/usr/bin/env bash
# Train a retrieval test model on varied passkey formats, on a lent GPU (one prepared run).
#
# Why: the shipped model (models/nanokv-tiny, 4.2M parameters, trained on 2 CPU cores) retrieves
# a pass key only in its training format: 0.975 in the classic format, 0.00-0.05 with another
# filler or wording (docs/results/model/formats.md). A CPU fine-tune on the trained formats
# moved that only slightly in 40 minutes. This run trains a larger model from scratch on every
# trained haystack and wording (scripts/train_tiny.py --passkey-format trained) and evaluates
# the held-out ones (--eval-formats), within a fixed time budget, writing to $OUT:
#   $OUT/model/        the exported Hugging Face directory (weights, tokenizer, eval_results.json)
#   $OUT/train.log     the training log (in-training evaluations by format)
#   $OUT/eval_*.md     nanokv eval's passkey table per format on the trained model
#
#   OUT=/path bash scripts/gpu_train_retrieval.sh
# Env: MINUTES (training budget, default 7), PY (python, default python), SHAPE (train_tiny
# shape flags, default an 8-layer, 512-wide Qwen3 with 8 query / 4 KV heads of 64),
# TOKENS_PER_STEP (default 32768), EXTRA (more train_tiny flags), EVAL_SAMPLES (default 50).
# The tokenizer is the shipped model's (no tokenizer training on the GPU machine). Note: the
# held-out perplexity depends on the interpreter's standard library (the corpus), so compare it
# only with runs on the same Python version.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_train}
PY=${PY:-python}
MINUTES=${MINUTES:-7}
SHAPE=${SHAPE:---hidden 512 --intermediate 1536 --layers 8 --heads 8 --kv-heads 4 --head-dim 64}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-32768}
EVAL_SAMPLES=${EVAL_SAMPLES:-50}
EXTRA=${EXTRA:-}
export PYTHONPATH=.
mkdir -p "$OUT/work"
cp models/nanokv-tiny/tokenizer.json "$OUT/work/tokenizer.json"
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

limit=$(( ${MINUTES%.*} * 60 + 300 ))  # the budget plus the final evaluation
echo "== train (budget ${MINUTES} min, limit ${limit}s)"
# shellcheck disable=SC2086
timeout "$limit" $PY scripts/train_tiny.py --workdir "$OUT/work" --out "$OUT/model" \
  --max-minutes "$MINUTES" --steps 100000 --lengths 1024,2048,2048 \
  --tokens-per-step "$TOKENS_PER_STEP" $SHAPE --lr 1e-3 --warmup 100 --induction-warmup 0 \
  --copy-frac 0.0 --stdlib-frac 0.3 --answer-weight 3 --early-needle-frac 0.3 \
  --task-weights passkey=0.7,multikey_needle=0.15,kv_lookup=0.1,variable_tracking=0.05 \
  --passkey-format trained --eval-formats held_out,trained,story/pass_key,grass/secret_code \
  --eval-every 400 --eval-samples 16 --final-samples "$EVAL_SAMPLES" --stop-passkey 2 \
  --threads 8 $EXTRA > "$OUT/train.log" 2>&1
echo "   rc=$? ($OUT/train.log)"

if [ -f "$OUT/model/config.json" ]; then
  for fmt in classic trained held_out story/pass_key grass/secret_code; do
    name=${fmt//\//_}
    echo "== eval $fmt"
    timeout 120 $PY -m nanokv.cli eval --model "$OUT/model" --policies full --tasks passkey \
      --num-samples "$EVAL_SAMPLES" --context-tokens 2048 --eval-seed 500000 \
      --passkey-format "$fmt" > "$OUT/eval_$name.md" 2> "$OUT/eval_$name.err"
    echo "   rc=$? ($OUT/eval_$name.md)"
  done
fi
