"""What the controller does once something went wrong: the incident flow (driver thread).

An incident (the dump flow; the retry strategy is in retry.py; recover/elastic belong to later issues):

1. a REPORT, a dead rank, a hung rank, or the cluster brain opens it: NORMAL -FAULT-> ABNORMAL;
2. ``stop`` to every live rank: each holds its fence and answers once its main thread is quiet
   (parked in the decorator or blocked before its next optimizer update); a rank that dies meanwhile
   is dropped from the wait by the liveness sweep -- so every rank is accounted for;
3. lock step = the highest step of a healthy rank at which every shard has a usable copy
   (policy.choose_lock_step; normally the one step every healthy rank stopped at); policy picks the
   feasible strategies (and the cluster brain, if registered, chooses among them within
   MINDIO_WAIT_MINDX_TIME);
4. dump: ``save(step, save_info)`` on one usable rank per optimizer shard, then ``rename(step)`` on one
   of them -- only after every save succeeded, so the checkpoint becomes "latest" only when complete;
5. ``exit(code)`` to every registered rank (awaited from the live ones): EXIT_CODE_DUMPED after a complete
   dump, EXIT_CODE_FAULT otherwise; the order stands for ranks heard later (:meth:`IncidentFlow.carry`).
   No dump at lock step 0: nothing to save (policy.plan_dump).

When "retry" is enabled and possible it is tried first (retry.py); if it succeeds the driver waits for
the next incident, if any step of it fails the flow falls back to dump (then exit) as above. A rank that
reports RS_REPEATED (after a relaunch, the exception the previous launch dumped after, at the same step:
processor/repeats.py) ends the job at once with EXIT_CODE_REPEATED, one line naming the step, the rank
and the exception (:meth:`IncidentFlow.end_repeated`).

The cluster brain (tft_notify_controller_* / tft_register_mindx_callback) enters here too.
:class:`IncidentFlow` is a part of :class:`mindio.ttp.controller.controller.Controller` (``core.incidents``): it owns
the open incident and what the driver thread waits on, and uses the controller's rank table, lock,
state machine and action engine.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from ... import _knobs, _logging
from . import dump, policy, sequence
from .actions import ControllerClosed
from ..wire import protocol as P
from .brain import RankFault, fault_key, result_code
from .._enums import ActionName, EXIT_CODE_DUMPED, EXIT_CODE_FAULT, EXIT_CODE_REPEATED, Cause, ReportState, ResultCode
from .states import Result, State
from .strategy import Context, Outcome

__all__ = ["IncidentFlow", "Incident", "Facts", "OPEN_STATES"]

_log = logging.getLogger("mindio.ttp.incident")
OPEN_STATES = (State.INIT, State.NORMAL, State.PAUSE, State.DOWNGRADE)


@dataclass
class Incident:
    """The open incident (one at a time; the I/O thread adds ranks to it under the controller's lock,
    the driver thread runs it). The facts its decision is made on are policy.Incident."""
    cause: Cause              # why it opened (vocab.Cause; its value in logs and events)
    first: int | None         # the rank that opened it (None: a request)
    t0: float = field(default_factory=time.monotonic)
    primary: dict = field(default_factory=dict)   # rank -> ReportState of its primary report (or a death)
    seen: dict = field(default_factory=dict)      # rank -> time.monotonic() its fault was first seen
    messages: dict = field(default_factory=dict)  # rank -> the message of its report
    secondaries: set = field(default_factory=set)  # ranks that reported a secondary error (named at the decision)

    def add(self, rank: int, state: ReportState | None, message: str = "") -> None:
        """(under the controller's lock) ``rank`` failed with ``state`` (None: it died)."""
        self.primary[rank] = state if state is not None else ReportState.RS_UNKNOWN
        self.seen.setdefault(rank, time.monotonic())
        if message:
            self.messages[rank] = message


@dataclass
class Facts:
    """What an incident's decision is made on (:meth:`IncidentFlow.facts`, after the stop round)."""
    graceful: bool        # a requested dump (no fault)
    lock: int             # the lock step (policy.choose_lock_step)
    views: list           # policy.RankView of every rank of the job
    plan: policy.DumpPlan  # who saves which shard at the lock step
    faulty: list          # the faulty ranks
    repairable: bool      # every shard of a faulty rank has a usable replica
    primary: dict         # rank -> ReportState of its primary report (or a death)
    seen: dict            # rank -> when its fault was first seen
    messages: dict        # rank -> the message of its report
    repeated: list        # ranks that met the previous launch's exception again (RS_REPEATED)
    # (not judged when the job ends at once for ``repeated``)
    lacking: dict = field(default_factory=dict)  # rank -> the handlers it did not register (no in-place strategy)
    incident: policy.Incident | None = None  # the facts as policy.feasible_strategies reads them
    enabled: set = field(default_factory=set)  # the job's strategies (the brain's filter; "dump" for a requested one)
    feasible: list = field(default_factory=list)  # policy's feasible strategies, in its order


class IncidentFlow:
    """The incident flow as the controller's part (``Controller.incidents``): it owns the open incident,
    the driver thread's wake-up, the cluster brain's answer in hand (change_strategy / "stop switch")
    and a requested dump not yet started; the rank table, lock, state machine and action engine are the
    controller's."""

    def __init__(self, core):
        self.core = core
        self.current: Incident | None = None  # the open incident (the I/O thread adds ranks under the lock)
        self.wakeup = threading.Event()  # the driver thread: an incident, an upgrade or close()
        self.answered = threading.Event()  # the cluster brain answered (change_strategy, "stop switch")
        self.chosen: str | None = None  # its answer
        self.mindx_wait: float | None = None  # the next negotiation's wait (notify_stop_train's ``wait``)
        self.dump_wanted: str | None = None  # why a last-words checkpoint was requested, until one starts
        self.order: tuple[int, int] | None = None  # the job's exit order once given: (code, sn)
        self.told: dict = {}  # rank -> when it was last sent the exit order
        self.resent_logged = (0.0, 0)  # (when carry() last logged, ranks sent the order again since)
        self.carried: set = set()  # ranks that confirmed the exit order (I/O thread)

    def expect(self) -> None:
        """Forget the cluster brain's earlier answer: the next one is awaited."""
        self.chosen = None
        self.answered.clear()

    def close(self) -> None:
        """(under the controller's lock) The open incident is over; the driver thread waits for the next."""
        self.current = None
        self.wakeup.clear()

    def faulted(self, inc: Incident) -> bool:
        """Whether a rank failed (reported or died) in ``inc`` since it opened."""
        with self.core.lock:
            return bool(inc.primary)

    def as_fault(self) -> bool:
        """A pause or a hot switch during which a rank failed: the incident is handled as a fault."""
        _log.error("a rank failed during the pause; handling it as a fault")
        self.current.cause = Cause.FAULT
        return self.run()

    # ------------------------------------------------------------------ incidents
    def open(self, rank: int | None, state: ReportState | None, cause: Cause = Cause.FAULT,
             message: str = "") -> bool:
        """Open an incident (or add ``rank`` to the one open); whether this call opened it."""
        if not self.core.active:
            return False
        opened = False
        with self.core.lock:
            inc = self.current
            if inc is None:
                if self.core.sm.state not in OPEN_STATES:
                    return False
                inc = self.current = Incident(Cause(cause), rank)
                self.wakeup.set()
                opened = True
            if rank is not None and (state is None or policy.is_primary(state)):
                inc.add(rank, state, message)
            elif rank is not None and state is ReportState.RS_NORMAL and message:
                inc.secondaries.add(rank)  # (the rank found it secondary itself: decorator, policy)
        return opened

    def secondary(self, rank: int, state: ReportState, message: str) -> ReportState:
        """(I/O thread, under the lock) ``state`` of a report, or RS_NORMAL when it is secondary: an
        RS_UNKNOWN or RS_RETRY (a generic exception: the rank had not heard of the incident yet) from a rank
        not already faulty, while an incident is open, whose message is what the
        incident itself causes on its peers -- a collective timed out waiting for a stopped or torn-down
        rank, a closed connection, an aborted or destroyed group (policy.secondary_in_incident). Such a
        rank stays healthy: its state is usable for the dump and repair, as the reference treats a
        FORCE STOP."""
        inc = self.current
        if state is ReportState.RS_NORMAL and message:  # the rank found it secondary itself (decorator); counted
            _log.info("rank %d: secondary error: %s", rank, message[:200])  # by open(), which comes next
            return state
        if inc is None or state not in (ReportState.RS_UNKNOWN, ReportState.RS_RETRY) or rank in inc.primary \
                or not policy.secondary_in_incident(message):
            return state
        inc.secondaries.add(rank)
        _log.info("rank %d: %s -- after the incident of rank %s began: secondary, not a new fault", rank,
                  message[:200], inc.first)
        _logging.event("secondary_error", from_rank=rank, message=message[:300], first=inc.first)
        return ReportState.RS_NORMAL

    def error_ranks(self) -> dict:
        with self.core.lock:  # the I/O thread adds ranks to the incident while the driver reads it
            primary = dict(self.current.primary) if self.current is not None else {}
        return {r: 0 if s in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED) else 1 for r, s in primary.items()}

    def mindx_call(self, action: str, *args) -> None:
        func = self.core.mindx.get(action)
        if func is not None:
            try:
                func(*args)
            except Exception:
                _log.exception("cluster-brain callback %s failed", action)

    def drive(self) -> None:
        while not self.core.stop.is_set():
            self.wakeup.wait()  # idle until an incident, an upgrade or close(): nobody is awaited
            if self.core.stop.is_set():
                return
            try:
                if self.core.elastic.upgrade_due():  # elastic_flow.py: standbys offer every removed rank back
                    if self.core.elastic.run_upgrade():
                        continue
                    return
                if self.run():
                    self.serve_dump_request()  # a preemption during the recovery: its dump now
                    continue  # retried: every rank trains again; wait for the next incident
            except ControllerClosed as exc:  # close() during the incident: nothing more is done
                _log.warning("incident handling ended: %s", exc)
                return
            except Exception:
                _log.exception("incident handling failed; stopping the job without a dump")
                self.exit(EXIT_CODE_FAULT)
            return  # after a dump or an exit the job ends (FINAL)

    def run(self) -> bool:
        """One incident; True when the job goes on (retry succeeded, pause continued), False when it ends.
        A fault or a requested dump: :meth:`stop` -> :meth:`facts` -> :meth:`decide` -> :meth:`execute`."""
        inc = self.current
        if inc.cause is Cause.HOT_SWITCH:
            return self.core.hot_switch.run(inc)
        if inc.cause is Cause.PAUSE:
            return self.core.pause.run(inc)
        facts = self.facts(inc, self.stop(inc))
        if facts.repeated and not facts.graceful:
            return self.end_repeated(facts.repeated, facts.messages)
        return self.execute(self.decide(inc, facts), facts)

    def stop(self, inc: Incident) -> dict:
        """The incident begins: ABNORMAL (or DUMP for a requested dump), the cluster brain hears of the
        faulty ranks, every live rank is stopped (stopround.StopRound) and the brain hears how that went.
        {rank: Reply of its stop} (the latest reply of each live rank)."""
        graceful = inc.cause is Cause.DUMP_REQUEST
        self.core.sm.fire(Result.DUMP if graceful else Result.FAULT, first_rank=inc.first, cause=inc.cause.value)
        self.mindx_call("report_fault_ranks", self.error_ranks())
        live = sequence.live_ranks(self.core)
        # a rank answers "stop" when quiet, or after half the limit anyway: the held fence keeps its step
        # from moving, and a rank caught mid-update reports UPDATING and is simply not usable
        params = {"timeout": self.core.action_limit / 2, "stop_clean": bool(_knobs.get("TTP_STOP_CLEAN_BEFORE_DUMP"))}
        replies = self.core.stop_round.run(live, params)  # stopround.py: a rank blocked behind a fenced one is released
        stopped = all(r in replies and replies[r].ok for r in live)
        self.mindx_call("report_stop_complete", int(ResultCode.OK if stopped else ResultCode.NOT_READY),
                        "training stopped" if stopped else "some ranks did not confirm the stop", self.error_ranks())
        return replies

    def facts(self, inc: Incident, replies: dict) -> Facts:
        """What the decision is made on, after the stop round's ``replies``: the ranks' views, the lock step
        (the highest with a usable copy of every shard), the dump plan, the faulty ranks and whether
        they can be repaired, the incident's reports, and policy's feasible strategies.

        Judged again when a rank was declared dead while they were gathered (at most once per rank of
        the job): the launcher's check of a silent node takes up to 1 s (:meth:`spare_available`), and a
        rank of a lost node can answer the stop and die within it (seen in CI: rank 3 of a killed node
        replied, died 50 ms later, and the decision named rank 2 alone as faulty and kept rank 3 in the
        dump plan)."""
        for _ in range(len(self.core.ranks) + 1):
            with self.core.lock:
                before = frozenset(self.core.ranks.dead())
            facts = self._facts(inc, replies)
            with self.core.lock:
                after = frozenset(self.core.ranks.dead())
            if after == before:
                return facts
            _log.info("rank(s) %s declared dead while the decision's facts were gathered: judged again",
                      sorted(after - before)[:16])
        return facts

    def _facts(self, inc: Incident, replies: dict) -> Facts:
        graceful = inc.cause is Cause.DUMP_REQUEST
        views = self.views(replies)
        shards = policy.ShardMap(views)  # every rank's shards, looked up once for the whole decision
        lock = policy.choose_lock_step(shards)
        stale = policy.stale_ranks(views, lock)
        if any(v.step != lock for v in views if v.rank in stale):
            _log.warning("the stop caught the ranks at different steps (%s); lock step %d, the highest with a "
                         "usable copy of every shard; retry and recover repair ranks %s from replicas",
                         {v.rank: v.step for v in views if v.alive and not v.faulty and v.rank < 16}, lock,
                         stale[:16])
            _logging.event("mixed_steps", lock_step=lock, stale=stale[:64],
                           steps={str(v.rank): v.step for v in views[:64] if v.alive})
        plan = policy.plan_dump(shards, lock)  # none at step 0: nothing to save
        faulty = [v.rank for v in views if v.faulty]
        try:
            policy.select_repair_sources(shards, lock, faulty)
            repairable = bool(faulty)
        except ValueError:
            repairable = False
        with self.core.lock:
            primary, seen, messages = dict(inc.primary), dict(inc.seen), dict(inc.messages)
        repeated = sorted(r for r, s in primary.items() if s is ReportState.RS_REPEATED)
        if repeated and not graceful:  # the job ends at once (end_repeated): nothing more to judge
            return Facts(graceful, lock, views, plan, faulty, repairable, primary, seen, messages, repeated)
        dead = frozenset(v.rank for v in views if not v.alive)
        lacking = {r: rep.detail["missing"] for r, rep in replies.items() if rep.ok and rep.detail.get("missing")}
        incident = policy.Incident(states=primary, dead=dead, repair_possible=repairable, dump_possible=plan.possible,
                                   spare_available=self.spare_available(dead),
                                   in_place_possible=not lacking)
        enabled = self.core.brain.enabled(self.core.job_strategies()) | ({"dump"} if graceful else set())
        return Facts(graceful, lock, views, plan, faulty, repairable, primary, seen, messages, repeated, lacking,
                     incident, enabled, policy.feasible_strategies(enabled, incident))

    def decide(self, inc: Incident, facts: Facts) -> list:
        """The strategies to try, in order, from the chosen one (the cluster brain's choice within
        MINDIO_WAIT_MINDX_TIME, or the first of the order), ending with "exit"; ``last_decision`` and
        the ``decision`` event say why."""
        graceful, feasible, enabled, incident = facts.graceful, facts.feasible, facts.enabled, facts.incident
        lacking, primary, faulty, lock, plan = facts.lacking, facts.primary, facts.faulty, facts.lock, facts.plan
        if lacking and not graceful:
            blocked = [s for s in policy.feasible_strategies(enabled, replace(incident, in_place_possible=True))
                       if s not in feasible]
            if blocked:
                _log.warning("%s would be possible, but they call the repair and rollback handlers on every rank "
                             "and ranks %s did not register %s (tft_register_repair_handler, "
                             "tft_register_rollback_handler)", blocked, sorted(lacking)[:16],
                             lacking[min(lacking)])
        alive = {v.rank: v.alive for v in facts.views}
        faults = [RankFault(r, fault_key(primary.get(r), alive.get(r, False)), facts.messages.get(r, ""),
                            facts.seen.get(r, inc.t0)) for r in sorted(set(primary) | set(faulty))]
        added = [] if graceful else self.added_strategies(enabled, incident)
        feasible = feasible[:-1] + added + feasible[-1:]
        order, verdict = self.core.brain.plan(faults, feasible, self.core.implemented_strategies())
        for name in added:  # a strategy policy.py does not know goes right before the one it names
            before = self.core.strategies[name].before
            order.insert(order.index(before) if before in order else order.index("exit"), name)
        strategy = order[0] if graceful else self.negotiate(order)  # a requested dump: nothing to ask
        latency = time.monotonic() - inc.t0
        self.core.last_decision = {"strategy": strategy, "lock_step": lock, "save_info": plan.save_info,
                                   "decided_at": time.time(), "faulty": faulty,
                                   "missing_shards": [list(map(str, m)) for m in plan.missing],
                                   "feasible": feasible, "order": order, "level": verdict.level,
                                   "why": {str(r): w for r, (_lv, w) in list(verdict.ranks.items())[:16]},
                                   "latency_s": latency}
        _log.warning("incident decision after %.3f s: %s (lock step %d, faulty %s, level %s, order %s, "
                     "feasible %s)", latency, strategy, lock, faulty[:16], verdict.level, order, feasible)
        if inc.secondaries:
            _log.warning("ranks %s saw secondary errors (the fault of %s reaching them, e.g. gloo's 'Connection "
                         "closed by peer'): expected, logged at INFO", sorted(inc.secondaries)[:16], faulty[:16])
        _logging.event("decision", **self.core.last_decision)
        retryable = bool(primary) and set(primary.values()) <= {ReportState.RS_UCE, ReportState.RS_HCCL_FAILED,
                                                                ReportState.RS_RETRY}
        if "retry" in enabled and retryable and not graceful and "retry" not in feasible and not lacking:
            _log.warning("retry is enabled but not possible for this incident (reports %s, dead %s, every "
                         "shard of a UCE rank has a usable replica: %s); using %s",
                         {r: s.name for r, s in list(primary.items())[:16]}, sorted(incident.dead)[:16],
                         facts.repairable, strategy)
        return order[order.index(strategy):] if strategy in order else order

    def execute(self, order: list, facts: Facts) -> bool:
        """Run the strategies of ``order`` until one resumes training (True) or ends the job (False); a
        strategy that fails falls back to the next; "exit" (or none left): the exit order, False."""
        lock, enabled = facts.lock, facts.enabled
        ctx = Context(lock, facts.views, facts.primary, facts.plan, self.current.t0, facts.graceful)
        for i, strategy in enumerate(order):
            if strategy == "exit":
                break
            if strategy != "dump" or ctx.plan.possible:
                outcome = self.core.strategies[strategy].run(self.core, ctx)
                if outcome is not Outcome.FAILED:
                    return outcome is Outcome.RESUMED  # True: the job trains again; False: it ended
            left = [s for s in order[i + 1:] if s != "dump" or ctx.plan.possible]
            _log.error("%s failed; falling back to %s (remaining %s)", strategy, left[0], left)
            self.mindx_call("report_result", int(result_code(left)), f"{strategy} failed", self.error_ranks(), strategy)
            _logging.event("fallback", src=strategy, dst=left[0])
        if lock <= 0 and "dump" in enabled:
            dump.nothing_to_save(lock)
        elif ctx.plan.missing and "dump" in enabled:
            dump.no_writer(ctx.views, lock, ctx.plan.missing)
        self.core.sm.fire(Result.FAIL if self.core.sm.state is State.DUMP else Result.EXIT,
                          reason="nothing to save at step 0" if lock <= 0 and "dump" in enabled else
                          "no dump possible" if ctx.plan.missing else "exit chosen")
        self.exit(EXIT_CODE_FAULT)
        return False

    def end_repeated(self, ranks: list, messages: dict) -> bool:
        """Ranks met, at the same step, the exception the job's previous launch dumped after
        (processor/repeats.py): a relaunch would meet it again, and a dump would save the state it
        started from. One line per rank (its message names the step, the rank and the exception), then
        EXIT_CODE_REPEATED to every rank: the launcher does not relaunch on it."""
        for rank in ranks:
            _log.error("rank %d: %s", rank, messages.get(rank, "the same exception at the same step again"))
        _logging.event("deterministic_fault", ranks=ranks[:64],
                       messages={str(r): messages.get(r, "")[:300] for r in ranks[:8]})
        self.mindx_call("report_result", int(ResultCode.EXIT_ONLY), "the same fault at the same step after "
                        "the relaunch", self.error_ranks(), "exit")
        self.exit(EXIT_CODE_REPEATED)
        return False

    def spare_available(self, dead: frozenset) -> bool:
        """Can recover replace the dead ranks? Judged, as ``Replace.run`` judges it, on the ranks dead when
        asked: the launcher's check probes a silent node (up to 1 s), and a node found lost takes its other
        ranks with it (they die with their agent) -- one of them may have answered the stop just before.
        Seen under load: rank 3 of a killed node replied to the stop and died 50 ms later; recover was
        judged on rank 2 alone (not a whole node), found impossible, and the job dumped instead of moving
        node 1 to its standby."""
        rep = self.core.replacements
        if rep.possible("recover", dead):
            return True
        with self.core.lock:
            now = dead | frozenset(self.core.ranks.dead())
        if now == dead or not rep.possible("recover", now):
            return False
        _log.info("recover judged on the ranks dead now %s (the stop round saw %s dead)", sorted(now)[:16],
                  sorted(dead)[:16])
        return True

    def views(self, replies: dict) -> list:
        """What the decision sees of every rank of the job after the stop round's ``replies``."""
        with self.core.lock:
            self.core.ranks.after_stop(replies)  # each rank's step and data status as its reply says
            views = self.core.ranks.views(replies)  # from the rank table's columns (ranks.py)
        missing = sorted(set(self.core.elastic.job_ranks()) - set(self.core.ranks))  # without the removed ranks
        return views + [policy.RankView(r, alive=False, faulty=True) for r in missing]

    # ------------------------------------------------------------------ strategies
    def added_strategies(self, enabled: set, facts: policy.Incident) -> list:
        """Strategies of ``STRATEGIES`` that policy.py does not know and that say they are feasible."""
        return [name for name, s in self.core.strategies.items()
                if name not in policy.STRATEGY_ORDER and s.feasible(self.core, enabled, facts)]

    def settle(self) -> None:
        """Before exiting a job that had no fault (requested dump, exit while paused): every rank tears its
        healthy process groups down and parks first (the ``clean`` action), so no rank leaves while a peer
        still destroys a group connected to it -- seen as ``terminate called`` (SIGABRT) at exit on gloo."""
        live = sequence.live_ranks(self.core)
        replies = self.core.call(ActionName.CLEAN, {"timeout": self.core.action_limit / 2}, live, self.core.action_limit)
        bad = [r for r in live if r not in replies or not replies[r].ok]
        if bad:
            _log.error("ranks %s did not tear down before the exit: %s", bad[:16],
                       {r: replies[r].detail for r in bad[:4] if r in replies})

    def negotiate(self, strategies: list[str]) -> str:
        if "report_strategies" not in self.core.mindx:
            return strategies[0]
        self.expect()
        self.mindx_call("report_strategies", self.error_ranks(), list(strategies))
        wait, self.mindx_wait = self.mindx_wait or _knobs.get("MINDIO_WAIT_MINDX_TIME"), None
        if self.answered.wait(wait) and self.chosen in strategies:
            return self.chosen
        _log.warning("cluster brain chose %r (allowed %s) or did not answer; using %s", self.chosen,
                     strategies, strategies[0])
        return strategies[0]

    def exit(self, code: int) -> None:
        """The job's exit order: ``exit(code)`` to every rank with a route, awaited from the live ones (10 s,
        a fixed bound), then FINAL. Also to the ranks declared dead: such a rank's process may live (a
        link thread starved past the heartbeat window, a stopped process continued, a host cut off for a
        while) and its next collective fails on the peers that left; it then parks for a decision, and
        without the order it waited for a controller that ignored it -- forever when that controller
        lives in its own process (rank 0, issue 13), else MINDIO_CONTROLLER_LOST_EXIT s and the wrong
        code. The order stands: a rank heard later that has not confirmed it gets it again (:meth:`carry`)."""
        if self.core.sm.state is not State.EXIT:
            self.core.sm.fire(Result.EXIT if self.core.sm.can(Result.EXIT) else Result.SHUTDOWN, code=code)
        self.core.exit_code = code
        sn = self.core.actions.reserve()
        with self.core.lock:  # a rank registering meanwhile is either a target or sees the order (carry)
            now = time.monotonic()
            targets = [r.rank for r in self.core.ranks.values() if r.registered and r.ident]
            self.told.update(dict.fromkeys(targets, now))
            self.order = (code, sn)
        self.core.elastic.tell_standbys(code, sn)  # standbys are in no rank table (elastic_flow.py)
        replies = self.core.call(ActionName.EXIT, {"code": code}, targets, 10.0, sn=sn)  # waits only for the live ones
        with self.core.lock:
            silent = [r for r in targets if r not in replies and (x := self.core.ranks.get(r)) is not None and x.alive]
        if silent and not self.core.stop.is_set():  # (a controller closed meanwhile hears nobody)
            _log.warning("exit order EXIT(%d): no confirmation from live ranks %s within 10 s (a fixed bound); each "
                         "gets the order again when heard from", code, silent[:16])
        if self.core.sm.state is State.EXIT:
            self.core.sm.fire(Result.OK)
        self.core.final.set()

    def carry(self, rank: int) -> None:
        """(I/O thread) A frame of ``rank`` (a beat, a report, a registration) after the job's exit order:
        a rank that has not confirmed the order gets it again, with the same sn (a processor that has it
        replays its reply), at most every 2 heartbeat intervals -- as the action engine resends. A rank
        declared dead whose process lived, or one that registered or reported after the order went out,
        carries it out instead of parking for a decision that never comes."""
        order = self.order
        if order is None or rank in self.carried:
            return
        r = self.core.ranks.get(rank)
        if r is None or not r.registered or not r.ident:
            return
        now = time.monotonic()
        last = self.told.get(rank)
        if last is not None and now - last < 2 * self.core.interval:
            return
        self.told[rank] = now
        why = "declared dead, its process lives" if not r.alive else \
            "registered after the order went out" if last is None else "no confirmation yet"
        # one line per 2 heartbeat intervals, not one per rank: after a mass death (a lost switch) every
        # live rank may need the order again, and 100k lines would stall the I/O thread
        at, since = self.resent_logged
        if now - at >= 2 * self.core.interval:
            _log.warning("rank %d heard after the job's exit order without having confirmed it (%s): sending it "
                         "the order again, EXIT(%d)%s", rank, why, order[0],
                         f" (and {since} other rank(s) since the last such line)" if since else "")
            self.resent_logged = (now, 0)
        else:
            self.resent_logged = (at, since + 1)
        _logging.event("exit_order_resent", to_rank=rank, code=order[0], why=why)
        self.core.send(rank, P.Action(ActionName.EXIT, {"code": order[0]}), sn=order[1])

    def confirmed(self, rank: int, sn: int) -> None:
        """(I/O thread) ``rank`` replied to action ``sn``: when that is the exit order, it has it."""
        order = self.order
        if order is not None and sn == order[1]:
            self.carried.add(rank)

    # ------------------------------------------------------------------ cluster brain
    def notify_dump(self) -> int:
        if self.core.sm.state is not State.NORMAL:
            return 1
        self.open(None, None, cause=Cause.DUMP_REQUEST)
        return 0

    def request_dump(self, why: str) -> None:
        """(I/O thread, or node 0's agent) A preemption (preempt.py, mindio-run): a last-words checkpoint
        at the current step, then EXIT(75) -- the incident of ``notify_dump``. Asked while another incident
        runs (or before every rank registered) it waits for the job to train again: a recovery that ends
        in a dump or an exit needs none, one that resumes training is followed by this dump."""
        with self.core.lock:
            inc = self.current
            under_way = (inc is not None and inc.cause is Cause.DUMP_REQUEST) or \
                self.core.sm.state in (State.DUMP, State.EXIT, State.FINAL)
        if under_way:
            _log.info("last-words checkpoint requested again (%s): one is under way", why)
            return
        if self.dump_wanted is None:
            _log.warning("last-words checkpoint requested (%s): every rank stops at its current step, the "
                         "ranks that hold each shard save it, then the job exits with %d", why, EXIT_CODE_DUMPED)
            _logging.event("dump_requested", why=why, state=self.core.sm.state.value)
        self.dump_wanted = why
        self.serve_dump_request()

    def serve_dump_request(self) -> None:
        """Open the requested dump's incident if the job is training (NORMAL), no other incident is open
        and some rank finished a step in this run; else it stays asked for. Before the first step there
        is nothing newer than what the job started from, and a save then would label the loaded state
        step 0: the first heartbeat that carries a step serves it (controller.py)."""
        if self.dump_wanted is None or self.core.sm.state is not State.NORMAL:
            return
        with self.core.lock:
            trained = any(r.step > 0 for r in self.core.ranks.values() if r.alive)
        if trained and self.open(None, None, cause=Cause.DUMP_REQUEST):
            self.dump_wanted = None

    def notify_stop_train(self, fault_ranks: dict, wait: float | None = None) -> int:
        """Open or widen an incident for ``fault_ranks``; ``wait`` (tft_notify_controller_on_global_rank's
        ``time``): seconds the negotiation of this incident waits for change_strategy."""
        if wait is not None:
            self.mindx_wait = float(wait)
        for rank, kind in fault_ranks.items():
            if int(rank) in self.core.ranks:
                self.core.ranks[int(rank)].faulty = True
            self.open(int(rank), ReportState.RS_UCE if int(kind) == 0 else ReportState.RS_UNKNOWN,
                      cause=Cause.CLUSTER_BRAIN)
        return 0

    def change_strategy(self, strategy: str) -> int:
        """The cluster brain's choice: answers report_strategies, or ends a pause (pause.py)."""
        self.chosen = strategy
        self.answered.set()
        return 0
