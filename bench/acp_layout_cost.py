"""What the zip layout (format version 2, a file torch.load reads) adds to a save's blocking part.

Plans and writes the same state dict into a reused, pre-faulted buffer in the bare layout (version 1)
and in the zip layout (version 2), alternated in one process, and prints the medians: wall time and
CPU time of the plan (the two pickling passes, the layout) and wall time of plan + copy. Four shapes:
few large tensors (the acp_bench states) and many small ones (where per-tensor costs show).

    .venv/bin/python bench/acp_layout_cost.py [--repeat 9]
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import time

import torch

from mindio import _native
from mindio.acp import format as fmt


def _state(n: int, floats: int) -> dict:
    return {f"layer{i}.weight": torch.randn(floats) for i in range(n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    cases = [("1 GiB, 64 tensors of 16 MiB", _state(64, 4 << 20)), ("256 MiB, 16 tensors of 16 MiB", _state(16, 4 << 20)),
             ("64 MiB, 1000 tensors of 64 KiB", _state(1000, 16 << 10)), ("5000 tensors of 16 B", _state(5000, 4))]
    copy = lambda dst, jobs: _native.copy_many(dst, jobs, 2, 16 << 20)   # noqa: E731 -- the save's 2 threads
    for name, sd in cases:
        buf = mmap.mmap(-1, fmt.plan(sd).total_len + (1 << 20))
        buf[:] = bytes(len(buf))                                         # pre-faulted, as the pool is
        runs: dict = {False: [], True: []}
        for _ in range(args.repeat):
            for torch_zip in (False, True):
                wall, cpu = time.perf_counter(), time.thread_time()
                plan = fmt.plan(sd, torch_zip=torch_zip)
                plan_wall, plan_cpu = time.perf_counter() - wall, time.thread_time() - cpu
                plan.write_into(buf, copy_many=copy)
                runs[torch_zip].append((plan_wall, plan_cpu, time.perf_counter() - wall))
        for torch_zip in (False, True):
            med = [statistics.median(r[i] for r in runs[torch_zip]) * 1e3 for i in range(3)]
            print(f"{name:32s} {'v2 zip' if torch_zip else 'v1 bare'}: plan {med[0]:8.2f} ms "
                  f"({med[1]:8.2f} ms CPU), plan + copy {med[2]:8.2f} ms  (medians of {args.repeat})")


if __name__ == "__main__":
    main()
