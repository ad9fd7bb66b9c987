"""Overhead of --enable-high-availability for examples/megatron/pretrain_gpt.py, on this machine.

Runs the example at one parallel layout (``--pp`` pipeline stages x DP = nproc/pp, TP1) in three
configurations, alternating them for several rounds so that machine noise hits all alike, and prints
ratios against the baseline:

    off       no high availability: one copy of each optimizer shard (ZeRO-1 over DP)
    replicas  --replica-cnt 2 without mindio.ttp: the replica optimizer alone
    on        --enable-high-availability --no-dump: replicas (R=2) + controller, processors, update reports
    crosscheck  (with ``--crosscheck N``) replicas + MINDIO_CROSSCHECK_STEPS=N: the replica cross-check (every N
              steps an XXH3-64 hash of the whole shard as N slices, two small all-gathers and a verified copy); its
              row is also compared with 'replicas', the cost of the check alone, and each rank's own
              measure of its time (event ``crosscheck_cost``) with the step
    slow      (with ``--slow W``) 'on' + MINDIO_SLOW_WINDOW=W: each rank's wait clock (processor/waitclock.py:
              25 Hz reads of its main thread's CPU clock and run-queue delay and of its groups' counters) and a
              beat per window, the controller's scoring; compared with 'on', and the wait clock thread's own
              CPU per rank (its ``wait_clock`` event at exit): the step-time ratio on a shared 2-core machine
              varies by +-5 % run to run
    slow100   (with ``--slow W``) the same at MINDIO_SLOW_HZ=100, the rate of the clock before schedstat (its
              CPU per rank is the baseline the 'slow' clock's is compared with, in the same run)

Step time = median of the per-step times printed by rank 0, warm-up steps excluded.
Memory: optimizer-state bytes of rank 0 (fp32 main params + Adam moments) measured from the live
shards. Formula: a rank holds ``12*P*R/d`` bytes (P = params of its model-parallel slice -- with
pipeline parallelism its stage --, d = DP size, R = replica count), so the replicas add
``12*P*(R-1)/d``; the bench prints measured extra / formula (1.0000 when they match).

    python bench/ha_overhead.py                  # DP=4, 60 steps, 3 rounds, tiny GPT
    python bench/ha_overhead.py --nproc 2 --iters 100 --rounds 5
    python bench/ha_overhead.py --pp 2           # TP1 x PP2 x DP2 (2 micro-batches per step)
    python bench/ha_overhead.py --size 1g        # >= 1 GiB of state per rank (bench/_sizes.py); 12 steps
    python bench/ha_overhead.py --crosscheck 8   # + the replica cross-check row (issue 32: <= 1 % of a step)
    python bench/ha_overhead.py --crosscheck 8 --crosscheck-cost 1   # its CPU work alone, 1 GiB shard, no job
    python bench/ha_overhead.py --slow 5         # + the slow-rank anatomy row (issue 31: <= 0.5 % of a step)

Where the extra time goes, as CPU time per piece of a step (wall clock on a shared machine varies as much
as the effect): ``python bench/ha_cpu.py --pp 2`` (the same configurations).

``measure()`` / ``report()`` are what bench/peers/run_all.py calls; the last line of the report checks
issue 18's target (on <= 1.05x off).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mindio._ports import free_port as _free_port  # outside the ephemeral range (mindio/_ports.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sizes  # noqa: E402  (bench/_sizes.py)

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "examples" / "megatron" / "pretrain_gpt.py"
CONFIGS = {
    "off": [],
    "replicas": ["--replica-cnt", "2"],
    "on": ["--enable-high-availability", "--no-dump"],  # no --save here: no last-words checkpoint planned
}


def layout(nproc: int, pp: int) -> list:
    """The example's flags for TP1 x PP ``pp`` x DP nproc/pp; with PP, 2 micro-batches per step (the
    pipeline has something to overlap)."""
    if pp == 1:
        return []
    return ["--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(2 * 2 * nproc // pp)]


def run(nproc: int, iters: int, extra, timeout: float = 600, attempts: int = 2, script: Path = PRETRAIN,
        env=None) -> str:
    """One job of ``script`` (the example, or a wrapper of it); retried once if it dies (the machine is
    shared: e.g. an OOM kill elsewhere)."""
    for attempt in range(attempts):
        try:
            return _run_once(nproc, iters, extra, timeout, script, env or {})
        except RuntimeError as exc:
            if attempt == attempts - 1:
                raise SystemExit(str(exc))
            print(f"  (retrying: {str(exc).splitlines()[0]})", flush=True)


def _run_once(nproc: int, iters: int, extra, timeout: float, script: Path, env: dict) -> str:
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node",
           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(script), "--use-distributed-optimizer", "--train-iters", str(iters), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TTP_PORT": str(_free_port()),
           "PYTHONPATH": str(REPO), **env}
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
        fd, path = tempfile.mkstemp(prefix="mindio-ha-overhead-", suffix=".log")  # the whole output, kept
        with os.fdopen(fd, "w") as f:
            f.write(out)
        raise RuntimeError(f"run {extra} failed ({proc.returncode}; its whole output: {path}):\n{out[-3000:]}")
    return out


def parse(out: str, warmup: int):
    steps = [float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/\d+ .*\| step ([0-9.]+) ms", out)
             if int(m.group(1)) > warmup]
    mem = re.search(r"optimizer-state-bytes: (\d+) on rank 0 \(P=(\d+), R=(\d+), d=(\d+)", out)
    rss = re.search(r"max-rss-MiB: ([0-9.]+)", out)
    return steps, tuple(int(x) for x in mem.groups()), float(rss.group(1))


def configs(crosscheck: int = 0, slow: int = 0) -> dict:
    """The configurations measured: CONFIGS, plus the cross-check's with ``crosscheck`` = N > 0 and the
    slow-rank anatomy's with ``slow`` = W > 0."""
    out = {name: (extra, {}) for name, extra in CONFIGS.items()}
    if crosscheck:
        out["crosscheck"] = (CONFIGS["replicas"], {"MINDIO_CROSSCHECK_STEPS": str(crosscheck)})
    if slow:
        out["slow"] = (CONFIGS["on"], {"MINDIO_SLOW_WINDOW": str(slow)})
        out["slow100"] = (CONFIGS["on"], {"MINDIO_SLOW_WINDOW": str(slow), "MINDIO_SLOW_HZ": "100"})
    return out


def measure(size: str, nproc: int, iters: int, warmup: int, rounds: int, pp: int = 1, echo=print,
            crosscheck: int = 0, slow: int = 0) -> dict:
    """Step times of the configurations, alternated over ``rounds``; memory of rank 0."""
    flags = _sizes.get(size).args() + layout(nproc, pp)
    todo = configs(crosscheck, slow)
    steps = {k: [] for k in todo}
    per_round = {k: [] for k in todo}
    mem, rss = {}, {}
    clock: dict = {}  # config -> [(CPU s, wall s, hz, source)] of every rank's wait clock thread in its runs
    checks: list = []  # the 'crosscheck' runs' crosscheck_cost events (each rank's, every N steps)
    for r in range(rounds):
        for name, (extra, env) in todo.items():
            logged = name in ("slow", "slow100", "crosscheck")  # their ranks' events are read after the run
            if logged:
                fd, events = tempfile.mkstemp(prefix="mindio-ha-overhead-events-", suffix=".jsonl")
                os.close(fd)
                env = {**env, "MINDIO_EVENT_LOG": events}
            s, m, x = parse(run(nproc, iters, flags + extra, env=env), warmup)
            if name.startswith("slow"):
                clock.setdefault(name, []).extend(_clock_costs(events))
            if name == "crosscheck":
                checks += _events(events, "crosscheck_cost")
            if logged:
                os.unlink(events)
            steps[name] += s
            per_round[name].append(statistics.median(s))
            mem[name], rss[name] = m, x
            echo(f"round {r + 1}: {name:8s} median step {statistics.median(s):7.2f} ms")
    base, best = statistics.median(steps["off"]), min(per_round["off"])
    out = {"size": size, "nproc": nproc, "pp": pp, "iters": iters, "warmup": warmup, "rounds": rounds,
           "configs": {}, "mem": mem, "rss": rss, "load": os.getloadavg()[0], "crosscheck": crosscheck,
           "slow": slow, "clock": clock, "checks": checks}
    for name in todo:
        med, fast = statistics.median(steps[name]), min(per_round[name])
        out["configs"][name] = {"median_ms": med, "ratio": med / base, "best_ms": fast, "best_ratio": fast / best}
    return out


def _events(path: str, kind: str) -> list:
    import json

    with open(path) as f:
        return [e for e in map(json.loads, filter(str.strip, f)) if e.get("kind") == kind]


def _clock_costs(events: str) -> list:
    """(CPU s, wall s, hz, source) of each rank's wait clock thread in a run (its ``wait_clock`` event at exit)."""
    return [(e["cpu_s"], e["wall_s"], e.get("hz"), e.get("source", "cpu"))
            for e in _events(events, "wait_clock") if e.get("wall_s", 0) > 0]


def report(res: dict) -> str:
    pp, nproc = res["pp"], res["nproc"]
    rows = [f"TP1 x PP{pp} x DP{nproc // pp}, size {res['size']}, {res['iters']} steps x {res['rounds']} rounds, "
            f"warm-up {res['warmup']} excluded; step time (ms) and ratio to 'off': median over all steps | "
            f"best round; load average {res['load']:.1f} at the end"]
    for name, c in res["configs"].items():
        rows.append(f"  {name:8s} {c['median_ms']:8.2f} ms  x{c['ratio']:.3f}   | {c['best_ms']:8.2f} ms  "
                    f"x{c['best_ratio']:.3f}")
    for row, base, what, target in (("crosscheck", "replicas", f"cross-check (N={res['crosscheck']})", 0.01),
                                    ("slow", "on", f"slow-rank anatomy (MINDIO_SLOW_WINDOW={res.get('slow')})", 0.005),
                                    ("slow100", "on", "the same at MINDIO_SLOW_HZ=100", 0.005)):
        if row in res["configs"]:  # an optional row against the configuration it adds to: its cost alone
            c, b = res["configs"][row], res["configs"][base]
            cost, best = c["median_ms"] / b["median_ms"] - 1, c["best_ms"] / b["best_ms"] - 1
            rows.append(f"  {what} vs {base}: {100 * cost:+.2f} % of the step time (median) | {100 * best:+.2f} % "
                        f"(best round); target <= {100 * target:g} %: {'PASS' if cost <= target else 'FAIL'} (median)")
    checks = [e for e in res.get("checks", []) if e.get("steps")]
    steady = [e for e in checks if not e.get("allocated")]  # a rank's first copy also allocates (page faults)
    for label, got in (("all", checks), ("steady", steady)) if checks else ():
        if not got:
            rows.append("  cross-check in the job, steady: no report after a rank's first copy (run more than "
                        "2 x N steps)")
            continue
        # the check's own time, as each rank measured it in the job: not the noise of the step times
        steps = sum(e["steps"] for e in got)
        work, gather = (1000 * sum(e[k] for e in got) / steps for k in ("work_s", "gather_s"))
        step_ms = res["configs"]["crosscheck"]["median_ms"]
        share = (work + gather) / step_ms
        what = "every report" if label == "all" else "after each rank's first copy"
        rows.append(f"  cross-check in the job, {what} ({len(got)} reports of N={res['crosscheck']} steps, "
                    f"{got[0]['shard_bytes'] / 2**30:.3f} GiB shard per rank): hashing + verified copy "
                    f"{work:.2f} ms, all-gathers {gather:.2f} ms per step and rank = {100 * share:.2f} % of the "
                    f"{step_ms:.0f} ms step; target <= 1 %: {'PASS' if share <= 0.01 else 'FAIL'}")
    means = {}
    for name, got in sorted(res.get("clock", {}).items()):  # the anatomy's own work, not the step times' noise
        shares = sorted(cpu / wall for cpu, wall, *_ in got)
        means[name] = mean = sum(shares) / len(shares)
        rows.append(f"  {name}: its wait clock thread's CPU per rank ({len(shares)} ranks x runs, "
                    f"{', '.join(sorted({f'{h} Hz {src}' for *_, h, src in got}))}): {100 * mean:.2f} % of one "
                    f"core (max {100 * shares[-1]:.2f} %) = at most that share of the step time, if it took the "
                    f"rank's own core; target <= 0.5 %: {'PASS' if mean <= 0.005 else 'FAIL'} (mean)")
    if len(means) == 2:
        rows.append(f"  wait clock CPU, slow / slow100: x{means['slow'] / means['slow100']:.2f}")
    rows.append("optimizer state of rank 0, measured vs 12*P*R/d:")
    for name in CONFIGS:
        b, p, r, d = res["mem"][name]
        rows.append(f"  {name:8s} {b:10d} B  vs {12 * p * r / d:10.0f} B (P={p}, R={r}, d={d}): x{b / (12 * p * r / d):.4f}")
    (b_off, p, _, d), (b_on, _, r_on, _) = res["mem"]["off"], res["mem"]["on"]
    formula = 12 * p * (r_on - 1) / d
    rows.append(f"extra of 'on': {b_on - b_off} B vs 12*P*(R-1)/d = {formula:.0f} B: x{(b_on - b_off) / formula:.4f} "
                "(a DP shard is cut at element boundaries of megatron's padded buckets, so a rank may hold a few "
                "params more or less than P/d)")
    rows.append("rank-0 peak RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in res["rss"].items()))
    on = res["configs"]["on"]["ratio"]
    rows.append(f"target {'PASS' if on <= 1.05 else 'FAIL'}: replicas + control plane x{on:.3f} <= x1.05 "
                f"the step time of plain Megatron (median)")
    return "\n".join(rows)


def crosscheck_cost(gib: float, every: int, reps: int = 2) -> dict:
    """The cross-check's work on one rank holding a ``gib`` GiB shard, in this process, no job: every
    ``every`` steps the XXH3-64 of each of its slices (one pass) and the copy into the kept snapshot's
    memory (mindio.megatron.verified). Returns ms per step (amortized) and its parts; best of ``reps``."""
    import time

    import torch

    from mindio.adapter.crosscheck import slice_hashes

    n = int(gib * 2**30) // 4 // 3
    shard = [torch.randn(n) for _ in range(3)]  # fp32 main params, exp_avg, exp_avg_sq
    kept = [t.clone() for t in shard]

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    crc_ms = best(lambda: slice_hashes(shard, every))
    copy_ms = best(lambda: [d.copy_(x) for d, x in zip(kept, shard)])
    return {"bytes": sum(t.numel() * 4 for t in shard), "every": every, "full_crc_ms": crc_ms,
            "copy_ms": copy_ms, "per_step_ms": (crc_ms + copy_ms) / every, "load": os.getloadavg()[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=list(_sizes.SIZES), help="model size (bench/_sizes.py)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks (TP=1; DP = nproc / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--iters", type=int, default=None, help="steps per run (default: 60, 12 at size 1g)")
    ap.add_argument("--warmup", type=int, default=None, help="steps excluded (default: 5, 2 at size 1g)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--crosscheck", type=int, default=0, metavar="N",
                    help="also measure the replica cross-check (MINDIO_CROSSCHECK_STEPS=N); 0: not")
    ap.add_argument("--slow", type=int, default=0, metavar="W",
                    help="also measure slow-rank scoring on top of 'on' (MINDIO_SLOW_WINDOW=W); 0: not")
    ap.add_argument("--crosscheck-cost", type=float, default=0, metavar="GIB",
                    help="only the cross-check's work on a GIB GiB shard in this process (no job), N=--crosscheck")
    args = ap.parse_args()
    if args.crosscheck_cost:
        c = crosscheck_cost(args.crosscheck_cost, args.crosscheck or 8)
        print(f"cross-check of a {c['bytes'] / 2**30:.2f} GiB shard, N={c['every']}: every N steps the hash of "
              f"its N slices {c['full_crc_ms']:.1f} ms + copy {c['copy_ms']:.1f} ms; {c['per_step_ms']:.1f} ms "
              f"per step amortized (+ two all-gathers every N steps); load average {c['load']:.1f}")
        return
    big = args.size == "1g"
    args.iters = args.iters or (12 if big else 60)
    args.warmup = args.warmup if args.warmup is not None else (2 if big else 5)
    if args.pp == 1:  # (with pipeline stages a rank holds one stage's share)
        print(_sizes.get(args.size).describe(2, args.nproc), flush=True)
    res = measure(args.size, args.nproc, args.iters, args.warmup, args.rounds, args.pp,
                  echo=lambda s: print(s, flush=True), crosscheck=args.crosscheck, slow=args.slow)
    print("\n" + report(res))


if __name__ == "__main__":
    main()
