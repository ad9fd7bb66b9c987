#!/usr/bin/env bash
# Install everything into ./.venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q -ra "$@"
