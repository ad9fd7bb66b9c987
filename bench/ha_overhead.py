"""Overhead of --enable-high-availability for examples/megatron/pretrain_gpt.py, on this machine.

Runs the example at one parallel layout (``--pp`` pipeline stages x DP = nproc/pp, TP1) in three
configurations, alternating them for several rounds so that machine noise hits all alike, and prints
ratios against the baseline:

    off       no high availability: one copy of each optimizer shard (ZeRO-1 over DP)
    replicas  --replica-cnt 2 without mindio.ttp: the replica optimizer alone
    on        --enable-high-availability: replicas (R=2) + controller, processors, update reports

Step time = median of the per-step times printed by rank 0, warm-up steps excluded.
Memory: optimizer-state bytes of rank 0 (fp32 main params + Adam moments) measured from the live
shards. Formula: a rank holds ``12*P*R/d`` bytes (P = params of its model-parallel slice -- with
pipeline parallelism its stage --, d = DP size, R = replica count), so the replicas add
``12*P*(R-1)/d``; the bench prints measured extra / formula (1.0000 when they match).

    python bench/ha_overhead.py                  # DP=4, 60 steps, 3 rounds
    python bench/ha_overhead.py --nproc 2 --iters 100 --rounds 5
    python bench/ha_overhead.py --pp 2           # TP1 x PP2 x DP2 (2 micro-batches per step)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "examples" / "megatron" / "pretrain_gpt.py"
CONFIGS = {
    "off": [],
    "replicas": ["--replica-cnt", "2"],
    "on": ["--enable-high-availability"],
}


def layout(nproc: int, pp: int) -> list:
    """The example's flags for TP1 x PP ``pp`` x DP nproc/pp; with PP, 2 micro-batches per step (the
    pipeline has something to overlap)."""
    if pp == 1:
        return []
    return ["--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(2 * 2 * nproc // pp)]


def run(nproc: int, iters: int, extra, timeout: float = 600, attempts: int = 2) -> str:
    """One job; retried once if it dies (the machine is shared: e.g. an OOM kill elsewhere)."""
    for attempt in range(attempts):
        try:
            return _run_once(nproc, iters, extra, timeout)
        except RuntimeError as exc:
            if attempt == attempts - 1:
                raise SystemExit(str(exc))
            print(f"  (retrying: {str(exc).splitlines()[0]})", flush=True)


def _run_once(nproc: int, iters: int, extra, timeout: float) -> str:
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node",
           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(PRETRAIN), "--use-distributed-optimizer", "--train-iters", str(iters), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TTP_PORT": str(_free_port()),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil  # installed with the megatron extra

        victims = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for v in victims:  # torchrun's workers live in their own sessions
            try:
                v.kill()
            except psutil.Error:
                pass
        proc.communicate(timeout=30)
        raise RuntimeError(f"run {extra} timed out")
    if proc.returncode:
        raise RuntimeError(f"run {extra} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def parse(out: str, warmup: int):
    steps = [float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/\d+ .*\| step ([0-9.]+) ms", out)
             if int(m.group(1)) > warmup]
    mem = re.search(r"optimizer-state-bytes: (\d+) on rank 0 \(P=(\d+), R=(\d+), d=(\d+)", out)
    rss = re.search(r"max-rss-MiB: ([0-9.]+)", out)
    return steps, tuple(int(x) for x in mem.groups()), float(rss.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4, help="ranks (TP=1; DP = nproc / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    steps = {k: [] for k in CONFIGS}
    per_round = {k: [] for k in CONFIGS}
    mem, rss = {}, {}
    for r in range(args.rounds):
        for name, extra in CONFIGS.items():
            s, m, x = parse(run(args.nproc, args.iters, layout(args.nproc, args.pp) + extra), args.warmup)
            steps[name] += s
            per_round[name].append(statistics.median(s))
            mem[name], rss[name] = m, x
            print(f"round {r + 1}: {name:8s} median step {statistics.median(s):7.2f} ms", flush=True)

    base = statistics.median(steps["off"])
    best = min(per_round["off"])
    print(f"\nTP1 x PP{args.pp} x DP{args.nproc // args.pp}, {args.iters} steps x {args.rounds} rounds, warm-up {args.warmup} "
          f"excluded; step time (ms) and ratio to 'off': median over all steps | best round")
    for name in CONFIGS:
        med, fast = statistics.median(steps[name]), min(per_round[name])
        print(f"  {name:8s} {med:8.2f} ms  x{med / base:.3f}   | {fast:8.2f} ms  x{fast / best:.3f}")
    print("\noptimizer state of rank 0, measured vs 12*P*R/d:")
    for name in CONFIGS:
        b, p, r, d = mem[name]
        formula = 12 * p * r / d
        print(f"  {name:8s} {b:10d} B  vs {formula:10.0f} B (P={p}, R={r}, d={d}): x{b / formula:.4f}")
    (b_off, p, _, d), (b_on, _, r_on, _) = mem["off"], mem["on"]
    formula = 12 * p * (r_on - 1) / d
    print(f"extra of 'on': {b_on - b_off} B vs 12*P*(R-1)/d = {formula:.0f} B: x{(b_on - b_off) / formula:.4f} "
          "(a DP shard is cut at element boundaries of megatron's padded buckets, so a rank may hold a few "
          "params more or less than P/d)")
    print("rank-0 peak RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))


if __name__ == "__main__":
    main()
