#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a lent GPU machine (no FastAPI, no
# downloads there): each stage has its own time limit and writes to $OUT (default /tmp/gpu_check).
# Run from the repository root:  OUT=/path bash scripts/gpu_check.sh
# Stages: (1) greedy parity with HF on CUDA through the CUDA-only paths (padded decode batch,
# quantized store on the device), (2) the CPU unit tests of those paths' logic on this machine
# (PyTorch reference), (3) nanokv bench on CUDA with a tiny random model. Results are recorded in
# docs/results/gpu/ with the machine, command and date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$? ($OUT/$name.log)"
}

stage cuda_parity 240 $PY scripts/cuda_parity.py --out "$OUT"
stage cpu_logic 180 $PY -m pytest -q tests/unit/test_attention.py tests/unit/test_seams.py \
  tests/model/test_pluggable.py -k "padded or backend or spec"
$PY -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import build_tiny_model; build_tiny_model('$OUT/tiny', 'qwen3')" > "$OUT/tiny.log" 2>&1
stage cuda_bench 180 $PY -m nanokv.cli bench --model "$OUT/tiny" --device cuda --json \
  --num-requests 64 --prompt-len 64 256 --output-len 32 128 --max-model-len 512
