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

from ... import _logging, vocab
from . import policy, sequence
from .._enums import ActionName, OsStatus, RepairType, ReportState
from .sequence import Sequence
from .states import Result
from .strategy import Context, Outcome, Strategy

__all__ = ["Retry", "uce_repair_type"]

_log = logging.getLogger("mindio.ttp.retry")


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


class Retry(Strategy):
    """The retry strategy (module docstring): every rank keeps its process; the sequence is clean ->
    rebuild (generation g+1) -> repair (UCE and stale ranks from replicas) -> rollback -> resume."""

    name = vocab.Strategy.RETRY.value

    def run(self, core, ctx: Context) -> Outcome:
        return Outcome.RESUMED if self.steps(core, ctx) else self.fall_back(core, ctx)

    def steps(self, core, ctx: Context) -> bool:
        """Run the retry sequence; True when every rank trains again."""
        lock, views, primary = ctx.lock, ctx.views, ctx.primary
        seq = Sequence(core, self.name, ctx.t0)
        core.sm.fire(Result.RETRY, lock_step=lock)
        live = sequence.live_ranks(core)
        uce = sorted(r for r, s in primary.items() if s in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED))
        if len(live) != core.world_size:
            _log.error("retry needs every rank alive; live %d of %d", len(live), core.world_size)
            return seq.fail("alive")
        refused = core.uce_refused()
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
        if not seq.step(ActionName.CLEAN, {"timeout": core.action_limit}, live):
            return False
        core.gen += 1
        if not seq.step(ActionName.REBUILD, {"gen": core.gen, "fault_ranks": sorted(primary), "same_layout": True}, live):
            return False
        core.sm.fire(Result.OK, gen=core.gen)
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
