#!/usr/bin/env bash
# Run nanokv, HF transformers (static batching) and vLLM (CPU) R times each, alternating,
# on the same model and workload, one engine at a time. Collects the JSON lines and prints
# median output tok/s per engine and the ratios nanokv/HF and nanokv/vLLM.
#
#   benchmarks/run_peers.sh [-r ROUNDS] [-m MODEL_DIR] [-e "nanokv hf vllm"] [-o OUT.jsonl]
#
# Env: VLLM_VENV (default /work/.vllm-venv), VLLM_ARGS (extra bench_vllm.py args, e.g.
# "--compile"), NICE (default 0), WORKLOAD (replaces the default workload arguments
# "--num-requests 16 --prompt-len 64 256 --output-len 32 128 --seed 0", for smoke runs),
# WAIT_IDLE_S (default 0: off): before each run wait up to this many seconds until the rest of
# the machine is quiet (CPU busy < IDLE_BUSY, default 0.10, over 3 s). Each result line gets
# "round" and "cpu_busy_before" (the other processes' CPU use just before the run) added. An engine that is missing (nanokv CLI without `bench`, no
# vLLM venv) or fails is reported and skipped; the others still run.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROUNDS=3
MODEL=/tmp/qwen3-0.6b-random
ENGINES="nanokv hf vllm"
OUT=""
while getopts "r:m:e:o:h" opt; do
    case "$opt" in
        r) ROUNDS="$OPTARG" ;;
        m) MODEL="$OPTARG" ;;
        e) ENGINES="$OPTARG" ;;
        o) OUT="$OPTARG" ;;
        *) sed -n '2,10p' "$0"; exit 2 ;;
    esac
done
VLLM_VENV="${VLLM_VENV:-/work/.vllm-venv}"
VLLM_ARGS="${VLLM_ARGS:-}"
NICE="${NICE:-0}"
WAIT_IDLE_S="${WAIT_IDLE_S:-0}"
IDLE_BUSY="${IDLE_BUSY:-0.10}"
STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-/tmp/nanokv-peers-$STAMP.jsonl}"
LOGDIR="/tmp/nanokv-peers-$STAMP.logs"
mkdir -p "$LOGDIR"
: > "$OUT"

# shellcheck disable=SC2206
WORKLOAD=(${WORKLOAD:---num-requests 16 --prompt-len 64 256 --output-len 32 128 --seed 0})

if [ ! -f "$MODEL/config.json" ]; then
    echo "model $MODEL missing: run $ROOT/.venv/bin/python benchmarks/make_qwen3_0_6b.py --out $MODEL" >&2
    exit 1
fi

engine_cmd() {
    case "$1" in
        nanokv) echo "$ROOT/.venv/bin/nanokv bench --model $MODEL ${WORKLOAD[*]} --dtype float32 --max-model-len 1024 --kv-cache-memory 4GiB --json" ;;
        hf) echo "$ROOT/.venv/bin/python $ROOT/benchmarks/bench_hf.py --model $MODEL ${WORKLOAD[*]} --dtype float32" ;;
        vllm) echo "$VLLM_VENV/bin/python $ROOT/benchmarks/bench_vllm.py --model $MODEL ${WORKLOAD[*]} --dtype float32 $VLLM_ARGS" ;;
        *) return 1 ;;
    esac
}

engine_available() {
    case "$1" in
        nanokv) [ -x "$ROOT/.venv/bin/nanokv" ] && "$ROOT/.venv/bin/nanokv" bench --help >/dev/null 2>&1 ;;
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
    if engine_available "$e"; then ACTIVE="$ACTIVE $e"; else echo "[run_peers] skipping $e: not available" >&2; fi
done
[ -n "$ACTIVE" ] || { echo "[run_peers] no engine available" >&2; exit 1; }

echo "[run_peers] engines:$ACTIVE rounds=$ROUNDS model=$MODEL workload: ${WORKLOAD[*]}" >&2
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
            'import json,sys; d=json.loads(sys.stdin.read()); d["round"]=int(sys.argv[1]); d["cpu_busy_before"]=float(sys.argv[2]); print(json.dumps(d))' \
            "$r" "$busy")"
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
print(f"{'engine':8} {'runs':>4} {'out tok/s (median)':>19} {'total tok/s':>11} {'elapsed_s':>9}"
      "  all out tok/s [cpu busy before]")
for eng, rs in by.items():
    o = [r["output_tok_s"] for r in rs]
    med[eng] = statistics.median(o)
    print(f"{eng:8} {len(rs):4d} {med[eng]:19.1f} {statistics.median(r['total_tok_s'] for r in rs):11.1f} "
          f"{statistics.median(r['elapsed_s'] for r in rs):9.2f}  "
          + ", ".join(f"{r['output_tok_s']:.1f} [{r.get('cpu_busy_before', float('nan')):.2f}]" for r in rs))
for peer in ("hf", "vllm"):
    if "nanokv" in med and peer in med:
        print(f"nanokv/{peer}: {med['nanokv'] / med[peer]:.2f}x")
PY
