#!/usr/bin/env bash
# Create ./.venv (if absent) and install mindio with its test and megatron extras.
# torch is constrained to 2.13.0 (constraints.txt): an unconstrained torch pulls GBs of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,megatron]"
.venv/bin/python -c "import mindio, mindio._native as n; print('mindio', mindio.__version__, 'installed; native core:', n.BACKEND)"
