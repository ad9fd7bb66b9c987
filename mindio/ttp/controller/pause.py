"""Graceful pause / continue (优雅暂停), driven by the cluster brain; controller side.

``tft_notify_controller_stop_train(fault_ranks, stop_type="pause", timeout)`` opens a *pause* incident;
the driver thread runs it (NORMAL -PAUSE-> PAUSE):

1. ``pause_query`` to every rank: each processor caps its limit step at (its step + 1) at once -- no rank
   can start a step beyond that -- and answers its step. Ranks of one data-parallel job are at most one
   step apart, so no rank has passed the largest cap.
2. ``pause_at(target)``, target = the largest cap: each rank's limit becomes ``target``; it trains up to
   ``target`` and its main thread parks inside ``tft_pause_train(target)`` (at the end of the iteration,
   nothing in flight); the processor then runs the stream-sync callback
   (``tft_register_stream_sync_handler``) and answers. All ranks stop at the same step.
3. ``report_stop_complete(0, ...)``; then wait up to ``timeout`` s (None or 0: TTP_NORMAL_ACTION_TIME_LIMIT)
   for ``tft_notify_controller_change_strategy``:
   * ``continue``: ``pause_resume`` clears every limit, PAUSE -CONTINUE-> NORMAL, training goes on
     unchanged (same step, same state: bitwise equal to an uninterrupted run);
   * ``dump``: a dump at the pause step, then exit (PAUSE -DUMP-> DUMP), as tft_notify_controller_dump;
   * ``exit``: every rank exits with EXIT_CODE_FAULT (stopped without a new checkpoint; PAUSE -EXIT-> EXIT);
   * no answer within ``timeout``: the pause ends safely -- training continues, with an error log line and
     ``report_result(0, "pause timed out ...", {}, "continue")``.
4. A rank that fails or dies while pausing or paused turns the pause into a fault incident (PAUSE -FAULT->
   ABNORMAL) handled like any other; a rank that cannot reach the pause step in time makes the pause fail:
   limits are cleared, training continues, ``report_stop_complete(404, ...)``.

The controller's part ``Controller.pause``; uses the incident flow (incident.py) and the controller's
rank table, state machine and action engine.
"""
from __future__ import annotations

import logging
import time

from ... import _logging
from . import policy, sequence
from .._enums import ActionName, EXIT_CODE_FAULT, Cause, ResultCode
from .dump import Dump
from .states import Result, State
from .strategy import Context

__all__ = ["PauseFlow"]

_log = logging.getLogger("mindio.ttp.pause")


class PauseFlow:
    """The pause as the controller's part (``Controller.pause``): it owns the request in hand; the
    incident it runs in, and the cluster brain's answer, are the incident flow's (incident.py)."""

    def __init__(self, core):
        self.core = core
        self.req: dict | None = None  # {"timeout", "ranks"} of the pause asked for

    def notify_pause(self, fault_ranks: dict, timeout: float | None = None) -> int:
        """Cluster brain: pause every rank at one step; 1 when the job is not in NORMAL training."""
        core = self.core
        with core.lock:
            if core.sm.state is not State.NORMAL or core.incidents.current is not None:
                return 1
            self.req = {"timeout": float(timeout) if timeout else float(core.action_limit),
                        "ranks": {int(r): int(k) for r, k in (fault_ranks or {}).items()}}
            core.incidents.expect()
        core.incidents.open(None, None, cause=Cause.PAUSE)
        return 0

    def end(self, live: list, why: str) -> bool:
        """Clear every limit (the ranks train on), PAUSE -CONTINUE-> NORMAL, close the incident."""
        core, flow = self.core, self.core.incidents
        core.call(ActionName.PAUSE_RESUME, {}, live, core.action_limit)
        with core.lock:
            faulted = flow.current is not None and bool(flow.current.primary)
            if not faulted:
                core.sm.fire(Result.CONTINUE, why=why)
                flow.close()
        return flow.as_fault() if faulted else True

    def run(self, inc) -> bool:
        """(driver thread, incident.py) Run the pause incident ``inc``; whether the job goes on."""
        core, flow = self.core, self.core.incidents
        req = self.req or {"timeout": float(core.action_limit), "ranks": {}}
        core.sm.fire(Result.PAUSE, ranks=sorted(req["ranks"])[:16])
        live = sequence.live_ranks(core)
        if len(live) < core.world_size or flow.faulted(inc):
            return flow.as_fault() if flow.faulted(inc) else self.end(live, "ranks missing")
        caps = core.call(ActionName.PAUSE_QUERY, {}, live, core.action_limit)
        if flow.faulted(inc):
            return flow.as_fault()
        if any(r not in caps or not caps[r].ok for r in live):
            flow.mindx_call("report_stop_complete", int(ResultCode.NOT_READY), "pause failed: no answer",
                            req["ranks"])
            return self.end(live, "pause_query failed")
        target = max(caps[r].detail["limit"] for r in live)
        limit = core.action_limit
        replies = core.call(ActionName.PAUSE_AT, {"step": target, "timeout": limit / 2}, live, limit)
        if flow.faulted(inc):
            return flow.as_fault()
        bad = {r: (replies[r].detail if r in replies else "no reply") for r in live
               if r not in replies or not replies[r].ok}
        if bad:
            _log.error("pause at step %d failed on ranks %s: %s; training continues", target, sorted(bad)[:16],
                       {r: bad[r] for r in sorted(bad)[:4]})
            flow.mindx_call("report_stop_complete", int(ResultCode.NOT_READY),
                            f"pause at step {target} failed on ranks {sorted(bad)[:16]}", req["ranks"])
            return self.end(live, "pause_at failed")
        paused_at = time.monotonic()
        _log.warning("every rank paused at step %d (%.3f s after the request)", target, paused_at - inc.t0)
        _logging.event("paused", step=target, latency_s=round(paused_at - inc.t0, 6))
        flow.mindx_call("report_stop_complete", int(ResultCode.OK), f"training paused at step {target}",
                        req["ranks"])
        end = paused_at + req["timeout"]
        while True:
            if flow.faulted(inc):
                return flow.as_fault()
            if flow.answered.wait(min(0.1, max(0.0, end - time.monotonic()))):
                choice = flow.chosen
                flow.answered.clear()
                if choice in ("continue", "dump", "exit"):
                    break
                _log.error("change_strategy(%r) is not possible while paused (continue, dump, exit)", choice)
            elif time.monotonic() >= end:
                choice = None
                break
        held = time.monotonic() - paused_at
        if choice is None:
            _log.error("no continue/dump/exit within the pause timeout of %.0f s; training continues",
                       req["timeout"])
            ok = self.end(live, "pause timed out")
            flow.mindx_call("report_result", int(ResultCode.OK),
                            f"pause timed out after {req['timeout']:.0f} s; training continued", {}, "continue")
            return ok
        _logging.event("pause_decision", strategy=choice, step=target, held_s=round(held, 6))
        if choice == "continue":
            ok = self.end(live, "continue")
            _log.warning("training continues from step %d after a pause of %.3f s", target, held)
            flow.mindx_call("report_result", int(ResultCode.OK), "training continued", {}, "continue")
            return ok
        if choice == "exit":
            flow.settle()
            flow.exit(EXIT_CODE_FAULT)
            return False
        core.sm.fire(Result.DUMP, lock_step=target)
        with core.lock:
            views = [policy.RankView(r.rank, r.alive, r.faulty, target, 0, tuple(r.replica))
                     for r in core.ranks.values()]
        plan = policy.select_dump_ranks(views, target)
        Dump().run(core, Context(target, views, plan=plan, graceful=True))
        return False
