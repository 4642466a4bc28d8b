#!/bin/bash
# LoRA serving against vLLM on one machine: the Qwen3-0.6B shape (28 layers, random weights of
# std 0.08), 4 random rank-16 adapters of every projection (`make_lora_adapters.py`), 8
# requests of 64 random-id tokens, 64 greedy output tokens (`bench_lora.py`): each engine
# without LoRA (the base model), then with it (no adapter, one adapter for all, the 4 adapters
# in turn), each run in its own process, the two engines in turn --rounds times. Needs the vLLM
# venv of benchmarks/setup_vllm.sh; about 25 minutes on 2 cores.
#
#   bash benchmarks/run_lora_results.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/lora}
PY=${PY:-.venv/bin/python}
VLLM_PY=${VLLM_PY:-/work/.vllm-venv/bin/python}
BASE=${BASE:-/tmp/qwen3-0.6b-std08}
ADAPTERS=${ADAPTERS:-/tmp/lora-adapters-qwen3-0.6b}
ROUNDS=${ROUNDS:-2}
WORKLOAD=(--requests 8 --prompt-len 64 --output-len 64 --repeats 3)
[ -d "$BASE" ] || "$PY" benchmarks/make_qwen3_0_6b.py --init-std 0.08 --out "$BASE"
[ -d "$ADAPTERS/adapter3" ] || "$PY" benchmarks/make_lora_adapters.py --model "$BASE" \
    --count 4 --rank 16 --out "$ADAPTERS"
mkdir -p "$OUT"
: > "$OUT/runs.jsonl"
for round in $(seq "$ROUNDS"); do
  for lora in off on; do
    "$PY" benchmarks/bench_lora.py --engine nanokv --lora "$lora" --model "$BASE" \
        --adapters "$ADAPTERS"/adapter{0,1,2,3} --num-threads 2 "${WORKLOAD[@]}" 2>/dev/null \
        | grep '^{"engine' >> "$OUT/runs.jsonl"
    "$VLLM_PY" benchmarks/bench_lora.py --engine vllm --lora "$lora" --model "$BASE" \
        --adapters "$ADAPTERS"/adapter{0,1,2,3} "${WORKLOAD[@]}" 2>/dev/null \
        | grep '^{"engine' >> "$OUT/runs.jsonl"
  done
done
"$PY" benchmarks/lora_table.py "$OUT/runs.jsonl" | tee "$OUT/table.md"
