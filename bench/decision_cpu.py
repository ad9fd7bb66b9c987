"""The controller's decision at N ranks, in one process: the part of bench/controller_scale.py's
"fault -> decision" that is the controller's own work once the stop round has answered (issue 34).

    python bench/decision_cpu.py --n 10000 --n 100000 --baseline HEAD~1

A real Controller (threads not started; by default in a process of its own, as mindio-run hosts it, its rank
table frozen out of the garbage collector's walks once every rank registered; ``--in-rank``: in a training
rank's process) whose rank table holds N registered ranks in DP groups of 16 with
2 replicas (as controller_scale.py lays them out); rank 5 dies; the stop round's replies come from every
other rank. Timed: ``IncidentFlow.facts`` (the views, the lock step, the dump plan, the repair check) and
``decide``, the median of 5 calls, in a fresh process per tree; the baseline (another commit's mindio,
``git archive``) runs in the same invocation, alternating with this tree, and the ratio is printed. Not in
the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DP = 16
RANK = -1  # the controller's rank: -1 in a process of its own (mindio-run), 0 in a training rank's (--in-rank)

_CHILD = r"""
import json, sys, time
from mindio.ttp._enums import OsStatus
from mindio.ttp.controller.controller import Controller
from mindio.ttp.controller.ranks import RankRecord
from mindio.ttp.controller.states import Result
from mindio.ttp.wire import protocol as P
n, dp, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
U = int(OsStatus.UPDATED)
ctl = Controller(int(sys.argv[4]), n, {"retry", "dump", "recover"}, b"k" * 32)
for r in range(n):
    g = r - r % dp
    ctl.ranks[r] = RankRecord(r, b"id%d" % r, step=7, data_status=U,
                              replica=[{"rank_list": list(range(g, g + dp)), "replica_cnt": 2, "replica_shift": 0}])
ctl.sm.fire(Result.ALL_REGISTERED, ranks=n)
getattr(ctl, "_freeze_heap", lambda: None)()  # as when every rank registered (in its own process: rank -1)
ctl.declare_dead([5], "heartbeat", log=False)
inc = ctl.incidents.current
rep = P.Reply(ok=True, detail={"step": 7, "data_status": U, "main": "parked"})
replies = {r: rep for r in range(n) if r != 5}
out = []
for _ in range(reps):
    t0 = time.process_time()
    facts = ctl.incidents.facts(inc, replies)
    order = ctl.incidents.decide(inc, facts)
    out.append(time.process_time() - t0)
assert facts.faulty == [5] and order[0] == "dump", (facts.faulty, order)
print(json.dumps(out))
"""


def _measure(src: str, n: int, reps: int) -> list:
    env = {**os.environ, "PYTHONPATH": src, "TTP_LOG_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(DP), str(reps), str(RANK)], env=env, cwd=src,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the measurement in {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, action="append", help="ranks (repeatable; default 10000 and 100000)")
    p.add_argument("--baseline", default="", help="a git revision whose mindio is measured too (its ratio)")
    p.add_argument("--rounds", type=int, default=3, help="processes per tree, alternating")
    p.add_argument("--in-rank", action="store_true", help="the controller in a training rank's process (rank 0, "
                   "torchrun), whose heap it does not freeze; default: in a process of its own (a mindio-run agent's)")
    a = p.parse_args()
    global RANK
    RANK = 0 if a.in_rank else -1
    sizes = a.n or [10000, 100000]
    trees = {"this tree": _ROOT}
    with tempfile.TemporaryDirectory(prefix="mindio-bench-") as tmp:
        if a.baseline:
            archive = subprocess.run(["git", "-C", _ROOT, "archive", a.baseline, "mindio"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            trees[f"baseline {a.baseline}"] = tmp
        print(f"decision CPU (facts + decide), median of {a.rounds} processes x 5 calls; DP groups of {DP}, 2 replicas")
        for n in sizes:
            got = {name: [] for name in trees}
            for _ in range(a.rounds):
                for name, src in trees.items():
                    got[name].append(statistics.median(_measure(src, n, 5)))
            med = {name: statistics.median(v) for name, v in got.items()}
            line = "  ".join(f"{name}: {med[name] * 1000:.0f} ms" for name in trees)
            if a.baseline:
                base = med[f"baseline {a.baseline}"]
                line += f"  ratio {med['this tree'] / base:.2f}x (this / baseline)"
            print(f"N={n:>7}: {line}")


if __name__ == "__main__":
    main()
