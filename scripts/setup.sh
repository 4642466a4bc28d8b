#!/usr/bin/env bash
# Creates .venv and installs nanokv (editable) with every extra, at the exact versions of
# constraints.txt (CPU torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q -c constraints.txt -e ".[serve,eval,test,ray,structured]"
# promtool (Debian package 'prometheus') validates deploy/prometheus in tests/e2e/test_deploy.py
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
