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
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,megatron,etcd]"
# an etcd server for mindio-run --rdzv-backend etcd and its tests (tests/_etcd.py; skipped without one):
# Debian's etcd-server (3.4), where this runs as root with apt; elsewhere install etcd yourself
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 \
      || echo "install.sh: apt-get install etcd-server failed: the etcd tests will be skipped"
  else
    echo "install.sh: no etcd binary (not root, or no apt): the etcd tests will be skipped"
  fi
fi
# Slurm and munge for the real-Slurm tests and drills (tests/slurm/_cluster.py, scripts/slurm_drills.sh; skipped
# without them): Debian's slurmctld, slurmd, slurm-client and munge, where this runs as root with apt. The
# tests start their own daemons, with their own key and configuration, in network namespaces
if ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
      || echo "install.sh: apt-get install slurmctld slurmd slurm-client munge failed: the Slurm tests will be skipped"
  else
    echo "install.sh: no slurmd/munged (not root, or no apt): the Slurm tests will be skipped"
  fi
fi
# bytecode for the project's own sources: an editable install compiles none, and where PYTHONDONTWRITEBYTECODE
# is set (this project's CI and dev images) every interpreter that imports mindio compiled its ~90 modules
# again (~0.1 CPU-s per process; the suite starts well over a thousand). Stale .pyc files are ignored by
# their timestamps, so an edited source is still what runs.
.venv/bin/python -m compileall -q -j 0 mindio examples tests bench >/dev/null
.venv/bin/python -c "import mindio, mindio._native as n; from mindio.ttp.wire import beats as b; \
print('mindio', mindio.__version__, 'installed; native core:', n.BACKEND, '| BEATS reader:', \
'python' if isinstance(b.reader(b'k'), b.PyBeatsReader) else 'native')"
