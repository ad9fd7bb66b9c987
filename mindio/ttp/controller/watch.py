"""How the controller finds dead and hung ranks (:class:`Liveness`, the controller's ``liveness``).

A rank is declared dead when it has been silent for ``misses * interval`` s of time the controller
could observe (``sweep`` on the I/O thread; time in which that thread did not run -- its process
stopped or starved -- is not counted, ``stalled``, and nothing is declared while its own inbound queue
is behind), or at once when another detector reports it (``declare_dead``: the same-host pid probe,
the launcher agent, a lost node). A silent rank whose process runs on this host and is alive and not
stopped (a rank in the controller's own process always is) is starved of CPU, not dead: it gets up to
``MINDIO_HANG_TIMEOUT`` s (``_starved``), then is SIGKILLed through its pidfd and declared dead. A rank making no progress outside a collective for
``MINDIO_HANG_TIMEOUT`` s is ordered SIGKILLed; progress is counted from the moment the controller last
entered NORMAL at the earliest (a rank parked by a recovery is not hung); the bound and the culprit
(the rank that never entered the collective its peers wait in) come from hangs.py. ``heard`` tells whether ranks still beat (ha.py uses it
before it declares a lost node's ranks dead).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from ... import _logging
from .._enums import ActionName
from . import hangs, slow
from .ranks import Watched
from ..wire import protocol as P
from .pidprobe import PidProbe
from .states import State

__all__ = ["Liveness"]

_log = logging.getLogger("mindio.ttp.controller")


class Liveness:
    """The controller's liveness watch (``Controller.liveness``; module docstring). It owns the order in
    which ranks were last heard (``seen``), the same-host pid probe, and what it logged of starved
    ranks; it reads the rank table and opens incidents through the controller."""

    def __init__(self, core):
        self.core = core
        # the ranks the sweep watches: the rank table's ``watched`` column (ranks.py), whose sweep is one
        # vector comparison of the beat times (RankTable.expired)
        self.seen = Watched(lambda: core.ranks)
        self.probe = PidProbe()  # same-host ranks: death seen through a pidfd (pidprobe.py)
        self.starved_logged: dict[int, float] = {}  # rank -> last_seen when its starvation was logged
        self.lagging = False  # the controller's inbound queue is behind: no death declared meanwhile
        # the stalls compensated (stalled), latest last: (when the I/O thread resumed, stall in s); a reader
        # comparing wall time with a rank's window subtracts those that fall inside it
        self.stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self.hang = hangs.HangBound(core.hang_timeout, core.hang_fixed)  # the bound of a stall (hangs.py)
        self.slow = slow.SlowScores()  # slow ranks from the step anatomy (slow.py)

    def touch(self, rank: int) -> None:
        """(I/O thread) A frame of live ``rank`` arrived: it goes to the end of the order."""
        self.core.ranks.watched[rank] = True

    def gap(self, rank: int, silent: float) -> None:
        """(I/O thread) Live ``rank`` beat again after ``silent`` s without a frame (more than 1.5
        intervals): an outage or stall it survived. One ``heartbeat_gap`` event, so that a drill or an
        operator sees how close to MINDIO_HEARTBEAT_MISSES x INTERVAL the outages came (docs/recovery.md)."""
        _logging.event("heartbeat_gap", from_rank=rank, silent_s=round(silent, 3))

    def stalled(self, gap: float) -> None:
        """(I/O thread) This thread did not run for ``gap`` s (its process stopped or starved: a loop
        turn takes at most ``period``). Silence we could not observe is not a rank's fault: every rank's
        clock moves on by ``gap``, so each gets its full ``misses * interval`` after we resume (frames
        still in the kernel or in zmq's own queues arrive meanwhile)."""
        _log.warning("controller I/O thread did not run for %.1f s (process stalled?); heartbeat silence in "
                     "that time is not counted", gap)
        _logging.event("controller_stalled", stall_s=round(gap, 3))
        self.stalls.append((time.monotonic(), gap))
        self.core.ranks.shift_clock(gap)

    def sweep(self, now: float, check_hang: bool) -> None:
        core = self.core
        if not core.active:
            self._forget_gone(now)
            link = core.primary_link()
            n = core.registered
            # more than half of the ranks, or the launcher's quorum (mindio/launch/backup.py: node 0 lost)
            quorum = core.takeover_quorum if core.takeover_quorum is not None else core.world_size // 2 + 1
            if link is not None and link.failovers and not link.registered.is_set() and n >= quorum:
                core.take_over(now, n)
            return
        limit = self.core.misses * self.core.interval
        if now - self.core.drained_at > self.core.interval:
            # our own inbound queue is behind: the missing heartbeats may be sitting in it. Never blame
            # ranks for the controller's backlog; declare deaths once we have caught up.
            if not self.lagging:
                _log.warning("controller is %.1f s behind its inbound queue; liveness checks paused",
                             now - self.core.drained_at)
            self.lagging = True
            return
        self.lagging = False
        dead, table = [], self.core.ranks
        for rank in table.expired(now, limit).tolist():  # a vector comparison; the loop: the expired only
            r = table[rank]
            if not self._starved(r, now):  # a starved rank stays watched: looked at again next sweep
                table.watched[rank] = False
                dead.append(r)
        if dead:  # one log line for a mass death (a lost node or switch), one event per rank
            _log.error("%d rank(s) missed %d heartbeats (%.2f s): declared dead: %s%s", len(dead), self.core.misses,
                       now - dead[0].last_seen, [r.rank for r in dead[:16]], " ..." if len(dead) > 16 else "")
            self.declare_dead([r.rank for r in dead], "heartbeat", log=False,
                              silent_s={r.rank: round(now - r.last_seen, 3) for r in dead})
        if check_hang and self.core.hang_timeout > 0 and self.core.sm.state is State.NORMAL:
            self._check_hangs(now)
        if check_hang and self.slow.window > 0:  # once a heartbeat interval, as the hang check
            self.check_slow()

    def check_slow(self) -> None:
        """(I/O thread: each heartbeat interval, and when a rank's beat says it timed a window's steps)
        Report a slow rank (slow.py); a window never spans a recovery or a pause."""
        if self.core.sm.state is not State.NORMAL:
            self.slow.reset()
            return
        for found in self.slow.check(self.core.ranks.ranks_where(alive=True, registered=True)):
            if found.group:  # cause communication: a process group, not a rank
                self._slow_group(found)
                continue
            s = self.slow.scores.get(found.rank, {})
            _log.warning("rank %d is slow (cause %s): %.3f s of its own time per step (compute, or stopped from "
                         "outside), %.2fx its peers' median, while they wait for it (MINDIO_SLOW_WINDOW %d steps, "
                         "MINDIO_SLOW_RATIO %.2f, MINDIO_SLOW_K %d)", found.rank, found.cause, s.get("own_s", 0.0),
                         found.ratio, self.slow.window, self.slow.ratio, self.slow.k)
            _logging.event("rank_slow", slow_rank=found.rank, cause=found.cause, ratio=found.ratio,
                           at_step=self.core.ranks[found.rank].step, **{k: v for k, v in s.items() if k != "wait"})
            if self.slow.action == "switch":  # sub-healthy: to a new process, as a cluster brain would ask
                threading.Thread(target=self._switch_out, args=(found.rank,), name="mindio-slow-switch",
                                 daemon=True).start()

    def _slow_group(self, found) -> None:
        """Report a process group whose collectives are slow (slow.py): a link or a switch, not a rank --
        nothing to hot-switch; the operator (or a cluster brain reading the event) acts."""
        g = self.slow.groups.get(found.group, {})
        _log.warning("process group %s (ranks %s%s) is slow (cause communication): its members wait %.3f s per "
                     "step in its collectives, %.2fx its usual wait (%.3f s), while their own time per step is "
                     "as before (MINDIO_SLOW_WINDOW %d steps, MINDIO_SLOW_RATIO %.2f, MINDIO_SLOW_K %d)%s",
                     found.group, list(found.ranks[:16]), " ..." if len(found.ranks) > 16 else "",
                     g.get("wait_s", 0.0), found.ratio, g.get("floor_wait_s", 0.0), self.slow.window,
                     self.slow.ratio, self.slow.k,
                     "; not switched: no rank is slow" if self.slow.action == "switch" else "")
        steps = [self.core.ranks[r].step for r in found.ranks if r in self.core.ranks]
        _logging.event("rank_slow", cause="communication", ratio=found.ratio, group=found.group,
                       ranks=list(found.ranks), at_step=max(steps, default=-1),
                       **{k: v for k, v in g.items() if k != "ranks"})

    def _switch_out(self, rank: int) -> None:
        """(its own thread: the hot switch's request takes the controller's lock) Hot-switch a slow rank."""
        rc = self.core.hot_switch.notify_prepare_action("hot switch", [rank])
        _log.warning("rank %d is sub-healthy (slow, MINDIO_SLOW_ACTION=switch): hot switch %s", rank,
                     "under way" if rc == 0 else "refused (reported only)")
        _logging.event("slow_switch", slow_rank=rank, accepted=rc == 0)

    def _check_hangs(self, now: float) -> None:
        """(I/O thread, NORMAL) Kill the ranks stalled past the hang bound that the job waits for
        (hangs.py). The progress clock restarts when the state (re)enters NORMAL: a rank paused by a
        recovery, or whose last beat still carries the age from before it, is not hung."""
        normal_for, table = now - self.core.sm.since, self.core.ranks
        alive = table.mask(alive=True)
        bound = self.hang.current(table.col["step_p99"][alive])
        ages = table.col["progress_age"][alive]  # as of each rank's last beat: + the time since it (now)
        ages = np.where(ages >= 0, ages + (now - table.col["beat_seen"][alive]), ages)  # (negative: not armed)
        if bound <= 0 or not np.any(np.minimum(ages, normal_for) >= bound):
            return  # nobody stalled past the bound (a vector test): no culprit to look for
        live = [table[r] for r in np.flatnonzero(alive).tolist()]
        heard_ago = {r.rank: now - r.beat_seen for r in live}  # its last beat (a reply carries no evidence)
        seqs = table.coll_seqs([r.rank for r in live])  # each relay frame's packed numbers unpacked once
        views = [(r.rank, min(r.progress_age + heard_ago[r.rank], normal_for) if r.progress_age >= 0
                  else r.progress_age, r.in_collective, r.step, seq) for r, seq in zip(live, seqs)]
        idle = {r.rank: r.idle_age for r in live}
        for hung in hangs.find_culprits(views, bound, need_waiter=not self.hang.fixed, idle=idle,
                                        patient=self.hang.base, heard_ago=heard_ago):
            rank = hung.rank
            _log.error("rank %d hung: no step progress for %.1f s (hang bound%s) and %s: ordering SIGKILL",
                       rank, bound, "" if self.hang.fixed else " from the job's step times", hung.why())
            seen = {v[0]: v for v in views}  # the evidence the decision rests on, for the culprit and 8 waiters
            _logging.event("rank_hung", hung_rank=rank, bound_s=round(bound, 3), group=hung.group, seq=hung.seq,
                           waiting=hung.waiting[:64], evidence={
                               str(q): {"age_s": round(seen[q][1], 3), "heard_ago_s": round(heard_ago[q], 3),
                                        "idle_s": round(idle[q], 3), "seqs": seen[q][4]}
                               for q in [rank] + hung.waiting[:8] if q in seen})
            self.core.send(rank, P.Action(ActionName.KILL, {"reason": "hung"}))
            with self.core.cond:
                self.core.ranks[rank].alive = False
                self.core.ranks[rank].faulty = True
            self.core.incidents.open(rank, None)

    def _forget_gone(self, now: float) -> None:
        """(I/O thread, a passive backup) Ranks registered here -- their links failed over to us -- that
        have not been heard for ``misses * interval`` s went back to the primary once it answered again
        (wire/home.py), or died: they no longer count towards a takeover, their sessions end and their held
        reports are dropped (the primary has them). If this backup takes over later, it waits for them
        again and the sweep declares dead those that never come (``Controller._take_over``)."""
        core, limit, gone = self.core, self.core.misses * self.core.interval, []
        with core.cond:
            for rank in core.ranks.expired(now, limit, alive=False).tolist():
                r = core.ranks[rank]
                core.ranks.watched[rank] = False
                if r.registered:
                    r.registered = False
                    core.registered -= 1
                    if r.ident:
                        core.sessions.close(r.ident)
                    r.ident = b""
                    gone.append(r.rank)
            if gone:
                core.held_reports = [h for h in core.held_reports if h[0] not in gone]
        if gone:
            _log.info("passive backup: rank(s) %s not heard for %.1f s (MINDIO_HEARTBEAT_MISSES x "
                      "MINDIO_HEARTBEAT_INTERVAL): back with the primary, or gone; no longer counted for a takeover",
                      gone[:16], limit)
            _logging.event("backup_forgot", ranks=gone[:64])

    def _starved(self, r, now: float) -> bool:
        """Is silent rank ``r`` only starved of CPU? Its process runs on this host and is alive and not
        stopped (pidprobe.PidProbe.runnable), and it has been silent for less than MINDIO_HANG_TIMEOUT
        (0: no such grace). Past that it is SIGKILLed through its pidfd (a process whose link thread
        cannot run for that long is hung) and declared dead by the caller."""
        silent = now - r.last_seen
        pid = self.probe.runnable(r.rank) if self.core.hang_timeout > 0 else 0
        if not pid:
            return False
        if silent < self.core.hang_timeout:
            if self.starved_logged.get(r.rank) != r.last_seen:
                self.starved_logged[r.rank] = r.last_seen
                _log.warning("rank %d silent for %.1f s, but its process %d on this host is alive and not stopped: "
                             "starved of CPU, not dead (hung after MINDIO_HANG_TIMEOUT=%.0f s)", r.rank, silent,
                             pid, self.core.hang_timeout)
                _logging.event("rank_starved", starved_rank=r.rank, pid=pid, silent_s=round(silent, 3))
            return True
        _log.error("rank %d silent for %.0f s with its process %d alive: hung; SIGKILL", r.rank, silent, pid)
        self.probe.kill(r.rank)
        return False

    def declare_dead(self, ranks, cause: str, log: bool = True, **detail) -> list[int]:
        """(any thread) Ranks ``ranks`` are dead because of ``cause`` ("heartbeat": missed beats, "pid": the
        same-host process probe saw the process exit, "agent": the launcher agent saw the worker exit, ...).
        Marks each live one dead and faulty, wakes the action engine (so no action waits for it), writes one
        ``rank_dead`` event per rank and opens (or joins) the incident. Returns the ranks newly declared;
        ranks already dead or unknown are ignored, so several detectors may report the same death."""
        newly = []
        with self.core.cond:
            for rank in ranks:
                r = self.core.ranks.get(rank)
                if r is not None and r.alive:
                    r.alive, r.faulty = False, True
                    newly.append(rank)
            if newly:
                self.core.actions.lost(newly)
                self.core.cond.notify_all()
        if newly and self.core.sm.state in (State.EXIT, State.FINAL):
            # the controller ordered every rank to exit: a process ending now carries that order out (no
            # fault, no incident); marked dead above only so that no action waits for its reply
            _log.info("rank(s) %s gone after the exit order (%s)", newly[:16], cause)
            return []
        if newly and log:
            _log.error("rank(s) %s%s declared dead (%s)", newly[:16], " ..." if len(newly) > 16 else "", cause)
        per_rank = {k: v for k, v in detail.items() if isinstance(v, dict)}
        common = {k: v for k, v in detail.items() if not isinstance(v, dict)}
        for rank in newly:
            _logging.event("rank_dead", dead_rank=rank, cause=cause, **common,
                           **{k: v[rank] for k, v in per_rank.items() if rank in v})
            self.core.incidents.open(rank, None)
        return newly

    def heard(self, ranks, within: float) -> list[int]:
        """(any thread) Those of ``ranks`` that are alive, registered, and sent a frame in the last ``within``
        seconds (of this controller's observed time: see :meth:`stalled`)."""
        now = time.monotonic()
        with self.core.lock:
            t = self.core.ranks
            ranks = [r for r in ranks if r in t]
            idx = np.asarray(ranks, np.int64)
            ok = t.col["alive"][idx] & t.col["registered"][idx] & (now - t.col["last_seen"][idx] <= within)
            return np.asarray(ranks, np.int64)[ok].tolist()
