#!/usr/bin/env bash
# The checks that need a GPU, in one go (for a lent GPU machine with torch already installed):
# environment, native build, the device-path tests (the checkpoint store's CUDA save/load, and the
# tft_* loop's NCCL stop/teardown/rebuild: tests/dropin/test_plain_loop_cuda.py), then
# bench/nccl_abort.py and bench/acp_gpu_bench.py. Logs go to $OUT (default ./gpu-check-out). A machine with no registry access
# gets missing packages (pyzmq) as wheels in $WHEELS: `pip download pyzmq --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps -d DIR` on a machine that has one.
# Usage: [WHEELS=DIR] bash scripts/gpu_check.sh [bench args...]
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-check-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install --no-index --no-deps "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  df -h /dev/shm /var/tmp | tail -n +2; free -g | head -2; echo "ulimit -l: $(ulimit -l)"; nproc
  python3 -c "import zmq" 2>/dev/null && echo "pyzmq present" || echo "pyzmq absent"
} 2>&1 | tee "$OUT/env.log"
python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1
python3 -c "from mindio import _native; print('native core:', _native.BACKEND)" | tee -a "$OUT/env.log"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/acp/test_device.py \
  tests/acp/test_format.py tests/recovery/test_device.py tests/dropin/test_plain_loop_cuda.py 2>&1 \
  | tee "$OUT/tests.log" | tail -n 15
timeout 300 python3 bench/nccl_abort.py 2>&1 | tee "$OUT/nccl_abort.log"
timeout "${BENCH_TIMEOUT:-480}" python3 bench/acp_gpu_bench.py "$@" 2>&1 | tee "$OUT/bench.log"
