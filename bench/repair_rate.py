"""Repair data path throughput: what recover-in-place / recover pay per byte of optimizer state.

    .venv/bin/python bench/repair_rate.py --mb 256 --rounds 3
    .venv/bin/python bench/repair_rate.py --size 1g      # one rank's optimizer shard at that size (684 MB)

Two processes on loopback, gloo on CPU: rank 0 sends an optimizer shard (fp32 master, two Adam moments,
a step counter) plus the scalar state to rank 1 with ``mindio.adapter.send_state`` / ``recv_state`` --
the calls the Megatron and DDP adapters make for RT_SEND -> RT_RECV_REPAIR -- and rank 1 checks every
byte arrived. Prints the best and median GB/s over ``--rounds`` (the recovery bench's repair phase adds
the control round trips of the repair action, which dominate for the tiny example model).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _worker(mb: int, rounds: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from mindio.adapter import recv_state, send_state

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    n = mb * 2**20 // 4 // 3  # fp32 elements per tensor: master, exp_avg, exp_avg_sq
    g = torch.Generator().manual_seed(7)
    src = [torch.randn(n, generator=g) for _ in range(3)] + [torch.tensor([123.0])]
    dst = [torch.empty_like(t) for t in src]
    scalars = {"iteration": 42, "consumed_samples": 4096}
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            send_state(src, scalars, 1)
        else:
            got = recv_state(dst, 0)
            assert got["iteration"] == 42 and all(torch.equal(a, b) for a, b in zip(src, dst))
        times.append(time.perf_counter() - t0)
    if rank == 1:
        nbytes = sum(t.numel() * t.element_size() for t in src)
        rates = [nbytes / t / 1e9 for t in times]
        print(f"repair-rate: {nbytes} B per transfer; best {max(rates):.2f} GB/s, median "
              f"{statistics.median(rates):.2f} GB/s over {rounds} rounds ({', '.join(f'{t:.3f}' for t in times)} s); "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="optimizer-shard megabytes to send")
    p.add_argument("--size", default=None, help="send one rank's optimizer shard of this model size "
                   "(bench/_sizes.py: 12 B x P x R / d at DP=4, R=2); overrides --mb")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.mb, a.rounds)
        return 0
    if a.size:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _sizes

        size = _sizes.get(a.size)
        a.mb = max(1, round(12 * size.params * 2 // 4 / 2**20))
        print(f"repair-rate: {size.describe()}; sending its optimizer shard, {a.mb} MiB", flush=True)
    from mindio._ports import free_port

    port = free_port()  # outside the ephemeral range (see mindio/_ports.py)
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--mb", str(a.mb), "--rounds", str(a.rounds)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
