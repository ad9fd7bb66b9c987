"""Controller side: the pieces every recovery sequence (retry, recover, downgrade, upgrade, hot switch)
shares, written once -- which ranks are live or dead, abandoning a sequence, resuming training at the
lock step, the timing breakdown of a recovery.

Plain functions over the controller (``ctl``), so each strategy's flow calls the same code whatever
class it is mixed into (tests drive the flows on small scripted controllers). The strategies still
write their own step order: the sequence *object* of issue #14 is not here yet (docs/architecture.md).
"""
from __future__ import annotations

from .states import Result

__all__ = ["live", "dead", "live_ranks", "abandon", "resume", "phases"]


def live(table: dict) -> list[int]:
    """The live ranks of a rank table (``{rank: RankRecord}``), sorted; call it under the table's lock."""
    return sorted(r.rank for r in table.values() if r.alive)


def dead(table: dict) -> list[int]:
    """The dead ranks of a rank table, sorted; call it under the table's lock."""
    return sorted(r.rank for r in table.values() if not r.alive)


def live_ranks(ctl) -> list[int]:
    """The controller's live ranks, sorted (takes its lock)."""
    with ctl._lock:
        return live(ctl.ranks)


def abandon(ctl, ranks: list, failed: str) -> bool:
    """A step after the rebuild failed: destroy the new generation's groups on ``ranks`` (a rank blocked
    in a transfer with a failed peer is released), then the state machine's FAIL; returns False."""
    ctl._call("clean", {"timeout": 5.0}, ranks, 10.0)
    ctl.sm.fire(Result.FAIL, failed=failed)
    return False


def resume(ctl, lock: int, ranks: list, timeout: float, mark: list | None = None, close_incident: bool = True,
           **why) -> None:
    """The end of every in-process recovery: the state machine's OK at the lock step (``why`` goes to its
    log line), the incident closed (unless ``close_incident`` is False: an upgrade opened none, and a fault
    that arrived meanwhile must stay open), the ranks of ``mark`` (default: every live rank) healthy at
    ``lock``; then ``retry`` re-enters train() on ``ranks``."""
    with ctl._lock:
        ctl.sm.fire(Result.OK, lock_step=lock, **why)
        if close_incident:
            ctl._incident = None
            ctl._incident_evt.clear()
        records = [r for r in ctl.ranks.values() if r.alive] if mark is None else [ctl.ranks[r] for r in mark]
        for r in records:
            r.faulty = False
            r.step = lock
    ctl._call("retry", {}, ranks, timeout)


def phases(t0: float, marks: dict, order) -> tuple[float, dict]:
    """(total s, {phase: s since the previous mark}) of a recovery timed from ``t0``; the total runs to
    the last phase of ``order``."""
    prev, parts = t0, {}
    for k in order:
        if k in marks:
            parts[k] = round(marks[k] - prev, 6)
            prev = marks[k]
    return marks[order[-1]] - t0, parts
