"""Going on after node 0's loss: the backup controller takes over and moves node 0's ranks to a standby
(issue 16). Needs the agents on an etcd server (``--rdzv-backend etcd``: their store outlives node 0),
a backup controller on this node (``MINDIO_BACKUP_CONTROLLERS``, backup.py), ``recover`` among the
strategies and a ``--standby`` agent waiting; without a standby the backup ends the job with a
last-words checkpoint instead (backup.orphaned).

Node 1's agent finds node 0's beats stopped and takes the controller's leader key (backup.lead: only
once node 0's expired). Then, in its main loop (:class:`Takeover`, one :meth:`Takeover.tick` per monitor
interval):

1. it hosts a fresh workers' store (a TCPStore on this node's address; node 0's went with it) and
   publishes it (``round/<n>/store`` = JSON {addr, port}): the standby's replacements start on it
   (MASTER_ADDR/MASTER_PORT), and the survivors' next rebuild moves there (the recover sequence's
   ``rebuild`` carries it: ``store_moved``, mindio.ttp.processor.inplace.World.move);
2. its backup becomes the round's controller for new processes (``round/<n>/ttp``) and gets the
   launcher's replacer (ha.HostedController over it), so its decision can be recover;
3. the backup is armed (backup.arm) and takes over once the ranks outside node 0 failed over to it;
   from then on this agent is the job's leading agent, as node 0's was: it hosts the controller (node 0's
   ranks are declared dead as a lost node's, the standby takes them in the running round, bitwise),
   it counts the others out at the end and says the job ended.

Every wait is bounded: the takeover by ``MINDIO_DECISION_TIMEOUT``, the recovery by the controller's own
bounds (``--recover-timeout``).
"""
from __future__ import annotations

import datetime
import json
import logging
import time

from .. import _logging
from . import backup, ha

log = logging.getLogger(__name__)

__all__ = ["possible", "Takeover", "STORE_KEY"]

STORE_KEY = "round/{rnd}/store"


def possible(agent) -> bool:
    """Can node 0's ranks go to a standby: recover enabled and a standby agent waiting?"""
    store = agent.store
    spares = store.add("standby/count", 0) - store.add("standby/claimed", 0)
    return "recover" in agent.cfg.high_availability and spares > 0


class Takeover:
    """This node's backup taking over node 0's controller in round ``rnd`` (module docstring)."""

    def __init__(self, agent, ctl, rnd: int):
        from torch.distributed import TCPStore

        cfg = agent.cfg
        self.agent, self.ctl, self.t0 = agent, ctl, time.monotonic()
        self.addr = addr = backup.bind_addr(cfg)
        self.worker_store = TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=cfg.rdzv_timeout))
        moved = f"{addr}:{self.worker_store.port}"
        agent.store.set(STORE_KEY.format(rnd=rnd), json.dumps({"addr": addr, "port": self.worker_store.port}))
        self.hosted = ha.HostedController(agent, rnd, ctl=ctl, addr=addr)
        self.hosted.store_moved = moved
        log.warning("node 0 lost: the backup controller on node %d takes over once ranks %d..%d failed over to "
                    "it, then gives node 0's ranks to a standby; the workers' store moved to %s", cfg.node_rank,
                    cfg.nproc_per_node, cfg.world_size - 1, moved)
        _logging.event("controller_node_lost", node=cfg.node_rank, error="beats stopped; leader key taken",
                       store=moved, standby=True)

    def tick(self) -> str | None:
        """Arm the backup; None while it has not taken over yet, "" once it did (this agent hosts it from
        now on), or why the round fails (it did not take over within MINDIO_DECISION_TIMEOUT)."""
        backup.arm(self.agent, self.ctl, self.t0)
        if self.ctl.active:
            log.warning("the backup controller on node %d is in charge", self.agent.cfg.node_rank)
            return ""
        bound = self.agent.cfg.decision_timeout
        if time.monotonic() - self.t0 > bound:
            return (f"waited {bound:g} s for the backup controller on node {self.agent.cfg.node_rank} to take over "
                    f"(it needs ranks {self.agent.cfg.nproc_per_node}..{self.agent.cfg.world_size - 1} to fail over to "
                    f"it; {self.ctl.registered} did); MINDIO_DECISION_TIMEOUT sets the bound")
        return None
