"""Hot-switch backups in the launcher: started *before* the job pauses, released into the rank after it.

The controller's hot switch (mindio/ttp/controller/hotswitch.py) asks the replacer (ha.HostedController) for
backups first, while training goes on; keys in node 0's agent store, under
``round/<n>/switch/<gen>/`` (``gen``: the generation the switch will build):

* ``ready/<rank>``  the backup process: its pid. It has run the training script up to its
                    ``init_process_group`` (imports, data, everything before the world; the gc freeze of
                    the start-up objects) and now waits there (mindio.ttp.processor.reboot). This is its
                    registration with the controller; it is not a rank yet.
* ``dead/<rank>``   the owning agent: the backup exited before it was released (the switch is cancelled
                    before any rank paused).
* ``order/<rank>``  ``join`` (the agent, once the old process of the rank exited: the backup becomes
                    the rank's worker and joins generation ``gen``) or ``leave`` (the controller: the
                    switch was cancelled; the backup exits 0).

A backup is started by the agent that owns its rank (a warm spare, as a replacement, with
``MINDIO_SWITCH_BACKUP`` naming the key prefix); other nodes get the order through
``round/<n>/replace/<node>`` with ``"backup": true`` (ha.RoundWatch.tick).
"""
from __future__ import annotations

import logging
import subprocess
import time

from .. import _logging
from .view import WorkerView

log = logging.getLogger(__name__)

__all__ = ["prefix", "start_local", "status", "dismiss", "take", "release", "poll", "stop"]


def prefix(rnd: int, gen: int) -> str:
    return f"round/{rnd}/switch/{gen}"


def start_local(agent: WorkerView, ranks, gen: int) -> None:
    """(any thread) Start a backup for each of ``ranks`` (this node's) in a warm spare."""
    cfg, t0 = agent.cfg, time.monotonic()
    with agent.lock:
        for rank in ranks:
            old = agent.switch_backups.pop(rank, None)
            if old is not None and old[1].poll() is None:
                old[1].kill()  # a backup of an earlier, unfinished switch of this rank
            extra = {"MINDIO_REBOOT_GEN": gen, "MINDIO_REBOOT_TYPE": "hot switch",
                     "MINDIO_SWITCH_BACKUP": prefix(agent.current_round, gen)}
            agent.switch_backups[rank] = (gen, agent.spawn(rank - cfg.node_rank * cfg.nproc_per_node, extra))
    log.warning("hot switch: backups for ranks %s started (generation %d) in %.3f s", list(ranks), gen,
                time.monotonic() - t0)
    _logging.event("switch_backups_started", ranks=list(ranks), gen=gen, node=cfg.node_rank,
                   pids=[agent.switch_backups[r][1].pid for r in ranks])
    agent.request_refill()


def status(store, rnd: int, ranks, gen: int) -> tuple[dict, dict]:
    """({rank: pid} of backups that registered, {rank: why} of backups that died first)."""
    p, ready, dead = prefix(rnd, gen), {}, {}
    for r in ranks:
        if store.check([f"{p}/dead/{r}"]):
            dead[r] = store.get(f"{p}/dead/{r}").decode()
        elif store.check([f"{p}/ready/{r}"]):
            ready[r] = int(store.get(f"{p}/ready/{r}"))
    return ready, dead


def dismiss(store, rnd: int, ranks, gen: int) -> None:
    """The switch is off: every backup of ``ranks`` leaves (exit 0) as soon as it reads this."""
    for r in ranks:
        store.set(f"{prefix(rnd, gen)}/order/{r}", "leave")
    _logging.event("switch_backups_dismissed", ranks=list(ranks), gen=gen)


def take(agent: WorkerView, rank: int, gen: int) -> subprocess.Popen | None:
    """(agent.replace_local, under its lock, after the rank's old process exited) The backup of ``rank``
    for ``gen``, which becomes the rank's worker (:func:`release` lets it join); None when there is none
    (a spare is started instead, as for recover-in-place)."""
    entry = agent.switch_backups.pop(rank, None)
    if entry is None:
        return None
    g, proc = entry
    if g != gen or proc.poll() is not None:
        log.error("hot switch: the backup of rank %d (generation %d, exit %s) cannot join generation %d",
                  rank, g, proc.poll(), gen)
        if proc.poll() is None:
            proc.kill()
        return None
    return proc


def release(store, rnd: int, ranks, gen: int) -> None:
    """(after replace_local took them) The backups of ``ranks`` join generation ``gen`` now."""
    for r in ranks:
        store.set(f"{prefix(rnd, gen)}/order/{r}", "join")


def poll(agent: WorkerView, rnd: int) -> None:
    """(agent main loop) A backup that exited before it was released: tell the controller."""
    backups = agent.switch_backups
    if not backups:
        return
    with agent.lock:
        gone = {r: (g, p) for r, (g, p) in backups.items() if p.poll() is not None}
        for r in gone:
            backups.pop(r)
    for r, (g, p) in gone.items():
        key = f"{prefix(rnd, g)}/order/{r}"
        if agent.store.check([key]) and agent.store.get(key) == b"leave":
            continue  # dismissed: it left as told
        log.error("hot switch: the backup of rank %d (pid %d) exited with %s before the switch", r, p.pid,
                  p.returncode)
        agent.store.set(f"{prefix(rnd, g)}/dead/{r}", f"backup pid {p.pid} exited with {p.returncode}")
        _logging.event("switch_backup_exited", switched_rank=r, backup_pid=p.pid, code=p.returncode)


def stop(agent: WorkerView) -> None:
    """(end of a round) Backups not released are not needed any more."""
    with agent.lock:
        procs = [p for _g, p in agent.switch_backups.values()]
        agent.switch_backups.clear()
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
