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
ends the job (EXIT_CODE_FAULT) -- the survivors' groups are gone by then.

The rank side (the zit actions a processor runs) is in elastic_rank.py, the standby process in
standby.py; mindio.ttp.elastic is the public module that names them all. This module imports neither
(controller-side code never reaches into the rank side).
"""
from __future__ import annotations

import logging
import time

from .. import _knobs, _logging
from . import policy, sequence
from ._enums import EXIT_CODE_FAULT, EXIT_CODE_REMOVED, OsStatus
from .ranks import RankRecord
from .states import Result, State

__all__ = ["ElasticFlow", "plan_downgrade", "UPGRADE_STOP_TRIES", "EXIT_CODE_REMOVED"]

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


class ElasticFlow:
    """Controller side; mixed into :class:`mindio.ttp.controller.Controller`."""

    members: list | None = None     # the ranks of the current torch world (sorted); None: all of them
    removed: tuple = ()             # ranks a downgrade took out of the world
    _standbys: dict | None = None   # removed rank -> (ident, pid, host, registered at)
    _layout: dict | None = None     # rank -> replica list before the first downgrade (for the upgrade)
    _gone: dict | None = None       # removed rank -> (host, pid) of its old process (never a standby)
    _upgrade_due = False

    def job_ranks(self) -> list:
        """The ranks of the current world (every rank unless a downgrade removed some)."""
        return list(range(self.world_size)) if self.members is None else list(self.members)

    # ---------------------------------------------------------------- downgrade (driver thread)
    def _run_downgrade(self, ctx: dict):
        return True if self._downgrade(ctx["lock"], ctx["views"], ctx["t0"]) else None

    def _downgrade(self, lock: int, views: list, t_incident: float) -> bool:
        marks = {"decide": time.monotonic()}
        self.sm.fire(Result.DOWNGRADE, lock_step=lock)
        members = self.job_ranks()
        faulty = sorted(v.rank for v in views if v.faulty and v.rank in members)
        replicas = {v.rank: [dict(e) for e in v.replica] for v in views}
        try:
            survivors, removed, dp_groups = plan_downgrade(replicas, members, faulty)
        except ValueError as exc:
            _log.error("downgrade impossible: %s", exc)
            self.sm.fire(Result.FAIL, failed="plan")
            return False
        live = set(sequence.live_ranks(self))
        bad = [v.rank for v in views if v.rank in survivors and not (
            v.rank in live and v.step == lock and v.data_status == OsStatus.UPDATED)]
        if bad:
            _log.error("downgrade: survivors %s are dead or not at the lock step %d with complete optimizer "
                       "state", bad[:16], lock)
            self.sm.fire(Result.FAIL, failed="survivors")
            return False
        _log.warning("downgrade: removing ranks %s (DP slices of faulty %s); %d ranks go on", removed[:16],
                     faulty[:16], len(survivors))
        if not self._step_ok("clean", {"timeout": self.action_limit}, survivors):
            self.sm.fire(Result.FAIL, failed="clean")
            return False
        marks["clean"] = time.monotonic()
        leaving = sorted(r for r in removed if r in live)
        if leaving:
            self._call("exit", {"code": EXIT_CODE_REMOVED}, leaving, 10.0)
        with self._cond:
            if self._layout is None:
                self._layout = {r: replicas[r] for r in members if r in replicas}
            if self._gone is None:
                self._gone = {}
            for r in removed:
                old = self.ranks.pop(r, None)
                self._seen.pop(r, None)
                if old is not None:
                    self._gone[r] = (old.host, old.pid)
                    if old.registered:
                        self._registered -= 1
            self.members, self.removed = survivors, tuple(sorted(set(self.removed) | set(removed)))
            self._cond.notify_all()
        self.gen += 1
        params = {"gen": self.gen, "members": survivors, "kind": "downgrade", "dp_groups": dp_groups}
        if not self._step_ok("zit_rebuild", params, survivors):
            return sequence.abandon(self, survivors, "zit_rebuild")
        marks["rebuild"] = time.monotonic()
        if not self._step_ok("rollback", {"step": lock}, survivors):
            return sequence.abandon(self, survivors, "rollback")
        marks["rollback"] = time.monotonic()
        sequence.resume(self, lock, survivors, self.action_limit, mark=survivors, world=len(survivors))
        marks["resume"] = time.monotonic()
        total, parts = sequence.phases(t_incident, marks, ["decide", "clean", "rebuild", "rollback", "resume"])
        _log.warning("downgrade done: %d ranks train again %.3f s after the fault (%s), generation %d, lock step "
                     "%d, removed %s", len(survivors), total, parts, self.gen, lock, removed[:16])
        _logging.event("downgrade_done", total_s=round(total, 6), lock_step=lock, gen=self.gen, removed=removed,
                       world=len(survivors), table=sorted(self.ranks)[:64], members=self.job_ranks()[:64], **{f"{k}_s": v for k, v in parts.items()})
        self._mindx_call("report_result", 0, "downgrade done", {r: 1 for r in faulty}, "downgrade")
        if set(self.removed) <= set(self._standbys or {}):
            self._upgrade_due = True   # standbys were already waiting
            self._incident_evt.set()
        return True

    # ---------------------------------------------------------------- standbys (I/O thread)
    def _on_standby(self, ident: bytes, rank: int, body, now: float) -> None:
        """A processor registered for a removed rank: a standby offering it back (upgrade)."""
        from . import protocol as P

        if (body.host, body.pid) == (self._gone or {}).get(rank):
            return  # the removed rank's own process, exiting (its heartbeat was answered UNKNOWN): no offer
        with self._lock:
            if self._standbys is None:
                self._standbys = {}
            first = rank not in self._standbys or self._standbys[rank][1] != body.pid
            self._standbys[rank] = (ident, body.pid, body.host, now)
        if first:  # a standby's heartbeats are answered UNKNOWN (not in the world yet): it says hello again
            self._standby_seen(rank, body)
        self._chan.send(P.Envelope(P.MsgType.REGISTER_ACK, P.RegisterAck(gen=self.gen, interval=self.interval,
                                                                         backups=list(self.backups)),
                                   rank=rank), ident)
        if set(self.removed) <= set(self._standbys) and self.sm.state is State.DOWNGRADE and self._incident is None:
            self._upgrade_due = True
            self._incident_evt.set()

    def _standby_seen(self, rank: int, body) -> None:
        _log.warning("standby for removed rank %d registered (pid %d on %s); waiting for %s", rank, body.pid,
                     body.host, sorted(set(self.removed) - set(self._standbys))[:16])
        _logging.event("standby_registered", standby_rank=rank, pid=body.pid)

    def upgrade_due(self) -> bool:
        """(driver thread) Standbys registered for every removed rank and no incident is open."""
        return self._upgrade_due and self._incident is None

    # ---------------------------------------------------------------- upgrade (driver thread)
    def _run_upgrade(self) -> bool:
        self._upgrade_due = False
        self._incident_evt.clear()
        if self._incident is not None:  # a fault arrived meanwhile: it goes first
            self._incident_evt.set()
            return True
        # a standby says hello every heartbeat interval until it is taken in; one silent for ``misses``
        # intervals is forgotten and the job stays downgraded until another one offers the rank
        limit, now = self.misses * self.interval, time.monotonic()
        with self._lock:  # the I/O thread adds standbys
            silent = [r for r, (_i, _p, _h, t) in (self._standbys or {}).items() if now - t > limit]
            for r in silent:
                self._standbys.pop(r, None)
            ready = set(self.removed) <= set(self._standbys or {})
        for r in silent:
            _log.warning("standby for rank %d silent for more than %.1f s: forgotten", r, limit)
        if not ready:
            return True
        t0 = time.monotonic()
        marks = {}
        survivors, new = self.job_ranks(), sorted(self.removed)
        self.sm.fire(Result.UPGRADE, ranks=new)
        for attempt in range(UPGRADE_STOP_TRIES):
            replies = self._call("stop", {"timeout": 2.0}, survivors, self.action_limit)
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
            self._call("unhold", {}, survivors, self.action_limit)
            time.sleep(0.1 * (attempt + 1))
        marks["stop"] = time.monotonic()
        if stale or not self._step_ok("clean", {"timeout": self.action_limit}, survivors):
            _log.error("upgrade: survivors %s did not stop at step %d with complete state (%s)", stale[:16], lock,
                       {r: steps.get(r) for r in stale[:8]})
            return self._upgrade_failed(survivors, "stop")
        marks["clean"] = time.monotonic()
        with self._cond:
            for r in new:
                ident, pid, host, _t = self._standbys.pop(r)
                self.ranks[r] = RankRecord(r, ident, pid, host, time.monotonic(), step=0)
                self._seen[r] = None
                self._registered += 1
            full = sorted(set(survivors) | set(new))
            self.members = None if full == list(range(self.world_size)) else full
            self.removed = tuple(sorted(set(self.removed) - set(new)))
        self.gen += 1
        if not self._step_ok("zit_rebuild", {"gen": self.gen, "members": full, "kind": "upgrade",
                                             "rank_list": new}, full):
            return self._upgrade_failed(full, "zit_rebuild")
        marks["rebuild"] = time.monotonic()
        pairs = _repair_pairs(self._layout or {}, survivors, new)
        if pairs is None:
            return self._upgrade_failed(full, "repair plan")
        involved = sorted({p["src"] for p in pairs} | {p["dst"] for p in pairs})
        if not self._step_ok("zit_repair", {"step": lock, "error_ranks": new, "pairs": pairs}, involved):
            return self._upgrade_failed(full, "zit_repair")
        marks["repair"] = time.monotonic()
        if not self._step_ok("zit_rollback", {"step": lock}, full):
            return self._upgrade_failed(full, "zit_rollback")
        marks["rollback"] = time.monotonic()
        if _knobs.get("MINDIO_DUMP_AFTER_UPGRADE"):
            views = [policy.RankView(r, True, False, lock, 0, tuple((self._layout or {}).get(r, ())))
                     for r in full]
            plan = policy.select_dump_ranks(views, lock)
            if not plan.possible or not self._dump(lock, plan):
                _log.error("upgrade: the checkpoint after the scale-out failed (missing %s)", plan.missing[:4])
            else:
                _logging.event("upgrade_dump", step=lock)
        marks["dump"] = time.monotonic()
        # no incident to close: the upgrade opened none (a fault that arrived meanwhile stays open)
        sequence.resume(self, lock, full, self.action_limit, mark=full, close_incident=False, world=len(full))
        marks["resume"] = time.monotonic()
        total, parts = sequence.phases(t0, marks, ["stop", "clean", "rebuild", "repair", "rollback", "dump", "resume"])
        _log.warning("upgrade done: %d ranks train again after %.3f s (%s), generation %d, lock step %d, new "
                     "ranks %s", len(full), total, parts, self.gen, lock, new[:16])
        _logging.event("upgrade_done", total_s=round(total, 6), lock_step=lock, gen=self.gen, added=new,
                       world=len(full), table=sorted(self.ranks)[:64], members=self.job_ranks()[:64], **{f"{k}_s": v for k, v in parts.items()})
        self._mindx_call("report_result", 0, "upgrade done", {}, "upgrade")
        return True

    def _upgrade_failed(self, ranks: list, failed: str) -> bool:
        _log.error("upgrade failed at %s; the survivors' groups are gone: ending the job", failed)
        _logging.event("upgrade_failed", step_name=failed)
        sequence.abandon(self, ranks, failed)
        self._exit(EXIT_CODE_FAULT)
        return False


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
