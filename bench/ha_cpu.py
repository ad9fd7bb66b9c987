"""Where --enable-high-availability spends CPU: per-step CPU time of each piece of a training step.

Wall-clock ratios on a shared 2-core machine vary as much as the effect (bench/ha_overhead.py); CPU time
does not depend on what else runs. This runs the example at the same layouts and configurations as
bench/ha_overhead.py (off / replicas / on, alternated over rounds) under bench/_cpu_phases.py, and prints
per configuration, in ms per step averaged over the ranks (and over rounds):

* ``process``: CPU of the whole rank process per counted step (all threads);
* ``main``: CPU of the training thread inside train_step, then its pieces (see bench/_cpu_phases.py);
* the other threads' CPU per step, by thread name (mindio's link / controller threads, gloo's, torch's).

    python bench/ha_cpu.py --pp 2                  # TP1 x PP2 x DP2, 60 steps, 3 rounds
    python bench/ha_cpu.py --pp 2 --per-rank       # one column per rank as well
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sizes  # noqa: E402  (bench/_sizes.py)
import ha_overhead  # noqa: E402

PHASES = Path(__file__).resolve().parent / "_cpu_phases.py"
ORDER = ("step", "fwd_bwd", "grad_sync", "reduce_scatter", "opt_step", "clip", "adam", "param_sync", "all_gather",
         "ttp_start", "ttp_end", "rng_record", "rng_python", "rng_numpy", "rng_torch", "rng_tracker", "sched",
         "ttp_pause", "gc0", "gc1", "gc2")


def collect(folder: str) -> list:
    return sorted((json.loads(p.read_text()) for p in Path(folder).glob("rank*.json")), key=lambda r: r["rank"])


def per_step(rank: dict) -> dict:
    """ms per counted step: process, each phase (main-thread CPU; wall in 'wall:<phase>'), each thread."""
    n = rank["steps"]
    out = {"process": 1000 * rank["process_cpu_s"] / n}
    for name, (_, cpu, wall) in rank["phases"].items():
        out[name] = 1000 * cpu / n
        out["wall:" + name] = 1000 * wall / n
    for comm, s in rank["threads_cpu_s"].items():
        out["thread:" + comm] = 1000 * s / n
    return out


def measure(nproc: int, pp: int, iters: int, warmup: int, rounds: int, size: str = "tiny", echo=print,
            configs=tuple(ha_overhead.CONFIGS)) -> dict:
    flags = _sizes.get(size).args() + ha_overhead.layout(nproc, pp)
    runs = {k: [] for k in configs}  # config -> list of per-rank dicts, one list per round
    for r in range(rounds):
        for name in configs:
            extra = ha_overhead.CONFIGS[name]
            with tempfile.TemporaryDirectory() as folder:
                out = ha_overhead.run(nproc, iters, flags + extra, script=PHASES,
                                      env={"HA_CPU_WARMUP": str(warmup), "HA_CPU_OUT": folder})
                ranks = [per_step(x) for x in collect(folder)]
            if len(ranks) != nproc:
                raise SystemExit(f"{name}: {len(ranks)} of {nproc} ranks wrote their figures:\n{out[-3000:]}")
            runs[name].append(ranks)
            echo(f"round {r + 1}: {name:8s} process CPU {statistics.mean(x['process'] for x in ranks):6.2f} ms/step "
                 f"per rank, main thread in step {statistics.mean(x['step'] for x in ranks):6.2f}")
    return runs


def table(runs: dict, per_rank: bool = False) -> str:
    configs = list(runs)
    keys = ["process", *ORDER] + sorted({k for rs in runs.values() for ranks in rs for x in ranks for k in x
                                         if k.startswith("thread:")})

    def value(cfg, key, rank=None):
        vals = [(x if rank is None else [x[rank]]) for x in runs[cfg]]
        per_round = [statistics.mean(r.get(key, 0.0) for r in ranks) for ranks in vals]
        return statistics.mean(per_round)

    if configs != list(ha_overhead.CONFIGS):  # a subset: the figures only
        return "\n".join(f"{k:24s}" + "".join(f"{value(c, k):10.3f}" for c in configs) for k in keys
                         if max(value(c, k) for c in configs) >= 0.005)

    nranks = len(runs[configs[0]][0])
    head = f"{'ms CPU / step':24s}" + "".join(f"{c:>10s}" for c in configs) + f"{'on-off':>9s}{'rep-off':>9s}"
    if per_rank:
        head += "   on-off per rank"
    rows = [head]
    for k in keys:
        v = [value(c, k) for c in configs]
        if max(v) < 0.005:
            continue
        row = f"{k:24s}" + "".join(f"{x:10.3f}" for x in v) + f"{v[2] - v[0]:9.3f}{v[1] - v[0]:9.3f}"
        if per_rank:
            row += "   " + " ".join(f"{value('on', k, i) - value('off', k, i):7.3f}" for i in range(nranks))
        rows.append(row)
    rows.append("(main-thread CPU per piece; nested pieces are inside their parent: grad_sync in fwd_bwd, "
                "clip/adam/param_sync in opt_step; thread:* = CPU of each thread of the rank, by name)")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="tiny", choices=list(_sizes.SIZES))
    ap.add_argument("--per-rank", action="store_true")
    ap.add_argument("--configs", default=",".join(ha_overhead.CONFIGS), help="which of off,replicas,on")
    ap.add_argument("--json", default=None, help="also write the raw per-rank figures here")
    args = ap.parse_args()
    runs = measure(args.nproc, args.pp, args.iters, args.warmup, args.rounds, args.size,
                   echo=lambda s: print(s, flush=True), configs=args.configs.split(","))
    if args.json:
        Path(args.json).write_text(json.dumps(runs))
    print()
    print(table(runs, args.per_rank))


if __name__ == "__main__":
    main()
