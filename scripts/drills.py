"""Network drills: a small mindio-run job across hosts simulated as network namespaces, one fault each.

Run as root (``bash scripts/drills.sh``; else it prints why it skips and exits 0). It builds a switch
namespace with a bridge and ``--hosts`` host namespaces (``mdrill<id>-h<i>``, address 10.213.<id>.<i+1>
on ``eth0``, a veth whose other end sits on the bridge), runs the toy job of
tests/recovery/_recover_toy.py (DP=4, ZeRO-1 Adam over 2 replica halves; shard k on ranks k and k+2) with
2 ranks on each of hosts 0 and 1 and (where the row says so) a ``--standby`` agent on host 2, applies one
fault per row, and prints the table::

    fault | outcome | time to training again | steps lost | digest equal | hung?

Every agent runs with ``GLOO_SOCKET_IFNAME=eth0`` and ``MINDIO_PID_PROBE=0`` (only cross-host paths see
a death). Links flap with ``ip link set`` (no tc netem needed). Traffic stays inside the namespaces this
script creates; each row is bounded (``--row-timeout``), and the namespaces are removed at the end (also
after an error or Ctrl-C). Every process a row starts is killed with its namespace's processes.

Faults (the ``FAULTS`` table): kill node 1 (with / without a standby), silent host death (node 1's link
down, then every process on it killed), a partition of node 1 for 2 s and for 10 s, flapping (100 ms
down at each full second for 10 s: node 1's switch port, also with more heartbeat misses and with
``arp_evict_nocarrier=0`` on the hosts; the port blocked at the bridge, no carrier change; node 1's own
NIC; a flapping row's outcome adds the longest heartbeat silence survived before any death), a hang (``MINDIO_HANG_TIMEOUT=5``), a fault during recovery (the
replacement dies at start), node 0's loss with the default provisional backup controller on node 1
(its dump is never made the latest) and with a full one (MINDIO_BACKUP_CONTROLLERS=1: the backup dumps
from node 1's replicas as the latest; also under the 10 s partition), and with one
(the default there) and a standby while the agents' store is an etcd server on a fourth host (``--rdzv-backend etcd``: the backup
takes over and moves node 0's ranks to the standby; needs the ``etcd`` binary, Debian's etcd-server).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "tests" / "recovery" / "_recover_toy.py"
sys.path.insert(0, str(REPO))
from tests._faultplan import FaultPlan  # noqa: E402  (the toy's fault plan)
PORT = 29400


@dataclass
class Row:
    name: str
    apply: str                     # what the harness does to the network / processes (see Drill.fault)
    standby: bool = True
    toy_fault: tuple = ()          # a fault of the toy's plan (kind, rank): fires inside the job at --fault-step
    env: dict = field(default_factory=dict)
    seconds: float = 0.0
    replacement_fails: str = ""    # the toy plan's replacement_fails (tests/_faultplan.py)
    sysctl: dict = field(default_factory=dict)  # set in every host namespace for this row (reset after it)
    etcd: bool = False             # the agents' store on an etcd server on host 3 (--rdzv-backend etcd)


FAULTS = [
    Row("kill node 1 (standby)", "kill-node"),
    Row("kill node 1 (no standby)", "kill-node", standby=False),
    Row("silent host death (link down, then kill)", "silent-death"),
    Row("partition node 1 for 2 s", "partition", seconds=2.0),
    Row("partition node 1 for 10 s", "partition", seconds=10.0),
    Row("link flapping (100 ms down every 1 s, 10 s)", "flap", seconds=10.0),
    Row("link flapping, MINDIO_HEARTBEAT_MISSES=8", "flap", seconds=10.0, env={"MINDIO_HEARTBEAT_MISSES": "8"}),
    Row("link flapping, hosts with arp_evict_nocarrier=0", "flap", seconds=10.0,
        sysctl={"net.ipv4.conf.eth0.arp_evict_nocarrier": "0"}),
    Row("loss flapping at the switch, no carrier loss (port blocked 100 ms every 1 s, 10 s)", "flap-block",
        seconds=10.0),
    Row("NIC flapping on node 1 (eth0 100 ms down every 1 s, 10 s)", "flap-nic", seconds=10.0),
    Row("kill node 0 (controller + stores; provisional backup on node 1: the default on its TCPStore)",
        "kill-node0"),
    Row("kill node 0, backup controller on node 1 (MINDIO_BACKUP_CONTROLLERS=1; no standby)", "kill-node0",
        standby=False, env={"MINDIO_BACKUP_CONTROLLERS": "1"}),
    Row("partition node 1 for 10 s, backup controller on node 1 (MINDIO_BACKUP_CONTROLLERS=1)", "partition",
        seconds=10.0, env={"MINDIO_BACKUP_CONTROLLERS": "1"}),
    Row("kill node 0, standby, agents on etcd (backup controller on node 1 by default)", "kill-node0", etcd=True),
    Row("hang rank 1 (MINDIO_HANG_TIMEOUT=5)", "none", toy_fault=("hang", 1), env={"MINDIO_HANG_TIMEOUT": "5"}),
    Row("fault during recovery (replacement dies)", "none", toy_fault=("kill", 1), replacement_fails="start"),
]


def sh(*cmd, check=True, ns: str | None = None) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + [str(c) for c in cmd]
    return subprocess.run(full, check=check, capture_output=True, text=True)


def can_run() -> str:
    """'' when the drills can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"mdrillprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Net:
    """A switch namespace with a bridge and ``n`` host namespaces on it; :meth:`close` removes them."""

    def __init__(self, n: int, ident: int):
        self.ident, self.sw = ident, f"mdrill{ident}-sw"
        self.hosts = [f"mdrill{ident}-h{i}" for i in range(n)]
        self.addrs = [f"10.213.{ident}.{i + 1}" for i in range(n)]
        sh("ip", "netns", "add", self.sw)
        try:
            sh("ip", "link", "add", "br0", "type", "bridge", ns=self.sw)
            sh("ip", "link", "set", "br0", "up", ns=self.sw)
            for i, (h, a) in enumerate(zip(self.hosts, self.addrs)):
                sh("ip", "netns", "add", h)
                sh("ip", "link", "add", "eth0", "netns", h, "type", "veth", "peer", "name", f"p{i}", "netns", self.sw)
                sh("ip", "link", "set", f"p{i}", "master", "br0", "up", ns=self.sw)
                sh("ip", "addr", "add", f"{a}/24", "dev", "eth0", ns=h)
                sh("ip", "link", "set", "eth0", "up", ns=h)
                sh("ip", "link", "set", "lo", "up", ns=h)
        except BaseException:
            self.close()
            raise

    def link(self, i: int, up: bool, host_side: bool = False) -> None:
        """Host ``i``'s port on the switch up or down (a cable or switch port fault: the host's veth loses
        carrier, so its kernel drops its ARP entries unless arp_evict_nocarrier=0, but keeps its address
        and routes); ``host_side``: the host's own eth0 down (its routes over eth0 go away with it and
        come back on up)."""
        if host_side:
            sh("ip", "link", "set", "eth0", "up" if up else "down", ns=self.hosts[i])
        else:
            sh("ip", "link", "set", f"p{i}", "up" if up else "down", ns=self.sw)

    def block(self, i: int, blocked: bool) -> None:
        """Host ``i``'s switch port drops every frame (bridge port state disabled) or forwards again: loss
        that neither host sees as a carrier change (a fault deeper in the network)."""
        sh("bridge", "link", "set", "dev", f"p{i}", "state", "0" if blocked else "3", ns=self.sw)

    def sysctl(self, key: str, value: str | None = None) -> list[str]:
        """Set ``key`` to ``value`` in every host namespace (None: only read); the values before."""
        old = [sh("sysctl", "-n", key, ns=h).stdout.strip() for h in self.hosts]
        if value is not None:
            for h in self.hosts:
                sh("sysctl", "-qw", f"{key}={value}", ns=h)
        return old

    def kill_host(self, i: int) -> None:
        """SIGKILL every process in host ``i``'s namespace (its power is cut)."""
        r = sh("ip", "netns", "pids", self.hosts[i], check=False)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for i in range(len(self.hosts)):
            self.kill_host(i)
        for h in self.hosts + [self.sw]:
            subprocess.run(["ip", "netns", "del", h], capture_output=True)


class Drill:
    def __init__(self, net: Net, row: Row, out: Path, steps: int, fault_step: int, timeout: float,
                 step_sleep: float):
        self.net, self.row, self.out = net, row, out
        self.steps, self.fault_step, self.timeout, self.step_sleep = steps, fault_step, timeout, step_sleep
        self.procs: dict[str, subprocess.Popen] = {}
        self.fault_t: float | None = None
        self.etcd: subprocess.Popen | None = None

    def start(self) -> None:
        self.out.mkdir(parents=True)
        self.sysctl_before = {k: self.net.sysctl(k, v)[0] for k, v in self.row.sysctl.items()}
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TTP_LOG_STDOUT="1",
                   GLOO_SOCKET_IFNAME="eth0", MINDIO_PID_PROBE="0",
                   MINDIO_EVENT_LOG=str(self.out / "events.jsonl"), **self.row.env)
        common = [sys.executable, "-W", "ignore", "-m", "mindio.launch.cli", "--nnodes", "2", "--nproc-per-node", "2",
                  "--master-addr", self.net.addrs[0], "--master-port", str(PORT),
                  "--high-availability", "retry,recover-in-place,recover,dump"]
        tail = [str(TOY), "--out", str(self.out), "--steps", str(self.steps), "--step-sleep", str(self.step_sleep)]
        faults = [(*self.row.toy_fault, self.fault_step)] if self.row.toy_fault else []
        tail += FaultPlan.of(*faults, replacement_fails=self.row.replacement_fails).argv()
        if self.row.etcd:  # host 3 runs the etcd server (v2 API); the agents wait for it (etcdstore.connect)
            url, peer = f"http://{self.net.addrs[3]}:2379", f"http://{self.net.addrs[3]}:2380"
            log = open(self.out / "etcd.log", "w")
            self.etcd = subprocess.Popen(
                ["ip", "netns", "exec", self.net.hosts[3], "etcd", "--name", "d", "--data-dir", str(self.out / "etcd-data"),
                 "--enable-v2=true", "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"d={peer}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            common += ["--rdzv-backend", "etcd", "--rdzv-endpoint", f"{self.net.addrs[3]}:2379",
                       "--rdzv-id", f"drill-{self.out.name}"]
        agents = [("node0", 0, ["--node-rank", "0"]), ("node1", 1, ["--node-rank", "1"])]
        if self.row.standby:
            agents.append(("standby", 2, ["--standby", "--warm-spares", "2"]))
        for name, host, flags in agents:
            log = open(self.out / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(
                ["ip", "netns", "exec", self.net.hosts[host]] + common + flags
                + ["--local-addr", self.net.addrs[host]] + tail,
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            time.sleep(0.3)

    def iteration(self) -> int:
        """The highest iteration rank 0 printed so far."""
        try:
            text = (self.out / "node0.log").read_text(errors="replace")
        except OSError:
            return 0
        its = re.findall(r"\[rank 0\] iteration (\d+)", text)
        return max(map(int, its)) if its else 0

    def fault(self) -> None:
        """Apply the row's network / process fault once rank 0 reached the fault step."""
        row, net = self.row, self.net
        end = time.monotonic() + self.timeout
        while self.iteration() < self.fault_step and time.monotonic() < end:
            if all(p.poll() is not None for p in self.procs.values()):
                return
            time.sleep(0.05)
        self.fault_t = time.time()
        if row.apply == "kill-node":
            net.kill_host(1)
        elif row.apply == "kill-node0":
            net.kill_host(0)
        elif row.apply == "silent-death":
            net.link(1, False)
            time.sleep(0.5)
            net.kill_host(1)
        elif row.apply == "partition":
            net.link(1, False)
            time.sleep(row.seconds)
            net.link(1, True)
        elif row.apply in ("flap", "flap-nic", "flap-block"):
            cut = (lambda up: net.block(1, not up)) if row.apply == "flap-block" else \
                (lambda up: net.link(1, up, host_side=row.apply == "flap-nic"))
            start = time.monotonic()  # on a fixed schedule: down at start + k s, up 100 ms later
            for k in range(int(row.seconds)):
                time.sleep(max(0.0, start + k - time.monotonic()))
                cut(False)
                time.sleep(max(0.0, start + k + 0.1 - time.monotonic()))
                cut(True)
            time.sleep(max(0.0, start + row.seconds - time.monotonic()))

    def run(self) -> dict:
        self.start()
        t = threading.Thread(target=self.fault, daemon=True)
        t.start()
        # the node whose agent says how the job ended: node 1 when node 0 is the one killed
        main = self.procs["node1" if self.row.apply == "kill-node0" else "node0"]
        hung = False
        try:
            main.wait(self.timeout)
        except subprocess.TimeoutExpired:
            hung = True
        t.join(timeout=15)
        # the other agents end with node 0's round; whatever is left (a frozen or cut-off host) is killed
        deadline = time.monotonic() + 10
        for name, p in self.procs.items():
            if p is not main:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for i in range(len(self.net.hosts)):
            self.net.kill_host(i)
        for p in self.procs.values():
            p.wait()
        if self.etcd is not None:
            self.etcd.wait()
        self.net.link(1, True)
        self.net.link(1, True, host_side=True)
        self.net.block(1, False)
        for key, value in self.sysctl_before.items():
            self.net.sysctl(key, value)
        return self.summary(main.returncode, hung)

    def summary(self, code: int, hung: bool) -> dict:
        events = []
        path = self.out / "events.jsonl"
        if path.exists():
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        text = "".join((self.out / f"{n}.log").read_text(errors="replace") for n in self.procs)
        digests = re.findall(r"state-digest: ([0-9a-f]{64})", text)
        done = [e for e in events if e["kind"] in ("recover_done", "retry_done")]
        dead = [e for e in events if e["kind"] == "rank_dead"]
        fault_t = self.fault_t or next((e["t"] for e in events if e["kind"] == "fault_injected"), None)
        if self.row.toy_fault:
            fault_t = next((e["t"] for e in events if e["kind"] == "fault_injected"), fault_t)
        if hung:
            outcome = "HUNG (row timeout)"
        elif code == 0 and done:
            outcome = "recovered: " + ", then ".join(f"{d.get('strategy', 'retry')} {d.get('replaced', [])}"
                                                     for d in done)
        elif code == 0:
            outcome = "ridden out (no recovery)" if not dead else "recovered"
        elif code == 75:
            outcome = "dump (exit 75): last-words checkpoint"
        else:
            outcome = f"exit {code}, nothing saved" if not (self.out / "ckpt" / "latest").exists() else f"exit {code}"
        first_dead = min((e["t"] for e in dead), default=float("inf"))  # later gaps: a recovery's pauses
        gaps = [e for e in events if e["kind"] == "heartbeat_gap" and e["t"] < first_dead]
        if gaps and self.row.apply.startswith("flap"):  # how close the outages came to the liveness bound
            worst = max(gaps, key=lambda e: e["silent_s"])
            outcome += f"; longest silence survived: {worst['silent_s']:.2f} s (rank {worst['from_rank']})"
        if self.row.apply == "kill-node0" and not hung and not (code == 0 and done):
            said = re.findall(r"mindio-run: (?:job failed|node 0 lost)[^\n]*",
                              (self.out / "node1.log").read_text(errors="replace"))
            tb = "mindio/launch/agent.py" in (self.out / "node1.log").read_text(errors="replace")  # agent traceback
            dumped = next((e for e in events if e["kind"] == "backup_dumped"), None)
            saved = (" (last-words checkpoint)" if code == 75 and (self.out / "ckpt" / "latest").exists() else
                     " (provisional last-words checkpoint, not the latest)" if code == 75 and dumped
                     and dumped.get("provisional") else "")
            if dumped and fault_t:
                saved += f", saved {dumped['t'] - fault_t:.2f} s after the kill"
            outcome = (f"node 1 exit {code}{saved}" + (", with a traceback" if tb else "") +
                       (f": \"{said[0][:160]}...\"" if said else ", no reason printed"))
        elif (self.out / "node1.log").exists():  # node 1 acting on its own (a backup beside a job that went on)
            said = re.findall(r"mindio-run: (?:node 0 lost|job failed on node 1)[^\n]*",
                              (self.out / "node1.log").read_text(errors="replace"))
            if said:
                outcome += f"; node 1: \"{said[0][:140]}...\""
        again = f"{done[0]['t'] - fault_t:.2f} s" if done and fault_t else "-"  # every rank trains again
        reached = max((int(i) for i in re.findall(r"\[rank \d\] iteration (\d+)", text)), default=0)
        if done:  # iterations some rank computed twice (its old process, then its replacement / a rollback)
            lost = str(max(len(its) - len(set(its)) for its in
                           ([int(i) for i in re.findall(rf"\[rank {r}\] iteration (\d+)", text)] for r in range(4))))
        elif (self.out / "ckpt" / "latest").exists():  # resuming from the dump redoes what came after it
            lost = str(max(0, reached - int((self.out / "ckpt" / "latest").read_text())))
        elif any(e["kind"] == "backup_dumped" and e.get("provisional") for e in events):  # the same, from it
            lost = str(max(0, reached - next(e["step"] for e in events if e["kind"] == "backup_dumped")))
        else:
            lost = "-" if code == 0 else "all"
        return {"fault": self.row.name, "outcome": outcome, "again": again, "lost": lost,
                "digest": digests[0] if digests else None, "hung": "yes" if hung else "no", "code": code,
                "reached": reached, "dead": sorted({e["dead_rank"] for e in dead})}


def drill_args(doc: str, own: dict, fault_step: int, row_timeout: float, rows: list, why: str,
               argv=None) -> tuple | None:
    """The command line of a drill script (this one, scripts/slurm_drills.py): its ``own`` options
    (flag: add_argument's keywords), then the shared --fault-step, --row-timeout, --only and --keep.
    (args, the rows --only selects); None, with the reason printed, where the script cannot run (``why``)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag, kw in own.items():
        p.add_argument(flag, **kw)
    p.add_argument("--fault-step", type=int, default=fault_step)
    p.add_argument("--row-timeout", type=float, default=row_timeout)
    p.add_argument("--only", default="", help="run the rows whose name contains this text")
    p.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    a = p.parse_args(argv)
    if why:
        print(f"{Path(sys.argv[0]).stem.replace('_', ' ')} skipped: {why}")
        return None
    return a, [r for r in rows if a.only.lower() in r.name.lower()]


def keep_or_remove(work: Path, keep: bool) -> None:
    """A drill script's end: its logs' path printed (--keep), else the logs removed."""
    if keep:
        print(f"\nlogs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parsed = drill_args(__doc__, {"--steps": dict(type=int, default=30), "--step-sleep": dict(type=float, default=0.2)},
                        fault_step=12, row_timeout=150.0, rows=FAULTS, why=can_run())
    if parsed is None:
        return 0
    a, rows = parsed
    if shutil.which("etcd") is None:
        for r in [r for r in rows if r.etcd]:
            print(f"  {r.name}: skipped: needs the etcd binary (apt-get install etcd-server)")
        rows = [r for r in rows if not r.etcd]
    work = Path(tempfile.mkdtemp(prefix="mindio-drills-"))
    ident = os.getpid() % 200 + 20
    net = Net(4 if any(r.etcd for r in rows) else 3, ident)  # host 3: the etcd server
    results = []
    try:
        ref = Drill(net, Row("no fault (reference)", "none"), work / "ref", a.steps, a.fault_step,
                    a.row_timeout, a.step_sleep).run()
        results.append(ref)
        for i, row in enumerate(rows):
            results.append(Drill(net, row, work / f"row{i}", a.steps, a.fault_step, a.row_timeout,
                                 a.step_sleep).run())
            print(f"  {results[-1]['fault']}: {results[-1]['outcome']}", flush=True)
    finally:
        net.close()
    print()
    print("| fault | outcome | time to training again | steps lost | digest equal | hung? |")
    print("|---|---|---|---|---|---|")
    for r in results:
        equal = "-" if r["digest"] is None else ("yes" if r["digest"] == ref["digest"] else "NO")
        if r is ref:
            equal = "(reference)"
        print(f"| {r['fault']} | {r['outcome']} | {r['again']} | {r['lost']} | {equal} | {r['hung']} |")
    keep_or_remove(work, a.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
