"""Elastic training (MindIO ZIT), controller side: downgrade (scale in by whole DP slices) and upgrade
(scale back out).

Downgrade -- chosen by the incident flow as strategy "downgrade" (``elastic-training`` enabled, every
shard of every faulty rank has a usable replica, no spare). Every live rank is already stopped::

    ABNORMAL -DOWNGRADE-> DG_REPAIR
      plan         remove every optimizer *instance* (a contiguous part of a DP group, megatron-core's
                   num_distributed_optimizer_instances; MindIO's replica layout) that holds a faulty rank,
                   in every DP group, so the layout stays regular (:func:`plan_downgrade`); the survivors
                   keep at least one instance = a complete sharded copy of the optimizer state
      clean        survivors: groups destroyed (inplace.py); removed ranks still alive are told to exit
                   (EXIT_CODE_REMOVED) and leave the rank table (removed, not dead)
      zit_rebuild  generation g+1: new default group of the survivors only (torch rank = position in the
                   sorted survivor list), then ``zit_downgrade_rebuild(new_dp_ranks, new_world_ranks,
                   args, ctx)``: fewer instances, more micro-batches per step (global batch kept)
      rollback     every survivor back to the lock step (the ordinary rollback callback)
    DG_REPAIR -OK-> DOWNGRADE, then ``retry``: every survivor re-enters train().

Upgrade -- when a standby process has registered for every removed rank (``start_standby``; the
controller treats a registration for a removed rank as a standby offer), the driver thread::

    DOWNGRADE -UPGRADE-> UPGRADE
      stop, clean  survivors stop at the next step boundary (fence) and destroy their groups
      zit_rebuild  generation g+1: the full world again; ``zit_upgrade_rebuild(rank_list, args, ctx)`` on
                   every rank (standbys build their model/optimizer here, survivors put theirs back)
      zit_repair   ``zit_upgrade_repair(step, need_rebuild, error_ranks, repair_info, args, ctx)``: a
                   replica RT_SEND -> the new rank RT_RECV_REPAIR (optimizer shard + scalar state)
      zit_rollback ``zit_upgrade_rollback(step, args, ctx)`` on every rank
      (dump)       with MINDIO_DUMP_AFTER_UPGRADE=1, a checkpoint of the lock step (save + rename)
    UPGRADE -OK-> NORMAL, then ``retry``: every rank (the standbys for the first time) enters train().

Both record events (``downgrade_done`` / ``upgrade_done``) with the time and a breakdown. A failed step
falls back: a downgrade returns None to the incident flow (next strategy, e.g. dump); a failed upgrade
ends the job -- the survivors' groups are gone by then -- with a last-words checkpoint first when the
job enabled dump: the survivors that stopped at the lock step with complete state hold every shard
between them (the new ranks hold nothing yet and never write), so the lock step is dumped from them and
the job exits EXIT_CODE_DUMPED; only when some shard has no such holder (a line per shard says why)
EXIT_CODE_FAULT.

The rank side (the zit actions a processor runs) is in elastic_rank.py, the standby process in
standby.py; mindio.ttp.elastic is the public module that names them all. This module imports neither
(controller-side code never reaches into the rank side).
"""
from __future__ import annotations

import logging
import time

from ... import _knobs, _logging
from . import dump, policy, sequence
from .._enums import ActionName, EXIT_CODE_DUMPED, EXIT_CODE_FAULT, EXIT_CODE_REMOVED, OsStatus
from ... import vocab
from .ranks import RankRecord
from .sequence import Sequence
from .states import Result, State
from .strategy import Context, Outcome, Strategy

__all__ = ["Elastic", "Downgrade", "plan_downgrade", "UPGRADE_STOP_TRIES", "EXIT_CODE_REMOVED"]

_log = logging.getLogger("mindio.ttp.elastic")  # the name it always logged under
UPGRADE_STOP_TRIES = 3   # stops before an upgrade gives up on survivors caught at different points


def plan_downgrade(replicas: dict, members, faulty) -> tuple[list, list, list]:
    """(survivors, removed, new DP groups) for a downgrade; raises ValueError when impossible.

    ``replicas``: rank -> its ``tft_set_optimizer_replica`` list (entry 0, the dense optimizer, is used);
    ``members``: the ranks of the current world; ``faulty``: ranks to get rid of. Instance ``k`` of a DP
    group of ``d`` ranks with ``R`` instances is positions ``[k*d/R, (k+1)*d/R)``; the instances holding
    a faulty rank are removed from every DP group.
    """
    groups: dict[tuple, int] = {}
    for r in members:
        entries = replicas.get(r) or ()
        if not entries or not entries[0].get("rank_list"):
            raise ValueError(f"rank {r} reported no optimizer replica layout (tft_set_optimizer_replica)")
        groups[tuple(sorted(entries[0]["rank_list"]))] = max(1, int(entries[0].get("replica_cnt", 1)))
    bad: set[int] = set()
    for g, cnt in groups.items():
        per = len(g) // cnt
        bad |= {g.index(f) // per for f in faulty if f in g}
    if not bad:
        raise ValueError(f"faulty ranks {sorted(faulty)[:16]} are in no reported DP group")
    removed: set[int] = set()
    new_groups = []
    for g, cnt in groups.items():
        if len(bad) >= cnt:
            raise ValueError(f"every optimizer instance of DP group {list(g)[:16]} holds a faulty rank: no "
                             "complete copy of the optimizer state survives (more replicas needed)")
        per = len(g) // cnt
        for k in bad:
            removed |= set(g[k * per:(k + 1) * per])
        new_groups.append([r for r in g if g.index(r) // per not in bad])
    survivors = sorted(r for r in members if r not in removed)
    return survivors, sorted(removed), sorted(new_groups)


class Elastic:
    """The controller's elastic-training state and flows (``Controller.elastic``): the current world's
    members, the removed ranks and their standbys, the layout before the first downgrade, and the
    upgrade. The downgrade itself is the :class:`Downgrade` strategy."""

    def __init__(self, core):
        self.core = core
        self.members: list | None = None     # the ranks of the current torch world (sorted); None: all of them
        self.removed: tuple = ()             # ranks a downgrade took out of the world
        self.standbys: dict = {}             # removed rank -> (ident, pid, host, registered at)
        self.layout: dict | None = None      # rank -> replica list before the first downgrade (for the upgrade)
        self.gone: dict = {}                 # removed rank -> (host, pid) of its old process (never a standby)
        self.upgrade_wanted = False
        self.end: tuple | None = None        # (code, sn): the job ended; every standby is told (tell_standbys)
        self._told: dict = {}                # standby rank -> when it was last told

    def job_ranks(self) -> list:
        """The ranks of the current world (every rank unless a downgrade removed some)."""
        return list(range(self.core.world_size)) if self.members is None else list(self.members)

    def remove_ranks(self, removed: list, survivors: list, replicas: dict) -> None:
        """(driver thread, a downgrade) ``removed`` leave the rank table (removed, not dead); the world is
        ``survivors`` now; the layout before the first downgrade is kept for the upgrade."""
        members = self.job_ranks()
        with self.core.cond:
            if self.layout is None:
                self.layout = {r: replicas[r] for r in members if r in replicas}
            for r in removed:
                old = self.core.ranks.pop(r, None)
                self.core.liveness.seen.pop(r, None)
                if old is not None:
                    self.gone[r] = (old.host, old.pid)
                    if old.registered:
                        self.core.registered -= 1
            self.members, self.removed = survivors, tuple(sorted(set(self.removed) | set(removed)))
            self.core.cond.notify_all()

    def standbys_waiting(self) -> None:
        """After a downgrade: standbys already registered for every removed rank -> upgrade now."""
        if set(self.removed) <= set(self.standbys):
            self.upgrade_wanted = True   # standbys were already waiting
            self.core.incidents.wakeup.set()

    # ---------------------------------------------------------------- standbys (I/O thread)
    def on_standby(self, ident: bytes, rank: int, body, now: float) -> None:
        """A processor registered for a removed rank: a standby offering it back (upgrade)."""
        from ..wire import protocol as P

        if (body.host, body.pid) == self.gone.get(rank):
            return  # the removed rank's own process, exiting (its heartbeat was answered UNKNOWN): no offer
        with self.core.lock:
            first = rank not in self.standbys or self.standbys[rank][1] != body.pid
            self.standbys[rank] = (ident, body.pid, body.host, now)
        if first:  # a standby's heartbeats are answered UNKNOWN (not in the world yet): it says hello again
            self._standby_seen(rank, body)
        self.core.ack_register(ident, rank)
        if self.end is not None:  # the job ended: this standby leaves with its code instead of waiting
            self._tell(rank, ident)
            return
        if set(self.removed) <= set(self.standbys) and self.core.sm.state is State.DOWNGRADE and self.core.incidents.current is None:
            self.upgrade_wanted = True
            self.core.incidents.wakeup.set()

    def tell_standbys(self, code: int, sn: int | None = None) -> None:
        """(any thread) The job ended with ``code``: its exit order, or 0 once every rank of the world left
        after its training finished. A standby waiting in ``wait_for_scale_out`` is in no rank table, so the
        order's targets miss it: each gets the order here, and one that says hello later gets it then
        (:meth:`on_standby`) -- it exits with the job's code, not with 76 after MINDIO_CONTROLLER_LOST_EXIT s
        of a controller gone (issue 13)."""
        sn = self.core.actions.reserve() if sn is None else sn  # (its lock is the controller's)
        with self.core.lock:
            if self.end is None:
                self.end = (code, sn)
            waiting = [(r, v[0]) for r, v in self.standbys.items()]
        for rank, ident in waiting:
            self._tell(rank, ident)

    def _tell(self, rank: int, ident: bytes) -> None:
        """Send the job's exit order to the standby of ``rank`` (at most every 2 heartbeat intervals: it says
        hello every interval until it has it)."""
        from ..wire import protocol as P

        code, sn = self.end
        now = time.monotonic()
        last = self._told.get(rank)
        if last is not None and now - last < 2 * self.core.interval:
            return
        self._told[rank] = now
        _log.warning("the job ended (EXIT(%d)): the standby for removed rank %d leaves with that code", code, rank)
        _logging.event("exit_order_to_standby", standby_rank=rank, code=code)
        self.core.send(rank, P.Action(ActionName.EXIT, {"code": code}), sn=sn, ident=ident)

    def _standby_seen(self, rank: int, body) -> None:
        _log.warning("standby for removed rank %d registered (pid %d on %s); waiting for %s", rank, body.pid,
                     body.host, sorted(set(self.removed) - set(self.standbys))[:16])
        _logging.event("standby_registered", standby_rank=rank, pid=body.pid)

    def upgrade_due(self) -> bool:
        """(driver thread) Standbys registered for every removed rank and no incident is open."""
        return self.upgrade_wanted and self.core.incidents.current is None

    # ---------------------------------------------------------------- upgrade (driver thread)
    def run_upgrade(self) -> bool:
        self.upgrade_wanted = False
        self.core.incidents.wakeup.clear()
        if self.core.incidents.current is not None:  # a fault arrived meanwhile: it goes first
            self.core.incidents.wakeup.set()
            return True
        # a standby says hello every heartbeat interval until it is taken in; one silent for ``misses``
        # intervals is forgotten and the job stays downgraded until another one offers the rank
        limit, now = self.core.misses * self.core.interval, time.monotonic()
        with self.core.lock:  # the I/O thread adds standbys
            silent = [r for r, (_i, _p, _h, t) in self.standbys.items() if now - t > limit]
            for r in silent:
                self.standbys.pop(r, None)
            ready = set(self.removed) <= set(self.standbys)
        for r in silent:
            _log.warning("standby for rank %d silent for more than %.1f s: forgotten", r, limit)
        if not ready:
            return True
        seq = Sequence(self.core, "upgrade", time.monotonic(), first=None,
                       then="the survivors' groups are gone: ending the job")
        survivors, new = self.job_ranks(), sorted(self.removed)
        self.core.sm.fire(Result.UPGRADE, ranks=new)
        for attempt in range(UPGRADE_STOP_TRIES):
            replies = self.core.call(ActionName.STOP, {"timeout": 2.0}, survivors, self.core.action_limit)
            steps = {r: (rep.detail.get("step"), rep.detail.get("data_status")) for r, rep in replies.items()
                     if rep.ok}
            lock = max((s for s, _ in steps.values()), default=0)
            stale = [r for r in survivors if steps.get(r) != (lock, int(OsStatus.UPDATED))]
            if not stale or attempt == UPGRADE_STOP_TRIES - 1 or len(replies) < len(survivors):
                break
            # the stop reached some survivors just before their fence and others just after it: the ones
            # past it wait in the next collective for the fenced ones. Let them all run on, stop again.
            _log.warning("upgrade: the stop caught the survivors at different points (%s); releasing the "
                         "fence and stopping again", {r: steps.get(r) for r in survivors[:8]})
            _logging.event("upgrade_stop_again", steps={str(r): steps.get(r) for r in survivors[:64]})
            self.core.call(ActionName.UNHOLD, {}, survivors, self.core.action_limit)
            time.sleep(0.1 * (attempt + 1))
        seq.mark("stop")
        # what a failed upgrade can still dump: the survivors at the lock step with complete state
        holders = [r for r in survivors if steps.get(r) == (lock, int(OsStatus.UPDATED))]
        ended = lambda: self._upgrade_ended(lock, holders, new)  # noqa: E731 (the failure exits below)
        if stale:
            _log.error("upgrade: survivors %s did not stop at step %d with complete state (%s)", stale[:16], lock,
                       {r: steps.get(r) for r in stale[:8]})
            return self._upgrade_failed(survivors, "stop", ended)
        if not seq.step(ActionName.CLEAN, {"timeout": self.core.action_limit}, survivors, abandon=survivors):
            return ended()
        with self.core.cond:
            for r in new:
                ident, pid, host, _t = self.standbys.pop(r)
                self.core.ranks[r] = RankRecord(r, ident, pid, host, time.monotonic(), step=0)
                self.core.liveness.seen[r] = None
                self.core.registered += 1
            full = sorted(set(survivors) | set(new))
            self.members = None if full == list(range(self.core.world_size)) else full
            self.removed = tuple(sorted(set(self.removed) - set(new)))
        self.core.gen += 1
        if not seq.step(ActionName.ZIT_REBUILD, {"gen": self.core.gen, "members": full, "kind": "upgrade", "rank_list": new},
                        full, abandon=full, mark="rebuild"):
            return ended()
        pairs = _repair_pairs(self.layout or {}, survivors, new)
        if pairs is None:
            return self._upgrade_failed(full, "repair plan", ended)
        involved = sorted({p["src"] for p in pairs} | {p["dst"] for p in pairs})
        if not seq.step(ActionName.ZIT_REPAIR, {"step": lock, "error_ranks": new, "pairs": pairs}, involved, abandon=full,
                        mark="repair"):
            return ended()
        if not seq.step(ActionName.ZIT_ROLLBACK, {"step": lock}, full, abandon=full, mark="rollback"):
            return ended()
        if _knobs.get("MINDIO_DUMP_AFTER_UPGRADE"):
            views = self._lock_views(lock, full, full)
            plan = policy.select_dump_ranks(views, lock)
            if not plan.possible or not dump.save(self.core, lock, plan, views):
                _log.error("upgrade: the checkpoint after the scale-out failed (missing %s)", plan.missing[:4])
            else:
                _logging.event("upgrade_dump", step=lock)
        seq.mark("dump")
        # no incident to close: the upgrade opened none (a fault that arrived meanwhile stays open)
        seq.resume(lock, full, mark=full, close_incident=False, world=len(full))
        seq.done(f"{len(full)} ranks train again", f"new ranks {new[:16]}", ({}, "upgrade"), lock_step=lock,
                 added=new, world=len(full), table=sorted(self.core.ranks)[:64], members=self.job_ranks()[:64])
        return True

    def _upgrade_failed(self, ranks: list, failed: str, ended) -> bool:
        """A failure outside a step (the stop, the repair plan): logged, ``ranks`` cleaned, the job ends."""
        _log.error("upgrade failed at %s; the survivors' groups are gone: ending the job", failed)
        _logging.event("upgrade_failed", step_name=failed)
        sequence.abandon(self.core, ranks, failed)
        return ended()

    def _lock_views(self, lock: int, ranks, writers) -> list:
        """The views of ``ranks`` for a dump of ``lock`` planned on the job's layout: ``writers`` alive with
        complete state at that step, the others out (dead or holding nothing)."""
        layout = self.layout or {}
        return [policy.RankView(r, alive=r in writers, faulty=r not in writers, step=lock,
                                replica=tuple(layout.get(r, ()))) for r in ranks]

    def _upgrade_ended(self, lock: int, holders: list, new: list) -> bool:
        """End the job after a failed upgrade: first the lock step's state from ``holders`` (survivors stopped
        there with complete state; the ``new`` ranks hold nothing yet), written by one holder per shard and
        renamed (dump.save, which re-plans around a holder that cannot write), then EXIT_CODE_DUMPED; when some
        shard has no holder left, a line per shard names why and the job exits EXIT_CODE_FAULT. Never False
        for a job whose state survived: the survivors are the last copies (issue 16)."""
        if "dump" not in self.core.brain.enabled(self.core.job_strategies()):
            _log.error("upgrade failed: the job did not enable 'dump', so the survivors' state at step %d is not "
                       "saved (HIGH_AVAILABILITY / --high-availability)", lock)
            self.core.incidents.exit(EXIT_CODE_FAULT)
            return False
        views = self._lock_views(lock, sorted(set(self.job_ranks()) | set(new)), holders)
        plan = policy.select_dump_ranks(views, lock)
        code = EXIT_CODE_FAULT
        if not plan.possible:
            dump.no_writer(views, lock, plan.missing)
        else:
            _log.warning("upgrade failed: dumping step %d from the survivors before the job ends", lock)
            if dump.save(self.core, lock, plan, views):
                code = EXIT_CODE_DUMPED
                _logging.event("upgrade_failed_dump", step=lock, ranks=list(plan.ranks[:64]))
        self.core.incidents.exit(code)
        return False


class Downgrade(Strategy):
    """Scale in by whole DP slices (module docstring): clean -> zit_rebuild -> rollback -> resume."""

    name = vocab.Strategy.DOWNGRADE.value

    def run(self, core, ctx: Context) -> Outcome:
        # no dump re-plan after a failed downgrade (as before): the incident's plan stands
        return Outcome.RESUMED if self.steps(core, ctx.lock, ctx.views, ctx.t0) else Outcome.FAILED

    def steps(self, core, lock: int, views: list, t_incident: float) -> bool:
        seq = Sequence(core, self.name, t_incident, label="retry")  # its failures were always "retry_failed"
        core.sm.fire(Result.DOWNGRADE, lock_step=lock)
        members = core.elastic.job_ranks()
        faulty = sorted(v.rank for v in views if v.faulty and v.rank in members)
        replicas = {v.rank: [dict(e) for e in v.replica] for v in views}
        try:
            survivors, removed, dp_groups = plan_downgrade(replicas, members, faulty)
        except ValueError as exc:
            _log.error("downgrade impossible: %s", exc)
            return seq.fail("plan")
        live = set(sequence.live_ranks(core))
        bad = [v.rank for v in views if v.rank in survivors and not (
            v.rank in live and v.step == lock and v.data_status == OsStatus.UPDATED)]
        if bad:
            _log.error("downgrade: survivors %s are dead or not at the lock step %d with complete optimizer "
                       "state", bad[:16], lock)
            return seq.fail("survivors")
        _log.warning("downgrade: removing ranks %s (DP slices of faulty %s); %d ranks go on", removed[:16],
                     faulty[:16], len(survivors))
        if not seq.step(ActionName.CLEAN, {"timeout": core.action_limit}, survivors):
            return False
        leaving = sorted(r for r in removed if r in live)
        if leaving:
            core.call(ActionName.EXIT, {"code": EXIT_CODE_REMOVED}, leaving, 10.0)
        core.elastic.remove_ranks(removed, survivors, replicas)
        core.gen += 1
        params = {"gen": core.gen, "members": survivors, "kind": "downgrade", "dp_groups": dp_groups}
        if not seq.step(ActionName.ZIT_REBUILD, params, survivors, abandon=survivors, mark="rebuild"):
            return False
        if not seq.step(ActionName.ROLLBACK, {"step": lock}, survivors, abandon=survivors):
            return False
        seq.resume(lock, survivors, mark=survivors, world=len(survivors))
        seq.done(f"{len(survivors)} ranks train again", f"removed {removed[:16]}",
                 ({r: 1 for r in faulty}, self.name), lock_step=lock, removed=removed, world=len(survivors),
                 table=sorted(core.ranks)[:64], members=core.elastic.job_ranks()[:64])
        core.elastic.standbys_waiting()
        return True


def _repair_pairs(layout: dict, survivors: list, new: list) -> list | None:
    """For every new rank and optimizer type, a surviving replica of the same shard (original layout)."""
    pairs = []
    for dst in new:
        for t, entry in enumerate(layout.get(dst) or ()):
            group, cnt = sorted(entry["rank_list"]), max(1, int(entry.get("replica_cnt", 1)))
            per = len(group) // cnt
            j = group.index(dst) % per
            srcs = [group[j + k * per] for k in range(cnt) if group[j + k * per] in survivors]
            if not srcs:
                _log.error("upgrade: no surviving replica of shard %d (type %d) for rank %d", j, t, dst)
                return None
            pairs.append({"type": t, "src": srcs[0], "dst": dst})
        if not layout.get(dst):
            _log.error("upgrade: the optimizer layout of rank %d is unknown", dst)
            return None
    return pairs
