"""The reliable action engine: one controller action in flight, to many ranks, with a deadline.

Protocol (controller side; the processor side is in processor.py):

1. :meth:`ActionEngine.call` numbers the action (``sn``), queues ACTION(name, params) for every target
   rank and waits on the controller's condition variable.
2. The controller's I/O thread hands the REPLYs to :meth:`on_replies`; the engine counts the replies it
   still expects and wakes the caller only when none is left (or when the I/O thread reports a death),
   so 100k replies do not cost 100k wake-ups.
3. An action is sent once. Only ranks that have not answered (and are alive) get it again -- a frame
   lost across a reconnect or a failover -- first after 2 heartbeat intervals (plus the action's own
   ``timeout`` parameter, within which a processor answers), then after twice the
   previous wait (at most :data:`RESEND_MAX_S`), each resend logged with the ranks it went to;
   processors replay their cached reply for a known sn and ignore a sn they are still running, so an
   action never runs twice on a rank. No resend while the controller's own inbound queue is behind
   (``backlog()``): the missing replies may be sitting in it, and resending to 100k ranks then only
   doubles the work (a resend storm).
4. ``call`` returns {rank: Reply} when every live target answered, or at the deadline
   (TTP_NORMAL_ACTION_TIME_LIMIT for recovery actions); ranks that died meanwhile are simply absent.
   One log line and one ``action`` event (with its duration, the failed and the missing ranks) per call.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ... import _logging
from ..wire import protocol as P

__all__ = ["ActionEngine", "ControllerClosed", "RESEND_MAX_S"]

_log = logging.getLogger("mindio.ttp.actions")
RESEND_MAX_S = 30.0  # longest wait between two resends of an action to ranks that have not answered


class ControllerClosed(RuntimeError):
    """The controller closes (Controller.close): the action in flight, and any later one, ends here; the
    incident that called it ends without acting on partial replies (incident.IncidentFlow.drive)."""


@dataclass
class _Pending:
    sn: int
    name: str
    targets: set
    replies: dict = field(default_factory=dict)
    outstanding: int = 0
    fail_fast: bool = False
    failed: bool = False


class ActionEngine:
    def __init__(self, cond: threading.Condition, send_many: Callable[[set, P.Action, int], None],
                 alive: Callable[[int], bool], interval: float, backlog: Callable[[], bool] = lambda: False,
                 alive_of: Callable[[set], set] | None = None):
        self._cond, self._send_many, self._alive, self._backlog = cond, send_many, alive, backlog
        # the live ones of a set of ranks (the controller's: one vector lookup in the rank table, ranks.py)
        self._alive_of = alive_of or (lambda ranks: {r for r in ranks if alive(r)})
        self.resends = 0
        self.resend = 2 * interval
        self.sn = 0
        self._pending: _Pending | None = None
        self.closed = False  # close(): no action runs any more

    def close(self) -> None:
        """(any thread) The controller closes: the action in flight ends now (its caller raises
        :class:`ControllerClosed`), and so does any later :meth:`call`."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def fail_pending(self) -> None:
        """(any thread, under the engine's condition) The action in flight fails now (its caller is
        woken by the condition's notify_all): a recovery step that lost a rank meanwhile."""
        if self._pending is not None:
            self._pending.failed = True

    def lost(self, ranks) -> None:
        """(any thread, under the engine's condition, which the caller then notifies) ``ranks`` were declared
        dead: the action in flight no longer counts their replies as outstanding, so the last live target's
        reply wakes its caller (before, a caller that looked again after the death, with a live target still
        to answer, slept out its look-again wait once that one answered: the stop of a recover-in-place
        incident took 0.55 s for replies that were all in after 0.1 s)."""
        p = self._pending
        if p is not None:
            p.outstanding -= sum(1 for rank in ranks if rank in p.targets and rank not in p.replies)

    def on_reply(self, rank: int, sn: int, body: P.Reply) -> None:
        """(I/O thread) Record one reply (:meth:`on_replies`)."""
        self.on_replies([P.Envelope(P.MsgType.REPLY, body, rank=rank, sn=sn)])

    def on_replies(self, replies: list) -> None:
        """(I/O thread) Record REPLY envelopes (one, or a relay's batch: its ranks' answers to one action)
        under one acquisition of the condition; the caller is woken once, when the last one it waits for
        came in or one failed a ``fail_fast`` action."""
        with self._cond:
            p = self._pending
            if p is None:
                return
            got = False
            for env in replies:
                if env.sn == p.sn and env.rank in p.targets and env.rank not in p.replies:
                    p.replies[env.rank] = env.body
                    p.outstanding -= 1
                    got = True
                    if not env.body.ok and p.fail_fast:
                        p.failed = True
            if got and (p.outstanding <= 0 or p.failed):
                self._cond.notify_all()

    def on_columns(self, sn: int, cols: P.Replies) -> None:
        """(I/O thread) Record a relay's REPLIES (protocol v7: its ranks' replies to action ``sn``, in columns)
        as :meth:`on_replies` records REPLY envelopes: when every entry is a target that had not answered (a
        relay's answers to one action: the usual case), with set operations and no Python loop per rank."""
        with self._cond:
            p = self._pending
            if p is None or sn != p.sn:
                return
            ranks, replies = cols.ranks, p.replies
            fresh = p.targets.intersection(ranks).difference(replies)
            if len(fresh) == len(ranks):
                replies.update(zip(ranks, map(P.Reply, cols.ok, cols.code, cols.detail)))
                got = len(ranks)
                failed = p.fail_fast and not all(cols.ok)
            else:  # some not targets, answered already, or twice in the frame: one by one
                got, failed = 0, False
                for rank, ok, code, detail in zip(ranks, cols.ok, cols.code, cols.detail):
                    if rank in fresh and rank not in replies:
                        replies[rank] = P.Reply(ok, code, detail)
                        got += 1
                        failed = failed or (not ok and p.fail_fast)
            p.outstanding -= got
            p.failed = p.failed or failed
            if got and (p.outstanding <= 0 or p.failed):
                self._cond.notify_all()

    def reserve(self) -> int:
        """(any thread) A sequence number of its own, for an action that is also sent outside :meth:`call`
        (the exit order, incident.py: ranks heard after it get it again with the same ``sn``)."""
        with self._cond:
            self.sn += 1
            return self.sn

    def call(self, name: str, params: dict, ranks, timeout: float, fail_fast: bool = False,
             sn: int | None = None) -> dict:
        """Run ACTION ``name`` on ``ranks``; see the module docstring. ``fail_fast``: return as soon as
        one rank replies with a failure (a recovery step that failed anywhere has failed). ``sn``: one
        from :meth:`reserve` (default: the next)."""
        t0 = time.monotonic()
        targets = set(ranks)
        with self._cond:
            if self.closed:
                raise ControllerClosed(f"action {name}: the controller is closing")
            if sn is None:
                self.sn += 1
                sn = self.sn
            # the caller is woken once every target alive now answered (a dead target -- the exit order goes to
            # every registered rank, incident.py -- never answers; one that does only wakes it once more)
            alive = len(self._alive_of(targets))
            pend = self._pending = _Pending(sn, name, targets, outstanding=alive, fail_fast=fail_fast)
        body = P.Action(name, params)
        # an action that carries a timeout is answered within it: no resend before then
        waiting, last_send, gap = set(targets), -1e9, self.resend + float(params.get("timeout") or 0)
        while True:
            now = time.monotonic()
            due = now - last_send >= gap
            if due and (last_send < 0 or not self._backlog()):
                if last_send >= 0:
                    self.resends += 1
                    _log.warning("action %s sn=%d: no reply from %d rank(s) %s within %.1f s; sending it to them "
                                 "again", name, pend.sn, len(waiting), sorted(waiting)[:16], now - t0)
                    _logging.event("action_resent", action=name, sn=pend.sn, ranks=sorted(waiting)[:64],
                                   after_s=round(now - t0, 3))
                    gap = min(2 * gap, max(self.resend, RESEND_MAX_S))
                self._send_many(waiting, body, pend.sn)
                last_send, due = now, False
            with self._cond:
                # only the ranks still waiting are looked at again (a 100k-rank round shrinks quickly)
                waiting = self._alive_of(waiting.difference(pend.replies))
                if self.closed:
                    self._pending = None
                    raise ControllerClosed(f"action {name} sn={pend.sn}: the controller closed while "
                                           f"{len(waiting)} rank(s) had not answered")
                if not waiting or now - t0 >= timeout or pend.failed:
                    break
                # resend due but our inbound queue is behind: look again in 0.25 s, not in a busy loop
                self._cond.wait(0.25 if due else max(0.01, min(gap - (now - last_send), t0 + timeout - now, 0.5)))
        with self._cond:
            self._pending = None
        dt = time.monotonic() - t0
        failed = sorted(r for r, rep in pend.replies.items() if not rep.ok)
        _log.info("action %s sn=%d: %d/%d replies in %.3f s%s", name, pend.sn, len(pend.replies), len(targets), dt,
                  f", failed {failed[:16]}" if failed else "")
        _logging.event("action", action=name, sn=pend.sn, ranks=len(targets), replies=len(pend.replies),
                       failed=failed, missing=sorted(waiting), duration_s=round(dt, 6))
        return pend.replies
