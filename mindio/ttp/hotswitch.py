"""Hot switch (亚健康热切): move sub-healthy ranks to new processes without losing a step; controller side.

``tft_notify_controller_prepare_action("hot switch", {rank: errtype})`` opens a *hot switch* incident;
the driver thread runs it (states: NORMAL -PAUSE-> PAUSE -MIGRATE-> MIGRATION -RECOVER-> ENV_CLEAR
-OK-> REPAIR -OK-> NORMAL):

1. pause: every rank stops at one step ``T`` (pause.py's ``pause_query`` / ``pause_at``: all parked at
   the fence, optimizer state of step ``T`` complete); ``report_stop_complete(0, ...)``.
2. decide: with a cluster brain attached (``report_stop_complete`` callback registered) wait up to
   MINDIO_WAIT_MINDX_TIME for ``change_strategy("migration")`` (go) or ``prepare_action("stop switch")``
   (cancel); no answer cancels. Without a cluster brain the switch goes on at once.
3. switch out: every rank tears its groups down and parks (``clean``); the old processes of the switched
   ranks get ``exit(EXIT_CODE_SWITCHED)`` -- healthy, nothing lost, they leave cleanly -- and leave the
   rank table.
4. switch in: exactly the recover-in-place sequence (recover.py, strategy "hot switch"): the launcher
   agent starts a backup process per switched rank in a warm spare (``MINDIO_REBOOT_GEN``,
   ``MINDIO_REBOOT_TYPE=hot switch``), the others rebuild their groups with it in generation g+1, it
   registers and parks before ``train()``, its optimizer shard comes from a replica (RT_SEND ->
   RT_RECV_REPAIR), every rank rolls back to ``T`` (nothing to undo: nothing ran past ``T``) and trains on.
   The result is bitwise equal to an uninterrupted run.

Cancel (``stop switch``, no decision in time, a pause that fails): ``pause_resume``; training continues
unchanged, no process replaced. A rank failing during the pause turns the switch into a fault incident.
A failure after the old processes left (a backup that does not come up, a repair that fails) falls back
to a dump by the remaining ranks at ``T`` (their replicas hold every shard), then exit.

Needs a *replacer*: the controller must be hosted by mindio-run's agent (``--high-availability``); the
reference's ClusterD starts the backup pod, ours is the agent's warm spare. The backups start once
training is paused (the reference starts the backup pod first; a warm spare starts in well under a step
of a real job).
"""
from __future__ import annotations

import logging
import time

from .. import _knobs, _logging
from . import policy
from ._enums import EXIT_CODE_FAULT, OsStatus, ResultCode
from .states import Result, State

__all__ = ["HotSwitchFlow", "EXIT_CODE_SWITCHED", "ACTIONS"]

_log = logging.getLogger(__name__)
EXIT_CODE_SWITCHED = 78  # this process was switched out by a hot switch; a backup serves its rank now
ACTIONS = ("hot switch", "stop switch")


class HotSwitchFlow:
    """Mixed into the controller next to PauseFlow and RecoverFlow."""

    _switch_req: dict | None = None

    def notify_prepare_action(self, action: str, ranks: list) -> int:
        """Cluster brain: 0 accepted, 1 refused (the reason is logged)."""
        if action == "stop switch":
            with self._lock:
                pending = self._switch_req is not None and self._switch_req.get("waiting")
                if pending:
                    self._chosen = "stop switch"
                    self._strategy_evt.set()
            if not pending:
                _log.error("stop switch: no hot switch is waiting for a decision")
            return 0 if pending else 1
        why = ""
        with self._lock:
            if self.sm.state is not State.NORMAL or self._incident is not None:
                why = f"the job is in {self.sm.state.value}, not in NORMAL training"
            elif any(not (r in self.ranks and self.ranks[r].alive) for r in ranks):
                why = f"ranks {ranks} are not all registered and alive"
        if not why and not self.can_replace("hot switch", ranks):  # recover.py
            why = ("no launcher agent hosts this controller (run under mindio-run with --high-availability)"
                   if self.replacer is None else f"the launcher cannot start backups for ranks {ranks}")
        if why:
            _log.error("hot switch of ranks %s refused: %s", ranks[:16], why)
            return 1
        with self._lock:
            self._switch_req = {"ranks": sorted(ranks), "waiting": False}
            self._chosen = None
            self._strategy_evt.clear()
        self._open_incident(None, None, cause="hot_switch")
        return 0

    # ------------------------------------------------------------------ driver thread
    def _run_incident(self) -> bool:
        """(incident.py's driver loop) A hot switch incident runs here, any other in IncidentFlow."""
        inc = self._incident
        if inc["cause"] == "hot_switch":
            return self._run_hot_switch(inc)
        return super()._run_incident()

    def _run_hot_switch(self, inc: dict) -> bool:
        ranks = self._switch_req["ranks"]
        self.sm.fire(Result.PAUSE, hot_switch=ranks[:16])
        live = self._live()
        if len(live) < self.world_size or self._faulted(inc):
            return self._as_fault() if self._faulted(inc) else self._cancel_switch(live, "ranks missing")
        caps = self._call("pause_query", {}, live, self.action_limit)
        target = max((c.detail["limit"] for c in caps.values() if c.ok), default=0)
        replies = {} if len(caps) < len(live) else self._call(
            "pause_at", {"step": target, "timeout": self.action_limit / 2}, live, self.action_limit)
        if self._faulted(inc):
            return self._as_fault()
        bad = sorted(r for r in live if r not in replies or not replies[r].ok)
        if bad:
            _log.error("hot switch: ranks %s did not pause at step %d", bad[:16], target)
            self._mindx_call("report_stop_complete", int(ResultCode.NOT_READY),
                             f"pause for the hot switch failed on ranks {bad[:16]}", {r: 1 for r in ranks})
            return self._cancel_switch(live, "pause failed")
        _log.warning("hot switch of ranks %s: every rank paused at step %d (%.3f s after the request)", ranks,
                     target, time.monotonic() - inc["t0"])
        _logging.event("hot_switch_paused", step=target, ranks=ranks)
        with self._lock:
            self._switch_req["waiting"] = True
        self._mindx_call("report_stop_complete", int(ResultCode.OK),
                         f"training paused at step {target} for the hot switch of ranks {ranks[:16]}",
                         {r: 1 for r in ranks})
        choice = self._switch_decision(inc)
        with self._lock:
            self._switch_req["waiting"] = False
        if choice == "fault":
            return self._as_fault()
        if choice != "migration":
            return self._cancel_switch(live, choice)
        return self._switch(ranks, target, inc["t0"])

    def _switch_decision(self, inc: dict) -> str:
        if "report_stop_complete" not in self.mindx:
            return "migration"  # no cluster brain: the caller of prepare_action wants it done
        end = time.monotonic() + _knobs.get("MINDIO_WAIT_MINDX_TIME")
        while time.monotonic() < end:
            if self._faulted(inc):
                return "fault"
            if self._strategy_evt.wait(min(0.1, max(0.0, end - time.monotonic()))):
                self._strategy_evt.clear()
                if self._chosen in ("migration", "stop switch"):
                    return self._chosen
                _log.error("change_strategy(%r) is not possible during a hot switch (migration, or "
                           "prepare_action('stop switch'))", self._chosen)
        _log.error("hot switch: no migration / stop switch within MINDIO_WAIT_MINDX_TIME; cancelled")
        return "no decision"

    def _cancel_switch(self, live: list, why: str) -> bool:
        _log.warning("hot switch cancelled (%s): training continues unchanged", why)
        _logging.event("hot_switch_cancelled", why=why)
        ok = self._end_pause(live, f"hot switch cancelled: {why}")  # pause.py
        self._mindx_call("report_result", int(ResultCode.OK), f"hot switch cancelled ({why}); training continued",
                         {}, "continue")
        self._switch_req = None
        return ok

    def _switch(self, ranks: list, target: int, t0: float) -> bool:
        self.sm.fire(Result.MIGRATE, lock_step=target, ranks=ranks[:16])
        everyone = self._live()
        replies = self._call("clean", {"timeout": self.action_limit}, everyone, self.action_limit)
        bad = sorted(r for r in everyone if r not in replies or not replies[r].ok)
        with self._lock:  # the switched ranks count as dead: the repair takes their shards from replicas
            views = [policy.RankView(r.rank, r.alive and r.rank not in ranks, r.rank in ranks, target,
                                     int(OsStatus.UPDATED), tuple(r.replica)) for r in self.ranks.values()]
        if not bad:
            self._call("exit", {"code": EXIT_CODE_SWITCHED}, ranks, 10.0)
            with self._cond:
                for r in ranks:  # gone on purpose: dead for the recover sequence, never declared dead
                    self._replaced[r] = self.gen + 1  # its last frames are refused, never re-registered
                    self._seen.pop(r, None)
                    if self.ranks.pop(r, None) is not None:
                        self._registered -= 1
                self._cond.notify_all()
            _logging.event("switched_out", ranks=ranks, step=target, code=EXIT_CODE_SWITCHED)
            self._switch_req = None
            if self._recover("hot switch", target, views, t0):  # recover.py: MIGRATION -RECOVER-> ...
                return True
        else:
            _log.error("hot switch: ranks %s did not park (clean): %s", bad[:16],
                       {r: replies[r].detail for r in bad[:4] if r in replies})
            self.sm.fire(Result.FAIL, failed="clean")
        self._switch_req = None
        live = set(self._live()) - set(ranks) if not bad else set(self._live())
        views = [v if v.rank in live else policy.RankView(v.rank, False, True, target, v.data_status, v.replica)
                 for v in views]
        plan = policy.select_dump_ranks(views, target)
        self._mindx_call("report_result", int(ResultCode.DUMP_OR_EXIT), "hot switch failed",
                         {r: 1 for r in ranks}, "migration")
        _logging.event("fallback", src="hot switch", dst="dump" if plan.possible else "exit")
        if plan.possible:
            return self._run_dump({"lock": target, "plan": plan, "graceful": False})
        self.sm.fire(Result.EXIT, reason="hot switch failed, no dump possible")
        self._exit(EXIT_CODE_FAULT)
        return False
