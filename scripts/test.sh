#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite.
# Two pytest-xdist workers (MINDIO_TEST_WORKERS=N to change, 0: one process): most of the suite waits on
# its training processes (steps, heartbeats, exits) rather than computing, so two tests at a time keep
# both cores busy. Tests of one module, and modules sharing a fault-free reference run, stay on one
# worker (tests/conftest.py), heaviest groups first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
workers=${MINDIO_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
exec .venv/bin/python -m pytest -q -ra -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
