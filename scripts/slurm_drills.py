"""Slurm drills: the Megatron example under examples/slurm/pretrain_gpt.sbatch on a real Slurm cluster
(tests/slurm/_cluster.py: slurmctld + 3 slurmd "hosts" in network namespaces), one fault per row.

Run as root (``bash scripts/slurm_drills.sh``; else it prints why it skips and exits 0). First a plain
``mindio-run --standalone --nproc-per-node 4`` run of the same command gives the reference digest; then
each row submits a 2-node job (2 ranks per node, 4 in all; a 3-node one with ``SPARES=1``), applies its
fault once rank 0 printed iteration ``--fault-step``, waits for the job's end and prints::

    fault | outcome | requeues | nodes down | time to training again | steps lost | digest equal | hung?

Faults: none; a worker SIGKILLed (rank 3, the example's ``--inject kill``); node n1 lost (every process
in its namespace SIGKILLed: slurmd, slurmstepd, mindio-run, workers) without and with a spare node;
``scancel --signal=TERM``; the time limit's ``--signal`` (``--time=2 --signal=TERM@S``). "time to training
again": from the fault (the signal's delivery for the time limit) to the next iteration line of rank 0
(after the requeue) or to the controller's ``recover_done`` event (in place). Each row is bounded
(``--row-timeout``); the cluster and its namespaces are removed at the end.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "slurm"))
from _cluster import SBATCH, Cluster, can_run  # noqa: E402

PRETRAIN = "examples/megatron/pretrain_gpt.py"
DIGEST = re.compile(r"^state-digest: ([0-9a-f]{64})", re.M)
ITER = re.compile(r"^ *iteration +(\d+)/", re.M)


@dataclass
class Row:
    name: str
    apply: str = "none"       # kill-node, scancel, timelimit, none
    inject: str = ""          # the example's --inject (a fault inside the job, at --fault-step)
    spares: int = 0
    env: dict = field(default_factory=dict)  # the batch script's knobs (DOWN_LOST=0, ...)


ROWS = [
    Row("no fault: 2-node sbatch job, 4 ranks"),
    Row("worker SIGKILLed (rank 3)", inject="kill:rank=3,step={step}"),
    Row("node n1 lost (slurmd + agent killed), no spare", "kill-node"),
    Row("node n1 lost, a spare node (SPARES=1)", "kill-node", spares=1),
    Row("scancel --signal=TERM", "scancel"),
    Row("time limit (--time=2 --signal=TERM@S)", "timelimit"),
]


def train_args(ckpt: Path, iters: int) -> list:
    return [PRETRAIN, "--use-distributed-optimizer", "--enable-high-availability", "--train-iters", str(iters),
            "--log-interval", "1", "--save", str(ckpt), "--load", str(ckpt)]


def base_env(out: Path) -> dict:
    return {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "MINDIO_PID_PROBE": "0",
            "MINDIO_EVENT_LOG": str(out / "events.jsonl"), "MINDIO_DRILL_DIR": str(out / "drill")}


def reference(out: Path, iters: int, timeout: float, command: list | None = None) -> str | None:
    """The digest of the same command (``command``: another training command) under plain mindio-run on
    this host (no Slurm)."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "mindio.launch.cli", "--standalone", "--nproc-per-node", "4",
                        "--high-availability", "dump,recover-in-place,recover"]
                       + (command or train_args(out / "ckpt", iters)),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "ref.log").write_text(r.stdout + r.stderr)
    found = DIGEST.findall(r.stdout + r.stderr)
    return found[-1] if r.returncode == 0 and found else None


class Drill:
    def __init__(self, cluster: Cluster, row: Row, out: Path, iters: int, fault_step: int, timeout: float,
                 time_signal: int, command: list | None = None, iter_re: re.Pattern = ITER):
        """``command``: another training command; ``iter_re``: its rank-0 iteration lines (group 1: the
        iteration)."""
        self.c, self.row, self.out, self.iter_re = cluster, row, out, iter_re
        self.iters, self.fault_step, self.timeout, self.time_signal = iters, fault_step, timeout, time_signal
        self.command = command
        self.fault_t: float | None = None
        self.again_t: float | None = None

    def text(self) -> str:
        try:
            return (self.out / "job.out").read_text(errors="replace")
        except OSError:
            return ""

    def submit(self) -> str:
        (self.out / "drill").mkdir(parents=True)
        args = self.command or train_args(self.out / "ckpt", self.iters)
        if self.row.inject:
            args += ["--inject", self.row.inject.format(step=self.fault_step)]
        nodes = 2 + self.row.spares
        flags = ["--nodes", nodes, "--output", self.out / "job.out"]
        if self.row.apply == "timelimit":
            flags += ["--time", "2", f"--signal=TERM@{self.time_signal}"]
        env = {**base_env(self.out), "NPROC": "2", "SPARES": str(self.row.spares), "CKPT": str(self.out / "ckpt"),
               "LOST_GRACE": "10", "RUNDIR": str(self.out / "run"), **self.row.env}
        return self.c.sbatch(*flags, SBATCH, *args, env=env)

    def watch(self, job: str, end: float) -> None:
        """Apply the fault at --fault-step; note when rank 0 trains again after it."""
        row = self.row
        while time.monotonic() < end and self.fault_t is None:
            its = [int(i) for i in self.iter_re.findall(self.text())]
            if its and max(its) >= self.fault_step:
                if row.apply == "kill-node":
                    self.fault_t = time.time()
                    self.c.kill_host(1)
                elif row.apply == "scancel":
                    self.fault_t = time.time()
                    self.c.run("scancel", "--signal=TERM", job)
                elif row.apply == "timelimit":  # Slurm's own signal: its delivery is the fault's time
                    self.fault_t = self.signalled(end)
                    break
                else:
                    self.fault_t = time.time()
                break
            if self.c.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
                return
            time.sleep(0.1)
        while time.monotonic() < end and self.again_t is None:  # the first iteration line after a restart
            text = self.text()
            restarted = "(restart 1)" in text
            if restarted and self.iter_re.findall(text.split("(restart 1)", 1)[1]):
                self.again_t = time.time()
            elif restarted and row.apply == "timelimit":  # the resumed run may finish: no second signal
                self.c.run("scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED", check=False)
            if self.c.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                return
            time.sleep(0.1)

    def signalled(self, end: float) -> float | None:
        """When the time limit's signal reached the job: the agents' preemption event."""
        while time.monotonic() < end:
            for e in self.events():
                if e["kind"].startswith("preempt"):
                    return e["t"]
            time.sleep(0.2)
        return None

    def events(self) -> list:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def run(self) -> dict:
        self.out.mkdir(parents=True)
        job = self.submit()
        end = time.monotonic() + self.timeout
        t = threading.Thread(target=self.watch, args=(job, end), daemon=True)
        t.start()
        info = self.c.wait_job(job, max(1.0, end - time.monotonic()), states=("COMPLETED", "FAILED", "CANCELLED",
                                                                                "TIMEOUT", "NODE_FAIL"))
        hung = info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
        if hung:
            self.c.run("scancel", job, check=False)
        t.join(timeout=5)
        return self.summary(job, info, hung)

    def summary(self, job: str, info: dict, hung: bool) -> dict:
        text, events = self.text(), self.events()
        digests = DIGEST.findall(text)
        runs = re.split(r"pretrain_gpt\.sbatch: job \d+ \(restart \d+\)", text)[1:]
        exits = re.findall(r"pretrain_gpt\.sbatch: exit (\d+)", text)
        down = sorted({m for m in re.findall(r"no exit from ([\w ]+?) \d+ s after", text)})
        done = [e for e in events if e["kind"] in ("recover_done", "retry_done")]
        lost = "-"
        loaded = re.findall(r"loaded checkpoint iteration (\d+)", text)
        if len(runs) > 1 and loaded:  # resumed: the iterations of the first run after the checkpoint it left
            before = [int(i) for i in self.iter_re.findall(runs[0])]
            lost = str(max(0, max(before, default=0) - int(loaded[-1])))
        elif done:
            its = [int(i) for i in self.iter_re.findall(text)]
            lost = str(len(its) - len(set(its)))
        again = "-"
        if self.fault_t and self.again_t:
            again = f"{self.again_t - self.fault_t:.1f} s (requeued)"
        elif done:
            fault = next((e["t"] for e in events if e["kind"] == "fault_injected"), self.fault_t)
            again = f"{done[0]['t'] - fault:.1f} s (in place)" if fault else "-"
        outcome = f"{info.get('JobState', '?')}, exits {'/'.join(exits) or '-'}"
        if done:
            outcome += ", recovered in place: " + ", ".join(f"{d.get('strategy', 'retry')} {d.get('replaced', [])}"
                                                            for d in done)
        return {"fault": self.row.name, "outcome": outcome, "requeues": info.get("Restarts", "?"),
                "down": ",".join(down) or "-", "again": again, "lost": lost,
                "digest": digests[-1] if digests else None, "hung": "yes" if hung else "no", "job": job}


def main() -> int:
    from drills import drill_args, keep_or_remove

    parsed = drill_args(__doc__, {"--iters": dict(type=int, default=300),
                                  "--time-signal": dict(type=int, default=80,
                                                        help="--signal=TERM@S of the time-limit row (--time=2)")},
                        fault_step=60, row_timeout=400.0, rows=ROWS, why=can_run())
    if parsed is None:
        return 0
    a, rows = parsed
    work = Path(tempfile.mkdtemp(prefix="mindio-slurm-drills-"))
    ref = reference(work / "ref", a.iters, a.row_timeout)
    print(f"  reference (plain mindio-run, 4 ranks): {ref}", flush=True)
    results = []
    cluster = Cluster(work / "cluster", 3)
    try:
        for i, row in enumerate(rows):
            r = Drill(cluster, row, work / f"row{i}", a.iters, a.fault_step, a.row_timeout, a.time_signal).run()
            results.append(r)
            print(f"  {r['fault']}: {r['outcome']}", flush=True)
            if r["down"] != "-" or row.apply == "kill-node":  # the lost host back for the next row
                cluster.revive(1)
    finally:
        cluster.close()
    print()
    print("| fault | outcome | requeues | nodes down | time to training again | steps lost | digest equal | hung? |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        equal = "-" if r["digest"] is None or ref is None else ("yes" if r["digest"] == ref else "NO")
        print(f"| {r['fault']} | {r['outcome']} | {r['requeues']} | {r['down']} | {r['again']} | {r['lost']} | "
              f"{equal} | {r['hung']} |")
    keep_or_remove(work, a.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
