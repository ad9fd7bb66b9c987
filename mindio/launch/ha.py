"""High availability in the launcher: the controller as rank -1, worker deaths, process replacement.

Active when the job enables strategies (``--high-availability`` or ``HIGH_AVAILABILITY``). Then, per
round, in addition to the keys of agent.py (all in the agents' store: node 0's, or etcd):

* ``round/<n>/ttp``             node 0: JSON {addr, port} of the controller it hosts (rank -1). Every
                                agent passes them to its workers as TTP_ADDR / TTP_PORT with
                                MINDIO_CONTROLLER_EXTERNAL=1, so no rank hosts it (rank 0 may die like
                                any other). The controller signs with the job secret every worker
                                already has (secret.py); it is never in this store.
* ``round/<n>/deaths``          counter; ``round/<n>/death/<i>`` = "<rank> <reason>": a worker of
                                another node exited. Node 0 tells the controller (in-process).
                                Node 0's own workers are reported directly. Either way a SIGKILLed
                                rank is declared dead within one monitor interval (0.1 s), not after
                                missed heartbeats.
* ``round/<n>/replace/<node>``  counter; ``.../<node>/<i>`` = JSON {ranks, gen}: the controller
                                orders node ``node``'s agent to start these ranks again (recover-in-
                                place). A warm spare takes each, with MINDIO_REBOOT_GEN / _TYPE set
                                (mindio.ttp.processor.reboot).
* ``round/<n>/switch/<gen>/...`` hot switch: backups started before the pause register, join or leave
                                (switch.py); their start order is a replace order with ``"backup": true``.
* ``round/<n>/takeover/<node>`` JSON {gen}: the controller gives lost node ``node``'s ranks to a
                                standby agent (recover); the first standby to claim it
                                (``claim/<n>/<node>``) becomes that node and starts its ranks as
                                replacements, in the running round. With ``"kind": "elastic"``
                                (elastic.py) a vacant node after a downgrade: its ranks start as
                                elastic standbys and the controller scales the job back out.

* ``round/<n>/late/<rank>``     node 0: ``rank`` exited abnormally *after* its training finished (its
                                processor had left the controller: BYE) -- e.g. an abort at interpreter
                                exit. Nothing is left to recover: its node counts it as done, and the job
                                ends, non-zero and naming it, as soon as the other ranks are done.

A worker death no longer fails the round by itself: the controller decides (replace, dump, exit).
The round fails when the controller ended the job (its exit action went out); when the dead rank never
registered with the controller (it cannot recover a rank it does not know: the round fails as without
high availability); or when a death was neither replaced nor ended within the backstop
(``MINDIO_DECISION_TIMEOUT``): never a hang.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time

from .. import _logging
from .._secret import secret_key
from ..vocab import EXIT_CODE_SWITCHED
from . import backup, elastic, liveness, stores, switch
from .failures import Failure, describe
from .view import WorkerView

log = logging.getLogger(__name__)

__all__ = ["HostedController", "RoundWatch", "ttp_env", "wait_for_takeover"]


NODE0_LOST = "node 0 (the controller's node) lost"  # RoundWatch.tick on the other nodes: its agent stopped beating

# a processor's enable flag -> the strategies this launcher carries out for it (HostedController.adopt)
_BY_FEATURE = {"arf": ("recover-in-place", "recover")}


def _reboot_type(strategy: str) -> str:
    """MINDIO_REBOOT_TYPE of a replacement (tft_get_reboot_type): "hot switch" or "arf"."""
    return "hot switch" if strategy == "hot switch" else "arf"


def ttp_env(info: dict) -> dict:
    """Worker environment that points the training script's processor at the hosted controller."""
    return {"MINDIO_CONTROLLER_EXTERNAL": "1", "TTP_ADDR": info["addr"], "TTP_PORT": info["port"]}


class HostedController:
    """Node 0's controller for one round, plus the replacer it calls (recover.py's protocol)."""

    store_moved = ""  # host:port of the workers' store when it moved off node 0 (takeover.py); "" if not

    def __init__(self, agent: WorkerView, rnd: int, ctl=None, addr: str = ""):
        """Node 0: start the round's controller. Or (takeover.py) host ``ctl``, a backup controller
        listening on ``addr``, that takes over node 0's."""
        from ..ttp.controller.controller import Controller

        cfg = agent.cfg
        self.agent, self.rnd = agent, rnd
        # the controller's driver thread gets its own client of the agent store (not shared across threads)
        self.store = stores.client(cfg, cfg.rdzv_timeout)
        if ctl is None:
            ctl, addr = Controller(rank=-1, world_size=cfg.world_size, enabled=set(cfg.high_availability),
                                   key=secret_key(agent.secret), backups_allowed=backup.count(cfg)), cfg.master_addr
            ctl.start(addr, 0)  # the bind picks a free port
        self.ctl = ctl
        port = self.ctl.port
        self.ctl.attach_replacer(self, timeout=cfg.recover_timeout)
        self.info = {"addr": addr, "port": port}
        agent.store.set(f"round/{rnd}/ttp", json.dumps(self.info))
        self._deaths_seen = 0
        self.lost: set[int] = set()  # nodes whose agent is known gone (until a standby takes them)
        self._probing: dict[int, tuple] = {}  # node -> (its beat when a rank of it died, since)
        self._probed: set[int] = set()  # dead ranks whose node was probed already
        self._adopted = 0  # registered ranks when adopt() last looked
        log.info("round %d: controller (rank %d) on %s:%d, strategies %s", rnd, ctl.rank, addr, port,
                 sorted(cfg.high_availability))

    # -- called by the controller's driver thread --------------------------------------------------
    def possible(self, ranks, strategy: str) -> bool:
        """recover-in-place: every node owning ``ranks`` still has a live agent. recover: those nodes
        lost their agent, the ranks are whole nodes, and enough standby agents wait."""
        cfg, store = self.agent.cfg, self.store
        nodes = {r // cfg.nproc_per_node for r in ranks}
        alive = {n: self.node_alive(n) for n in nodes}
        if strategy == "hot switch" and stores.on_etcd(cfg):
            log.warning("hot switch of ranks %s declined: its backups wait on node 0's TCPStore, and this job's "
                        "agents are on etcd (--rdzv-backend etcd)", sorted(ranks))
            return False
        if strategy in ("recover-in-place", "hot switch"):
            return all(alive.values())
        if strategy == "recover":
            whole = all(set(range(n * cfg.nproc_per_node, (n + 1) * cfg.nproc_per_node)) <= set(ranks)
                        for n in nodes)
            spares = store.add("standby/count", 0) - store.add("standby/claimed", 0)
            return bool(nodes) and not any(alive.values()) and whole and spares >= len(nodes)
        return False

    def node_alive(self, node: int, wait: float | None = None) -> bool:
        """Does ``node``'s agent still beat? Its beat value must change within ``wait`` seconds
        (default: 10 monitor intervals, at least 1 s) -- far sooner than the 3 s node-loss timeout,
        and independent of the hosts' clocks. Node 0 (this agent) is alive."""
        cfg, store = self.agent.cfg, self.store
        if node == cfg.node_rank:
            return True
        key = f"agent/{node}/beat"
        if node in self.lost or node in self.agent.taken_over or not store.check([key]):
            return False
        first = store.get(key)
        clock = liveness.StallClock(0.5, "node probe")  # our own stall (or the store's) is not its silence
        deadline = clock.now() + (wait if wait is not None else max(1.0, 10 * cfg.monitor_interval))
        while clock.now() < deadline:
            time.sleep(min(0.02, cfg.monitor_interval / 2))
            if store.get(key) != first:
                return True
        log.error("node %d's agent stopped beating: its node is lost", node)
        self.lost.add(node)
        return False

    def replace(self, ranks, gen: int, strategy: str) -> None:
        cfg, store = self.agent.cfg, self.store
        by_node: dict[int, list] = {}
        for r in sorted(ranks):
            by_node.setdefault(r // cfg.nproc_per_node, []).append(r)
        for node, rs in by_node.items():
            if strategy == "recover":
                beat = f"agent/{node}/beat"
                self.agent.taken_over[node] = store.get(beat) if store.check([beat]) else b""
                self.lost.discard(node)
                store.set(f"round/{self.rnd}/takeover/{node}", json.dumps({"gen": gen}))
            elif node == cfg.node_rank:
                self.agent.replace_local(rs, gen, reboot_type=_reboot_type(strategy))
                if strategy == "hot switch":
                    switch.release(store, self.rnd, rs, gen)  # backups started before the pause join now
            else:
                i = store.add(f"round/{self.rnd}/replace/{node}", 1)
                store.set(f"round/{self.rnd}/replace/{node}/{i}",
                          json.dumps({"ranks": rs, "gen": gen, "type": _reboot_type(strategy)}))
        _logging.event("replace_ordered", ranks=sorted(ranks), gen=gen, strategy=strategy)

    # hot switch (mindio/ttp/controller/hotswitch.py): backups start before the pause (switch.py)
    def prestart(self, ranks, gen: int) -> None:
        cfg, by_node = self.agent.cfg, {}
        for r in sorted(ranks):
            by_node.setdefault(r // cfg.nproc_per_node, []).append(r)
        for node, rs in by_node.items():
            if node == cfg.node_rank:
                switch.start_local(self.agent, rs, gen)
            else:
                i = self.store.add(f"round/{self.rnd}/replace/{node}", 1)
                self.store.set(f"round/{self.rnd}/replace/{node}/{i}",
                               json.dumps({"ranks": rs, "gen": gen, "type": "hot switch", "backup": True}))

    def backups(self, ranks, gen: int) -> tuple[dict, dict]:
        return switch.status(self.store, self.rnd, ranks, gen)

    def dismiss(self, ranks, gen: int) -> None:
        switch.dismiss(self.store, self.rnd, ranks, gen)

    # -- called by node 0's agent main loop --------------------------------------------------------
    def adopt(self) -> None:
        """Enable what the ranks registered for and this launcher carries out (mindio.launch.needs): a
        rank with ``enable_arf`` (worker reboot) gets recover-in-place and recover, even when the
        launcher's --high-availability did not list them. Looked at when the registered count changes."""
        ctl = self.ctl
        with ctl._lock:
            if len(ctl.ranks) == self._adopted:
                return
            self._adopted = len(ctl.ranks)
            asked = {f for r in ctl.ranks.values() for f, on in (r.features or {}).items() if on}
        add = {s for f in asked for s in _BY_FEATURE.get(f, ())} - set(ctl.enabled)
        if add:
            ctl.enabled = set(ctl.enabled) | add  # a new set: the driver thread may be iterating the old one
            log.warning("ranks registered for %s: strategies %s enabled (the launcher can carry them out)",
                        sorted(asked), sorted(add))
            _logging.event("strategies_adopted", features=sorted(asked), added=sorted(add))

    def poll_deaths(self) -> str | None:
        """Deaths other nodes' agents reported; returns why the round fails, if one of them fails it."""
        store = self.agent.store
        n = store.add(f"round/{self.rnd}/deaths", 0)
        while self._deaths_seen < n:
            self._deaths_seen += 1
            key = f"round/{self.rnd}/death/{self._deaths_seen}"
            if not store.check([key]):
                self._deaths_seen -= 1  # counter bumped, value not written yet: next tick
                return None
            rank, _, reason = store.get(key).decode().partition(" ")
            failed = self.report_death(int(rank), reason, node=int(rank) // self.agent.cfg.nproc_per_node)
            if failed:
                return failed
        return None

    def report_death(self, rank: int, reason: str, node: int | None = None) -> str | None:
        """A worker exited: a replacement (reason starts with "replacement") fails the recovery in flight;
        a rank that left the controller (its training finished) failed *late*: marked, not recovered;
        a rank that never registered fails the round (returns why); any other is a dead rank for the
        controller, which decides."""
        if reason.startswith("replacement"):
            self.ctl.replacement_died(rank, reason)
            return None
        with self.ctl._lock:
            r = self.ctl.ranks.get(rank)
            known, left = r is not None, r is not None and r.left  # BYE: its training finished
        where = f"rank {rank} (node {self.agent.cfg.node_rank if node is None else node}) {reason}"
        if left:
            log.error("rank %d %s after its training finished (it had left the controller): nothing to "
                      "recover; the job ends, failed, once the other ranks are done", rank, reason)
            _logging.event("late_exit", dead_rank=rank, reason=reason)
            self.agent.store.set(f"round/{self.rnd}/late/{rank}", reason)
            return None
        if not known:
            return f"{where} before it registered with the controller (which cannot recover a rank it never knew)"
        self.ctl.declare_dead([rank], "agent", reason=reason)
        return None

    def probe_nodes(self) -> list[int]:
        """(agent main loop) When a rank of another node died, check that node's agent: if its beat
        does not change within 10 monitor intervals (>= 1 s), the node is lost -- sooner than the 3 s
        node-loss timeout. Returns the nodes found lost now (their ranks are declared dead)."""
        cfg, store, ctl = self.agent.cfg, self.agent.store, self.ctl
        clock = self.agent.clock  # the main loop's time, less its own stalls (liveness.py)
        with ctl._lock:
            all_dead = {r.rank for r in ctl.ranks.values() if not r.alive}
        self._probed &= all_dead  # a replaced rank that dies again is probed again
        for rank in sorted(all_dead - self._probed):
            self._probed.add(rank)
            node = rank // cfg.nproc_per_node
            key = f"agent/{node}/beat"
            if node != cfg.node_rank and node not in self._probing and node not in self.lost and store.check([key]):
                self._probing[node] = (store.get(key), clock.now())
        found = []
        for node, (beat, since) in list(self._probing.items()):
            if store.get(f"agent/{node}/beat") != beat:
                del self._probing[node]  # its agent lives: a worker died, not the node
            elif clock.now() - since > max(1.0, 10 * cfg.monitor_interval):
                del self._probing[node]
                self.lost.add(node)
                found.append(node)
        return found

    @property
    def ended(self) -> int | None:
        """The exit code the controller ended the job with, or None while it runs."""
        return self.ctl.exit_code if self.ctl.final.is_set() else None

    def close(self) -> None:
        # joins its threads (<= 2 s each) and ends its zmq context off the agent's main loop; not a daemon
        # thread: the interpreter's exit waits for it, so it is never stopped inside a zmq call (a daemon
        # thread that wakes up in the interpreter's teardown is ended with pthread_exit, and unwinding
        # through C++ frames then aborts the process: "terminate called without an active exception")
        threading.Thread(target=self.ctl.destroy, name="mindio-ctl-destroy").start()


class RoundWatch:
    """One round of high availability on one node's agent (agent.py calls :meth:`tick` every monitor
    interval): what it reported, since when a death waits for the controller, what it declared lost,
    which replacement orders it carried out."""

    def __init__(self, agent: WorkerView, rnd: int):
        self.agent, self.rnd = agent, rnd
        self.reported: set = set()  # worker processes whose exit was reported
        self.dead_since: float | None = None  # a death waits for the controller's decision since then
        self.declared_lost: set = set()  # nodes declared lost to the controller
        self.unrecorded: dict = {}  # {rank: code} reported by :meth:`replaced`, error files read at the next tick
        # a standby that took a node in this round must not replay orders its predecessor carried out
        self.replace_seen = agent.store.add(f"round/{rnd}/replace/{agent.cfg.node_rank}", 0)

    def _unlose(self, hosted, raw_lost: set) -> None:
        """A node taken for lost whose agent beats again while every one of its ranks still beats to the
        controller was cut off for a while (a flapping link, a stall), not lost: forget it, so that a later
        fault of its ranks is recovered in place again rather than as a lost node's."""
        cfg, ctl = self.agent.cfg, hosted.ctl
        for node in sorted(hosted.lost - raw_lost - set(self.agent.taken_over)):
            ranks = list(range(node * cfg.nproc_per_node, (node + 1) * cfg.nproc_per_node))
            if ctl.heard(ranks, 2 * ctl.interval) == ranks:
                hosted.lost.discard(node)
                log.warning("node %d's agent beats again and its ranks %s never stopped beating: it was cut off "
                            "for a while, not lost", node, ranks)
                _logging.event("node_back", node=node)

    def _lost_after_training(self, node: int, ranks: list) -> None:
        """(node 0) Node ``node`` was lost after every one of its ranks had left the controller (their training
        finished): nothing to recover, and its agent will never say that its workers are done -- say it for
        it, so that the job ends now, failed (a late failure, as a rank's abnormal exit after its training),
        instead of waiting for that agent forever."""
        agent, rnd = self.agent, self.rnd
        log.error("node %d lost (its agent stopped beating) after the training of its ranks %s had finished "
                  "(they had left the controller): nothing to recover; the job ends, failed, once the other "
                  "ranks are done", node, ranks)
        _logging.event("late_node_loss", node=node, ranks=ranks)
        for rank in ranks:
            agent.store.set(f"round/{rnd}/late/{rank}", "node lost")
            agent.add_failure(Failure(rank=rank, code=-1, node=node, time=time.time(), late=True, lost=True))
        agent.store.add(f"round/{rnd}/done", 1)  # on its behalf (an agent that comes back adds its own: >= is kept)

    def replaced(self, rank: int, proc) -> None:
        """(agent.replace_local, under the agent's lock) ``proc``, the old process of ``rank``, is being
        replaced. An exit this watch has not reported -- the controller learnt of the death first (its
        same-host pid probe) and had the rank replaced before this agent's next tick saw it -- is reported
        now: logged, its ``worker_exited`` event, its error file read at the next tick."""
        code = proc.poll()
        if code is None or proc in self.reported:
            return
        self.reported.add(proc)
        log.error("rank %d exited with %s (replaced before this agent's watch saw it)", rank, describe(code))
        _logging.event("worker_exited", round=self.rnd, dead_rank=rank, code=code)
        self.unrecorded[rank] = code

    def tick(self, bad: dict) -> str | None:
        """High availability: report deaths to the controller, carry out its replacement orders,
        declare lost nodes (node 0); return why the round failed, or None while it goes on."""
        agent, rnd = self.agent, self.rnd
        cfg, store = agent.cfg, agent.store
        on = elastic.enabled(cfg)
        removed = agent.removed = elastic.removed_ranks(agent, rnd) if on else frozenset()
        bad = {r: c for r, c in bad.items()  # switched out: its backup comes; removed by a downgrade: no death
               if c != EXIT_CODE_SWITCHED and not (on and elastic.is_removed_exit(r, c, removed))}
        with agent.lock:
            procs = {r: agent.workers[r] for r in bad}
            new = {r: c for r, c in bad.items() if procs[r] not in self.reported}
            self.reported.update(procs[r] for r in new)
            unrecorded, self.unrecorded = self.unrecorded, {}
        if unrecorded:
            agent.record_failures(rnd, unrecorded)
        failed = None
        for rank, code in new.items():
            self.dead_since = self.dead_since or time.monotonic()
            why = ("replacement " if procs[rank] in agent.replacements else "") + f"exited with {describe(code)}"
            log.error("rank %d %s; telling the controller", rank, why)
            _logging.event("worker_exited", round=rnd, dead_rank=rank, code=code)
            if agent.hosted is not None:
                failed = failed or agent.hosted.report_death(rank, why)
            else:
                i = store.add(f"round/{rnd}/deaths", 1)
                store.set(f"round/{rnd}/death/{i}", f"{rank} {why}")
        if new:  # after the reports (they are on the recovery's critical path): their error files, for the summary
            agent.record_failures(rnd, new)
        if failed:
            return failed
        agent.late_ranks |= {r for r in bad if r not in agent.late_ranks and store.check([f"round/{rnd}/late/{r}"])}
        switch.poll(agent, rnd)  # a hot-switch backup that exited before it was released
        agent.refill_spares()
        hosted = agent.hosted
        if hosted is not None:
            hosted.adopt()
            failed = hosted.poll_deaths()
            if failed:
                return failed
            if hosted.ended is not None:
                agent.hosted_code = hosted.ended
                return f"the controller ended the job (exit code {hosted.ended})"
            raw_lost = agent.lost_nodes()
            for node, stale in list(agent.taken_over.items()):
                if store.get(f"agent/{node}/beat") != stale:
                    del agent.taken_over[node]  # the standby beats as that node now
            hosted.probe_nodes()  # a rank of another node died: is its agent gone too? (~1 s)
            hosted.lost.update(n for n in raw_lost if n not in agent.taken_over)
            self._unlose(hosted, set(raw_lost))
            if on:
                elastic.offer_vacant(agent, rnd)  # a lost node whose ranks were all removed: to a standby agent
            agent.lost_now = sorted(n for n in hosted.lost if n not in agent.taken_over)
            for node in set(agent.lost_now) - self.declared_lost:
                ranks = list(range(node * cfg.nproc_per_node, (node + 1) * cfg.nproc_per_node))
                # workers die with their agent (PR_SET_PDEATHSIG): a rank that still beats to the controller
                # has a stalled agent, not a dead one; its own heartbeats decide (a stall is not a death)
                ctl = hosted.ctl
                with ctl._lock:  # every rank had left the controller (BYE): their training finished
                    after_training = all(r in ctl.ranks and ctl.ranks[r].left for r in ranks)
                if after_training:
                    self._lost_after_training(node, ranks)
                    continue
                beating = set(ctl.heard(ranks, 2 * ctl.interval))
                dead = [r for r in ranks if r not in beating]
                log.error("node %d lost (its agent stopped beating): its ranks %s are dead%s", node, dead,
                          f"; ranks {sorted(beating)} still beat to the controller: left to their heartbeats"
                          if beating else "")
                ctl.declare_dead(dead, "node lost", node=node)
                self.dead_since = self.dead_since or time.monotonic()
            self.declared_lost = set(agent.lost_now)
        else:
            key = f"round/{rnd}/replace/{cfg.node_rank}"
            n = store.add(key, 0)
            while self.replace_seen < n and store.check([f"{key}/{self.replace_seen + 1}"]):
                self.replace_seen += 1
                order = json.loads(store.get(f"{key}/{self.replace_seen}"))
                if order.get("backup"):  # hot switch: start backups now, they join later (switch.py)
                    switch.start_local(agent, order["ranks"], order["gen"])
                    continue
                agent.replace_local(order["ranks"], order["gen"], reboot_type=order.get("type", "arf"))
                if order.get("type") == "hot switch":
                    switch.release(store, rnd, order["ranks"], order["gen"])
                self.dead_since = None
            if 0 in agent.lost_nodes():
                return NODE0_LOST
        with agent.lock:
            all_live = all(p.poll() is None or p.poll() == 0 or r in removed or r in agent.late_ranks
                           for r, p in agent.workers.items())
        if all_live:
            self.dead_since = None
        elif self.dead_since and time.monotonic() - self.dead_since > cfg.decision_timeout:
            return (f"waited {cfg.decision_timeout:g} s for the controller (node 0's agent) to decide on a worker "
                    f"death (replace the rank, or end the job) and it did not; MINDIO_DECISION_TIMEOUT sets the bound")
        return None


def wait_for_takeover(agent: WorkerView, me: str):
    """High availability: wait until the controller gives a lost node to a standby (ha.py), claim
    it; return (round, generation) -- the ranks start as replacements in the running round."""
    while not agent.stopping:
        try:
            if stores.ended(agent.store, agent.cfg):
                log.info("standby agent: the job ended; leaving")
                return None
            rnd = int(agent.store.get("job/round")) if agent.store.check(["job/round"]) else 0
            for node in range(agent.cfg.nnodes):
                key = f"round/{rnd}/takeover/{node}"
                if not agent.store.check([key]):
                    continue
                if agent.store.compare_set(f"claim/{rnd}/{node}", "", me).decode() != me:
                    continue
                order = json.loads(agent.store.get(key))
                gen, agent.takeover_kind = order["gen"], order.get("kind", "recover")  # elastic.py: "elastic"
                agent.store.add("standby/claimed", 1)
                agent.cfg = dataclasses.replace(agent.cfg, node_rank=node, standby=False)
                _logging.set_context(node=node, rank="agent")
                agent.beat()
                print(f"mindio-run: standby takes over node {node} in round {rnd} (generation {gen}, "
                      f"{agent.takeover_kind})", file=sys.stderr)
                _logging.event("standby_takeover", node=node, round=rnd, gen=gen, how=agent.takeover_kind)
                return rnd, gen
        except (RuntimeError, OSError) as exc:  # node 0's store is gone: the job ended
            log.info("standby agent: job store unreachable (%s); leaving", exc)
            return None
        time.sleep(agent.cfg.monitor_interval)
    return None
