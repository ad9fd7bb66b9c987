"""A backup controller in a node's agent: the controller survives the loss of node 0 (issue 16).

With ``mindio-run --high-availability`` on two nodes or more: one backup by default
(``MINDIO_BACKUP_CONTROLLERS=N`` in the agents' environment: N backups, at most one per node but node 0;
0: none; :func:`count`) -- on node 0's TCPStore a *provisional* one unless that knob is set
(:func:`provisional`: its last-words checkpoint is never made the latest). Node 0's hosted controller
(ha.py) accepts N backups, and the agents of nodes 1..N each host one passive backup (``Controller(backup=True)``) for the round:
it announces itself to the primary, which advertises it to every rank in its acks, so each rank's link
knows where to fail over to (transport.Link).

Node 0 hosts the controller and both stores. When its agents' store becomes unreachable (node 0's
host died: every store call fails, :func:`orphaned` is called from the agent's run loop), node 1's
agent does not stop its workers (they hold replicas) but arms its backup: the backup takes over as
soon as every rank outside node 0 failed over to it (their links find the primary silent after
``MINDIO_HEARTBEAT_MISSES`` x ``MINDIO_HEARTBEAT_INTERVAL`` s; a rank that has not failed over 2.5
intervals after that bound is taken for dead, the sweep declares it), node 0's ranks are declared dead at
once (their node is gone), and the backup decides as any controller does. It has no launcher to
replace ranks with (the stores were on node 0), so its decision is the last-words checkpoint: the
surviving ranks dump from the surviving replicas and exit 75 -- or, when some shard has no surviving
copy, exit 76 and nothing is saved (the last periodic checkpoint stays the latest). The agent prints
one line saying which, and exits 75 (dump) or 1.

With the agents on etcd (``--rdzv-backend etcd``) the agents' store outlives node 0: node 0's loss is
found by its beats stopping, node 1 arms its backup only once it took the controller's leader key
(:func:`lead`: node 0's expired), and with a ``--standby`` agent waiting the job goes on instead:
takeover.py gives the backup a launcher to replace node 0's ranks with.

Until armed, a backup never takes over (``takeover_quorum`` above the world size): a primary that is
only stalled, or the backup's own link trouble, is no loss of node 0. Ranks whose links failed over to
it meanwhile (node 0 stalled longer than their bound) stay registered with it, but its acks say it is
passive, so each link keeps a HELLO pending at the primary and goes back the moment it answers
(mindio/ttp/wire/home.py); the backup forgets ranks it no longer hears. A rank that fails over before
the backup is armed is therefore counted like one that fails over after: the primary being gone, it
never goes back. A backup armed in a partition
(node 0 alive but unreachable from node 1) acts too: both sides may then dump the same step (see
docs/recovery.md, "Node 0").

Every wait is bounded by ``MINDIO_DECISION_TIMEOUT`` (the backstop for a decision on a death) and the
message says what was awaited and from whom.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from .. import _knobs, _logging
from .._secret import secret_key
from ..vocab import EXIT_CODE_DUMPED

log = logging.getLogger(__name__)

__all__ = ["count", "provisional", "PROVISIONAL_DIR", "start", "orphaned", "NodeLost", "lead"]


class NodeLost(Exception):
    """(agent main loop, etcd) Node 0 is lost and this node took the controller's leader key: its backup
    takes over (:func:`orphaned`, with this exception's text as the cause)."""


def lead(agent) -> bool:
    """(etcd) Node 0's agent stopped beating: take the controller's leader key for this node, which
    succeeds only once node 0's expired (etcdstore.Leader). True: this node's backup may take over
    (the beat thread refreshes the key from now on); False: node 0 still refreshes it, so it is alive
    and reaches etcd -- wait (its beats come back, or its key expires within its TTL)."""
    from .etcdstore import Leader

    lease = Leader(agent.cfg.node_rank, agent.cfg.node_lost_after)
    if not lease.take(agent.store):
        return False
    agent.leader = lease
    log.warning("node 0's agent stopped beating and its leader key expired: node %d holds it now",
                agent.cfg.node_rank)
    _logging.event("leader_taken", node=agent.cfg.node_rank)
    return True


PROVISIONAL_DIR = "mindio-provisional"  # where a provisional dump goes, under the job's checkpoint directory


def _asked() -> bool:
    """Whether the agents' environment sets MINDIO_BACKUP_CONTROLLERS (else the defaults below)."""
    return bool(os.environ.get("MINDIO_BACKUP_CONTROLLERS", ""))


def count(cfg) -> int:
    """How many backup controllers this job keeps (0: none), under high availability on 2+ nodes, at most
    one per node other than node 0: MINDIO_BACKUP_CONTROLLERS when set; else one (on node 0's TCPStore a
    provisional one: :func:`provisional`)."""
    if not cfg.high_availability or cfg.nnodes < 2:
        return 0
    wanted = _knobs.get("MINDIO_BACKUP_CONTROLLERS") if _asked() else 1
    return min(int(wanted), cfg.nnodes - 1)


def provisional(cfg) -> bool:
    """Whether this job's backup dumps provisionally: on node 0's TCPStore unless MINDIO_BACKUP_CONTROLLERS
    is set. There a node cut off from node 0 cannot tell that from node 0's loss (no quorum with two nodes,
    no leader key): a backup dumping as a controller does would write beside a job that went on, even after
    that job ended, and make its step the latest (the drill "partition node 1 for 10 s", 2026-11-26: node 0
    recovered onto the standby and finished, then node 1's backup wrote a step-12 checkpoint as the
    latest). A provisional dump writes the surviving replicas' state all the same, but never as the latest
    and never over the job's files: under :data:`PROVISIONAL_DIR` for an adapter that supports it
    (mindio.megatron: a complete checkpoint to ``--load``), else by the save handlers only (the rename
    handler is not run). MINDIO_BACKUP_CONTROLLERS=N asks for full backups (their dump is the latest);
    on etcd the leader key settles which side acts, so its backups are full by default."""
    from . import stores

    return not stores.on_etcd(cfg) and not _asked()


def bind_addr(cfg) -> str:
    """Where this node's backup listens: --local-addr, else the address this host reaches node 0 from."""
    if cfg.local_addr:
        return cfg.local_addr
    from .netif import route_source

    try:
        return route_source(cfg.master_addr)
    except OSError:
        return cfg.master_addr


def start(agent, rnd: int, info: dict):
    """Node k (1 <= k <= count): start this round's passive backup of the controller at ``info``
    (round/<n>/ttp); returns it, or None when this node hosts none."""
    cfg = agent.cfg
    if cfg.standby or not 1 <= cfg.node_rank <= count(cfg):
        return None
    from ..ttp.controller.controller import Controller

    ctl = Controller(rank=cfg.node_rank, world_size=cfg.world_size, enabled=set(cfg.high_availability),
                     key=secret_key(agent.secret), backup=True)
    ctl.takeover_quorum = cfg.world_size + 1  # never, until orphaned() arms it
    ctl.start(bind_addr(cfg), 0, primary=f"tcp://{info['addr']}:{info['port']}")
    log.info("round %d: backup controller on %s for the primary at %s:%s", rnd, ctl.address, info["addr"],
             info["port"])
    _logging.event("backup_started", round=rnd, node=cfg.node_rank, address=ctl.address)
    return ctl


def arm(agent, ctl, t0: float) -> list:
    """(node 0 lost since ``t0``) Let the backup ``ctl`` take over as soon as every rank outside node 0 but
    this node's exited workers failed over to it; a rank still missing once every live link must have
    failed over (its bound, plus two beats) is dead too. Returns this node's exited workers' ranks."""
    cfg = agent.cfg
    with agent.lock:
        gone = sorted(r for r, p in agent.workers.items() if p.poll() is not None)
    if not ctl.active:
        others = cfg.world_size - cfg.nproc_per_node
        late = time.monotonic() - t0 > ctl.misses * ctl.interval + 2.5 * ctl.interval
        ctl.takeover_quorum = max(1, ctl.registered if late else others - len(gone))
    return gone


def primary_answers(ctl, timeout: float = 1.0) -> str:
    """The primary controller's address when something still accepts a connection there ("" when the
    connection is refused, times out or fails): node 0's controller lives and this node was cut off."""
    import socket
    from urllib.parse import urlsplit

    link = ctl._primary_link
    if link is None:
        return ""
    where = urlsplit(link.address)
    try:
        socket.create_connection((where.hostname, where.port), timeout=timeout).close()
    except (OSError, ValueError):
        return ""
    return f"{where.hostname}:{where.port}"


def orphaned(agent, ctl, error: str) -> int:
    """Node 0 is lost (``error`` says how: its agents' store is unreachable, or on etcd its agent stopped
    beating and its leader key expired). Arm this node's backup, let it take over and end the job with a
    last-words checkpoint; wait (bounded) for its decision and for this node's workers; print one line;
    return the agent's exit code (75: dumped, else 1).

    On node 0's TCPStore (no leader key) a store that fails is not proof enough: after a partition heals,
    node 1's store connection may break while node 0 lives on and its controller went on without node 1
    (its ranks declared dead, replaced from their replicas or saved): a backup taking over then would
    dump a stale step beside the job and make it the latest. So the backup takes over only when node 0's
    controller does not answer either (refused, or silent for 1 s); else this node stops (exit 1). On etcd
    only a node holding the controller's leader key acts: one cut off from etcd stops (exit 1)."""
    from ..ttp.controller.states import State
    from . import stores

    cfg = agent.cfg
    t0 = time.monotonic()
    if stores.on_etcd(cfg):  # etcd unreachable from here: the leader key decides, not this node
        primary = "" if agent.leader is not None else "leader key not held"
        why = ("; this node does not hold the controller's leader key, so its backup controller does not take "
               "over (node 0, holding it, may go on without this node)")
    else:
        primary = primary_answers(ctl)
        why = (f", but node 0's controller at {primary} still answers: this node was cut off from the job, which "
               f"went on without it (its ranks were declared dead); its workers stop and its backup controller "
               f"does not take over")
    if primary:
        print(f"mindio-run: job failed on node {cfg.node_rank}: {error[:160]}{why}", file=sys.stderr, flush=True)
        _logging.event("backup_declined", node=cfg.node_rank, error=error[:300], primary=primary)
        return 1
    node0 = list(range(cfg.nproc_per_node))
    bound = cfg.decision_timeout
    if provisional(cfg):
        ctl.provisional_dump = PROVISIONAL_DIR
    _logging.event("controller_node_lost", node=cfg.node_rank, error=error, provisional=bool(ctl.provisional_dump))
    log.info("%s: node 0 (controller and stores) is lost; the backup "
              "controller on node %d takes over once ranks %d..%d failed over to it", error, cfg.node_rank,
              len(node0), cfg.world_size - 1)
    declared = False
    why = ""
    deadline = t0 + bound
    while True:
        gone = arm(agent, ctl, t0)
        if ctl.active and not declared:
            declared = True  # their host is gone, or they exited here: no need to wait for missed heartbeats
            ctl.declare_dead(node0, "node lost", node=0)
            if gone:
                ctl.declare_dead(gone, "agent", reason="exited (seen by node %d's agent)" % cfg.node_rank)
        if ctl.final.is_set():
            break
        with agent.lock:
            alive = [r for r, p in agent.workers.items() if p.poll() is None]
        if not alive:
            # the workers exit on the exit order, after replying to it; FINAL follows the replies (its
            # driver thread), so it may come a moment after the processes are gone: bounded by that action
            if ctl.sm.state in (State.EXIT, State.FINAL) and ctl.final.wait(ctl.action_limit):
                break
            why = "every worker of this node exited before the backup controller decided"
            break
        if agent.stopping:
            why = "the agent was stopped by a signal"
            break
        if time.monotonic() > deadline:
            why = (f"waited {bound:g} s for the backup controller on node {cfg.node_rank} to "
                   + ("decide" if ctl.active else f"take over (it needs ranks {len(node0)}..{cfg.world_size - 1} "
                                                  f"to fail over to it; {ctl.registered} did)")
                   + "; MINDIO_DECISION_TIMEOUT sets the bound")
            break
        time.sleep(min(0.05, cfg.monitor_interval))
    # the workers carry out the exit order (a dump first); bounded by --shutdown-timeout
    end = time.monotonic() + max(cfg.term_grace, 1.0)
    with agent.lock:
        procs = dict(agent.workers)
    for p in procs.values():
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except Exception:  # subprocess.TimeoutExpired: stopped by the agent's finally
            pass
    codes = {r: p.poll() for r, p in sorted(procs.items())}
    d = ctl.last_decision if ctl.final.is_set() else {}
    took = time.monotonic() - t0
    where = f"mindio-run: node 0 lost ({error[:160]})"
    if ctl.final.is_set() and ctl.exit_code == EXIT_CODE_DUMPED and all(c == EXIT_CODE_DUMPED for c in codes.values()):
        step = d.get("lock_step")
        if ctl.provisional_dump:
            print(f"{where}; the backup controller on node {cfg.node_rank} saved a provisional last-words "
                  f"checkpoint at step {step} from the surviving replicas ({took:.1f} s), not made the latest: on "
                  f"node 0's TCPStore this node cannot tell node 0's loss from being cut off from it (if node 0's "
                  f"agent still runs, the job went on there). "
                  + (f"It is the checkpoint directory {PROVISIONAL_DIR}/ inside the job's own (mindio.megatron: "
                     f"--load that directory to resume from it)" if ctl.provisional_renamed else
                     "The save handlers wrote it where they write; the rename handler, which would make it the "
                     "latest, was not run (run its step by hand to resume from it)")
                  + "; MINDIO_BACKUP_CONTROLLERS=1 or --rdzv-backend etcd make such a checkpoint the latest",
                  file=sys.stderr, flush=True)
            _logging.event("backup_dumped", node=cfg.node_rank, step=step, took_s=round(took, 3), provisional=True,
                           where=PROVISIONAL_DIR if ctl.provisional_renamed else "save handlers")
            return EXIT_CODE_DUMPED
        # on node 0's TCPStore (backups asked for) a node cut off from node 0 cannot tell it from node 0's
        # loss (no quorum with two nodes): say so, lest a second copy of a job that went on be started
        maybe = "" if stores.on_etcd(cfg) else (" (unless node 0 is only cut off from this node: if its agent "
                                                "still runs, the job went on there without this node)")
        print(f"{where}; the backup controller on node {cfg.node_rank} saved a last-words checkpoint at step "
              f"{step} from the surviving replicas ({took:.1f} s): relaunch the job to resume from it"
              f"{maybe}", file=sys.stderr, flush=True)
        _logging.event("backup_dumped", node=cfg.node_rank, step=step, took_s=round(took, 3))
        return EXIT_CODE_DUMPED
    if ctl.final.is_set():
        missing = d.get("missing_shards") or []
        why = (f"no surviving copy of shard(s) {missing[:8]}: nothing was saved" if missing else
               f"the backup controller ended the job with exit code {ctl.exit_code}; workers {codes}")
    print(f"{where}; {why or 'the job could not be saved'}; the last periodic checkpoint stays the latest",
          file=sys.stderr, flush=True)
    _logging.event("backup_failed", node=cfg.node_rank, why=why, codes={str(k): v for k, v in codes.items()})
    return 1
