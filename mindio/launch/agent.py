"""The per-node launch agent behind ``mindio-run`` (torchrun-compatible).

One agent runs on every node. Conversation through the agents' store -- a TCPStore hosted by node 0 on
``--master-port``, or the job's keys on an etcd server (``--rdzv-backend etcd``: stores.py,
etcdstore.py); every key below lives there:

* ``agent/<node>/beat``      each agent, every monitor interval, from its beat thread: its wall-clock
                             time; others watch the value change (liveness.py).
* ``round/<n>/joined``       each agent adds 1 when it starts round ``n`` (a round = one generation of
                             worker processes; a whole-job restart starts the next round).
* ``round/<n>/port``         node 0: port of the round's *worker* TCPStore. Every round gets a fresh
                             store so that keys of a failed round can never collide with the new one.
* ``round/<n>/failed``       any agent: why the round failed (a worker exited non-zero, a node's beats
                             stopped). Every agent then stops its workers and, while restarts remain,
                             joins round ``n+1``.
* ``round/<n>/done``         each agent adds 1 when all its workers exited 0; the job succeeds when it
                             reaches ``nnodes``. Node 0 keeps the stores up until then.
* ``round/<n>/failures/<node>`` each agent: JSON list of its workers' failures (rank, exit code, the
                             exception from the worker's error file: failures.py), so that every agent's
                             summary names the round's root cause, whichever node it ran on.
* ``rdzv/next_node``         ``--rdzv-backend c10d`` without ``--node-rank``: the node ranks handed out
                             (the agent hosting the endpoint is node 0).
* ``controller/leader``      etcd, with backup controllers: the node whose agent hosts the controller in
                             charge (a TTL key; etcdstore.Leader, backup.lead).
* ``round/<n>/store``        etcd: JSON {addr, port} of the workers' store once it moved off a lost node 0
                             (takeover.py).
* ``job/ended``              etcd: the leading agent's last word; waiting standby agents leave.

With high availability on (``--high-availability`` / ``HIGH_AVAILABILITY``), node 0 also hosts the
controller as rank -1, a worker death is reported to it at once, and agents start single ranks again
(recover-in-place) or a standby takes a lost node's ranks (recover) in the running round: see ha.py.

Workers are started through :mod:`mindio.launch._bootstrap`: each agent keeps ``warm_spares``
interpreters that already imported torch (and whatever of the script's imports cannot read the rank
environment), so a (re)start does not pay the interpreter start-up on the critical path; where a
fork is safe (CPU-only torch), one fork server per agent does those imports once and forks every
worker instead (forkserver.py). Workers die
with their agent (PR_SET_PDEATHSIG), so killing an agent simulates the loss of a node. Their output and
error files follow torchrun's ``--log-dir`` / ``--tee`` / ``--redirects`` (logs.py).

Every wait is bounded; when a bound is hit, the message names what was awaited, from whom, and the flag
or variable that sets it.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from .. import _logging
from ..errors import ConfigError
from . import backup, elastic, failures, ha, liveness, netif, preempt, relay, secret, stores, switch, takeover
from .config import LaunchConfig
from .logs import WorkerLogs
from .spares import Spares

log = logging.getLogger(__name__)

__all__ = ["LaunchConfig", "Agent"]

# after a worker fails, how long to wait for the node's other workers before reporting who failed
EXIT_GRACE_S = 1.0
CONNECT_ATTEMPT_S = 1.0  # one attempt to reach node 0's agents' store (a stop signal waits at most this)
STORE_PING_S = 5.0  # node 0's port accepts: the bound for its TCPStore to answer (a wrong port: one line)
MEMBERSHIP = "agent(s) came to join (--nnodes MIN:MAX): every worker restarts with them (no restart counted)"
ENDED = "job/ended"  # --nnodes MIN:MAX: node 0 says that the job ended (an agent waiting for a round leaves)
RETRY_LOG_S = 30.0  # while node 0's agents' store does not answer: one line per this many seconds


class Agent:
    """Runs one node's workers; see the module docstring for the protocol between agents."""

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self._store = None
        self._worker_store = None
        self._workers: dict[int, subprocess.Popen] = {}  # global rank -> process
        self._stopping = False
        base = dict(os.environ)
        base.update({k: str(v) for k, v in cfg.extra_env.items()})
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes must not each spawn N threads
        # gloo's interface: checked (or chosen) before any worker starts (netif.py)
        base.update(netif.choose(base, cfg.master_addr, cfg.local_addr, cfg.nnodes > 1 or cfg.standby))
        if base.get("GLOO_SOCKET_IFNAME") and (advice := netif.flap_advice(base["GLOO_SOCKET_IFNAME"])):
            log.info("%s", advice)  # hosts' links: a multi-host job (or one that named its interface)
        self._base_env = base
        if cfg.standby and cfg.high_availability and cfg.warm_spares < cfg.nproc_per_node:
            # a standby takes a whole node at once: every one of its ranks should start warm
            self.cfg = cfg = dataclasses.replace(cfg, warm_spares=cfg.nproc_per_node)
        if cfg.warm_spares and not (cfg.high_availability or cfg.max_restarts or cfg.standby):
            # no controller to replace a rank, no restart, no standby: this job never starts a worker
            # after its first ones; a spare would only cost a core its torch import, then be thrown away
            self.cfg = cfg = dataclasses.replace(cfg, warm_spares=0)
        self._spares = Spares(cfg, base)
        self._lock = threading.Lock()  # _workers: the controller's driver thread replaces ranks too
        self._hosted: ha.HostedController | None = None
        self._backup = None  # this round's backup controller (backup.py; opt-in, nodes 1..N)
        self._relay = None  # this round's relay process for this node's ranks (relay.py; MINDIO_RELAYS)
        self._store_lost = False  # node 0's agents' store is unreachable (run)
        self.leader = None  # etcd: the controller's leader key this node holds (etcdstore.Leader; the beat thread refreshes it)
        self._leader_lost = False  # ... and could not refresh
        self._takeover = None  # etcd: this node's backup taking over from a lost node 0 (takeover.py)
        self._took_lead = False  # ... and it did: this agent leads the job as node 0's did
        self._was_standby = cfg.standby  # started as a standby agent (run: after the rendezvous)
        self._store_addr = cfg.master_addr  # the host of the round's workers' store (takeover.py moves it)
        self._ttp: dict | None = None
        self.secret = ""  # the job secret, handed to every worker (secret.py)
        self._round = self._port = 0
        self.lost_now: list[int] = []
        self.taken_over: dict[int, bytes] = {}  # node given to a standby -> its last beat before
        self._refill = False
        self._replacements: set = set()  # worker processes started as replacements (reboot)
        self.switch_backups: dict = {}  # rank -> (gen, Popen) of a hot-switch backup not released yet (switch.py)
        self.takeover_kind = "recover"  # how a standby took its node: "recover" or "elastic" (elastic.py)
        self.removed = frozenset()  # ranks the controller removed by a downgrade (ha.RoundWatch.tick, elastic.py)
        self.removed_published: tuple = ()  # the removed ranks node 0 published (elastic.py)
        # other nodes' beats, judged by our own (stall-free) observation; our beats from a thread (liveness.py)
        self._watch = liveness.BeatWatch(cfg.node_lost_after, cfg.node_lost_after / 3 + cfg.monitor_interval)
        self._beater: liveness.Beater | None = None
        self._logs: WorkerLogs | None = None
        self._failures: list = []  # this node's failures in the current round (failures.Failure)
        self._signal: int | None = None  # the signal that stopped the agent
        self.hosted_code: int | None = None  # the exit code the hosted controller ended the job with (ha.py)
        self._ha: ha.RoundWatch | None = None  # this round's high-availability bookkeeping (ha.py)
        self.preemption = preempt.Preemption()  # a preemption signal, and whether its dump was asked for
        self.late_ranks: set = set()  # ranks that failed after their training finished (ha.py)
        self._max_nodes = cfg.nnodes  # --nnodes MIN:MAX: MAX (cfg.nnodes is the running round's count)
        self._ranged = 0 < cfg.min_nodes < cfg.nnodes
        self._membership = 0  # rounds restarted because agents came (--nnodes MIN:MAX): no restart counted

    # --- the WorkerView (view.py): what ha.py, switch.py and elastic.py use of this agent ---------
    store = property(lambda self: self._store)
    lock = property(lambda self: self._lock)
    workers = property(lambda self: self._workers)
    replacements = property(lambda self: self._replacements)
    hosted = property(lambda self: self._hosted)
    current_round = property(lambda self: self._round)
    stopping = property(lambda self: self._stopping)
    clock = property(lambda self: self._watch.clock)

    def lost_nodes(self) -> list[int]:
        return self._lost_nodes()

    def beat(self) -> None:
        self._beat()

    def request_refill(self) -> None:
        self._refill = True

    def refill_spares(self) -> None:
        if self._refill:
            self._refill = False
            with self._lock:
                self._spares.fill()

    # --- stores -------------------------------------------------------------------------------
    def _connect(self):
        """Node 0 hosts the agents' store on the master port; the others connect to it (bounded by the
        rendezvous timeout). ``--rdzv-backend c10d`` without ``--node-rank``: the agent that can host the
        endpoint is node 0, the others take the next node ranks (beyond ``--nnodes``: a standby)."""
        from torch.distributed import DistNetworkError, TCPStore

        cfg = self.cfg
        if stores.on_etcd(cfg):  # a store that outlives node 0: node 0 creates the job's keys (etcdstore.py)
            from . import etcdstore

            node0 = cfg.node_rank == 0 and not cfg.standby
            try:
                self._store = etcdstore.connect(cfg.etcd_endpoint, cfg.run_id, cfg.rdzv_timeout, create=node0,
                                                stopping=lambda: self._stopping)
            except InterruptedError as exc:
                raise _Stopped(str(exc)) from None
            if node0 and backup.count(cfg):  # the controller's leader key, while backups wait (backup.py)
                self.leader = etcdstore.Leader(0, cfg.node_lost_after)
                self.leader.take(self._store)
            return
        timeout = datetime.timedelta(seconds=cfg.rdzv_timeout)
        deadline = time.monotonic() + cfg.rdzv_timeout
        where = f"{cfg.master_addr}:{cfg.master_port}"
        host = cfg.node_rank == 0 and not cfg.standby
        if cfg.dynamic_rank:
            host = cfg.is_host if cfg.is_host is not None else _is_local(cfg.master_addr)
        try:
            if host:
                try:
                    self._store = TCPStore(cfg.master_addr, cfg.master_port, world_size=None, is_master=True,
                                           timeout=timeout, wait_for_workers=False)
                except DistNetworkError as exc:
                    if not cfg.dynamic_rank or cfg.is_host:
                        if "EADDRINUSE" in str(exc) or "in use" in str(exc):
                            raise ConfigError(
                                f"--master-port {cfg.master_port} is in use on this host (another job, or a "
                                f"torchrun?): pick a free port (on a single node, leave --master-port out and "
                                f"mindio-run picks one)") from None
                        raise ConfigError(f"cannot host the agents' store on {where}: {exc}") from None
                    host = False  # another agent on this host hosts the endpoint: join it
            if not host:
                self._await_store(deadline)
                # its c10d client retries (a line each) until its timeout: the port answers now, so a
                # short one; then the rendezvous bound for the calls
                self._store = TCPStore(cfg.master_addr, cfg.master_port, world_size=None, is_master=False,
                                       wait_for_workers=False, timeout=datetime.timedelta(
                                           seconds=max(1.0, min(STORE_PING_S, deadline - time.monotonic()))))
                self._store.set_timeout(timeout)
        except DistNetworkError as exc:
            if time.monotonic() < deadline:  # the port accepted connections, and no TCPStore answered there
                raise ConfigError(f"{where} accepts connections but is not node 0's agents' store (no TCPStore "
                                  f"answered within {STORE_PING_S:g} s): check --master-addr/--master-port "
                                  f"({str(exc).splitlines()[0]})") from None
            raise ConfigError(f"node 0's agent store at {where} did not answer within {cfg.rdzv_timeout:g} s "
                              f"(--rdzv-conf join_timeout=S sets it): start node 0's agent first, or check "
                              f"--master-addr/--master-port ({str(exc).splitlines()[0]})") from None
        if cfg.dynamic_rank:
            node = 0 if host else self._store.add("rdzv/next_node", 1)
            standby = node >= cfg.nnodes
            self.cfg = dataclasses.replace(cfg, node_rank=0 if standby else node, standby=standby, dynamic_rank=False)
            _logging.set_context(node="-" if standby else node, rank="standby" if standby else "agent")
            log.info("c10d rendezvous: this agent is %s", "a standby" if standby else f"node {node}")

    def _await_store(self, deadline: float) -> None:
        """Wait until node 0's agents' store accepts connections: one connection attempt of at most
        ``CONNECT_ATTEMPT_S`` at a time, so that a stop signal ends the wait at once (a TCPStore client
        blocks in c10d until its timeout, printing a line per retry) and the log gets one line when the
        wait starts, then one every ``RETRY_LOG_S`` (bounded: ``--rdzv-conf join_timeout``)."""
        import socket

        cfg, attempt, next_log = self.cfg, 0, time.monotonic()
        while True:
            if self._stopping:
                raise _Stopped(f"stopped while waiting for node 0's agents' store at {cfg.master_addr}:"
                               f"{cfg.master_port}")
            attempt += 1
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((cfg.master_addr, cfg.master_port),
                                              timeout=max(0.05, min(CONNECT_ATTEMPT_S, left))):
                    return
            except OSError as exc:
                why = exc.strerror or type(exc).__name__
            now = time.monotonic()
            if now >= deadline:
                return  # the store client says it did not answer (_connect: one line)
            if now >= next_log:  # the first: INFO (node 0's agent may simply start later than this one)
                log.log(logging.INFO if attempt == 1 else logging.WARNING,
                        "node 0's agents' store at %s:%d does not answer yet (attempt %d: %s); trying again for "
                        "%.0f s more (--rdzv-conf join_timeout=S)", cfg.master_addr, cfg.master_port, attempt, why,
                        deadline - now)
                next_log = now + RETRY_LOG_S
            time.sleep(min(0.2, max(0.0, deadline - now)))

    def _new_worker_store(self, rnd: int, gen: int | None = None) -> int:
        """The port of round ``rnd``'s workers' store: node 0 hosts it (not a standby that takes node 0 in
        the running round, ``gen``); where it moved (takeover.py), the address too (``_store_addr``)."""
        from torch.distributed import TCPStore

        if self.cfg.node_rank == 0 and gen is None:
            self._worker_store = TCPStore(
                self.cfg.master_addr, 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.cfg.rdzv_timeout),
            )
            self._store.set(f"round/{rnd}/port", str(self._worker_store.port))
        self._wait_key(f"round/{rnd}/port", f"the port of round {rnd}'s worker store", "node 0's agent")
        moved = takeover.STORE_KEY.format(rnd=rnd)
        if gen is not None and self._store.check([moved]):
            where = json.loads(self._store.get(moved))
            self._store_addr = where["addr"]
            return int(where["port"])
        return int(self._store.get(f"round/{rnd}/port"))

    def _wait_key(self, key: str, what: str, whom: str) -> None:
        """Wait (bounded by the rendezvous timeout) until ``key`` exists in the agents' store."""
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        while not self._store.check([key]):
            if self._stopping:
                raise _Stopped(f"stopped while waiting for {what} ({key})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.cfg.rdzv_timeout:g} s for {what} ({key}) from {whom}; "
                                   f"--rdzv-conf join_timeout=S sets the bound")
            time.sleep(min(0.05, self.cfg.monitor_interval))

    def _beat(self) -> None:
        self._store.set(f"agent/{self.cfg.node_rank}/beat", repr(time.time()))

    def _lost_nodes(self) -> list[int]:
        keys = [f"agent/{n}/beat" for n in range(self.cfg.nnodes)
                if n != self.cfg.node_rank or self.cfg.standby]
        keys = [k for k in keys if self._store.check([k])]  # never beat: still joining (rdzv timeout covers it)
        beats = self._store.multi_get(keys) if keys else []
        return self._watch.lost({int(k.split("/")[1]): b for k, b in zip(keys, beats)})

    # --- workers ------------------------------------------------------------------------------
    def _worker_env(self, local_rank: int, rnd: int, port: int) -> dict:
        """What torchrun gives a worker (local_elastic_agent), plus mindio's own variables."""
        cfg = self.cfg
        rank = cfg.node_rank * cfg.nproc_per_node + local_rank
        env = {
            "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": cfg.world_size,
            "LOCAL_WORLD_SIZE": cfg.nproc_per_node, "GROUP_RANK": cfg.node_rank,
            "GROUP_WORLD_SIZE": cfg.nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": cfg.world_size,
            "ROLE_NAME": cfg.role, "MASTER_ADDR": self._store_addr, "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": rnd, "TORCHELASTIC_MAX_RESTARTS": cfg.max_restarts,
            "TORCHELASTIC_RUN_ID": cfg.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "MINDIO_AGENT_STORE": cfg.etcd_endpoint or f"{cfg.master_addr}:{cfg.master_port}", "MINDIO_NODE_RANK": cfg.node_rank,
            "MINDIO_AGENT_PID": os.getpid(),  # the node's agent: mindio.drill's kill-node target
            "MINDIO_SECRET": self.secret,  # through the spare's stdin pipe, never a store (secret.py)
            **(ha.ttp_env(self._ttp) if self._ttp else {}),
            **({"MINDIO_RELAY_ADDR": self._relay.address} if self._relay is not None else {}),
        }
        if cfg.virtual_local_rank:  # as torchrun: LOCAL_RANK 0, and only this worker's device visible
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible is not None else None
            if devices is not None and local_rank >= len(devices):
                raise ConfigError(f"--virtual-local-rank: local rank {local_rank} has no device in "
                                  f"CUDA_VISIBLE_DEVICES={visible}")
            env.update(LOCAL_RANK=0, CUDA_VISIBLE_DEVICES=devices[local_rank].strip() if devices else local_rank)
        return env

    def spawn(self, local_rank: int, extra: dict | None = None, replacement: bool = False):
        """(under ``_lock`` when workers run) Start ``local_rank``'s worker of the current round in a warm
        spare, with its environment, its log files and its error file (logs.py), plus ``extra``."""
        rnd = self._round
        if not self._logs.has_round(rnd):  # a standby that took a node starts its ranks as replacements
            self._logs.new_round(rnd, {lr: self._worker_env(lr, rnd, self._port)
                                       for lr in range(self.cfg.nproc_per_node)})
        env = self._worker_env(local_rank, rnd, self._port)
        env["TORCHELASTIC_ERROR_FILE"] = self._logs.error_file(local_rank)
        env.update(extra or {})
        if replacement:
            self._logs.clear_error(local_rank)
        out, err = self._logs.streams(local_rank)
        return self._spares.take(env, self.cfg.args, stdout=out, stderr=err)

    def _start_workers(self, rnd: int, port: int, gen: int | None = None) -> None:
        self._round, self._port = rnd, port
        if self.cfg.high_availability:
            if self.cfg.node_rank == 0 and gen is None:
                self._hosted = ha.HostedController(self, rnd)
            self._wait_key(f"round/{rnd}/ttp", "the address of the controller it hosts", "node 0's agent")
            self._ttp = json.loads(self._store.get(f"round/{rnd}/ttp"))
            self._relay = self._relay or relay.start(self, self._ttp)
            if self._backup is None:
                self._backup = backup.start(self, rnd, self._ttp)  # node 0's loss: backup.orphaned
        if gen is not None and self.takeover_kind == elastic.KIND:  # a vacant node after a downgrade
            elastic.start_standbys(self)  # its ranks offer themselves back to the controller (upgrade)
            return
        if gen is not None:  # a standby that took a lost node: its ranks are replacements
            self.replace_local([self.cfg.node_rank * self.cfg.nproc_per_node + i
                                for i in range(self.cfg.nproc_per_node)], gen, reboot_type="arf")
            return
        n = self.cfg.nproc_per_node
        self._logs.new_round(rnd, {lr: self._worker_env(lr, rnd, port) for lr in range(n)})
        for local_rank in range(n):
            self._workers[self.cfg.node_rank * n + local_rank] = self.spawn(local_rank)
        self._spares.fill()  # warm the next spare now, off the critical path

    def replace_local(self, ranks, gen: int, reboot_type: str = "arf") -> None:
        """(any thread) Start ``ranks`` of this node again in a warm spare, as replacements in ``gen``."""
        t0 = time.monotonic()
        with self._lock:
            for rank in ranks:
                old = self._workers.get(rank)
                if old is not None and reboot_type == "hot switch":
                    self._switched_out(rank, old)
                elif old is not None and self._ha is not None:
                    self._ha.replaced(rank, old)  # an exit the watch had not seen yet is accounted for
                if old is not None and old.poll() is None:
                    old.kill()  # the controller declared it dead: it must not linger
                backup = switch.take(self, rank, gen) if reboot_type == "hot switch" else None
                self._workers[rank] = backup or self.spawn(
                    rank - self.cfg.node_rank * self.cfg.nproc_per_node,
                    {"MINDIO_REBOOT_GEN": gen, "MINDIO_REBOOT_TYPE": reboot_type}, replacement=True)
                self._replacements.add(self._workers[rank])
        log.warning("ranks %s started again (generation %d) in %.3f s", list(ranks), gen, time.monotonic() - t0)
        _logging.event("ranks_replaced", ranks=list(ranks), gen=gen, node=self.cfg.node_rank,
                       take_s=round(time.monotonic() - t0, 6))
        self._refill = True

    def _switched_out(self, rank: int, old: subprocess.Popen) -> None:
        """Hot switch: the old process of ``rank`` leaves by itself (EXIT_CODE_SWITCHED); wait for it
        (bounded) before its backup takes the rank, and record how it ended."""
        try:
            old.wait(10)
        except subprocess.TimeoutExpired:
            log.error("rank %d's switched-out process %d did not exit within 10 s of its switch (a fixed "
                      "bound); killing it", rank, old.pid)
        log.warning("rank %d: switched-out process %d exited with %s", rank, old.pid, old.poll())
        _logging.event("switched_out_exit", switched_rank=rank, old_pid=old.pid, code=old.poll())

    def _stop_workers(self, settle: bool = False) -> tuple[dict, set]:
        """SIGTERM (or the signal that stopped the agent, forwarded as torchrun does) to every worker;
        SIGKILL after ``--shutdown-timeout`` seconds. ``settle``: the workers were told to exit (the
        controller ended the job): they get ``EXIT_GRACE_S`` to do so first. Returns {rank: exit code} of
        the workers that had exited before they were signalled (the others' ends are the agent's doing) or
        had failed on their own and were exiting when signalled, and the set of the latter."""
        switch.stop(self)  # hot-switch backups not released
        if self._hosted is not None:
            self._hosted.close()
            self._hosted = None
        if self._backup is not None:  # joined off the main loop, as the hosted controller
            threading.Thread(target=self._backup.destroy, name="mindio-backup-destroy").start()
            self._backup = None
        if settle:
            self._settle()
        with self._lock:
            procs = dict(self._workers)
            live = [p for p in procs.values() if p.poll() is None]
            ended = {r: p.returncode for r, p in procs.items() if p not in live}
        signalled = time.time()
        for p in live:
            p.send_signal(self._signal or signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.term_grace
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not exit within %.1f s of %s (--shutdown-timeout); killing it",
                            p.pid, self.cfg.term_grace, signal.Signals(self._signal or signal.SIGTERM).name)
                p.kill()
                p.wait()
        if any(p.returncode for p in procs.values()):  # for the operator (and tests): how every worker ended
            log.info("workers' exit codes: %s", ", ".join(
                f"rank {r}: {failures.describe(p.returncode)}{' (stopped by this agent)' if p in live else ''}"
                for r, p in sorted(procs.items())))
        # a worker that had failed on its own and was still exiting when it was signalled (its exit teardown
        # releases its process groups first: its peers, on other nodes too, fail meanwhile) wrote its error
        # file before: its failure is its own, not the agent's doing
        base = self.cfg.node_rank * self.cfg.nproc_per_node
        exiting = {r for r, p in procs.items()
                   if p in live and p.returncode and self._failed_before(r - base, signalled)}
        ended.update({r: procs[r].returncode for r in exiting})
        self._workers = {}
        if self._relay is not None:  # after its ranks ended: their last words went through it
            self._relay.close(5.0)
            self._relay = None
        if self._logs is not None:
            self._logs.stop()
        return ended, exiting

    def _failed_before(self, local_rank: int, when: float) -> bool:
        """Whether the worker of ``local_rank`` wrote its error file (failures.record) before ``when``."""
        path = self._logs.error_file(local_rank) if self._logs is not None else ""
        try:
            st = os.stat(path) if path and path != os.devnull else None
        except OSError:
            return False
        return st is not None and st.st_size > 0 and st.st_mtime <= when

    # --- rounds -------------------------------------------------------------------------------
    def _join(self, rnd: int) -> int | None:
        """Join round ``rnd`` once every agent did; returns the round joined (see _join_ranged)."""
        if self._ranged:
            return self._join_ranged(rnd)
        key = f"round/{rnd}/joined"
        if self.cfg.node_rank == 0:
            self._store.set("job/round", str(rnd))
        self._store.add(key, 1)
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        waiting_for: list[int] = []  # lost nodes this round waits for (a standby's claim, or their agent back)
        while self._store.add(key, 0) < self.cfg.nnodes:
            if self._stopping:
                raise _Stopped(f"stopped while waiting for the other agents to join round {rnd} "
                               f"({self._store.add(key, 0)} of {self.cfg.nnodes} joined)")
            lost = self._lost_nodes()
            spares = self._store.add("standby/count", 0) - self._store.add("standby/claimed", 0)
            short = lost if lost and spares < len(lost) else []
            if short and short != waiting_for:  # as torchrun's rendezvous: wait (bounded) for the node
                log.warning("round %d: node(s) %s lost and %d standby node(s) available; waiting up to %.0f s "
                            "(--rdzv-conf join_timeout=S) for a spare agent (--standby) or the lost node's "
                            "agent to join", rnd, short, max(spares, 0), deadline - time.monotonic())
            waiting_for = short
            if time.monotonic() > deadline and short:
                self.lost_now = list(short)  # their agents will not come to leave either (_leave)
                raise JobError(
                    f"round {rnd}: node(s) {short} lost and {max(spares, 0)} standby node(s) joined within "
                    f"{self.cfg.rdzv_timeout:g} s (--rdzv-conf join_timeout=S); start a spare agent with "
                    f"--standby or restart the lost node's agent"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"round {rnd}: only {self._store.add(key, 0)} of {self.cfg.nnodes} agents joined within "
                    f"{self.cfg.rdzv_timeout:g} s; start an agent for every node, or raise the bound with "
                    f"--rdzv-conf join_timeout=S"
                )
            self._beat()
            time.sleep(self.cfg.monitor_interval)
        return rnd

    def _join_ranged(self, rnd: int) -> int | None:
        """``--nnodes MIN:MAX`` (c10d node ranks, in arrival order): node 0 closes round ``rnd`` once MAX
        agents joined it, or at least MIN, every agent connected so far, and ``--rdzv-conf
        last_call_timeout`` passed since the last one came (torchrun's rule); it publishes the round's
        node count (``round/<n>/nodes``), and ``cfg.nnodes`` is that count for the round. An agent whose
        node rank is beyond it joins the next round, which node 0 starts at once (_monitor: MEMBERSHIP).
        Returns the round joined, None when the job ended first (``job/ended``)."""
        cfg = self.cfg = dataclasses.replace(self.cfg, nnodes=self._max_nodes)
        key, nodes = f"round/{rnd}/joined", f"round/{rnd}/nodes"
        if cfg.node_rank == 0:
            self._store.set("job/round", str(rnd))
        self._store.add(key, 1)
        deadline = time.monotonic() + cfg.rdzv_timeout
        seen, last = 0, time.monotonic()
        while not self._store.check([nodes]):
            if self._stopping:
                raise _Stopped(f"stopped while waiting for the other agents to join round {rnd}")
            if self._store.check([ENDED]):
                print(f"mindio-run: node {cfg.node_rank}: the job ended before this agent could join it",
                      file=sys.stderr)
                return None
            n = self._store.add(key, 0)
            if n != seen:
                seen, last = n, time.monotonic()
            connected = min(self._store.add("rdzv/next_node", 0) + 1, cfg.nnodes)
            if cfg.node_rank == 0 and n >= max(cfg.min_nodes, connected) and (
                    n >= cfg.nnodes or time.monotonic() - last >= cfg.last_call):
                self._store.compare_set(nodes, "", str(n))
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {rnd}: {n} agent(s) joined within {cfg.rdzv_timeout:g} s, fewer than "
                                   f"--nnodes {cfg.min_nodes}:{cfg.nnodes} needs; start more agents, or raise the "
                                   f"bound with --rdzv-conf join_timeout=S")
            self._beat()
            time.sleep(cfg.monitor_interval)
        count = int(self._store.get(nodes))
        if cfg.node_rank >= count:
            log.info("round %d runs with %d node(s); this agent (node %d) joins the next one", rnd, count,
                     cfg.node_rank)
            return self._join_ranged(rnd + 1)
        self.cfg = dataclasses.replace(cfg, nnodes=count)
        log.info("round %d: %d node(s) of --nnodes %d:%d", rnd, count, cfg.min_nodes, self._max_nodes)
        return rnd

    def _monitor(self, rnd: int) -> str | None:
        """Watch the round until it succeeds (returns None) or fails (returns the reason)."""
        failed_key, done_key = f"round/{rnd}/failed", f"round/{rnd}/done"
        reported_done = False
        self._failures, self.late_ranks = [], set()
        self._ha = ha.RoundWatch(self, rnd) if self.cfg.high_availability else None
        while not self._stopping:
            self._beat()
            if self._store.check([failed_key]):
                return self._store.get(failed_key).decode()
            if self._ranged and self.cfg.node_rank == 0 and self.cfg.nnodes < self._max_nodes and \
                    self._store.add("rdzv/next_node", 0) + 1 > self.cfg.nnodes:
                return self._fail_round(rnd, MEMBERSHIP, node=False)
            if self.preemption.signum is not None:
                self.preemption.tick(self, rnd)
                if self._stopping:
                    break
            codes = self._exit_codes()
            bad = {r: c for r, c in codes.items() if c not in (None, 0)}
            if self.cfg.high_availability:
                reason = self._ha_tick(rnd, bad)
                if reason:
                    return self._fail_round(rnd, reason)
                bad = {}
            if bad:
                bad = self._settle()
                self.record_failures(rnd, bad)
                return self._fail_round(rnd, failures.summary(f for f in self._failures if f.rank in bad))
            lost = [] if self.cfg.high_availability else self._lost_nodes()
            if lost:
                return self._fail_round(rnd, f"node(s) {lost} lost (no agent beat for {self.cfg.node_lost_after} s)",
                                        node=False)
            # a removed rank's worker (exited, or an elastic standby still waiting) does not hold up its node;
            # one an upgrade took back in while running does again; nor does a rank that failed after its
            # training finished (ha.py: the job then ends non-zero once the others are done)
            finished = all(c == 0 or r in self.removed or r in self.late_ranks for r, c in codes.items())
            if finished != reported_done:
                self._store.add(done_key, 1 if finished else -1)
                reported_done = finished
            if reported_done and self._store.add(done_key, 0) + self._vacant(rnd) >= self.cfg.nnodes:
                return None
            time.sleep(self.cfg.monitor_interval)
        return f"agent stopped by {signal.Signals(self._signal).name if self._signal else 'a signal'}"

    def _fail_round(self, rnd: int, reason: str, node: bool = True) -> str:
        """Mark round ``rnd`` failed (the first agent to do so names the reason); return the reason."""
        _logging.event("round_failed", round=rnd, node=self.cfg.node_rank, reason=reason)
        key = f"round/{rnd}/failed"
        self._store.compare_set(key, "", f"node {self.cfg.node_rank}: {reason}" if node else reason)
        return self._store.get(key).decode()

    def record_failures(self, rnd: int, codes: dict, exiting: frozenset = frozenset()) -> None:
        """(main loop) Workers of this node that exited non-zero ({rank: code}): read their error files
        and post them (``round/<n>/failures/<node>``) for every agent's summary. ``exiting``: ranks that had
        failed on their own and were exiting when this agent signalled them (_stop_workers)."""
        if not codes:
            return
        base = self.cfg.node_rank * self.cfg.nproc_per_node
        for rank, code in sorted(codes.items()):
            f = failures.read(rank, code, self._logs.error_file(rank - base), node=self.cfg.node_rank)
            f.stopped = rank in exiting and code < 0
            self._failures.append(f)
        try:
            self._store.set(f"round/{rnd}/failures/{self.cfg.node_rank}",
                            json.dumps([json.loads(f.to_json()) for f in self._failures]))
        except Exception as exc:  # node 0's store is gone: this node's own summary still has them
            log.info("could not post this node's failures: %s", exc)

    def add_failure(self, failure) -> None:
        """(main loop) A failure of another node's rank that this agent found (ha.py: a node lost after the
        training of its ranks finished): in this agent's summary."""
        self._failures.append(failure)

    def round_failures(self, rnd: int) -> list:
        """Every node's posted failures of round ``rnd`` (this node's own when the store is gone), each
        marked ``late`` when node 0 found it came after its training had finished (ha.py)."""
        out = list(self._failures)
        try:
            for node in range(self.cfg.nnodes):
                key = f"round/{rnd}/failures/{node}"
                if node != self.cfg.node_rank and self._store.check([key]):
                    out += [failures.Failure(**d) for d in json.loads(self._store.get(key))]
            for f in out:
                f.late = f.late or self._store.check([f"round/{rnd}/late/{f.rank}"])
        except Exception as exc:
            log.info("could not read the other nodes' failures: %s", exc)
        return out

    def _exit_codes(self) -> dict:
        """rank -> its worker's exit code, None while it runs."""
        with self._lock:
            return {r: p.poll() for r, p in self._workers.items()}

    def _settle(self) -> dict:
        """The failed workers, after waiting up to ``EXIT_GRACE_S`` for the others to exit too, or up to
        ``--shutdown-timeout`` while every failure seen is a consequence of another (failures.py).

        A worker that fails closes its sockets before its process is gone (interpreter teardown), so a
        peer blocked in a collective with it can die first; reporting only what the first look saw would
        name the peer's abort and not the failure that caused it. On a loaded machine the failed worker's
        teardown can outlast ``EXIT_GRACE_S``: while only consequences are known, its exit is awaited."""
        start = time.monotonic()
        grace = max(EXIT_GRACE_S, 2 * self.cfg.monitor_interval)
        while True:
            codes = self._exit_codes()
            bad = {r: c for r, c in codes.items() if c not in (None, 0)}
            waited = time.monotonic() - start
            if all(c is not None for c in codes.values()) or waited >= max(grace, self.cfg.term_grace) or (
                    waited >= grace and not self._only_consequences(bad)):
                return bad
            time.sleep(min(0.05, self.cfg.monitor_interval))

    def _only_consequences(self, bad: dict) -> bool:
        """Every failure of ``bad`` ({rank: code}) is a consequence of another (its error file says so) or
        a worker's exit after a last-words checkpoint (EXIT_CODE_DUMPED: the controller's exit order, which
        its peers are carrying out too -- stopping them 1 s later would cut their own exit short)."""
        base = self.cfg.node_rank * self.cfg.nproc_per_node
        return all(c == failures.EXIT_CODE_DUMPED or failures.read(r, c, self._logs.error_file(r - base)).secondary
                   for r, c in bad.items())

    def _ha_tick(self, rnd: int, bad: dict) -> str | None:
        lead = self.leader
        if lead is not None and lead.lapsed():  # etcd: no refresh got through within its TTL (the beat
            self.lose_leadership()              # thread may still be asking etcd again): another node may hold it
        if self._leader_lost:  # etcd: node 0 could not refresh the controller's leader key (backup.py)
            raise JobError(f"node {self.cfg.node_rank} could not refresh the controller's leader key on "
                           f"{stores.where(self.cfg)} within {self.cfg.node_lost_after:g} s (cut off from it, or "
                           f"stalled): a backup controller may hold the job now, so this node stops acting")
        reason = self._ha.tick(bad)
        if self._takeover is not None:  # node 0 lost: this node's backup takes over (takeover.py)
            why = self._takeover.tick()
            if why:
                return why
            if why == "":  # it did: this agent hosts the job's controller and store from now on
                self._hosted, self._worker_store = self._takeover.hosted, self._takeover.worker_store
                self._store_addr, self._port = self._takeover.addr, self._worker_store.port  # this node's replacements too
                self._backup, self._takeover, self._took_lead = None, None, True
            return None if reason == ha.NODE0_LOST else reason
        if reason == ha.NODE0_LOST and self._backup is not None and stores.on_etcd(self.cfg):
            if not backup.lead(self):
                return None  # node 0 still refreshes its leader key: alive, reaching etcd (wait: bounded by its TTL)
            if takeover.possible(self):  # a standby waits: go on (takeover.py)
                self._takeover = takeover.Takeover(self, self._backup, rnd)
                return None
            raise backup.NodeLost(f"its agent stopped beating for {self.cfg.node_lost_after:g} s and its leader key "
                                  f"on etcd expired")
        return reason

    def lose_leadership(self) -> None:
        """(beat thread) This node could not refresh the controller's leader key: it stops acting (_ha_tick)."""
        self.leader = None
        self._leader_lost = True

    def _vacant(self, rnd: int) -> int:
        return elastic.vacant_nodes(self, rnd) if self.cfg.high_availability and elastic.enabled(self.cfg) else 0

    def _wait_for_lost_node(self) -> int | None:
        """Standby: block until some node's agent stops beating, claim its node rank; return the
        round to join (None if stopped by a signal)."""
        self._store.add("standby/count", 1)
        me = f"standby-{os.getpid()}-{time.time()}"
        log.info("standby agent waiting for a lost node")
        if self.cfg.high_availability:
            return self._wait_for_takeover(me)
        while not self._stopping:
            try:
                lost = self._lost_nodes()
                if stores.ended(self._store, self.cfg):
                    log.info("standby agent: the job ended; leaving")
                    return None
            except (RuntimeError, OSError) as exc:  # node 0's store is gone: the job ended
                log.info("standby agent: job store unreachable (%s); leaving", str(exc).splitlines()[0])
                return None
            for node in lost:
                stale = self._store.get(f"agent/{node}/beat").decode()
                if self._store.compare_set(f"claim/{node}/{stale}", "", me).decode() != me:
                    continue  # another standby took this node
                self._store.add("standby/claimed", 1)
                self.cfg = dataclasses.replace(self.cfg, node_rank=node, standby=False)
                _logging.set_context(node=node, rank="agent")
                self._beat()
                rnd = int(self._store.get("job/round"))
                if self._store.add(f"round/{rnd}/joined", 0) >= self.cfg.nnodes:
                    rnd += 1
                print(f"mindio-run: standby takes over node {node} from round {rnd}", file=sys.stderr)
                return rnd
            time.sleep(self.cfg.monitor_interval)
        return None

    def _wait_for_takeover(self, me: str):
        return ha.wait_for_takeover(self, me)

    def run(self) -> int:
        """Run the job on this node; returns the agent's exit code: 0, 75 when it ended with a
        last-words checkpoint and no restart left (relaunch to resume from it), else 1. A bad setting
        (a port in use, a job secret that is not private: secret.py) raises ConfigError (cli.py: one line)."""
        for name in dict.fromkeys(self.cfg.signals + self.cfg.preempt_signals):
            signal.signal(getattr(signal, name), self._on_signal)
        self._logs = WorkerLogs(self.cfg)
        self._spares.fill(self.cfg.nproc_per_node)  # every first worker warms up while the agents rendezvous
        try:
            if self._store is None:
                self._connect()
            self._was_standby = self.cfg.standby
            self.secret = secret.resolve(self.cfg, self._store)
        except _Stopped as exc:
            self._spares.close()
            self._logs.close()
            return self._stopped(exc)
        except BaseException:
            self._spares.close()
            self._logs.close()
            raise
        self._beater = liveness.Beater(self)
        self._beater.start()
        rnd, gen = 0, None
        try:
            if self.cfg.standby:
                got = self._wait_for_lost_node()
                if got is None:
                    return 0
                rnd, gen = got if isinstance(got, tuple) else (got, None)
            while True:
                if gen is None:
                    rnd = self._join(rnd)
                    if rnd is None:  # --nnodes MIN:MAX: the job ended before this agent could join it
                        return 0
                port = self._new_worker_store(rnd, gen)
                log.info("round %d: starting %d workers (world size %d)", rnd, self.cfg.nproc_per_node, self.cfg.world_size)
                _logging.event("round_start", round=rnd, node=self.cfg.node_rank)
                self._start_workers(rnd, port, gen)
                gen = None
                reason = self._monitor(rnd)
                if reason is None:
                    return self._finished(rnd)
                codes, exiting = self._stop_workers(settle="the controller ended the job" in reason)
                seen = {f.rank for f in self._failures}
                self.record_failures(rnd, {r: c for r, c in codes.items() if c and r not in seen}, exiting)
                _logging.event("workers_stopped", round=rnd, node=self.cfg.node_rank, reason=reason)
                code = self._report_round(rnd, reason)
                if code is not None:
                    return code
                rnd += 1
        except backup.NodeLost as exc:  # etcd: node 0 lost, this node holds the leader key now
            return backup.orphaned(self, self._backup, str(exc))
        except _Stopped as exc:
            return self._stopped(exc)
        except (JobError, TimeoutError) as exc:
            print(f"mindio-run: job failed: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # node 0's store is gone (its host died or is cut off): one line, no traceback
            from torch.distributed import DistError  # loaded by now (the store client)

            if not isinstance(exc, DistError):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            self._store_lost = True  # no leaving through it either (_leave)
            if self._backup is not None:  # this node's backup controller saves what survives (backup.py)
                return backup.orphaned(self, self._backup, f"its agents' store is unreachable: {first}")
            if stores.on_etcd(self.cfg):
                print(f"mindio-run: job failed on node {self.cfg.node_rank}: {stores.where(self.cfg)} is "
                      f"unreachable ({first}); the agents cannot coordinate without it: resume from the last "
                      "checkpoint", file=sys.stderr)
            else:
                where = "this node's" if self.cfg.node_rank == 0 and not self.cfg.standby else "node 0's"
                print(f"mindio-run: job failed on node {self.cfg.node_rank}: {where} agents' store at "
                      f"{self.cfg.master_addr}:{self.cfg.master_port} is unreachable ({first}); node 0 hosts the "
                      "stores and the controller, so the job cannot go on without it: resume from the last "
                      "checkpoint", file=sys.stderr)
            _logging.event("store_lost", node=self.cfg.node_rank, error=first)
            return 1
        finally:
            self._stop_workers()
            self._spares.close()
            self._beater.stop()
            self._leave()
            self._logs.close()

    def _stopped(self, exc: "_Stopped") -> int:
        """A stop signal ended a wait of the rendezvous (node 0's store, the other agents, a key of the
        round): one line, exit 1 (no worker of this round runs yet)."""
        name = signal.Signals(self._signal).name if self._signal else "a signal"
        print(f"mindio-run: job failed: {name}: {exc or 'the agent stopped'}", file=sys.stderr)
        return 1

    def _finished(self, rnd: int) -> int:
        """Every worker's training finished: 0, unless a rank failed after its training finished."""
        late = [f for f in self.round_failures(rnd) if f.late]
        if late:
            print(f"mindio-run: job failed: {failures.summary(late)}", file=sys.stderr)
            return 1
        log.info("round %d: all workers finished", rnd)
        return 0

    def _await_causes(self, rnd: int) -> None:
        """Before the round's root cause is named: while every failure known (this node's and those the other
        nodes posted) is a consequence of another -- a lost connection, a collective timeout -- wait up to
        EXIT_GRACE_S for another node to post one that is not. A worker that fails closes its connections
        before its process is gone (its exit teardown releases its process groups, then the interpreter ends)
        and its agent posts it only then, so a peer on another node can fail, exit and be reported first
        (seen: node 0 named its rank's "Connection closed by peer" instead of node 1's ValueError). Within one
        node :meth:`_settle` waits for the failed worker itself."""
        if self.cfg.nnodes <= 1:
            return
        bound = max(EXIT_GRACE_S, 2 * self.cfg.monitor_interval)
        deadline = time.monotonic() + bound
        while True:
            known = self.round_failures(rnd)
            if not known or not all(f.secondary for f in known):
                return
            if time.monotonic() >= deadline:
                log.info("round %d: every failure known is a consequence of another (ranks %s) and no node posted "
                         "its cause within %.1f s (max(1 s, 2 x --monitor-interval)); naming what is known", rnd,
                         [f.rank for f in known[:8]], bound)
                return
            time.sleep(0.05)

    def _report_round(self, rnd: int, reason: str) -> int | None:
        """Say how round ``rnd`` ended (failures.outcome); the agent's exit code when the job ends, None
        when every worker restarts (``--max-restarts``)."""
        if reason == MEMBERSHIP and not self._stopping:  # --nnodes MIN:MAX: more agents came (not a failure)
            self._membership += 1
            print(f"mindio-run: round {rnd}: {reason}", file=sys.stderr)
            return None
        preempted = self.preemption.reason(self, rnd)  # this agent, or another, was preempted: no restart
        self._await_causes(rnd)
        text, code = failures.outcome(self.round_failures(rnd), preempted or reason, rnd - self._membership,
                                      self.cfg.max_restarts,
                                      stopping=self._stopping or bool(preempted),
                                      dumped=self.hosted_code == failures.EXIT_CODE_DUMPED, node=self.cfg.node_rank)
        print(text, file=sys.stderr)
        return code

    def _leave(self) -> None:
        """Node 0 hosts the stores: it leaves last (bounded by ``leave_timeout``), so no agent reads a
        store that is gone."""
        if self._store_lost or (self.cfg.standby and stores.on_etcd(self.cfg)):
            return  # a standby that never took a node has nothing to say on etcd
        try:
            if not self._leads():
                self._store.add("job/left", 1)
                if self.leader is not None:  # etcd: node 0 is gone, this node's backup ended the job
                    stores.end_job(self._store, self.cfg, f"ended by node {self.cfg.node_rank}'s backup controller")
                return
            if self._ranged:  # an agent waiting to join a next round leaves (_join_ranged)
                self._store.set(ENDED, "ended")
            deadline = time.monotonic() + self.cfg.leave_timeout
            # a vacant node (elastic.py) has no agent; a node lost in the round and not taken over (ha.py) has one
            # that will not come to leave (its loss ended the job, or came after its training: it is not awaited)
            left = self.cfg.nnodes - 1 - self._vacant(self._round) - len(self.lost_now)
            # stopped in the rendezvous: only the agents that joined are awaited (none came: no wait)
            left = min(left, self._store.add(f"round/{self._round}/joined", 0) - 1)
            while (n := self._store.add("job/left", 0)) < left:
                if time.monotonic() >= deadline:
                    log.warning("left after waiting %g s for the other agents to leave (%d of %d did); the "
                                "agents' store closes now", self.cfg.leave_timeout, n, left)
                    break
                time.sleep(self.cfg.monitor_interval)
            stores.end_job(self._store, self.cfg, "ended")
        except Exception:  # the store is already gone: nothing left to coordinate
            pass

    def _leads(self) -> bool:
        """This agent leads the job: node 0's (not a standby that took node 0), or the agent whose backup
        took over from a lost node 0 (takeover.py). It leaves last and says that the job ended."""
        return self._took_lead or (self.cfg.node_rank == 0 and not self._was_standby)

    def _on_signal(self, signum, frame):
        """(signal handler) Note the signal; the main loop acts on it. A preemption signal while workers
        run asks for a last-words checkpoint first (preempt.py); any other stops the agent now."""
        if self.preemption.on_signal(self, signum):
            return
        self.stop(signum)

    def stop(self, signum: int) -> None:
        """Stop the agent (its workers get ``signum``, the first signal that stopped it, at the round's end)."""
        self._stopping = True
        self._signal = self._signal or signum


class JobError(RuntimeError):
    """The job cannot go on (say why in one line): a lost node with no spare, ..."""


class _Stopped(Exception):
    """The agent was stopped by a signal while it waited."""


def _is_local(host: str) -> bool:
    """Is ``host`` an address of this machine (c10d: the agent there hosts the endpoint)?"""
    import socket

    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    if addr.startswith("127."):
        return True
    try:
        return addr in netif.interfaces().values()
    except (ImportError, OSError):
        return addr == socket.gethostbyname(socket.gethostname())
