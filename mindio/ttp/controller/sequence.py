"""Controller side: the one recovery sequence every strategy runs (retry, recover, downgrade, upgrade,
hot switch) -- stop -> clean -> rebuild -> repair -> rollback -> resume, each step one action to a set of
ranks -- with what every strategy shares written once: the step check (its log line and
``<label>_failed`` event), abandoning after a failed step, the timing breakdown, resuming training at
the lock step, the ``<name>_done`` event and the cluster brain's report.

A strategy (strategy.py) is a short script over a :class:`Sequence`::

    seq = Sequence(core, "retry", ctx.t0)
    ok = (seq.step(ActionName.CLEAN, {"timeout": limit}, live)
          and seq.step(ActionName.REBUILD, {"gen": core.gen + 1}, live)
          and seq.step(ActionName.REPAIR, params, involved, abandon=live)
          and seq.step(ActionName.ROLLBACK, {"step": lock}, live, abandon=live))
    if ok:
        seq.resume(lock, live)
        seq.done("every rank trains again", f"repaired {uce}", report=({...}, "retry"), lock_step=lock)

The plain functions below (``live_ranks``, ``abandon``, ``resume``, ``phases``) are
the pieces the object uses, for the flows that are not a sequence (the pause, the stop round).
"""
from __future__ import annotations

import logging
import time

from ... import _logging
from .._enums import ActionName
from .states import Result

__all__ = ["live_ranks", "abandon", "resume", "phases", "Sequence"]

_log = logging.getLogger("mindio.ttp")


def live_ranks(core) -> list[int]:
    """The job's live ranks, sorted (takes its lock; ranks.RankTable.live)."""
    with core.lock:
        return core.ranks.live()


def abandon(core, ranks: list, failed: str) -> bool:
    """A step after the rebuild failed: destroy the new generation's groups on ``ranks`` (a rank blocked
    in a transfer with a failed peer is released), then the state machine's FAIL; returns False."""
    core.call(ActionName.CLEAN, {"timeout": 5.0}, ranks, 10.0)
    core.sm.fire(Result.FAIL, failed=failed)
    return False


def resume(core, lock: int, ranks: list, timeout: float, mark: list | None = None, close_incident: bool = True,
           **why) -> None:
    """The end of every in-process recovery: the state machine's OK at the lock step (``why`` goes to its
    log line), the incident closed (unless ``close_incident`` is False: an upgrade opened none, and a fault
    that arrived meanwhile must stay open), the ranks of ``mark`` (default: every live rank) healthy at
    ``lock``; then ``retry`` re-enters train() on ``ranks``."""
    with core.lock:
        core.sm.fire(Result.OK, lock_step=lock, **why)
        if close_incident:
            core.incidents.close()
        records = [r for r in core.ranks.values() if r.alive] if mark is None else [core.ranks[r] for r in mark]
        for r in records:
            r.faulty = False
            r.step = lock
    core.call(ActionName.RETRY, {}, ranks, timeout)


def phases(t0: float, marks: dict, order) -> tuple[float, dict]:
    """(total s, {phase: s since the previous mark}) of a recovery timed from ``t0``; the total runs to
    the last phase of ``order``."""
    prev, parts = t0, {}
    for k in order:
        if k in marks:
            parts[k] = round(marks[k] - prev, 6)
            prev = marks[k]
    return marks[order[-1]] - t0, parts


class Sequence:
    """One run of a recovery sequence on controller ``core`` (driver thread).

    ``name``: the strategy (its ``<name>_done`` event unless ``done`` names another); ``label``: the
    word of its failure lines and ``<label>_failed`` events (default ``name``); ``t0``: when the
    incident began (the timing breakdown starts there; the first mark, ``decide``, is now unless
    ``first`` names another); ``then``: what a failure leads to, for its log line; ``lost``: a callable
    returning ranks lost meanwhile besides the watched ones (a replacement that died)."""

    def __init__(self, core, name: str, t0: float, label: str | None = None, first: str | None = "decide",
                 then: str = "falling back", lost=None):
        self.core, self.name, self.t0 = core, name, t0
        self.label, self.then, self._lost = label or name, then, lost
        self.marks: dict = {first: time.monotonic()} if first else {}

    def mark(self, phase: str) -> None:
        """The end of ``phase`` (the breakdown counts each phase from the previous mark)."""
        self.marks[phase] = time.monotonic()

    def fail(self, failed: str) -> bool:
        """A step before the new generation existed failed: the state machine's FAIL; False."""
        self.core.sm.fire(Result.FAIL, failed=failed)
        return False

    def abandon(self, ranks: list, failed: str) -> bool:
        """A step after the rebuild failed: :func:`abandon` (clean on ``ranks``, FAIL); False."""
        return abandon(self.core, ranks, failed)

    def step(self, action: str, params: dict, ranks: list, *, timeout: float | None = None,
             watch: list | None = None, abandon: list | None = None, mark: str | None = None) -> bool:
        """Run ``action`` on ``ranks`` (one action in flight, failing fast) and check it: every rank
        answered ok, and none of ``watch`` (and of ``lost``) died meanwhile. On success mark the phase
        (``mark``, default the action's name); on failure log it, write ``<label>_failed``, then
        :meth:`abandon` on ``abandon`` (after the rebuild) or :meth:`fail` (before it). Whether it
        succeeded."""
        core = self.core
        replies = core.call(action, params, ranks, core.action_limit if timeout is None else timeout, fail_fast=True)
        lost: list = []
        if watch is not None or self._lost is not None:
            with core.lock:
                lost = [r for r in (watch or ()) if not core.ranks[r].alive]
                lost += sorted(self._lost()) if self._lost is not None else []
        bad = {r: (replies[r].detail if r in replies else "no reply (dead or past the deadline)")
               for r in ranks if r not in replies or not replies[r].ok}
        if not bad and not lost:
            self.mark(mark or action)
            return True
        _log.error("%s failed at %s: ranks %s failed %s, ranks %s died; %s", self.label, action, sorted(bad)[:16],
                   {r: bad[r] for r in sorted(bad)[:4]}, lost[:16], self.then)
        _logging.event(f"{self.label}_failed", step_name=action, ranks=sorted(bad)[:64], lost=lost[:64])
        return self.abandon(abandon, action) if abandon is not None else self.fail(action)

    def resume(self, lock: int, ranks: list, mark: list | None = None, close_incident: bool = True, **why) -> None:
        """:func:`resume` (OK, incident closed, ranks healthy at ``lock``, ``retry`` to ``ranks``), marked."""
        resume(self.core, lock, ranks, self.core.action_limit, mark=mark, close_incident=close_incident, **why)
        self.mark("resume")

    def done(self, who: str, detail: str, report: tuple, event: str | None = None, **fields) -> float:
        """The sequence succeeded: one log line (``who`` -- "every rank trains again" --, the breakdown,
        generation, ``fields["lock_step"]``, ``detail``), the ``<name>_done`` event (``fields`` and one
        ``<phase>_s`` per phase) and the cluster brain's ``report_result(0, ...)`` with ``report`` =
        (rank dict, strategy name). Returns the total time."""
        total, parts = phases(self.t0, self.marks, list(self.marks))
        _log.warning("%s done: %s %.3f s after it began (%s), generation %d, lock step %d, %s",
                     self.name, who, total, parts, self.core.gen, fields.get("lock_step", -1), detail)
        _logging.event(event or f"{self.name.replace(' ', '_')}_done", total_s=round(total, 6), gen=self.core.gen,
                       **fields, **{f"{k}_s": v for k, v in parts.items()})
        ranks, strategy = report
        self.core.incidents.mindx_call("report_result", 0, f"{self.name} done", ranks, strategy)
        return total
