#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a lent GPU machine (no FastAPI, no
# downloads there; nanokv runs from the working tree with PYTHONPATH=.). Each stage has its own
# time limit (the default stages' limits add up to about 835 s, more than a 15-minute lease
# leaves after a machine start and a rerun: pick some with STAGES, e.g. the next session's
# STAGES='suite_cuda|triton_sweep|triton_bench|make_model|kv_|profile_kvquant$', 570 s of
# limits, the Triton-write profile_kvquant only) and writes to $OUT (default /tmp/gpu_check);
# summary.md gathers the figures at the end. With PACK=FILE.tgz the logs so far are packed into
# FILE after every stage (a tool that returns few files gets one, also when the run is cut short).
# Run from the repository root:  OUT=/path bash scripts/gpu_check.sh
# STAGES=REGEX runs only the stages whose name matches (e.g. STAGES='bench|profile' to rerun).
# Stages, most informative first:
#   suite_cuda             the tests that take another path on CUDA (tests/cuda, the Triton
#                          kernels against the dense reference, decode graphs, HF parity, KV
#                          policies over quantized caches, quantized outputs under chunking and
#                          prefix hits: the Triton prefill in decode's view end to end;
#                          speculative decoding's verification steps beside decode graphs)
#   triton_sweep           Triton decode attention alone at 1k-32k tokens of context, 1 and 16
#                          requests: int8 / fp8 / KVQuant 4-bit codes read in place against the
#                          bf16 pool, outputs checked against a dense reference, timed as CUDA
#                          graph replays; then each kernel's launch settings around its
#                          defaults (splits up to 64, pipelining depth, warps, key tile or the
#                          KVQuant kernel's unroll) at 32k tokens (--sweep-variants)
#   triton_bench           one layer's decode + prefill step, Triton backend vs PyTorch backend
#                          (float pool, int8, fp8; KVQuant 4-bit decode and prefill attention
#                          alone; benchmarks/bench_triton_attention.py)
#   parity                 greedy parity with HF on CUDA (tiny models; plain, prefix hits,
#                          chunking, preemption, int8), decode through CUDA graphs
#                          (parity_eager, --enforce-eager: only with STAGES=parity_eager)
#   make_model             the Qwen3-0.6B-shaped random model (benchmarks/make_qwen3_0_6b.py)
#   bench_64 (bench_256)   nano-vLLM's benchmark shape (random prompts 100-1024, outputs
#                          100-1024, ignore_eos, greedy, bf16) with graphs, 64 requests (256
#                          only with STAGES=bench_256: 11,096 output tok/s on 2026-12-04)
#   peer_hf_64             the same 64 requests through Hugging Face transformers (static
#                          batching, benchmarks/bench_hf.py): the peer for bench_64's ratio
#   kv_auto / kv_int8 / kv_kvquant / kv_kivi  the engine with a bf16 pool, an int8 store, a
#                          KVQuant 4-bit store and a KIVI 2-bit store (Triton decode over the
#                          codes, Triton writes, CUDA graphs) on one long-prompt workload (32
#                          requests, prompts 1024-2048, 128 outputs)
#   profile_kvquant        the KVQuant 4-bit engine's prefill timed and 2 decode steps profiled
#                          at 32 requests x 1024 tokens, through its CUDA graphs and eagerly (it
#                          ran at ~50 output tok/s on an H200, 70x slower than the bf16 pool,
#                          before its Triton write and graphs: where does its time go?)
#   profile_kvquant_torch_write  eagerly with the store's PyTorch quantize-on-write (the A/B
#                          of the Triton write kernels, kernels/triton/kvquant_write.py)
#   profile                torch profiler over 3 decode steps at 256 running, graphs and eager
#   suite                  the whole test suite (the CPU paths under this machine's torch and
#                          transformers; FastAPI's are not there): only with STAGES=suite
# Results are recorded in docs/results/gpu/ with the machine, command and date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python}
MODEL=${MODEL:-/tmp/qwen3-0.6b-random}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
: > "$OUT/stages.tsv"

stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  [[ $name =~ ${STAGES:-.} ]] || return 0
  # some stages only when asked for by name
  [[ " suite parity_eager bench_256 " != *" $name "* || -n ${STAGES:-} ]] || return 0
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$OUT/stages.tsv"
  echo "   rc=$rc in $((SECONDS - t0))s ($OUT/$name.log)"
  [ -z "${PACK:-}" ] || tar czf "$PACK" -C "$OUT" . 2>/dev/null
}

# nanokv's bench on the GPU; nano-vLLM's benchmark shape (also the HF peer's workload)
ENGINE_BENCH=($PY -m nanokv.cli bench --model "$MODEL" --device cuda --dtype bfloat16
  --skip-tokenizer-init --json)
NANO_SHAPE=(--prompt-len 100 1024 --output-len 100 1024)
bench() {  # name, seconds, requests, extra flags...
  local name=$1 limit=$2 n=$3; shift 3
  stage "$name" "$limit" "${ENGINE_BENCH[@]}" --num-requests "$n" "${NANO_SHAPE[@]}" \
    --max-num-seqs 256 --max-num-batched-tokens 16384 --max-model-len 4096 "$@"
}

CUDA_TESTS="tests/cuda tests/unit/test_triton_attention.py tests/unit/test_triton_kvquant.py
  tests/unit/test_triton_kvquant_read.py
  tests/unit/test_kvquant_triton_write.py tests/unit/test_kvquant_graph_write.py
  tests/unit/test_kivi_triton_write.py
  tests/model/test_decode_graphs.py tests/model/test_hf_parity.py tests/unit/test_seams.py
  tests/model/test_quant_policies.py tests/model/test_block_score_cache.py
  tests/model/test_quant_consistency.py"
# shellcheck disable=SC2086
stage suite_cuda 90 $PY -m pytest -p no:cacheprovider -rfE -n 12 $CUDA_TESTS
stage triton_sweep 200 $PY benchmarks/bench_triton_attention.py --device cuda --repeats 20 \
  --sweep-contexts 1024 4096 16384 32768 --sweep-requests 1 16 --sweep-variants --out "$OUT"
stage triton_bench 30 $PY benchmarks/bench_triton_attention.py --device cuda --repeats 5 \
  --out "$OUT"
stage parity 45 $PY scripts/cuda_parity.py --out "$OUT"
[ -f "$MODEL/config.json" ] || stage make_model 35 $PY benchmarks/make_qwen3_0_6b.py --out "$MODEL"
bench bench_256 60 256
stage profile 30 $PY scripts/gpu_profile_decode.py --model "$MODEL" --out "$OUT"
bench bench_64 30 64
stage peer_hf_64 100 $PY benchmarks/bench_hf.py --model "$MODEL" --device cuda --dtype bfloat16 \
  --num-requests 64 "${NANO_SHAPE[@]}"
for kv in auto:25 int8:25 kvquant:60 kivi:45; do  # name:seconds
  stage "kv_${kv%:*}" "${kv#*:}" "${ENGINE_BENCH[@]}" --num-requests 32 --prompt-len 1024 2048 \
    --output-len 128 128 --max-num-seqs 32 --max-model-len 4096 --kv-cache-dtype "${kv%:*}"
done
stage profile_kvquant 60 $PY scripts/gpu_profile_decode.py --model "$MODEL" --out "$OUT" \
  --kv-cache-dtype kvquant --requests 32 --prompt-len 1024 --steps 2
stage profile_kvquant_torch_write 60 $PY scripts/gpu_profile_decode.py --model "$MODEL" \
  --out "$OUT" --kv-cache-dtype kvquant --requests 32 --prompt-len 1024 --steps 2 \
  --kvquant-write torch
stage parity_eager 35 $PY scripts/cuda_parity.py --out "$OUT" --enforce-eager
# shellcheck disable=SC2086
stage suite 300 $PY -m pytest -p no:cacheprovider --continue-on-collection-errors -rfE -n 12 \
  -q tests/unit tests/model tests/e2e

$PY - "$OUT" > "$OUT/summary.md" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("# gpu_check summary\n")
print("| stage | rc | seconds | limit |\n|---|---|---|---|")
for line in (out / "stages.tsv").read_text().splitlines():
    print("| " + " | ".join(line.split("\t")) + " |")
for name in ("cuda_parity.json", "cuda_parity_eager.json"):
    p = out / name
    if p.exists():
        rows = json.loads(p.read_text())["results"]
        bad = [f"{r['arch']}/{r['scenario']}" for r in rows if not r["hf_equal"]]
        steps = sum(r.get("graph_steps", 0) for r in rows)
        print(f"\n{name}: {len(rows) - len(bad)}/{len(rows)} equal to HF, graph steps {steps}"
              + (f"; differ: {bad}" if bad else ""))
print("\n| run | output tok/s | median TTFT s | median TPOT ms | elapsed s |\n|---|---|---|---|---|")
results = {}
for name in ("bench_256", "bench_64", "peer_hf_64", "kv_auto", "kv_int8", "kv_kvquant",
             "kv_kivi"):
    log = out / f"{name}.log"
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")] if log.exists() else []
    if not lines:
        print(f"| {name} | (no result) | | | |")
        continue
    r = results[name] = json.loads(lines[-1])
    tpot = r.get("tpot_median_s")
    print(f"| {name} | {r['output_tok_s']:.0f} | {r.get('ttft_median_s') or 0:.2f} | "
          f"{(tpot or 0) * 1e3:.1f} | {r['elapsed_s']:.1f} |")
for kv in ("kv_int8", "kv_kvquant", "kv_kivi"):
    if kv in results and "kv_auto" in results:
        ratio = results[kv]["output_tok_s"] / results["kv_auto"]["output_tok_s"]
        print(f"\n{kv[3:]} / bf16 pool, output tok/s, same workload and run: {ratio:.2f}x")
if "bench_64" in results and "peer_hf_64" in results:
    ratio = results["bench_64"]["output_tok_s"] / results["peer_hf_64"]["output_tok_s"]
    print(f"\nnanokv / HF transformers, the same 64 requests, same run: {ratio:.2f}x")
for p in (out / "profile_decode.json", out / "profile_decode_kvquant.json"):
    if not p.exists():
        continue
    prof = json.loads(p.read_text())
    print(f"\nprofile ({prof['requests']} running, KV {prof.get('kv_cache_dtype', 'auto')}, "
          f"backend {prof['backend']}, prefill {prof.get('prefill_s')} s):")
    for mode in ("graphs", "eager"):
        if mode in prof:
            m = prof[mode]
            print(f"- {mode}: step wall ms {m['step_wall_ms']}, GPU ms/step {m['gpu_ms_per_step']},"
                  f" launches/step {m['launch_calls_per_step']}")
for name in ("triton_decode_sweep", "triton_launch_variants", "triton_attention"):
    p = out / f"{name}.md"
    if p.exists():
        print(f"\n{name}:\n\n{p.read_text()}")
for name in ("suite_cuda", "suite"):
    log = out / f"{name}.log"
    if log.exists():
        tail = [l for l in log.read_text().splitlines() if " passed" in l or " failed" in l]
        print(f"\n{name}: {tail[-1] if tail else '(no final line: cut by its time limit?)'}")
EOF
cat "$OUT/summary.md"
[ -z "${PACK:-}" ] || tar czf "$PACK" -C "$OUT" . 2>/dev/null
