#!/usr/bin/env bash
# Network drills across hosts simulated as network namespaces (root only; skips with a reason otherwise).
# Usage: bash scripts/drills.sh [--only TEXT] [--steps N] [--fault-step S] [--keep]   (scripts/drills.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/drills.py "$@"
