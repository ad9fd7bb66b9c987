#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite.
# Three pytest-xdist workers (MINDIO_TEST_WORKERS=N to change, 0: one process): one multi-process test at a
# time leaves the 2 cores idle part of its time (paced steps, heartbeats, stalls, exits; e.g. 21 CPU-s in
# a 39 s test). Measured on the 2-core CI machine, whole suite: 2 workers 1010 s (the cores 83% busy),
# 3 workers 912 s; with the fork-server host of tests/conftest.py, 781 s (the cores 91% busy: more workers
# would not help). 2026-11-30, a 2-core dev machine, 3 workers: 948 s, 1780 CPU-s in all the suite's processes,
# once fork servers stopped importing torch._dynamo for scripts that do not want it (1.2-1.7 CPU-s each).
# Tests of one module, and modules sharing a fault-free reference run, stay on one
# worker (tests/conftest.py), heaviest groups first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
workers=${MINDIO_TEST_WORKERS:-3}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
exec .venv/bin/python -m pytest -q -ra -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
