#!/usr/bin/env bash
# The wheel outside the repo: build it, install it into a fresh venv in a temporary directory
# (versions from constraints.txt, so torch is the CPU 2.13.0 build), and run from there, with
# nothing of the working tree on the path: a missing extra's message, generate on the shipped
# model with the C decode kernel built on first use, calibrate + a kvquant engine on its file
# (through the quantized C kernels, whose sources the wheel must carry, headers included),
# serve + a completion, and the load tester. Run by .ci/run; about a minute and a half here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nanokv-wheel.XXXXXX")
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "[check_wheel] $*"; }

"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT"
WHEEL=$(ls "$WORK"/dist/nanokv-*.whl)
"$PY" -m zipfile -l "$WHEEL" > "$WORK/wheel-files.txt"
for src in decode_attention.c quant_decode_attention.c panel_linear.c fused_elementwise.c \
    kvquant_quantize.c int8_quantize.c sum16.h half.h kvquant_block.h kvquant_block_avx512.h \
    kvquant_block_avx2.h kvquant_slot_keys_avx512.h sum8.h; do
  grep -q "nanokv/layers/csrc/$src" "$WORK/wheel-files.txt" \
    || { say "the wheel lacks the kernels' source $src"; exit 1; }
done
"$PY" -m venv "$WORK/venv"
BIN=$WORK/venv/bin
"$BIN/pip" install -q -c "$ROOT/constraints.txt" "$WHEEL"
cd "$WORK"
MODEL=$ROOT/models/nanokv-tiny
export NANOKV_CACHE_DIR=$WORK/kernel-cache

say "plain install: engine only"
"$BIN/python" -c "import nanokv, sys; assert '/site-packages/' in nanokv.__file__, nanokv.__file__"
if "$BIN/nanokv" serve "$MODEL" 2>err.txt; then say "serve ran without the [serve] extra"; exit 1; fi
cat err.txt
grep -q "pip install 'nanokv\[serve\]'" err.txt || exit 1
"$BIN/nanokv" generate --model "$MODEL" --prompt "def fibonacci(n):" --max-tokens 16 \
  --attention-backend native
ls "$NANOKV_CACHE_DIR"/*.so >/dev/null || { say "the decode kernel was not built"; exit 1; }
"$BIN/nanokv" calibrate --model "$MODEL" --num-samples 2 --eval-samples 2 --seq-len 256 \
  --eval-seq-len 512 --block-size 64 --output calib.json
"$BIN/nanokv" generate --model "$MODEL" --kv-cache-dtype kvquant --kv-quant-config calib.json \
  --block-size 64 --prompt "import os" --max-tokens 8 --attention-backend native
ls "$NANOKV_CACHE_DIR"/quant_decode_attention-*.so >/dev/null \
  || { say "the quantized decode kernels were not built"; exit 1; }

say "with the [serve] extra"
"$BIN/pip" install -q -c "$ROOT/constraints.txt" "$WHEEL[serve]"
PORT=$("$BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$BIN/nanokv" serve "$MODEL" --port "$PORT" --max-model-len 512 --no-access-log 2>serve.log &
SERVER=$!
URL=http://127.0.0.1:$PORT
"$BIN/python" - "$URL" <<'EOF'
import json, sys, time, urllib.request
url = sys.argv[1]
for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
body = json.dumps({"model": json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"],
                   "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=60))
assert out["usage"]["completion_tokens"] == 8, out
print("[check_wheel] completion:", repr(out["choices"][0]["text"]))
EOF
"$BIN/python" -m nanokv.workloads.loadtest --url "$URL" --concurrency 2 --duration 2
say "ok: $(basename "$WHEEL") works outside the repo"
