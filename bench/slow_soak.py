"""False alarms of slow-rank detection (issue 31): fault-free runs of examples/megatron/pretrain_gpt.py with
slow ranks scored, beside a busy loop, counting the ranks named (event ``rank_slow``). Not a test: it runs for
minutes (1,000 steps by default); the suite runs a 40-step version (tests/ttp/test_slow.py).

    python bench/slow_soak.py                        # 4 ranks, 1,000 steps, MINDIO_SLOW_WINDOW=5, one busy loop
    python bench/slow_soak.py --steps 300 --window 5 --k 5 --busy 0

Prints the ranks named (step, ratio, own/wait per step) and false alarms per 1,000 steps. Issue 31's bar for
turning detection on by default: none.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ha_overhead  # noqa: E402  (bench/ha_overhead.py: run())


def soak(steps: int, nproc: int, window: int, k: int | None, busy: int) -> list:
    """The ``rank_slow`` events of one fault-free run of ``steps`` steps beside ``busy`` busy loops."""
    d = tempfile.mkdtemp(prefix="mindio-slow-soak-")
    env = {"MINDIO_SLOW_WINDOW": str(window), "MINDIO_EVENT_LOG": os.path.join(d, "events.jsonl"),
           "TTP_LOG_STDOUT": "1"}
    if k is not None:
        env["MINDIO_SLOW_K"] = str(k)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        ha_overhead.run(nproc, steps, ["--enable-high-availability", "--save", os.path.join(d, "ckpt")],
                        timeout=max(600, steps), env=env, attempts=1)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    with open(env["MINDIO_EVENT_LOG"]) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return [e for e in events if e["kind"] == "rank_slow"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--window", type=int, default=5, help="MINDIO_SLOW_WINDOW")
    ap.add_argument("--k", type=int, default=None, help="MINDIO_SLOW_K (default: the knob's)")
    ap.add_argument("--busy", type=int, default=1, help="busy loops beside the job")
    a = ap.parse_args()
    found = soak(a.steps, a.nproc, a.window, a.k, a.busy)
    for e in found:
        who = f"rank {e['slow_rank']}" if "slow_rank" in e else f"group {e.get('group')} (ranks {e.get('ranks')})"
        print(f"  named: {who} at step {e['at_step']} (cause {e['cause']}, ratio {e['ratio']}, "
              f"own {e.get('own_s', 0):.4f} s / wait {e.get('wait_s', 0):.4f} s per step)")
    print(f"{a.nproc} ranks, {a.steps} fault-free steps, window {a.window}, K {a.k or 'default'}, {a.busy} busy "
          f"loop(s), load average {os.getloadavg()[0]:.1f}: {len(found)} rank(s) named = "
          f"{1000 * len(found) / a.steps:.1f} false alarms per 1,000 steps ({'PASS' if not found else 'FAIL'})")


if __name__ == "__main__":
    main()
