"""The stop round every incident begins with (incident.IncidentFlow.stop; the controller's ``stop_round``).

Every live rank is stopped -- each holds its fence and answers once its main thread is quiet -- and
the round is never held up by the fence itself: ranks held before an update another rank made finish
it (``advance``), fenced ranks are torn down when others still run (``teardown``), ranks blocked in a
collective with a dead peer shut their connections (``unblock``), and with recover-in-place a rank
still running after every other stopped is killed and replaced (:meth:`StopRound._kill_stuck`). The
details are in :meth:`StopRound.run`.
"""
from __future__ import annotations

import logging
import time

from ... import _knobs, _logging
from . import policy
from ..wire import protocol as P
from .._enums import ActionName, MainState

__all__ = ["StopRound", "STOP_GRACE_S", "STOP_LOOK_S"]

_log = logging.getLogger("mindio.ttp.retry")  # the logger these lines always had
STOP_GRACE_S = 1.0  # a rank still running this long after the stop, while others are fenced, may be blocked
STOP_LOOK_S = 0.2   # the stop's first look: a running rank inside a collective then is blocked at once


def _split(replies: dict) -> tuple[list, list]:
    """(running, fenced) ranks of a stop round's successful replies (where each one's main thread is), in one
    pass: a 100k-rank stop round is 100k replies."""
    running, fenced = [], []
    for r, rep in replies.items():
        if rep.ok:
            main = rep.detail.get("main")
            if main == MainState.RUNNING:
                running.append(r)
            elif main == MainState.FENCED:
                fenced.append(r)
    running.sort()
    fenced.sort()
    return running, fenced


class StopRound:
    """The stop round of every fault incident (the controller's ``stop_round``; incident.py runs it):
    uses the controller's action engine, rank table, views and liveness, and owns nothing else."""

    def __init__(self, core):
        self.core = core

    def run(self, live: list, params: dict) -> dict:
        """The incident's stop round, never held up by the fence itself; each action sent once.

        A rank that passed its fence (``tft_start_updating_os``) just before the stop reached it can
        be blocked in a collective with a peer the stop caught *at* its fence: the peer waits for the
        fence, the rank for the peer, until the stop's deadline (90 s by default; seen under load, in
        the dump flow and in retry). So:

        1. ``stop`` to every live rank: each holds its fence, asks a main thread computing outside its
           update to leave its step (``interrupt``: the framework's hook, e.g. Megatron's layer check
           points), and answers once its main thread is quiet, at the latest after :data:`STOP_GRACE_S`,
           or already after :data:`STOP_LOOK_S` when it is running inside a collective then (almost
           surely waiting for a fenced rank);
        2. ``advance`` to the ranks held before an update another rank made or started
           (policy.ranks_to_advance, the reference's prelock): they finish it, and a peer blocked in a
           collective of that update completes with them; the ranks that were running are looked at
           again (``wait_quiet`` for one grace);
        3. if some ranks still run while others are fenced, ``teardown`` to the fenced ones (the
           framework keeps their state for a dump, ARCHITECTURE section 3), which fails the blocked
           collective at once;
        4. with some rank dead, the ranks still running inside a collective wait for a peer that is gone
           without a reset (a silent host death, a partition) or for one blocked behind it: ``unblock``
           (:meth:`_unblock`) makes each shut its own collective connections, and it parks;
        5. the ranks still running: :meth:`_kill_stuck` (never one holding the last copy of a shard),
           then ``wait_quiet`` with the stop's full timeout.

        {rank: Reply} (the latest reply of each rank)."""
        grace = min(params["timeout"], STOP_GRACE_S)
        replies = self.core.call(ActionName.STOP, dict(params, timeout=grace, look=min(STOP_LOOK_S, grace), interrupt=True),
                                 live, self.core.action_limit)
        running, fenced = _split(replies)
        # torn down at the stop (TTP_STOP_CLEAN_BEFORE_DUMP): held as they are; nobody held at the fence: nothing
        # to advance (and no views of 100k ranks to build)
        if fenced and not params.get("stop_clean") and self._advance(replies, grace, running, fenced):
            running, fenced = _split(replies)
        return self._release_running(replies, params, running, fenced)

    def _advance(self, replies: dict, grace: float, running: list, fenced: list) -> bool:
        """Step 2 of :meth:`run`; ``replies`` is updated. Whether any rank was advanced."""
        views = self.core.incidents.views(replies)
        step, behind = policy.ranks_to_advance(views, fenced)
        if not behind:
            return False
        _log.warning("stop: ranks %s were held at their fence before the update of step %d, which another rank "
                     "made or started; letting them finish it%s", behind[:16], step,
                     f" (ranks {running[:16]} were running)" if running else "")
        _logging.event("advance", step=step, ranks=behind[:64], running=running[:64])
        replies.update(self.core.call(ActionName.ADVANCE, {"step": step, "timeout": grace}, behind, self.core.action_limit))
        if running:
            replies.update(self.core.call(ActionName.WAIT_QUIET, {"timeout": grace}, running, self.core.action_limit))
        return True

    def _release_running(self, replies: dict, params: dict, running: list, fenced: list) -> dict:
        """Steps 3 to 5 of :meth:`run` for the ranks ``replies`` says still run (``running``; ``fenced``: at their
        fence)."""
        if running and fenced and not params.get("stop_clean"):
            _log.warning("stop: ranks %s still running after the stop while %s wait at the fence; tearing the "
                         "fenced ranks down so that a collective between them fails", running[:16], fenced[:16])
            _logging.event("stop_release_fenced", running=running[:64], fenced=fenced[:64])
            replies.update(self.core.call(ActionName.TEARDOWN, {}, fenced, self.core.action_limit))
            running, _ = _split(replies)
        if running:
            running = self._unblock(running, replies, params["timeout"])
        if running:
            running = self._kill_stuck(running, params, replies)
        if running:
            replies.update(self.core.call(ActionName.WAIT_QUIET, {"timeout": params["timeout"]}, running, self.core.action_limit))
        return replies

    def _unblock(self, running: list, replies: dict, timeout: float) -> list:
        """Step 4 of :meth:`run`: ranks still running inside a collective once every other rank
        stopped, while some rank is dead, wait for a peer that is gone without a reset (a silent host death, a partition) or for
        one blocked behind it; no teardown of ours reaches them. Each shuts its own collective
        connections down (processor ``unblock``, unblock.py) and parks; returns the ranks still running.
        A released rank is waited for until it parked (``timeout``: the stop's); one still inside a
        collective :data:`STOP_GRACE_S` after its shutdown was not released and answers then. The rank
        keeps its state: it may hold the only copy of a shard."""
        inside = [r for r in running if replies[r].detail.get("in_collective")]
        with self.core.lock:
            dead = self.core.ranks.dead()
        if not inside or not dead:  # every peer lives: the teardown of the stopped ones releases them
            return running
        _log.warning("stop: ranks %s still blocked in a collective (dead ranks %s); releasing them from their "
                     "collective connections", inside[:16], dead[:16])
        t0 = time.monotonic()
        more = self.core.call(ActionName.UNBLOCK, {"timeout": timeout, "look": STOP_GRACE_S}, inside, self.core.action_limit)
        replies.update(more)
        still = sorted(r for r in running if replies[r].ok and replies[r].detail.get("main") == MainState.RUNNING)
        _logging.event("stop_unblocked", ranks=inside[:64], dead=dead[:64], still=still[:64],
                       took_s=round(time.monotonic() - t0, 6))
        return still

    def _kill_stuck(self, running: list, params: dict, replies: dict) -> list:
        """Ranks still running once every other rank stopped: the ones to keep waiting for.

        Every other live rank has torn its groups down by now (parked after its own error, or fenced
        and cleaned above), so a rank that does not stop either hangs outside a collective, or waits in
        one for such a rank, or for a peer whose group outlived its teardown. When recover-in-place could
        replace them, the running ranks get ``MINDIO_STOP_STUCK_S`` more; then those *outside* a
        collective (their main thread is not in torch.distributed; all of them if every one is inside)
        are SIGKILLed and replaced like dead ranks, and the others get the window again (a rank waiting
        for a killed one fails at once). Ranks whose death would leave some optimizer shard without a
        usable copy are never killed (:meth:`_last_copies`): they are kept for the dump or the repair.
        Otherwise the running ranks get the full stop timeout."""
        window = _knobs.get("MINDIO_STOP_STUCK_S")
        if window <= 0 or "recover-in-place" not in self.core.brain.enabled(self.core.job_strategies()):
            return running
        if any(not rep.ok for r, rep in replies.items() if r not in running):
            return running  # some rank did not confirm its stop: nothing says the others are released
        for _ in range(len(running)):
            more = self.core.call(ActionName.WAIT_QUIET, {"timeout": window}, running, self.core.action_limit)
            replies.update(more)
            still = sorted(r for r in running if r in more and more[r].ok and more[r].detail.get("main") == MainState.RUNNING)
            outside = [r for r in still if not more[r].detail.get("in_collective")]
            victims = outside or still
            with self.core.lock:
                dead = set(self.core.ranks.dead())
            if not still or not self.core.replacements.possible("recover-in-place", sorted(dead | set(victims))):
                return still
            last = self._last_copies(replies, dead, victims)
            if last:
                _log.error("stop: ranks %s still running %.0f s after every other rank stopped, but they hold the "
                           "only surviving copy of some optimizer shard: not killed (a dump or repair needs them)",
                           last[:16], window)
                _logging.event("stop_stuck_spared", ranks=last[:64], window_s=window)
                return still
            _log.error("stop: ranks %s still running %.0f s after every other rank stopped (%s): ordering SIGKILL, "
                       "they are replaced like dead ranks", victims[:16], window,
                       "outside a collective" if outside else "all inside a collective")
            _logging.event("stop_stuck_killed", ranks=victims[:64], window_s=window, in_collective=not outside)
            for rank in victims:
                self.core.send(rank, P.Action(ActionName.KILL, {"reason": "still running after the stop"}))
            self.core.liveness.declare_dead(victims, "stuck", log=False)  # watch.py
            running = [r for r in still if r not in victims]
            if not running:
                return []
        return running

    def _last_copies(self, replies: dict, dead: set, victims: list) -> list:
        """Those of ``victims`` whose death would leave some optimizer shard with no usable copy at the
        lock step (policy.select_dump_ranks), where one is left now: never kill the last copy."""
        views = self.core.incidents.views(replies)
        lock = policy.choose_lock_step(views)
        if not policy.select_dump_ranks(views, lock).possible:
            return []  # nothing complete to keep: killing does not lose a shard that could be saved
        gone = set(dead) | set(victims)
        after = [policy.RankView(v.rank, False, True, v.step, v.data_status, v.replica) if v.rank in gone else v
                 for v in views]
        if policy.select_dump_ranks(after, lock).possible:
            return []
        return [r for r in victims  # the victims whose own survival would keep the plan whole
                if policy.select_dump_ranks([v if v.rank != r else views[i] for i, v in enumerate(after)],
                                            lock).possible] or list(victims)
