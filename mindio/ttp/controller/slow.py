"""Slow ranks from the step anatomy every heartbeat carries (docs/recovery.md, "Slow ranks").

Each rank sends ``step_sums``: cumulative [steps timed, their wall s, its main thread's CPU s in them]
(processor/collectives.py StepTimes). On CPU/gloo a main thread waiting in a collective uses no CPU, so
per window a rank's compute per step is its CPU / steps and its wait per step (wall - CPU) / steps. A
window closes once every scored rank timed ``MINDIO_SLOW_WINDOW`` steps in it. The rank with the most
compute per step is slow (cause "compute") when that is at least ``MINDIO_SLOW_RATIO`` times its peers'
median and its peers wait for it: their median wait per step exceeds its own by at least
``MINDIO_SLOW_MIN_WAIT`` of its step time. ``MINDIO_SLOW_K`` windows in a row report it once (until it
clears). A busy loop elsewhere on the machine lengthens every rank's wall, not its CPU time: no straggler.

Limits. A rank slowed from outside while it does not run (SIGSTOP pulses, a cgroup CPU quota) uses the
same CPU, and its time stopped is wall without CPU like its peers' wait in the collective: this score
does not see it; nor does it tell a collective's wait from a sleep or a data-loader wait in the loop, so
it names no "communication" cause. Both need the time spent inside collectives (CUDA events / NCCL
completion hooks on GPU, where the main thread only launches kernels and its CPU is no measure of
compute either: the extension point is StepTimes.anatomy).

Per beat: :meth:`SlowScores.observe` stores one list (O(1)); :meth:`SlowScores.check` is O(ranks) per
closed window.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ... import _knobs

__all__ = ["SlowScores", "Slow"]


@dataclass
class Slow:
    """A finding: ``rank``, ``cause`` ("compute"), ``ratio``: its compute per step over its peers' median."""
    rank: int
    cause: str
    ratio: float


def _sane(raw) -> tuple | None:
    if raw.__class__ is not list or len(raw) != 3:
        return None
    n, wall, cpu = raw
    if n.__class__ is not int or not all(x.__class__ in (int, float) for x in (wall, cpu)) or n < 0 or wall < 0:
        return None
    return n, float(wall), float(cpu)


class SlowScores:
    def __init__(self, window: int | None = None, ratio: float | None = None, min_wait: float | None = None,
                 k: int | None = None):
        self.window = _knobs.get("MINDIO_SLOW_WINDOW") if window is None else window
        self.ratio = _knobs.get("MINDIO_SLOW_RATIO") if ratio is None else ratio
        self.min_wait = _knobs.get("MINDIO_SLOW_MIN_WAIT") if min_wait is None else min_wait
        self.k = _knobs.get("MINDIO_SLOW_K") if k is None else k
        self.last: dict[int, tuple] = {}   # rank -> its latest sums
        self.base: dict[int, tuple] = {}   # rank -> its sums when the window opened
        self.scores: dict[int, dict] = {}  # rank -> {"wait": fraction, "compute_s": per step} of the last window
        self.streak: tuple = (None, 0)     # ((rank, cause), windows in a row)
        self.reported: tuple | None = None

    def observe(self, rank: int, raw) -> None:
        """(I/O thread, each beat) Keep the rank's latest cumulative sums."""
        got = _sane(raw)
        if got is not None:
            if rank in self.last and got[0] < self.last[rank][0]:  # a new process (a replacement): start over
                self.base.pop(rank, None)
            self.last[rank] = got

    def check(self, ranks) -> list[Slow]:
        """The findings to report now, given the ranks alive (once each; empty while a window is open)."""
        if self.window <= 0:
            return []
        ranks = [r for r in ranks if r in self.last]
        if len(ranks) < 2:
            return []
        for r in ranks:
            self.base.setdefault(r, self.last[r])
        if any(self.last[r][0] - self.base[r][0] < self.window for r in ranks):
            return []
        for r in ranks:
            (n0, w0, c0), (n1, w1, c1) = self.base[r], self.last[r]
            n, wall, cpu = n1 - n0, max(w1 - w0, 1e-9), min(max(0.0, c1 - c0), max(w1 - w0, 1e-9))
            self.scores[r] = {"wall_s": round(wall / n, 6), "compute_s": round(cpu / n, 6),
                              "wait_s": round((wall - cpu) / n, 6), "wait": round(1 - cpu / wall, 4)}
            self.base[r] = self.last[r]
        return self._decide(ranks)

    def _decide(self, ranks) -> list[Slow]:
        found = None
        r = max(ranks, key=lambda q: self.scores[q]["compute_s"])
        me, peers = self.scores[r], [self.scores[p] for p in ranks if p != r]
        ratio = me["compute_s"] / max(statistics.median(s["compute_s"] for s in peers), 1e-9)
        held = statistics.median(s["wait_s"] for s in peers) - me["wait_s"]  # what its peers wait for it
        if ratio >= self.ratio and held >= self.min_wait * me["wall_s"]:
            found = Slow(r, "compute", round(ratio, 2))
        key = None if found is None else (found.rank, found.cause)
        n = self.streak[1] + 1 if key is not None and key == self.streak[0] else 1
        self.streak = (key, n)
        if key is None:
            self.reported = None
            return []
        if n >= self.k and self.reported != key:
            self.reported = key
            return [found]
        return []

    def status(self) -> dict:
        """For ``mindio status --json``: the last window's scores per rank and what was reported."""
        return {"window": self.window, "scores": {str(r): s for r, s in sorted(self.scores.items())},
                "slow": None if self.reported is None else {"rank": self.reported[0], "cause": self.reported[1]}}
