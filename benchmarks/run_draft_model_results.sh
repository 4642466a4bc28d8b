#!/bin/bash
# Draft-model speculative decoding against vLLM and Hugging Face transformers on one machine:
# a Qwen3-0.6B-shaped model (28 layers, random weights of std 0.08) and a 2-layer draft model
# cut from it (`make_draft_pair.py`; the model's later layers damped so the two agree often),
# two pairs (damping 0.02 and 0.01: about 60-75% and 85-90% of drafts accepted). Per pair:
# nanokv (decoding alone, k = 2, 4) and transformers (greedy, assisted generation) in one
# process, then vLLM's runs (k = 0, 2, 4), each in its own process. Needs the vLLM venv of
# benchmarks/setup_vllm.sh; about 30 minutes on 2 cores.
#
#   bash benchmarks/run_draft_model_results.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/speculative/draft_model}
PY=${PY:-.venv/bin/python}
VLLM_PY=${VLLM_PY:-/work/.vllm-venv/bin/python}
BASE=${BASE:-/tmp/qwen3-0.6b-std08}
WORKLOAD=(--repeats-in-prompt 1 --segment 64 --prompts 3 --output-len 48 --repeats 3)
[ -d "$BASE" ] || "$PY" benchmarks/make_qwen3_0_6b.py --init-std 0.08 --out "$BASE"
for damping in 0.02 0.01; do
  pair=/tmp/draft-pair-$damping
  [ -d "$pair/draft" ] || "$PY" benchmarks/make_draft_pair.py --base "$BASE" \
      --damping "$damping" --out "$pair"
  "$PY" benchmarks/bench_speculative.py --model "$pair/target" --draft-model "$pair/draft" \
      "${WORKLOAD[@]}" --k 2 4 --num-threads 2 --out "$OUT/damping_$damping" 2>/dev/null
  : > "$OUT/damping_$damping/vllm.jsonl"
  for k in 0 2 4; do
    "$VLLM_PY" benchmarks/bench_speculative_vllm.py --model "$pair/target" \
        --draft-model "$pair/draft" "${WORKLOAD[@]}" --k "$k" 2>/dev/null \
        | grep '^{"engine' >> "$OUT/damping_$damping/vllm.jsonl"
  done
done
