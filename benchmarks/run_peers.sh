#!/usr/bin/env bash
# Run nanokv, HF transformers (static batching) and vLLM (CPU) R times each, alternating,
# on the same model and workload, one engine at a time. Collects the JSON lines and prints
# median output tok/s per engine and the ratios nanokv/HF and nanokv/vLLM.
#
#   benchmarks/run_peers.sh [-p PRESET] [-r ROUNDS] [-m MODEL_DIR] [-e "ENGINES"] [-o OUT.jsonl]
#
# Presets (-p, or env PRESET):
#   short (default): engines "nanokv hf vllm" on /tmp/qwen3-0.6b-random, workload "--num-requests
#     16 --prompt-len 64 256 --output-len 32 128 --seed 0", nanokv with a 4 GiB pool.
#   long: the long-context preset, where the KV budget and not the weights bounds how many
#     requests run at once. Model /tmp/qwen3-0.6b-4l-random (make_qwen3_0_6b.py --layers 4:
#     the Qwen3-0.6B width, heads and vocabulary, 4 layers, 32 KiB of float32 KV per token),
#     workload "--num-requests 8 --prompt-len 2048 3072 --output-len 256 384 --seed 0"
#     (ignore_eos, greedy), one KV budget in bytes for every engine (KV_BYTES, default 268435456
#     = 256 MiB: 2-3 such requests in float32, all 8 in int8 or 4-bit), MAX_MODEL_LEN 4096,
#     MAX_NUM_SEQS 8 (= the requests, so it never binds; nanokv's KVQuant store charges one
#     staged block per max_num_seqs to the budget), MAX_BATCHED 4096 (step token budget). Engines: vllm (float32 KV,
#     kv_cache_memory_bytes = KV_BYTES), nanokv (float32), nanokv-int8, nanokv-kvquant4
#     (--kv-cache-dtype kvquant --kv-quant-bits 4, uncalibrated), nanokv-kvquant4-pe2 (the same
#     plus --kv-policy paged_eviction --kv-compression-ratio 0.5: a 2x policy). The summary adds
#     peak running requests and preemptions per engine and each engine's ratio to vllm.
#     Any engine name of the long preset also works with -p short (its budget flags included).
#     nanokv-w8 (either preset): nanokv with int8 weights (--quantization int8), float32 KV.
#     nanokv-nohybrid (either preset): nanokv with --disable-hybrid-kv-cache-manager (a model
#     whose layers mix windows and full attention keeps every layer's blocks).
#
# Env: VLLM_VENV (default /work/.vllm-venv), VLLM_ARGS (extra bench_vllm.py args, e.g.
# "--compile"), NANOKV_ARGS (extra `nanokv bench` args), NICE (default 0), WORKLOAD (replaces
# the preset's workload arguments, for smoke runs), KV_BYTES / MAX_MODEL_LEN / MAX_NUM_SEQS /
# MAX_BATCHED (long preset, above), WAIT_IDLE_S (default 0: off): before each run wait up to
# this many seconds until the rest of the machine is quiet (CPU busy < IDLE_BUSY, default 0.10,
# over 3 s). Each result line gets "round", "cpu_busy_before" (the other processes' CPU use just
# before the run) and "preset" added, and "engine" set to the runner's engine name (e.g.
# nanokv-int8). An engine that is missing (nanokv CLI without `bench`, no vLLM venv) or fails is
# reported and skipped; the others still run. PEER_MALLOC (default tuned): the vllm and hf runs
# get glibc's malloc set as nanokv sets its own on CPU (nanokv/worker/cpu_memory.py: mmap
# threshold 32 MiB, no mmap beyond it, no trimming; through GLIBC_TUNABLES), what vLLM's CPU
# docs get by preloading tcmalloc: on a Zen 5 EPYC vLLM ran the long preset at 44.0 tok/s
# without and 50.6 with it; and PyTorch's transparent huge pages on large buffers
# (THP_MEM_ALLOC_ENABLE=1, as the nanokv engine requests where the kernel lends them).
# "system": glibc's defaults and 4 KiB pages for the peers.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROUNDS=3
PRESET="${PRESET:-short}"
MODEL=""
ENGINES=""
OUT=""
while getopts "p:r:m:e:o:h" opt; do
    case "$opt" in
        p) PRESET="$OPTARG" ;;
        r) ROUNDS="$OPTARG" ;;
        m) MODEL="$OPTARG" ;;
        e) ENGINES="$OPTARG" ;;
        o) OUT="$OPTARG" ;;
        *) sed -n '2,42p' "$0"; exit 2 ;;
    esac
done
case "$ROUNDS" in
    ''|*[!0-9]*|0) echo "[run_peers] -r must be an integer >= 1, got '$ROUNDS'" >&2; exit 2 ;;
esac
KV_BYTES="${KV_BYTES:-268435456}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-8}"
MAX_BATCHED="${MAX_BATCHED:-4096}"
for v in KV_BYTES MAX_MODEL_LEN MAX_NUM_SEQS MAX_BATCHED; do
    case "${!v}" in
        ''|*[!0-9]*|0) echo "[run_peers] $v must be an integer >= 1, got '${!v}'" >&2; exit 2 ;;
    esac
done
case "$PRESET" in
    short)
        MODEL="${MODEL:-/tmp/qwen3-0.6b-random}"
        MAKE_MODEL="benchmarks/make_qwen3_0_6b.py --out $MODEL"
        ENGINES="${ENGINES:-nanokv hf vllm}"
        DEFAULT_WORKLOAD="--num-requests 16 --prompt-len 64 256 --output-len 32 128 --seed 0" ;;
    long)
        MODEL="${MODEL:-/tmp/qwen3-0.6b-4l-random}"
        MAKE_MODEL="benchmarks/make_qwen3_0_6b.py --layers 4 --out $MODEL"
        ENGINES="${ENGINES:-vllm nanokv nanokv-int8 nanokv-kvquant4 nanokv-kvquant4-pe2}"
        DEFAULT_WORKLOAD="--num-requests 8 --prompt-len 2048 3072 --output-len 256 384 --seed 0" ;;
    *) echo "[run_peers] unknown preset '$PRESET' (short, long)" >&2; exit 2 ;;
esac
NANOKV_ARGS="${NANOKV_ARGS:-}"
VLLM_VENV="${VLLM_VENV:-/work/.vllm-venv}"
VLLM_ARGS="${VLLM_ARGS:-}"
NICE="${NICE:-0}"
PEER_MALLOC="${PEER_MALLOC:-tuned}"
case "$PEER_MALLOC" in
    tuned) PEER_ENV="env THP_MEM_ALLOC_ENABLE=1 GLIBC_TUNABLES=$(PYTHONPATH="$ROOT" "$ROOT/.venv/bin/python" -c \
               'from nanokv.worker.cpu_memory import glibc_tunables; print(glibc_tunables())')" ;;
    system) PEER_ENV="" ;;
    *) echo "[run_peers] PEER_MALLOC must be tuned or system, got '$PEER_MALLOC'" >&2; exit 2 ;;
esac
WAIT_IDLE_S="${WAIT_IDLE_S:-0}"
IDLE_BUSY="${IDLE_BUSY:-0.10}"
STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-/tmp/nanokv-peers-$STAMP.jsonl}"
LOGDIR="/tmp/nanokv-peers-$STAMP.logs"
mkdir -p "$LOGDIR"
: > "$OUT"

# shellcheck disable=SC2206
WORKLOAD=(${WORKLOAD:-$DEFAULT_WORKLOAD})

if [ ! -f "$MODEL/config.json" ]; then
    echo "model $MODEL missing: run $ROOT/.venv/bin/python $MAKE_MODEL" >&2
    exit 1
fi

# The long preset's shared limits: the same KV bytes, lengths and batch limits for every engine.
NANOKV_LONG="--max-model-len $MAX_MODEL_LEN --max-num-seqs $MAX_NUM_SEQS --max-num-batched-tokens $MAX_BATCHED --kv-cache-memory $KV_BYTES"
VLLM_LONG="--max-model-len $MAX_MODEL_LEN --max-num-seqs $MAX_NUM_SEQS --max-num-batched-tokens $MAX_BATCHED --kv-cache-memory-bytes $KV_BYTES"

engine_cmd() {
    # the workload's --seed: nanokv bench's --workload-seed (its --seed seeds the engine)
    local nanokv="$ROOT/.venv/bin/nanokv bench --model $MODEL ${WORKLOAD[*]/#--seed/--workload-seed} --dtype float32 --json $NANOKV_ARGS"
    local vllm="$PEER_ENV $VLLM_VENV/bin/python $ROOT/benchmarks/bench_vllm.py --model $MODEL ${WORKLOAD[*]} --dtype float32 $VLLM_ARGS"
    case "$PRESET:$1" in
        short:nanokv) echo "$nanokv --max-model-len 1024 --kv-cache-memory 4GiB" ;;
        short:nanokv-w8) echo "$nanokv --max-model-len 1024 --kv-cache-memory 4GiB --quantization int8" ;;
        short:vllm) echo "$vllm" ;;
        *:hf) echo "$PEER_ENV $ROOT/.venv/bin/python $ROOT/benchmarks/bench_hf.py --model $MODEL ${WORKLOAD[*]} --dtype float32" ;;
        *:vllm) echo "$vllm $VLLM_LONG" ;;
        *:nanokv) echo "$nanokv $NANOKV_LONG" ;;
        *:nanokv-int8) echo "$nanokv $NANOKV_LONG --kv-cache-dtype int8" ;;
        *:nanokv-w8) echo "$nanokv $NANOKV_LONG --quantization int8" ;;
        *:nanokv-nohybrid) echo "$nanokv $NANOKV_LONG --disable-hybrid-kv-cache-manager" ;;
        *:nanokv-kvquant4) echo "$nanokv $NANOKV_LONG --kv-cache-dtype kvquant --kv-quant-bits 4" ;;
        *:nanokv-kvquant4-pe2) echo "$nanokv $NANOKV_LONG --kv-cache-dtype kvquant --kv-quant-bits 4 --kv-policy paged_eviction --kv-compression-ratio 0.5" ;;
        *) return 1 ;;
    esac
}

engine_available() {
    case "$1" in
        nanokv*) [ -x "$ROOT/.venv/bin/nanokv" ] && "$ROOT/.venv/bin/nanokv" bench --help >/dev/null 2>&1 ;;
        hf) [ -x "$ROOT/.venv/bin/python" ] ;;
        vllm) [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1 ;;
        *) return 1 ;;
    esac
}

# Fraction of all CPUs busy over 3 s (nothing of ours runs while this samples).
cpu_busy() {
    local a b
    a=($(head -n1 /proc/stat)); sleep 3; b=($(head -n1 /proc/stat))
    awk -v a="${a[*]}" -v b="${b[*]}" 'BEGIN {
        n = split(a, x, " "); split(b, y, " "); t = 0
        for (i = 2; i <= n; i++) t += y[i] - x[i]
        idle = (y[5] - x[5]) + (y[6] - x[6])
        printf "%.2f", (t > 0 ? 1 - idle / t : 0) }'
}

wait_idle() {
    local busy deadline=$(( $(date +%s) + WAIT_IDLE_S ))
    busy="$(cpu_busy)"
    while [ "$WAIT_IDLE_S" -gt 0 ] && awk -v b="$busy" -v m="$IDLE_BUSY" 'BEGIN{exit !(b >= m)}' \
            && [ "$(date +%s)" -lt "$deadline" ]; do
        echo "[run_peers]   waiting for a quiet machine (cpu busy $busy)" >&2
        sleep 20
        busy="$(cpu_busy)"
    done
    echo "$busy"
}

ACTIVE=""
for e in $ENGINES; do
    if ! engine_cmd "$e" >/dev/null; then
        echo "[run_peers] unknown engine '$e' (nanokv hf vllm nanokv-int8 nanokv-kvquant4 nanokv-kvquant4-pe2 nanokv-w8 nanokv-nohybrid)" >&2
        exit 2
    fi
    if engine_available "$e"; then ACTIVE="$ACTIVE $e"; else echo "[run_peers] skipping $e: not available" >&2; fi
done
[ -n "$ACTIVE" ] || { echo "[run_peers] no engine available" >&2; exit 1; }

echo "[run_peers] preset=$PRESET engines:$ACTIVE rounds=$ROUNDS model=$MODEL workload: ${WORKLOAD[*]}" >&2
[ "$PRESET" = short ] || echo "[run_peers] KV budget $KV_BYTES bytes, max-model-len $MAX_MODEL_LEN, max-num-seqs $MAX_NUM_SEQS, max-num-batched-tokens $MAX_BATCHED" >&2
echo "[run_peers] results -> $OUT, logs -> $LOGDIR" >&2
for ((r = 1; r <= ROUNDS; r++)); do
    for e in $ACTIVE; do
        log="$LOGDIR/$e-$r.log"
        busy="$(wait_idle)"
        echo "[run_peers] round $r/$ROUNDS: $e (cpu busy before: $busy, load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
        t0=$(date +%s)
        # shellcheck disable=SC2046
        line="$(nice -n "$NICE" $(engine_cmd "$e") 2>"$log" | grep '^{' | tail -n 1)"
        if [ -z "$line" ]; then
            echo "[run_peers]   $e failed (see $log)" >&2
            continue
        fi
        line="$(printf '%s' "$line" | "$ROOT/.venv/bin/python" -c \
            'import json,sys; d=json.loads(sys.stdin.read()); d.update(engine=sys.argv[3], round=int(sys.argv[1]), cpu_busy_before=float(sys.argv[2]), preset=sys.argv[4]); print(json.dumps(d))' \
            "$r" "$busy" "$e" "$PRESET")"
        echo "$line" >> "$OUT"
        echo "[run_peers]   $e done in $(( $(date +%s) - t0 ))s: $line" >&2
    done
done

"$ROOT/.venv/bin/python" - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault(r["engine"], []).append(r)
med = {}
print(f"{'engine':20} {'runs':>4} {'out tok/s (median)':>19} {'total tok/s':>11} {'elapsed_s':>9} "
      f"{'peak running':>12} {'preemptions':>11}  all out tok/s [cpu busy before]")


def fmt(values):
    vals = sorted({v for v in values if v is not None})
    return "/".join(str(v) for v in vals) if vals else "n/a"


for eng, rs in by.items():
    o = [r["output_tok_s"] for r in rs]
    med[eng] = statistics.median(o)
    print(f"{eng:20} {len(rs):4d} {med[eng]:19.1f} {statistics.median(r['total_tok_s'] for r in rs):11.1f} "
          f"{statistics.median(r['elapsed_s'] for r in rs):9.2f} "
          f"{fmt(r.get('peak_running') for r in rs):>12} {fmt(r.get('num_preemptions') for r in rs):>11}  "
          + ", ".join(f"{r['output_tok_s']:.1f} [{r.get('cpu_busy_before', float('nan')):.2f}]" for r in rs))
for peer in ("hf", "vllm"):
    for eng in med:
        if eng.startswith("nanokv") and peer in med:
            print(f"{eng}/{peer}: {med[eng] / med[peer]:.2f}x")
PY
