"""A real Slurm cluster on this machine: Debian's slurmctld, slurmd and munge, each slurmd a "host" in a
network namespace of its own (scripts/drills.py's ``Net``: a bridge, 10.213.<id>.<i+1> on each host's
eth0), slurmctld in one more. Used by tests/slurm/test_slurm_real.py and scripts/slurm_drills.py.

Needs root, iproute2 and the binaries (scripts/install.sh installs them where it runs as root with apt);
:func:`can_run` says why not otherwise. Everything lives under one work directory: munged's key and
socket (munged runs in the root namespace: its unix socket is reached through the file system), the
slurm.conf the daemons and clients read (``SLURM_CONF``), state, spool and logs. Traffic stays on the
bridge of the namespaces this creates; :meth:`Cluster.close` kills every process it started (the
namespaces' processes with them) and removes the namespaces.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from drills import Net, can_run as _can_net  # noqa: E402

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged")
SBATCH = REPO / "examples" / "slurm" / "pretrain_gpt.sbatch"

CONF = """\
ClusterName=mindio{ident}
SlurmctldHost={hostname}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={work}/munge.sock,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%n.pid
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
KillWait=5
MinJobAge=300
JobRequeue=1
OverTimeLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
"""


def _in(ns: str | None) -> list:
    """The prefix that runs a command in network namespace ``ns`` -- only its network: ``ip netns exec``
    would also remount /sys, which hides the cgroup file systems slurmd needs."""
    return ["nsenter", f"--net=/run/netns/{ns}"] if ns else []


def can_run() -> str:
    """'' when a cluster can be built here, else why not."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"needs Slurm and munge ({', '.join(missing)} not found; scripts/install.sh installs slurmctld, " \
               f"slurmd, slurm-client and munge where it runs as root with apt)"
    return _can_net()


class Cluster:
    """``nodes`` slurmd "hosts" n0..n{nodes-1} and a slurmctld host, on one bridge."""

    def __init__(self, work: Path, nodes: int, ident: int | None = None, slurmd_timeout: int = 10,
                 start_timeout: float = 60.0):
        self.work, self.ident = Path(work), ident if ident is not None else 220 + os.getpid() % 30
        self.names = [f"n{i}" for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.daemons: dict[str, subprocess.Popen] = {}
        self.net = Net(nodes + 1, self.ident)
        try:
            self._start(slurmd_timeout, start_timeout)
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _start(self, slurmd_timeout: int, start_timeout: float) -> None:
        w = self.work
        for d in ["state", "logs"] + [f"spool/{n}" for n in self.names]:
            (w / d).mkdir(parents=True, exist_ok=True)
        key = w / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.ctl_addr = self.net.addrs[-1]
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=1 RealMemory=100 State=UNKNOWN"
                          for n, a in zip(self.names, self.net.addrs))
        self.conf = w / "slurm.conf"
        self.conf.write_text(CONF.format(ident=self.ident, hostname=socket.gethostname().split(".")[0], ctl_addr=self.ctl_addr, ctld_port=6817, work=w,
                                         slurmd_timeout=slurmd_timeout, nodes=nodes))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MINDIO_FORK"))}
        self.env.update(SLURM_CONF=str(self.conf), PATH=f"{Path(sys.executable).parent}:{self.env.get('PATH', '')}")
        self._daemon("munged", None, ["munged", "-F", "-f", "--key-file", str(key), "--socket", str(w / "munge.sock"),
                                      "--pid-file", str(w / "munged.pid"), "--log-file", str(w / "munged.log"),
                                      "--seed-file", str(w / "munged.seed")])
        self._wait(lambda: (w / "munge.sock").exists(), 10, "munged's socket (munged.log)")
        self._daemon("slurmctld", self.net.hosts[-1], ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for i, n in enumerate(self.names):
            self.start_slurmd(i)
        self._wait(lambda: self.idle() == len(self.names), start_timeout,
                   f"{len(self.names)} idle nodes in sinfo (slurmctld.log, slurmd-*.log under {w})")

    def _daemon(self, name: str, ns: str | None, cmd: list) -> None:
        log = open(self.work / "logs" / f"{name}.out", "ab")
        full = _in(ns) + [str(c) for c in cmd]
        self.daemons[name] = subprocess.Popen(full, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
        log.close()

    def start_slurmd(self, i: int) -> None:
        self._daemon(f"slurmd-{self.names[i]}", self.net.hosts[i],
                     ["slurmd", "-D", "-N", self.names[i], "-f", str(self.conf)])

    @staticmethod
    def _wait(cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError(f"slurm cluster: no {what} after {timeout:.0f} s")
            time.sleep(0.2)

    # -- clients (run in the controller's namespace) ---------------------------------------------------
    def run(self, *cmd, check=True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        r = subprocess.run(_in(self.net.hosts[-1]) + [str(c) for c in cmd], env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def idle(self) -> int:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return sum(1 for line in r.stdout.splitlines() if line.split()[-1:] == ["idle"])

    def sbatch(self, *args, env: dict | None = None) -> str:
        r = subprocess.run(_in(self.net.hosts[-1]) + ["sbatch", "--parsable"] + [str(a) for a in args],
                           env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=30,
                           cwd=str(REPO))
        if r.returncode:
            raise RuntimeError(f"sbatch: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, NodeList, ExitCode, ...); {} once purged."""
        r = self.run("scontrol", "show", "job", "-o", job_id, check=False, timeout=10)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}

    def node(self, name: str) -> dict:
        r = self.run("scontrol", "show", "node", "-o", name, check=False, timeout=10)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}

    def wait_job(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        end = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if j.get("JobState") in states or time.monotonic() > end:
                return j
            time.sleep(0.3)

    # -- faults --------------------------------------------------------------------------------------
    def kill_host(self, i: int) -> None:
        """Node ``i`` lost: SIGKILL every process in its namespace (slurmd, slurmstepd, mindio-run, workers)."""
        self.net.kill_host(i)

    def revive(self, i: int, timeout: float = 60.0) -> None:
        """Node ``i`` back after :meth:`kill_host`: whatever is left in its namespace killed, a fresh slurmd,
        the node resumed (a job may have set it DOWN) and every node idle again."""
        self.kill_host(i)
        self.start_slurmd(i)
        self.run("scontrol", "update", f"NodeName={self.names[i]}", "State=RESUME", check=False)
        self._wait(lambda: self.idle() == len(self.names), timeout, f"{self.names[i]} idle again")

    # -- tear-down -----------------------------------------------------------------------------------
    def close(self) -> None:
        self.net.close()  # every process in the namespaces (slurmctld, slurmd, the jobs), then the namespaces
        for p in self.daemons.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
