#!/usr/bin/env bash
# Slurm drills: examples/slurm/pretrain_gpt.sbatch on a real Slurm cluster whose slurmd "hosts" are network
# namespaces (root, Slurm and munge: scripts/install.sh; else it skips with the reason).
# Usage: bash scripts/slurm_drills.sh [--only TEXT] [--iters N] [--fault-step S] [--keep]   (scripts/slurm_drills.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/slurm_drills.py "$@"
