#!/usr/bin/env bash
# Install everything into ./.venv and run the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python examples/demo.py "$@"
