"""The per-node launch agent behind ``mindio-run`` (torchrun-compatible).

One agent runs on every node. Conversation through the agents' TCPStore (hosted by node 0 on
``--master-port``; every key below lives there):

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

With high availability on (``--high-availability`` / ``HIGH_AVAILABILITY``), node 0 also hosts the
controller as rank -1, a worker death is reported to it at once, and agents start single ranks again
(recover-in-place) or a standby takes a lost node's ranks (recover) in the running round: see ha.py.

Workers are started through :mod:`mindio.launch._bootstrap`: each agent keeps ``warm_spares``
interpreters that already imported torch and the script's imports, so a (re)start does not pay the
interpreter start-up on the critical path. Workers die with their agent (PR_SET_PDEATHSIG), so killing
an agent simulates the loss of a node.
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
from . import elastic, ha, liveness, secret, switch
from .config import LaunchConfig
from .spares import Spares

log = logging.getLogger(__name__)

__all__ = ["LaunchConfig", "Agent"]

# after a worker fails, how long to wait for the node's other workers before reporting who failed
EXIT_GRACE_S = 1.0


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
        self._base_env = base
        if cfg.standby and cfg.high_availability and cfg.warm_spares < cfg.nproc_per_node:
            # a standby takes a whole node at once: every one of its ranks should start warm
            self.cfg = cfg = dataclasses.replace(cfg, warm_spares=cfg.nproc_per_node)
        self._spares = Spares(cfg, base)
        self._lock = threading.Lock()  # _workers: the controller's driver thread replaces ranks too
        self._hosted: ha.HostedController | None = None
        self._ttp: dict | None = None
        self.secret = ""  # the job secret, handed to every worker (secret.py)
        self._round = self._port = 0
        self.lost_now: list[int] = []
        self.taken_over: dict[int, bytes] = {}  # node given to a standby -> its last beat before
        self._refill = False
        self._replacements: set = set()  # worker processes started as replacements (reboot)
        self.switch_backups: dict = {}  # rank -> (gen, Popen) of a hot-switch backup not released yet (switch.py)
        self.takeover_kind = "recover"  # how a standby took its node: "recover" or "elastic" (elastic.py)
        self._removed = frozenset()  # ranks the controller removed by a downgrade (ha.tick, elastic.py)
        # other nodes' beats, judged by our own (stall-free) observation; our beats from a thread (liveness.py)
        self._watch = liveness.BeatWatch(cfg.node_lost_after, cfg.node_lost_after / 3 + cfg.monitor_interval)
        self._beater: liveness.Beater | None = None

    # --- stores -------------------------------------------------------------------------------
    def _connect(self):
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.cfg.rdzv_timeout)
        self._store = TCPStore(
            self.cfg.master_addr, self.cfg.master_port, world_size=None,
            is_master=self.cfg.node_rank == 0 and not self.cfg.standby, timeout=timeout,
            wait_for_workers=False,
        )

    def _new_worker_store(self, rnd: int) -> int:
        from torch.distributed import TCPStore

        if self.cfg.node_rank == 0:
            self._worker_store = TCPStore(
                self.cfg.master_addr, 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.cfg.rdzv_timeout),
            )
            self._store.set(f"round/{rnd}/port", str(self._worker_store.port))
        self._store.wait([f"round/{rnd}/port"])
        return int(self._store.get(f"round/{rnd}/port"))

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
        cfg = self.cfg
        rank = cfg.node_rank * cfg.nproc_per_node + local_rank
        return {
            "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": cfg.world_size,
            "LOCAL_WORLD_SIZE": cfg.nproc_per_node, "GROUP_RANK": cfg.node_rank,
            "GROUP_WORLD_SIZE": cfg.nnodes, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": cfg.world_size,
            "ROLE_NAME": "default", "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": rnd, "TORCHELASTIC_MAX_RESTARTS": cfg.max_restarts,
            "TORCHELASTIC_RUN_ID": cfg.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "MINDIO_AGENT_STORE": f"{cfg.master_addr}:{cfg.master_port}", "MINDIO_NODE_RANK": cfg.node_rank,
            "MINDIO_AGENT_PID": os.getpid(),  # the node's agent: mindio.drill's kill-node target
            "MINDIO_SECRET": self.secret,  # through the spare's stdin pipe, never a store (secret.py)
            **(ha.ttp_env(self._ttp) if self._ttp else {}),
        }

    def _start_workers(self, rnd: int, port: int, gen: int | None = None) -> None:
        self._round, self._port = rnd, port
        if self.cfg.high_availability:
            if self.cfg.node_rank == 0 and gen is None:
                self._hosted = ha.HostedController(self, rnd)
            self._store.wait([f"round/{rnd}/ttp"])
            self._ttp = json.loads(self._store.get(f"round/{rnd}/ttp"))
        if gen is not None and self.takeover_kind == elastic.KIND:  # a vacant node after a downgrade
            elastic.start_standbys(self)  # its ranks offer themselves back to the controller (upgrade)
            return
        if gen is not None:  # a standby that took a lost node: its ranks are replacements
            self.replace_local([self.cfg.node_rank * self.cfg.nproc_per_node + i
                                for i in range(self.cfg.nproc_per_node)], gen, reboot_type="arf")
            return
        for local_rank in range(self.cfg.nproc_per_node):
            env = self._worker_env(local_rank, rnd, port)
            self._workers[env["RANK"]] = self._spares.take(env, self.cfg.args)
        self._spares.fill()  # warm the next spare now, off the critical path

    def replace_local(self, ranks, gen: int, reboot_type: str = "arf") -> None:
        """(any thread) Start ``ranks`` of this node again in a warm spare, as replacements in ``gen``."""
        t0 = time.monotonic()
        with self._lock:
            for rank in ranks:
                env = self._worker_env(rank - self.cfg.node_rank * self.cfg.nproc_per_node, self._round, self._port)
                env.update(MINDIO_REBOOT_GEN=gen, MINDIO_REBOOT_TYPE=reboot_type)
                old = self._workers.get(rank)
                if old is not None and reboot_type == "hot switch":
                    self._switched_out(rank, old)
                if old is not None and old.poll() is None:
                    old.kill()  # the controller declared it dead: it must not linger
                backup = switch.take(self, rank, gen) if reboot_type == "hot switch" else None
                self._workers[rank] = backup or self._spares.take(env, self.cfg.args)
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
            log.error("rank %d's switched-out process %d did not exit within 10 s; killing it", rank, old.pid)
        log.warning("rank %d: switched-out process %d exited with %s", rank, old.pid, old.poll())
        _logging.event("switched_out_exit", switched_rank=rank, old_pid=old.pid, code=old.poll())

    def _stop_workers(self) -> None:
        switch.stop(self)  # hot-switch backups not released
        if self._hosted is not None:
            self._hosted.close()
            self._hosted = None
        with self._lock:
            live = [p for p in self._workers.values() if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.term_grace
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._workers = {}

    # --- rounds -------------------------------------------------------------------------------
    def _join(self, rnd: int) -> None:
        key = f"round/{rnd}/joined"
        if self.cfg.node_rank == 0:
            self._store.set("job/round", str(rnd))
        self._store.add(key, 1)
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        while self._store.add(key, 0) < self.cfg.nnodes:
            lost = self._lost_nodes()
            spares = self._store.add("standby/count", 0) - self._store.add("standby/claimed", 0)
            if lost and spares < len(lost):
                raise RuntimeError(
                    f"round {rnd}: node(s) {lost} lost and {max(spares, 0)} standby node(s) available; "
                    f"start a spare agent with --standby or restart the lost node's agent"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"round {rnd}: only {self._store.add(key, 0)} of {self.cfg.nnodes} agents joined within "
                    f"{self.cfg.rdzv_timeout} s; start an agent for every --node-rank or raise --rdzv-timeout"
                )
            self._beat()
            time.sleep(self.cfg.monitor_interval)

    def _monitor(self, rnd: int) -> str | None:
        """Watch the round until it succeeds (returns None) or fails (returns the reason)."""
        failed_key, done_key = f"round/{rnd}/failed", f"round/{rnd}/done"
        reported_done = False
        self._reported, self._dead_since, self._declared_lost = set(), None, set()
        # a standby that took a node in this round must not replay orders its predecessor carried out
        self._replace_seen = self._store.add(f"round/{rnd}/replace/{self.cfg.node_rank}", 0)
        while not self._stopping:
            self._beat()
            if self._store.check([failed_key]):
                return self._store.get(failed_key).decode()
            codes = self._exit_codes()
            bad = {r: c for r, c in codes.items() if c not in (None, 0)}
            if self.cfg.high_availability:
                reason = self._ha_tick(rnd, bad)
                if reason:
                    _logging.event("round_failed", round=rnd, node=self.cfg.node_rank, reason=reason)
                    self._store.compare_set(failed_key, "", f"node {self.cfg.node_rank}: {reason}")
                    return self._store.get(failed_key).decode()
                bad = {}
            if bad:
                bad = self._settle()
                reason = "; ".join(f"rank {r} exited with {_describe(c)}" for r, c in sorted(bad.items()))
                _logging.event("round_failed", round=rnd, node=self.cfg.node_rank, reason=reason)
                self._store.compare_set(failed_key, "", f"node {self.cfg.node_rank}: {reason}")
                return self._store.get(failed_key).decode()
            lost = [] if self.cfg.high_availability else self._lost_nodes()
            if lost:
                self._store.compare_set(failed_key, "", f"node(s) {lost} lost (no agent beat for {self.cfg.node_lost_after} s)")
                return self._store.get(failed_key).decode()
            # a removed rank's worker (exited, or an elastic standby still waiting) does not hold up its node;
            # one an upgrade took back in while running does again
            finished = all(c == 0 or r in self._removed for r, c in codes.items())
            if finished != reported_done:
                self._store.add(done_key, 1 if finished else -1)
                reported_done = finished
            if reported_done and self._store.add(done_key, 0) + self._vacant(rnd) >= self.cfg.nnodes:
                return None
            time.sleep(self.cfg.monitor_interval)
        return "agent stopped by signal"

    def _exit_codes(self) -> dict:
        """rank -> its worker's exit code, None while it runs."""
        with self._lock:
            return {r: p.poll() for r, p in self._workers.items()}

    def _settle(self) -> dict:
        """The failed workers, after waiting up to ``EXIT_GRACE_S`` for the others to exit too.

        A worker that fails closes its sockets before its process is gone (interpreter teardown), so a
        peer blocked in a collective with it can die first; reporting only what the first look saw would
        name the peer's abort and not the failure that caused it."""
        deadline = time.monotonic() + max(EXIT_GRACE_S, 2 * self.cfg.monitor_interval)
        while True:
            codes = self._exit_codes()
            if all(c is not None for c in codes.values()) or time.monotonic() >= deadline:
                return {r: c for r, c in codes.items() if c not in (None, 0)}
            time.sleep(min(0.05, self.cfg.monitor_interval))

    def _ha_tick(self, rnd: int, bad: dict) -> str | None:
        return ha.tick(self, rnd, bad)

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
            for node in self._lost_nodes():
                stale = self._store.get(f"agent/{node}/beat").decode()
                if self._store.compare_set(f"claim/{node}/{stale}", "", me).decode() != me:
                    continue  # another standby took this node
                self._store.add("standby/claimed", 1)
                self.cfg = dataclasses.replace(self.cfg, node_rank=node, standby=False)
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
        """Run the job on this node; returns the agent's exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._spares.fill()  # interpreters warm up while the agents rendezvous
        if self._store is None:
            self._connect()
        try:
            self.secret = secret.resolve(self.cfg, self._store)
        except ConfigError as exc:
            print(f"mindio-run: {exc}", file=sys.stderr)
            self._spares.close()
            return 2
        self._beater = liveness.Beater(self)
        self._beater.start()
        rnd, gen = 0, None
        if self.cfg.standby:
            got = self._wait_for_lost_node()
            if got is None:
                self._spares.close()
                return 0
            rnd, gen = got if isinstance(got, tuple) else (got, None)
        try:
            while True:
                if gen is None:
                    self._join(rnd)
                port = self._new_worker_store(rnd)
                log.info("round %d: starting %d workers (world size %d)", rnd, self.cfg.nproc_per_node, self.cfg.world_size)
                _logging.event("round_start", round=rnd, node=self.cfg.node_rank)
                self._start_workers(rnd, port, gen)
                gen = None
                reason = self._monitor(rnd)
                if reason is None:
                    log.info("round %d: all workers finished", rnd)
                    return 0
                self._stop_workers()
                _logging.event("workers_stopped", round=rnd, node=self.cfg.node_rank, reason=reason)
                if self._stopping or rnd >= self.cfg.max_restarts:
                    print(f"mindio-run: job failed: {reason} (restarts used: {rnd} of {self.cfg.max_restarts})", file=sys.stderr)
                    return 1
                print(f"mindio-run: round {rnd} failed: {reason}; restarting all workers", file=sys.stderr)
                rnd += 1
        finally:
            self._stop_workers()
            self._spares.close()
            self._beater.stop()
            self._leave()

    def _leave(self) -> None:
        """Node 0 hosts the stores: it leaves last, so no agent reads a store that is gone."""
        try:
            if self.cfg.node_rank != 0:
                self._store.add("job/left", 1)
                return
            deadline = time.monotonic() + 10
            left = self.cfg.nnodes - 1 - self._vacant(self._round)  # a vacant node (elastic.py) has no agent
            while self._store.add("job/left", 0) < left and time.monotonic() < deadline:
                time.sleep(self.cfg.monitor_interval)
        except Exception:  # the store is already gone: nothing left to coordinate
            pass

    def _on_signal(self, signum, frame):
        self._stopping = True


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
