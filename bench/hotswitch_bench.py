"""Hot-switch benchmark: how long training stops, backups started before the pause vs after it.

    .venv/bin/python bench/hotswitch_bench.py                # 2 runs per order, alternating, ~3 min quiet
    .venv/bin/python bench/hotswitch_bench.py --rounds 1 --json out.json

The job is examples/megatron/pretrain_gpt.py under mindio-run (4 ranks, DP=4, distributed optimizer with 2
replicas, the tiny default GPT, gloo on CPU), driven by the cluster brain of tests/recovery/_hotswitch_brain.py
(scenario ``switch``): once every rank passed iteration 3 it asks for the hot switch of rank 1 and answers
``migration``. Rank 0 holds iteration 5 (``--inject hold``) until the switch is past its backups'
registration, so that the job is still training when they register, however slowly they start.

Two orders, alternating in one run (same machine, same load):

* ``prestart`` (now): the backup starts and registers while training goes on (interpreter, imports, the
  example's data and model code, the gc freeze), then the job pauses; only the new generation's groups,
  the model/optimizer build and the repair happen while paused.
* ``after`` (``MINDIO_SWITCH_PRESTART=0``, the former order): the job pauses first, then the backup starts.

Per run: **paused** = the first rank parked at the pause step (``paused_at``) -> every rank training
again (``train_resumed``); **request** = ``prepare_action`` -> training again; the backup's start before the
pause (``hot_switch_backups_ready``). Every run must end with the same state digest (bitwise equal runs).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mindio._ports import free_port as _port  # outside the ephemeral range (mindio/_ports.py)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "megatron" / "pretrain_gpt.py"
BRAIN_DIR = REPO / "tests" / "recovery"
ARGS = ["--use-distributed-optimizer", "--enable-high-availability", "--no-dump", "--train-iters", "20", "--seed", "1234",
        "--inject", "hold:rank=0,step=5,seconds=120"]


def one(mode: str, work: Path, timeout: float) -> dict:
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{BRAIN_DIR}", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1", "HIGH_AVAILABILITY": "recover-in-place,dump", "HS_SCENARIO": "switch",
           "HS_OUT": str(work), "HS_AT": "3", "MINDIO_DRILL_DIR": str(work), "MINDIO_EVENT_LOG": str(work / "ev.jsonl"),
           "TTP_LOG_PATH": str(work / "logs"), "TTP_PORT": str(_port()), "MINDIO_ACP_IDLE_EXIT": "20",
           "MINDIO_HEARTBEAT_INTERVAL": "0.5", "MINDIO_HEARTBEAT_MISSES": "6",
           "MINDIO_SWITCH_PRESTART": "1" if mode == "prestart" else "0"}
    cmd = [sys.executable, "-W", "ignore", "-m", "_hotswitch_brain", "--nproc-per-node", "4", "--master-addr",
           "127.0.0.1", "--master-port", str(_port()), str(EXAMPLE), *ARGS]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"{mode}: the job did not end within {timeout:.0f} s; output in {work}") from exc
    (work / "output.txt").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: the job exited {p.returncode}; see {work / 'output.txt'}")
    read = lambda f: [json.loads(x) for x in f.read_text().splitlines() if x.strip()]  # noqa: E731
    ev, brain = read(work / "ev.jsonl"), read(work / "brain.jsonl")
    kinds = {e["kind"] for e in ev}
    if "recover_done" not in kinds:
        raise SystemExit(f"{mode}: no hot switch happened ({sorted(kinds)}); see {work}")
    resumed = max(e["t"] for e in ev if e["kind"] == "train_resumed")
    ready = [e for e in ev if e["kind"] == "hot_switch_backups_ready"]
    digests = re.findall(r"state-digest: ([0-9a-f]+)", p.stdout + p.stderr)
    return {"mode": mode, "wall_s": round(time.monotonic() - t0, 1),
            "paused_s": round(resumed - min(e["t"] for e in ev if e["kind"] == "paused_at"), 3),
            "request_s": round(resumed - next(b["t"] for b in brain if b["kind"] == "prepare_action"), 3),
            "backup_start_s": ready[0]["start_s"] if ready else None,
            "phases": {k: v for k, v in next(e for e in ev if e["kind"] == "recover_done").items()
                       if k.endswith("_s") and k != "total_s"},
            "digest": digests[-1] if digests else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs per order (alternating)")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    load = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory(prefix="hotswitch-bench-") as tmp:
        for i in range(a.rounds):
            for mode in ("after", "prestart"):
                r = one(mode, Path(tmp) / f"{mode}{i}", a.timeout)
                runs.append(r)
                print(f"{mode:9s} paused {r['paused_s']:.3f} s  request->training {r['request_s']:.3f} s  "
                      f"backup start before the pause {r['backup_start_s']}  {r['phases']}", flush=True)
    digests = {r["digest"] for r in runs}
    med = {m: statistics.median(r["paused_s"] for r in runs if r["mode"] == m) for m in ("after", "prestart")}
    print(f"\nload average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; {a.rounds} run(s) per order")
    print(f"training paused (median): backups after the pause {med['after']:.3f} s, before it {med['prestart']:.3f} s "
          f"-> {med['after'] / med['prestart']:.2f}x shorter")
    print("final state digests: " + ("all equal" if len(digests) == 1 and None not in digests
                                     else f"DIFFER {sorted(map(str, digests))}"))
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "median_paused_s": med, "load": load}, indent=1))
    return 0 if len(digests) == 1 and None not in digests else 1


if __name__ == "__main__":
    sys.exit(main())
