"""Elastic training in the launcher: removed ranks, vacant nodes, standby agents that give ranks back.

With ``elastic-training`` among the strategies, the controller that node 0's agent hosts (ha.py) may
*downgrade*: remove whole optimizer instances and go on with fewer ranks (mindio.ttp.elastic). The
launcher then has three jobs, all through node 0's agent store:

* ``round/<n>/removed``         node 0: JSON list of the ranks the controller removed (now). A removed
                                rank's exit (77 = EXIT_CODE_REMOVED, or the death that caused the
                                downgrade) neither fails the round nor keeps its node from finishing.
* ``round/<n>/takeover/<node>`` node 0: JSON {gen, kind: "elastic", ranks} -- the key recover uses
                                (ha.py), written for a lost node whose ranks were *all* removed: the
                                node is vacant and offered to a ``--standby`` agent. The first standby to
                                claim it (``claim/<n>/<node>``, as for recover) becomes that node and
                                starts its ranks as elastic standbys (``MINDIO_STANDBY=1``): processes
                                that register with the controller for the removed ranks
                                (mindio.ttp.elastic.start_standby). Once every removed rank has one, the
                                controller's upgrade pauses the job at a step, rebuilds the full world,
                                repairs the new ranks from replicas, rolls back and continues.
* vacant nodes                  an offered node no standby claimed counts as finished when the job ends
                                (``round/<n>/done``), so a job that stays downgraded still ends.

A standby agent that waits *before* the node is lost takes it by recover when ``recover`` is enabled
(ha.py), else by this offer right after the downgrade.
"""
from __future__ import annotations

import json
import logging

from .. import _logging
from ..vocab import EXIT_CODE_REMOVED, Strategy
from .view import WorkerView

log = logging.getLogger(__name__)

__all__ = ["KIND", "enabled", "removed_ranks", "is_removed_exit", "offer_vacant", "vacant_nodes", "start_standbys"]

KIND = "elastic"


def enabled(cfg) -> bool:
    """The job may downgrade (``elastic-training`` among the launcher's strategies)."""
    return Strategy.ELASTIC_TRAINING in cfg.high_availability


def removed_ranks(agent: WorkerView, rnd: int) -> frozenset:
    """(agent main loop) The ranks the controller's downgrades removed, as node 0 published them."""
    if agent.hosted is not None:
        return frozenset(agent.hosted.ctl.elastic.removed)
    key = f"round/{rnd}/removed"
    if not agent.store.check([key]):
        return frozenset()
    return frozenset(json.loads(agent.store.get(key)))


def is_removed_exit(rank: int, code, removed) -> bool:
    """A worker exit that is no death: the rank was removed, or it exits because it was (77)."""
    return rank in removed or code == EXIT_CODE_REMOVED


def offer_vacant(agent: WorkerView, rnd: int) -> None:
    """(node 0's main loop, every tick) Publish the removed ranks; offer every lost node whose ranks
    were all removed to a standby agent (the takeover key of recover, kind "elastic")."""
    hosted, store, n = agent.hosted, agent.store, agent.cfg.nproc_per_node
    removed = tuple(sorted(hosted.ctl.elastic.removed))
    if removed != agent.removed_published:
        store.set(f"round/{rnd}/removed", json.dumps(list(removed)))
        agent.removed_published = removed
    if not removed:
        return
    for node in sorted(hosted.lost):
        ranks = list(range(node * n, (node + 1) * n))
        if node in agent.taken_over or not set(ranks) <= set(removed):
            continue
        if store.check([f"claim/{rnd}/{node}"]):
            continue  # a standby took this node once in this round already: a claim is final (ha.py)
        beat = f"agent/{node}/beat"
        agent.taken_over[node] = store.get(beat) if store.check([beat]) else b""  # not lost again meanwhile
        hosted.lost.discard(node)
        store.set(f"round/{rnd}/takeover/{node}", json.dumps({"gen": hosted.ctl.gen, "kind": KIND, "ranks": ranks}))
        log.warning("node %d is vacant (ranks %s removed by the downgrade): offered to a standby agent", node, ranks)
        _logging.event("node_offered", node=node, ranks=ranks, round=rnd)


def vacant_nodes(agent: WorkerView, rnd: int) -> int:
    """(any agent, when its own workers are done) Offered nodes no standby claimed: they count as done."""
    store, count = agent.store, 0
    for node in range(agent.cfg.nnodes):
        key = f"round/{rnd}/takeover/{node}"
        if not store.check([key]) or store.check([f"claim/{rnd}/{node}"]):
            continue
        if json.loads(store.get(key)).get("kind") == KIND:
            count += 1
    return count


def start_standbys(agent: WorkerView) -> None:
    """(a standby agent that claimed a vacant node) Start the node's ranks as elastic standbys, warm:
    the job's worker environment plus ``MINDIO_STANDBY=1``; they register with the controller and wait
    for the upgrade (the training script must support it: examples/megatron/pretrain_gpt.py does)."""
    cfg = agent.cfg
    ranks = []
    with agent.lock:
        for local in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + local
            agent.workers[rank] = agent.spawn(local, {"MINDIO_STANDBY": "1"}, replacement=True)
            ranks.append(rank)
    log.warning("node %d: ranks %s started as elastic standbys", cfg.node_rank, ranks)
    _logging.event("standbys_started", node=cfg.node_rank, ranks=ranks)
    agent.request_refill()
