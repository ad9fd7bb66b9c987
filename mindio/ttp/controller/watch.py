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
import time

from ... import _logging
from . import hangs, slow
from ..wire import protocol as P
from .._enums import ActionName
from .pidprobe import PidProbe
from .states import State

__all__ = ["Liveness"]

_log = logging.getLogger("mindio.ttp.controller")


class Liveness:
    """The controller's liveness watch (``Controller.liveness``; module docstring). It owns the order in
    which ranks were last heard (``seen``), the same-host pid probe, and what it logged of starved
    ranks; it reads the rank table and opens incidents through the controller."""

    def __init__(self, ctl):
        self.ctl = ctl
        # live ranks, least recently heard first: a frame moves its rank to the end, so the sweep looks
        # only at the front (O(expired) per sweep instead of O(world))
        self.seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.probe = PidProbe()  # same-host ranks: death seen through a pidfd (pidprobe.py)
        self.starved_logged: dict[int, float] = {}  # rank -> last_seen when its starvation was logged
        self.lagging = False  # the controller's inbound queue is behind: no death declared meanwhile
        # the stalls compensated (stalled), latest last: (when the I/O thread resumed, stall in s); a reader
        # comparing wall time with a rank's window subtracts those that fall inside it
        self.stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self.hang = hangs.HangBound(ctl.hang_timeout, ctl.hang_fixed)  # the bound of a stall (hangs.py)
        self.slow = slow.SlowScores()  # slow ranks from the step anatomy (slow.py)

    def touch(self, rank: int) -> None:
        """(I/O thread) A frame of live ``rank`` arrived: it goes to the end of the order."""
        seen = self.seen
        seen[rank] = None
        seen.move_to_end(rank)

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
        for r in list(self.ctl.ranks.values()):
            r.last_seen += gap

    def sweep(self, now: float, check_hang: bool) -> None:
        ctl = self.ctl
        if not ctl.active:
            self._forget_gone(now)
            link = ctl._primary_link
            n = ctl._registered
            # more than half of the ranks, or the launcher's quorum (mindio/launch/backup.py: node 0 lost)
            quorum = ctl.takeover_quorum if ctl.takeover_quorum is not None else ctl.world_size // 2 + 1
            if link is not None and link.failovers and not link.registered.is_set() and n >= quorum:
                ctl._take_over(now, n)
            return
        limit = self.ctl.misses * self.ctl.interval
        if now - self.ctl._drained_at > self.ctl.interval:
            # our own inbound queue is behind: the missing heartbeats may be sitting in it. Never blame
            # ranks for the controller's backlog; declare deaths once we have caught up.
            if not self.lagging:
                _log.warning("controller is %.1f s behind its inbound queue; liveness checks paused",
                             now - self.ctl._drained_at)
            self.lagging = True
            return
        self.lagging = False
        dead, starved = [], []
        while self.seen:
            r = self.ctl.ranks[next(iter(self.seen))]
            if r.alive and now - r.last_seen <= limit:
                break
            self.seen.popitem(last=False)
            if r.alive and self._starved(r, now):
                starved.append(r.rank)
            elif r.alive:
                dead.append(r)
        for rank in starved:  # looked at again once the ranks that beat meanwhile are behind it
            self.seen[rank] = None
        if dead:  # one log line for a mass death (a lost node or switch), one event per rank
            _log.error("%d rank(s) missed %d heartbeats (%.2f s): declared dead: %s%s", len(dead), self.ctl.misses,
                       now - dead[0].last_seen, [r.rank for r in dead[:16]], " ..." if len(dead) > 16 else "")
            self.declare_dead([r.rank for r in dead], "heartbeat", log=False,
                              silent_s={r.rank: round(now - r.last_seen, 3) for r in dead})
        if check_hang and self.ctl.hang_timeout > 0 and self.ctl.sm.state is State.NORMAL:
            self._check_hangs(now)
        if check_hang and self.slow.window > 0:  # once a heartbeat interval, as the hang check
            self._check_slow()

    def _check_slow(self) -> None:
        """(I/O thread) Report a slow rank (slow.py); a window never spans a recovery or a pause."""
        if self.ctl.sm.state is not State.NORMAL:
            self.slow.base.clear()
            return
        for found in self.slow.check([r.rank for r in self.ctl.ranks.values() if r.alive and r.registered]):
            s = self.slow.scores.get(found.rank, {})
            _log.warning("rank %d is slow (cause %s): %.3f s of compute per step, %.2fx its peers' median, "
                         "while they wait for it (MINDIO_SLOW_WINDOW %d steps, MINDIO_SLOW_RATIO %.2f, "
                         "MINDIO_SLOW_K %d)", found.rank, found.cause, s.get("compute_s", 0.0), found.ratio,
                         self.slow.window, self.slow.ratio, self.slow.k)
            _logging.event("rank_slow", slow_rank=found.rank, cause=found.cause, ratio=found.ratio,
                           at_step=self.ctl.ranks[found.rank].step, **{k: v for k, v in s.items() if k != "wait"})

    def _check_hangs(self, now: float) -> None:
        """(I/O thread, NORMAL) Kill the ranks stalled past the hang bound that the job waits for
        (hangs.py). The progress clock restarts when the state (re)enters NORMAL: a rank paused by a
        recovery, or whose last beat still carries the age from before it, is not hung."""
        normal_for = now - self.ctl.sm.since
        live = [r for r in self.ctl.ranks.values() if r.alive]
        bound = self.hang.current(r.step_p99 for r in live)
        views = [(r.rank, min(r.progress_age, normal_for) if r.progress_age >= 0 else r.progress_age,
                  r.in_collective, r.step, r.coll_seq) for r in live]
        idle = {r.rank: r.idle_age for r in live}
        for hung in hangs.find_culprits(views, bound, need_waiter=not self.hang.fixed, idle=idle,
                                        patient=self.hang.base):
            rank = hung.rank
            _log.error("rank %d hung: no step progress for %.1f s (hang bound%s) and %s: ordering SIGKILL",
                       rank, bound, "" if self.hang.fixed else " from the job's step times", hung.why())
            _logging.event("rank_hung", hung_rank=rank, bound_s=round(bound, 3), group=hung.group, seq=hung.seq,
                           waiting=hung.waiting[:64])
            self.ctl._send(rank, P.Action(ActionName.KILL, {"reason": "hung"}))
            with self.ctl._cond:
                self.ctl.ranks[rank].alive = False
                self.ctl.ranks[rank].faulty = True
            self.ctl.incidents.open(rank, None)

    def _forget_gone(self, now: float) -> None:
        """(I/O thread, a passive backup) Ranks registered here -- their links failed over to us -- that
        have not been heard for ``misses * interval`` s went back to the primary once it answered again
        (wire/home.py), or died: they no longer count towards a takeover, their sessions end and their held
        reports are dropped (the primary has them). If this backup takes over later, it waits for them
        again and the sweep declares dead those that never come (``Controller._take_over``)."""
        ctl, limit, gone = self.ctl, self.ctl.misses * self.ctl.interval, []
        with ctl._cond:
            while self.seen:
                r = ctl.ranks[next(iter(self.seen))]
                if now - r.last_seen <= limit:
                    break
                self.seen.popitem(last=False)
                if r.registered:
                    r.registered = False
                    ctl._registered -= 1
                    if r.ident:
                        ctl.sessions.close(r.ident)
                    r.ident = b""
                    gone.append(r.rank)
            if gone:
                ctl._held_reports = [h for h in ctl._held_reports if h[0] not in gone]
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
        pid = self.probe.runnable(r.rank) if self.ctl.hang_timeout > 0 else 0
        if not pid:
            return False
        if silent < self.ctl.hang_timeout:
            if self.starved_logged.get(r.rank) != r.last_seen:
                self.starved_logged[r.rank] = r.last_seen
                _log.warning("rank %d silent for %.1f s, but its process %d on this host is alive and not stopped: "
                             "starved of CPU, not dead (hung after MINDIO_HANG_TIMEOUT=%.0f s)", r.rank, silent,
                             pid, self.ctl.hang_timeout)
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
        with self.ctl._cond:
            for rank in ranks:
                r = self.ctl.ranks.get(rank)
                if r is not None and r.alive:
                    r.alive, r.faulty = False, True
                    newly.append(rank)
            if newly:
                self.ctl.actions.lost(newly)
                self.ctl._cond.notify_all()
        if newly and self.ctl.sm.state in (State.EXIT, State.FINAL):
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
            self.ctl.incidents.open(rank, None)
        return newly

    def heard(self, ranks, within: float) -> list[int]:
        """(any thread) Those of ``ranks`` that are alive, registered, and sent a frame in the last ``within``
        seconds (of this controller's observed time: see :meth:`stalled`)."""
        now = time.monotonic()
        with self.ctl._lock:
            return [r for r in ranks if (x := self.ctl.ranks.get(r)) is not None and x.alive and x.registered
                    and now - x.last_seen <= within]
