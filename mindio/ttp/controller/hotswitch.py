"""Hot switch (亚健康热切): move sub-healthy ranks to new processes without losing a step; controller side.

``tft_notify_controller_prepare_action("hot switch", {rank: errtype})`` opens a *hot switch* incident;
the driver thread runs it (states: NORMAL -PAUSE-> PAUSE -MIGRATE-> MIGRATION -RECOVER-> ENV_CLEAR
-OK-> REPAIR -OK-> NORMAL). As the reference (backup pod first, then the pause):

0. backups, while training goes on (state NORMAL): the launcher agent owning each switched rank starts
   a backup in a warm spare (mindio/launch/switch.py; ``MINDIO_REBOOT_GEN=g+1``, ``MINDIO_REBOOT_TYPE=hot
   switch``). It runs the training script up to its ``init_process_group`` -- interpreter and imports
   (warm already), everything the script does before the world (data, ...), the gc freeze -- registers
   as the rank's backup (not a rank yet) and waits there (reboot.await_switch). The controller waits
   (<= MINDIO_RECOVER_TIMEOUT) until every backup registered; a backup that dies first, or a deadline,
   cancels the switch before any rank paused.
1. pause: every rank stops at one step ``T`` (pause.py's ``pause_query`` / ``pause_at``: all parked at
   the fence, optimizer state of step ``T`` complete); ``report_stop_complete(0, ...)``.
2. decide: with a cluster brain attached (``report_stop_complete`` callback registered) wait up to
   MINDIO_WAIT_MINDX_TIME for ``change_strategy("migration")`` (go) or ``prepare_action("stop switch")``
   (cancel); no answer cancels. Without a cluster brain the switch goes on at once.
3. switch out: every rank tears its groups down and parks (``clean``); the old processes of the switched
   ranks get ``exit(EXIT_CODE_SWITCHED)`` -- healthy, nothing lost, they leave cleanly -- and leave the
   rank table.
4. switch in: the recover-in-place sequence (recover.py, strategy "hot switch"): its replace step
   releases the waiting backups once the old processes exited; the others rebuild their groups with
   them in generation g+1 -- the collective part of the backup's start (default group, framework
   subgroups, model and optimizer build with Megatron's normal init order) is all that runs while the
   job is paused --, each registers and parks before ``train()``, its optimizer shard comes from a
   replica (RT_SEND -> RT_RECV_REPAIR), every rank rolls back to ``T`` (nothing to undo: nothing ran past
   ``T``) and trains on. The result is bitwise equal to an uninterrupted run.

Cancel (``stop switch`` -- accepted while the backups start too --, no decision in time, a pause that
fails, a backup that does not register):
the backups are dismissed (they exit 0), ``pause_resume`` if paused; training continues unchanged, no
process replaced. A rank failing meanwhile turns the switch into a fault incident. A failure after the
old processes left (a backup dying after its release, a repair that fails) falls back to a dump by the
remaining ranks at ``T`` (their replicas hold every shard), then exit.

Needs a *replacer*: the controller must be hosted by mindio-run's agent (``--high-availability``); the
reference's ClusterD starts the backup pod, ours is the agent's warm spare. ``MINDIO_SWITCH_PRESTART=0``
starts the backups only after the pause (the former order; kept to measure the difference:
bench/hotswitch_bench.py).
"""
from __future__ import annotations

import logging
import threading
import time

from ... import _knobs, _logging
from . import policy, sequence
from ... import vocab
from ...vocab import HOT_SWITCH_ACTIONS
from .dump import Dump
from .recover import Replace
from .strategy import Context
from .._enums import ActionName, EXIT_CODE_FAULT, EXIT_CODE_SWITCHED, Cause, OsStatus, ResultCode
from .states import Result, State

__all__ = ["HotSwitch", "EXIT_CODE_SWITCHED", "ACTIONS"]

_log = logging.getLogger("mindio.ttp.hotswitch")
ACTIONS = HOT_SWITCH_ACTIONS


class HotSwitch:
    """The hot switch (module docstring) as the controller's part (``Controller.hot_switch``): it owns
    the request in hand and the backups started and not released."""

    def __init__(self, core):
        self.core = core
        self.req: dict | None = None                  # {"ranks", "waiting"} of the switch in hand
        self.pending_backups: tuple | None = None     # (ranks, generation) of backups started, not released
        self.in_turn: threading.Thread | None = None  # switching sub-healthy ranks out, one after another

    # ------------------------------------------------------------------ sub-healthy ranks (a rank's request)
    def asked(self, rank: int, reason: str) -> None:
        """(I/O thread) Rank ``rank`` asks for ``reason`` = "R1,R2,... why": its holders found sub-healthy
        (mindio.megatron.verified: two replica mismatches within the window), this rank among them. They are
        hot-switched out one after another (a backup takes each one's state from the other holder), as
        :meth:`_in_turn` says; a request while one is in hand is logged and dropped."""
        head, _, why = reason.partition(" ")
        try:
            ranks = sorted({int(r) for r in head.split(",")})
        except ValueError:
            ranks = []
        if rank not in ranks or len(ranks) > 16 or any(r not in self.core.ranks for r in ranks):
            _log.warning("rank %d asked to switch out ranks %r: refused (a rank asks for itself and known ranks "
                         "only, 16 at most)", rank, head[:80])
            return
        if self.in_turn is not None and self.in_turn.is_alive():
            _log.warning("rank %d asked to switch out ranks %s: ranks are being switched out already", rank, ranks)
            return
        _log.warning("ranks %s are sub-healthy (asked by rank %d: %s): switching them out one after another",
                     ranks, rank, why[:300])
        _logging.event("sub_healthy", ranks=ranks, asked_by=rank, why=why[:300])
        self.in_turn = threading.Thread(target=self._in_turn, args=(ranks,), name="mindio-sub-healthy", daemon=True)
        self.in_turn.start()

    def _in_turn(self, ranks: list) -> None:
        """(its own thread) Hot-switch ``ranks`` out one at a time, each once the job trains again (NORMAL, no
        incident): switching two holders of one shard at once would leave their backups no replica to take the
        shard from. A switch refused or not done (no launcher agent, no backup, cancelled) turns the rest into a
        fault incident: recovered as failed ranks (recover, else a dump), never left training."""
        bound = self.core.replacements.timeout + 4 * self.core.action_limit
        for i, rank in enumerate(ranks):
            if not self._training_again(bound, ranks[i:]):
                return
            before = self.core.replacements.replaced.get(rank)
            rc = self.notify_prepare_action("hot switch", [rank])
            _logging.event("sub_healthy_switch", rank=rank, accepted=rc == 0)
            if rc == 0 and not self._training_again(bound, ranks[i:]):
                return
            if self.core.replacements.replaced.get(rank) == before:  # refused, cancelled or failed
                with self.core.lock:
                    rest = {r: 1 for r in ranks[i:] if r in self.core.ranks and self.core.ranks[r].alive}
                if not rest:
                    _log.warning("sub-healthy ranks %s: not switched out: they left (the job ended)", ranks[i:])
                    return
                _log.error("sub-healthy ranks %s: rank %d was not switched out; handled as failed ranks %s", ranks[i:],
                           rank, sorted(rest))
                self.core.incidents.notify_stop_train(rest)
                return
            _log.warning("sub-healthy rank %d switched out (%d of %d)", rank, i + 1, len(ranks))

    def _training_again(self, bound: float, waiting: list) -> bool:
        """Wait (<= ``bound`` s) until the job is in NORMAL training with no incident open; False (logged) if
        not, or when the controller stops."""
        end = time.monotonic() + bound
        while not self.core.stop.is_set():
            with self.core.lock:
                if self.core.sm.state is State.NORMAL and self.core.incidents.current is None:
                    return True
            if time.monotonic() > end:
                _log.error("sub-healthy ranks %s not switched out: the job was not training again within %.0f s "
                           "(MINDIO_RECOVER_TIMEOUT + 4 x TTP_NORMAL_ACTION_TIME_LIMIT)", waiting, bound)
                return False
            self.core.stop.wait(0.05)
        return False

    def notify_prepare_action(self, action: str, ranks: list) -> int:
        """Cluster brain: 0 accepted, 1 refused (the reason is logged)."""
        if action == "stop switch":
            with self.core.lock:
                pending = self.req is not None and self.req.get("waiting")
                if pending:
                    self.core.incidents.change_strategy("stop switch")
            if not pending:
                _log.error("stop switch: no hot switch is waiting for a decision")
            return 0 if pending else 1
        why = ""
        with self.core.lock:
            if self.core.sm.state is not State.NORMAL or self.core.incidents.current is not None:
                why = f"the job is in {self.core.sm.state.value}, not in NORMAL training"
            elif any(not (r in self.core.ranks and self.core.ranks[r].alive) for r in ranks):
                why = f"ranks {ranks} are not all registered and alive"
        if not why and not self.core.replacements.possible("hot switch", ranks):  # recover.py
            why = ("no launcher agent hosts this controller (run under mindio-run with --high-availability)"
                   if self.core.replacements.replacer is None else f"the launcher cannot start backups for ranks {ranks}")
        if why:
            _log.error("hot switch of ranks %s refused: %s", ranks[:16], why)
            return 1
        early = bool(_knobs.get("MINDIO_SWITCH_PRESTART") and hasattr(self.core.replacements.replacer, "prestart"))
        with self.core.lock:  # "stop switch" is accepted while the backups start too (early)
            self.req = {"ranks": sorted(ranks), "waiting": early}
            self.core.incidents.expect()
        self.core.incidents.open(None, None, cause=Cause.HOT_SWITCH)
        return 0

    # ------------------------------------------------------------------ driver thread
    def run(self, inc) -> bool:
        """(driver thread, incident.py) Run the hot switch incident ``inc``; whether the job goes on."""
        ranks, gen = self.req["ranks"], self.core.gen + 1
        if _knobs.get("MINDIO_SWITCH_PRESTART") and hasattr(self.core.replacements.replacer, "prestart"):
            self.pending_backups = (ranks, gen)  # dismissed on every way out but a switch done (_dismiss)
            why = self._start_backups(inc, ranks, gen)
            if why:
                self._dismiss()
                return self.core.incidents.as_fault() if why == "fault" else self._cancel_unpaused(why)
        self.core.sm.fire(Result.PAUSE, hot_switch=ranks[:16])
        live = sequence.live_ranks(self.core)
        if len(live) < self.core.world_size or self.core.incidents.faulted(inc):
            return self._fault_now() if self.core.incidents.faulted(inc) else self._cancel_switch(live, "ranks missing")
        caps = self.core.call(ActionName.PAUSE_QUERY, {}, live, self.core.action_limit)
        target = max((c.detail["limit"] for c in caps.values() if c.ok), default=0)
        replies = {} if len(caps) < len(live) else self.core.call(
            ActionName.PAUSE_AT, {"step": target, "timeout": self.core.action_limit / 2}, live, self.core.action_limit)
        if self.core.incidents.faulted(inc):
            return self._fault_now()
        bad = sorted(r for r in live if r not in replies or not replies[r].ok)
        if bad:
            _log.error("hot switch: ranks %s did not pause at step %d", bad[:16], target)
            self.core.incidents.mindx_call("report_stop_complete", int(ResultCode.NOT_READY),
                                          f"pause for the hot switch failed on ranks {bad[:16]}", {r: 1 for r in ranks})
            return self._cancel_switch(live, "pause failed")
        _log.warning("hot switch of ranks %s: every rank paused at step %d (%.3f s after the request)", ranks,
                     target, time.monotonic() - inc.t0)
        _logging.event("hot_switch_paused", step=target, ranks=ranks)
        with self.core.lock:
            self.req["waiting"] = True
        self.core.incidents.mindx_call("report_stop_complete", int(ResultCode.OK),
                                      f"training paused at step {target} for the hot switch of ranks {ranks[:16]}",
                                      {r: 1 for r in ranks})
        choice = self._switch_decision(inc)
        with self.core.lock:
            self.req["waiting"] = False
        if choice == "fault":
            return self._fault_now()
        if choice != "migration":
            return self._cancel_switch(live, choice)
        return self._switch(ranks, target, inc.t0)

    def _start_backups(self, inc, ranks: list, gen: int) -> str:
        """Start the backups (the launcher's warm spares run the script up to its init_process_group)
        and wait until every one registered, while training goes on. '' when they did, else why not."""
        t0 = time.monotonic()
        try:
            self.core.replacements.replacer.prestart(ranks, gen)
        except Exception as exc:
            _log.error("hot switch: starting backups for ranks %s failed: %s", ranks[:16], exc)
            return f"the backups could not be started ({exc})"
        end = t0 + self.core.replacements.timeout
        while True:
            if self.core.incidents.faulted(inc):
                return "fault"
            with self.core.lock:
                if self.core.incidents.chosen == "stop switch":
                    return "stop switch"
            ready, dead = self.core.replacements.replacer.backups(ranks, gen)
            if dead:
                _log.error("hot switch: backups exited before they registered: %s", dead)
                _logging.event("switch_backup_failed", ranks=sorted(dead), why=list(dead.values())[:4])
                return f"the backup of ranks {sorted(dead)[:16]} exited before it registered"
            if len(ready) == len(ranks):
                with self.core.lock:
                    if self.core.incidents.chosen == "stop switch":
                        return "stop switch"
                    self.req["waiting"] = False  # until the pause is complete
                break
            if time.monotonic() > end or self.core.stop.wait(0.02):
                _log.error("hot switch: backups of ranks %s did not register within %.0f s",
                           sorted(set(ranks) - set(ready))[:16], self.core.replacements.timeout)
                return "the backups did not register in time"
        took = time.monotonic() - t0
        _log.warning("hot switch: backups of ranks %s registered %.3f s after their start (pids %s); training "
                     "went on meanwhile", ranks[:16], took, ready)
        _logging.event("hot_switch_backups_ready", ranks=ranks, gen=gen, pids=ready, start_s=round(took, 6))
        return ""

    def _dismiss(self) -> None:
        """Backups started for this switch and not released (yet) leave."""
        pending, self.pending_backups = self.pending_backups, None
        if pending:
            try:
                self.core.replacements.replacer.dismiss(*pending)
            except Exception:
                _log.exception("hot switch: dismissing the backups failed (the agent stops them at the round's "
                               "end, else they leave at their deadline)")

    def _fault_now(self) -> bool:
        self._dismiss()
        return self.core.incidents.as_fault()

    def _cancel_unpaused(self, why: str) -> bool:
        """The switch is off before any rank paused: close the incident; training was never touched."""
        _log.warning("hot switch cancelled (%s) before the pause: training continues unchanged", why)
        _logging.event("hot_switch_cancelled", why=why)
        with self.core.lock:
            faulted = bool(self.core.incidents.current.primary)
            if not faulted:
                self.core.incidents.close()
        self.req = None
        if faulted:
            return self.core.incidents.as_fault()
        self._report_continued(why)
        return True

    def _report_continued(self, why: str) -> None:
        self.core.incidents.mindx_call("report_result", int(ResultCode.OK),
                                      f"hot switch cancelled ({why}); training continued", {}, "continue")

    def _switch_decision(self, inc) -> str:
        if "report_stop_complete" not in self.core.mindx:
            return "migration"  # no cluster brain: the caller of prepare_action wants it done
        end = time.monotonic() + _knobs.get("MINDIO_WAIT_MINDX_TIME")
        while time.monotonic() < end:
            if self.core.incidents.faulted(inc):
                return "fault"
            if self.core.incidents.answered.wait(min(0.1, max(0.0, end - time.monotonic()))):
                self.core.incidents.answered.clear()
                if self.core.incidents.chosen in ("migration", "stop switch"):
                    return self.core.incidents.chosen
                _log.error("change_strategy(%r) is not possible during a hot switch (migration, or "
                           "prepare_action('stop switch'))", self.core.incidents.chosen)
        _log.error("hot switch: no migration / stop switch within MINDIO_WAIT_MINDX_TIME; cancelled")
        return "no decision"

    def _cancel_switch(self, live: list, why: str) -> bool:
        self._dismiss()
        _log.warning("hot switch cancelled (%s): training continues unchanged", why)
        _logging.event("hot_switch_cancelled", why=why)
        ok = self.core.pause.end(live, f"hot switch cancelled: {why}")  # pause.py
        self._report_continued(why)
        self.req = None
        return ok

    def _switch(self, ranks: list, target: int, t0: float) -> bool:
        self.core.sm.fire(Result.MIGRATE, lock_step=target, ranks=ranks[:16])
        everyone = sequence.live_ranks(self.core)
        replies = self.core.call(ActionName.CLEAN, {"timeout": self.core.action_limit}, everyone, self.core.action_limit)
        bad = sorted(r for r in everyone if r not in replies or not replies[r].ok)
        with self.core.lock:  # the switched ranks count as dead: the repair takes their shards from replicas
            views = [policy.RankView(r.rank, r.alive and r.rank not in ranks, r.rank in ranks, target,
                                     int(OsStatus.UPDATED), tuple(r.replica)) for r in self.core.ranks.values()]
        reserved = self.pending_backups[1] if self.pending_backups else self.core.gen + 1
        if reserved != self.core.gen + 1:  # cannot happen: one driver thread bumps the generation
            _log.error("hot switch: backups wait for generation %d, the switch builds %d", reserved, self.core.gen + 1)
            self._dismiss()
            bad = everyone
        if not bad:
            self.core.call(ActionName.EXIT, {"code": EXIT_CODE_SWITCHED}, ranks, 10.0)
            with self.core.cond:
                for r in ranks:  # gone on purpose: dead for the recover sequence, never declared dead
                    self.core.replacements.replaced[r] = self.core.gen + 1  # its last frames are refused, never re-registered
                    self.core.liveness.seen.pop(r, None)
                    if self.core.ranks.pop(r, None) is not None:
                        self.core.registered -= 1
                self.core.cond.notify_all()
            _logging.event("switched_out", ranks=ranks, step=target, code=EXIT_CODE_SWITCHED)
            self.req = None  # the backups are released by the replace step of the recover sequence
            if Replace(vocab.Strategy.HOT_SWITCH.value).steps(self.core, target, views, t0):  # MIGRATION -RECOVER-> ...
                self.pending_backups = None  # released by the recover sequence's replace step: ranks now
                return True
            self._dismiss()  # any backup not released yet
        else:
            _log.error("hot switch: ranks %s did not park (clean): %s", bad[:16],
                       {r: replies[r].detail for r in bad[:4] if r in replies})
            self._dismiss()
            self.core.sm.fire(Result.FAIL, failed="clean")
        self.req = None
        live = set(sequence.live_ranks(self.core)) - set(ranks) if not bad else set(sequence.live_ranks(self.core))
        views = [v if v.rank in live else policy.RankView(v.rank, False, True, target, v.data_status, v.replica)
                 for v in views]
        plan = policy.select_dump_ranks(views, target)
        self.core.incidents.mindx_call("report_result", int(ResultCode.DUMP_OR_EXIT), "hot switch failed",
                                      {r: 1 for r in ranks}, "migration")
        _logging.event("fallback", src="hot switch", dst="dump" if plan.possible else "exit")
        if plan.possible:
            Dump().run(self.core, Context(target, views, plan=plan))
            return False
        self.core.sm.fire(Result.EXIT, reason="hot switch failed, no dump possible")
        self.core.incidents.exit(EXIT_CODE_FAULT)
        return False
