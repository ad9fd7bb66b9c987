"""Controller side of the retry strategy (MindIO UCE step-level online recovery; processes stay alive).

Chosen by incident.py when "retry" is enabled (HIGH_AVAILABILITY) and possible (policy: only RS_UCE /
RS_HCCL_FAILED reports, no dead rank, every shard of a UCE rank has a usable replica at the lock step),
and run only when every rank allows it (its processor registered with ``enable_uce=True``, the
reference default; :meth:`Controller.uce_refused`), else it fails at once and the next strategy runs.
Every rank is already stopped (fenced or parked) when this starts. Sequence, one action in flight,
each bounded by TTP_NORMAL_ACTION_TIME_LIMIT (processor side: inplace.py):

    ABNORMAL -RETRY-> ENV_CLEAR
      clean     every rank parked in the decorator, its groups destroyed and references dropped
      rebuild   generation g+1: new default group on store prefix mindio/gen<g+1>/, framework subgroups
                (``same_layout``: the same ranks and layout, a framework may keep its objects)
    ENV_CLEAR -OK-> REPAIR
      repair    for each RS_UCE rank and optimizer type: replica source RT_SEND -> rank RT_UCE_LOWLEVEL,
                or RT_UCE_HIGHLEVEL (need_rebuild) when the error may have hit its optimizer update
                (:func:`uce_repair_type`); skipped for network-class errors: no state was lost. A rank
                the stop caught at another step than the lock step (on the other side of its fence,
                policy.choose_lock_step) or mid-update is repaired the same way (``stale`` in the event)
      rollback  every rank: iteration, scheduler, data iterator, params back to the lock step
    REPAIR -OK-> NORMAL
      retry     every rank re-enters train()

A failed or late reply at any step -FAIL-> ABNORMAL and :class:`Retry` returns FAILED; the incident falls
back to the next strategy (dump, then exit) with a log line naming the step that failed. The time from
the incident to every rank released is logged and recorded as the ``retry_done`` event with the
breakdown (decide, clean, rebuild, repair, rollback, resume).
"""
from __future__ import annotations

import logging
import time

from ... import _knobs, _logging, vocab
from . import policy, sequence
from ..wire import protocol as P
from .._enums import ActionName, MainState, OsStatus, RepairType, ReportState
from .sequence import Sequence
from .states import Result
from .strategy import Context, Outcome, Strategy

__all__ = ["StopRound", "Retry", "uce_repair_type", "STOP_GRACE_S", "STOP_LOOK_S"]

_log = logging.getLogger("mindio.ttp.retry")
STOP_GRACE_S = 1.0  # a rank still running this long after the stop, while others are fenced, may be blocked
STOP_LOOK_S = 0.2   # the stop's first look: a running rank inside a collective then is blocked at once


def uce_repair_type(state: ReportState, data_status: int) -> str:
    """How a UCE rank is repaired (reference RepairType): ``RT_UCE_HIGHLEVEL`` -- the model and
    optimizer of the rank are rebuilt and its whole optimizer shard is received -- when the error may
    have corrupted them: an RS_UCE_CORRUPTED report (an ``HBM MULTI BIT ECC`` inside the optimizer
    update window, ``tft_can_do_uce_repair`` False) or a rank stopped with its optimizer state not
    UPDATED (the error hit between ``tft_start_updating_os`` and ``tft_end_updating_os``);
    ``RT_UCE_LOWLEVEL`` -- the shard is received into the existing objects -- otherwise."""
    if state == ReportState.RS_UCE_CORRUPTED or int(data_status) != int(OsStatus.UPDATED):
        return RepairType.RT_UCE_HIGHLEVEL.name
    return RepairType.RT_UCE_LOWLEVEL.name


def _mains(replies: dict) -> dict:
    """{rank: where its main thread is} of a stop round's successful replies."""
    return {r: rep.detail.get("main") for r, rep in replies.items() if rep.ok}


def _split(replies: dict) -> tuple[list, list]:
    """(running, fenced) ranks of a stop round's replies."""
    mains = _mains(replies)
    return (sorted(r for r, m in mains.items() if m == MainState.RUNNING),
            sorted(r for r, m in mains.items() if m == MainState.FENCED))


class StopRound:
    """The stop round of every fault incident (the controller's ``stop_round``; incident.py runs it):
    uses the controller's action engine, rank table, views and liveness, and owns nothing else."""

    def __init__(self, ctl):
        self.ctl = ctl

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
        replies = self.ctl._call(ActionName.STOP, dict(params, timeout=grace, look=min(STOP_LOOK_S, grace), interrupt=True),
                                 live, self.ctl.action_limit)
        if not params.get("stop_clean"):  # torn down at the stop (TTP_STOP_CLEAN_BEFORE_DUMP): held as they are
            self._advance(replies, grace)
        return self._release_running(replies, params)

    def _advance(self, replies: dict, grace: float) -> None:
        """Step 2 of :meth:`run`; ``replies`` is updated."""
        views = self.ctl.incidents.views(replies)
        step, behind = policy.ranks_to_advance(views, [r for r, m in _mains(replies).items() if m == MainState.FENCED])
        if not behind:
            return
        running = sorted(r for r, m in _mains(replies).items() if m == MainState.RUNNING)
        _log.warning("stop: ranks %s were held at their fence before the update of step %d, which another rank "
                     "made or started; letting them finish it%s", behind[:16], step,
                     f" (ranks {running[:16]} were running)" if running else "")
        _logging.event("advance", step=step, ranks=behind[:64], running=running[:64])
        replies.update(self.ctl._call(ActionName.ADVANCE, {"step": step, "timeout": grace}, behind, self.ctl.action_limit))
        if running:
            replies.update(self.ctl._call(ActionName.WAIT_QUIET, {"timeout": grace}, running, self.ctl.action_limit))

    def _release_running(self, replies: dict, params: dict) -> dict:
        """Steps 2 and 3 of :meth:`run` for the ranks ``replies`` says still run."""
        running, fenced = _split(replies)
        if running and fenced and not params.get("stop_clean"):
            _log.warning("stop: ranks %s still running after the stop while %s wait at the fence; tearing the "
                         "fenced ranks down so that a collective between them fails", running[:16], fenced[:16])
            _logging.event("stop_release_fenced", running=running[:64], fenced=fenced[:64])
            replies.update(self.ctl._call(ActionName.TEARDOWN, {}, fenced, self.ctl.action_limit))
            running, _ = _split(replies)
        if running:
            running = self._unblock(running, replies, params["timeout"])
        if running:
            running = self._kill_stuck(running, params, replies)
        if running:
            replies.update(self.ctl._call(ActionName.WAIT_QUIET, {"timeout": params["timeout"]}, running, self.ctl.action_limit))
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
        with self.ctl._lock:
            dead = self.ctl.ranks.dead()
        if not inside or not dead:  # every peer lives: the teardown of the stopped ones releases them
            return running
        _log.warning("stop: ranks %s still blocked in a collective (dead ranks %s); releasing them from their "
                     "collective connections", inside[:16], dead[:16])
        t0 = time.monotonic()
        more = self.ctl._call(ActionName.UNBLOCK, {"timeout": timeout, "look": STOP_GRACE_S}, inside, self.ctl.action_limit)
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
        if window <= 0 or "recover-in-place" not in self.ctl.brain.enabled(self.ctl.job_strategies()):
            return running
        if any(not rep.ok for r, rep in replies.items() if r not in running):
            return running  # some rank did not confirm its stop: nothing says the others are released
        for _ in range(len(running)):
            more = self.ctl._call(ActionName.WAIT_QUIET, {"timeout": window}, running, self.ctl.action_limit)
            replies.update(more)
            still = sorted(r for r in running if r in more and more[r].ok and more[r].detail.get("main") == MainState.RUNNING)
            outside = [r for r in still if not more[r].detail.get("in_collective")]
            victims = outside or still
            with self.ctl._lock:
                dead = set(self.ctl.ranks.dead())
            if not still or not self.ctl.replacements.possible("recover-in-place", sorted(dead | set(victims))):
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
                self.ctl._send(rank, P.Action(ActionName.KILL, {"reason": "still running after the stop"}))
            self.ctl.declare_dead(victims, "stuck", log=False)  # watch.py
            running = [r for r in still if r not in victims]
            if not running:
                return []
        return running

    def _last_copies(self, replies: dict, dead: set, victims: list) -> list:
        """Those of ``victims`` whose death would leave some optimizer shard with no usable copy at the
        lock step (policy.select_dump_ranks), where one is left now: never kill the last copy."""
        views = self.ctl.incidents.views(replies)
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


class Retry(Strategy):
    """The retry strategy (module docstring): every rank keeps its process; the sequence is clean ->
    rebuild (generation g+1) -> repair (UCE and stale ranks from replicas) -> rollback -> resume."""

    name = vocab.Strategy.RETRY.value

    def run(self, ctl, ctx: Context) -> Outcome:
        return Outcome.RESUMED if self.steps(ctl, ctx) else self.fall_back(ctl, ctx)

    def steps(self, ctl, ctx: Context) -> bool:
        """Run the retry sequence; True when every rank trains again."""
        lock, views, primary = ctx.lock, ctx.views, ctx.primary
        seq = Sequence(ctl, self.name, ctx.t0)
        ctl.sm.fire(Result.RETRY, lock_step=lock)
        live = sequence.live_ranks(ctl)
        uce = sorted(r for r, s in primary.items() if s in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED))
        if len(live) != ctl.world_size:
            _log.error("retry needs every rank alive; live %d of %d", len(live), ctl.world_size)
            return seq.fail("alive")
        refused = ctl.uce_refused()
        if refused:
            _log.error("retry is enabled on the controller but ranks %s registered with enable_uce=False "
                       "(tft_init_processor; the example's --enable-hbmfault-repair): not retrying",
                       refused[:16])
            _logging.event("retry_refused", ranks=refused[:64])
            return seq.fail("enable_uce")
        # ranks whose state is of another step than the lock step (the stop reached them on the other side
        # of their fence, policy.choose_lock_step) or was caught mid-update: repaired like UCE ranks
        stale = policy.stale_ranks(views, lock, among=[v.rank for v in views if v.rank not in uce])
        if stale:
            _log.warning("retry: ranks %s are not at the lock step %d with complete optimizer state (%s); "
                         "they are repaired from replicas too", stale[:16], lock,
                         {v.rank: (v.step, v.data_status) for v in views if v.rank in stale[:8]})
        targets = sorted(set(uce) | set(stale))
        if not seq.step(ActionName.CLEAN, {"timeout": ctl.action_limit}, live):
            return False
        ctl.gen += 1
        if not seq.step(ActionName.REBUILD, {"gen": ctl.gen, "fault_ranks": sorted(primary), "same_layout": True}, live):
            return False
        ctl.sm.fire(Result.OK, gen=ctl.gen)
        kinds: dict = {}
        if targets:
            try:
                sources = policy.select_repair_sources(views, lock, targets)
            except ValueError as exc:
                _log.error("retry: %s", exc)
                return seq.fail("repair plan")
            status = {v.rank: v.data_status for v in views}
            kinds = {r: uce_repair_type(primary.get(r, ReportState.RS_NORMAL), status.get(r, OsStatus.UPDATED))
                     for r in targets}
            pairs = [{"type": t, "src": src, "dst": dst, "repair_type": kinds[dst]}
                     for (dst, t), src in sorted(sources.items())]
            involved = sorted({p["src"] for p in pairs} | {p["dst"] for p in pairs})
            _log.warning("retry: repairing %s (%s) from replicas %s", targets, kinds,
                         {f"{p['dst']}/{p['type']}": p["src"] for p in pairs[:16]})
            if not seq.step(ActionName.REPAIR, {"step": lock, "error_ranks": targets, "pairs": pairs}, involved,
                            abandon=live):
                return False
        else:
            seq.mark("repair")
        if not seq.step(ActionName.ROLLBACK, {"step": lock}, live, abandon=live):
            return False
        seq.resume(lock, live)
        seq.done("every rank trains again", f"repaired {uce}, stale {stale}",
                 ({r: 0 if r in uce else 1 for r in primary}, self.name), lock_step=lock, repaired=uce,
                 stale=stale, repair_types={str(r): k for r, k in kinds.items()})
        return True
