#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite.
# Two pytest-xdist workers (MINDIO_TEST_WORKERS=N to change, 0: one process): one multi-process test at a
# time leaves the 2 cores idle part of its time (paced steps, heartbeats, stalls, exits; e.g. 21 CPU-s in
# a 39 s test), so two tests at a time use them. Tests of one module, and modules sharing a fault-free reference run, stay on one
# worker (tests/conftest.py), heaviest groups first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
workers=${MINDIO_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
exec .venv/bin/python -m pytest -q -ra -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
