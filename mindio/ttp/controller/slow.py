"""Slow ranks from the step anatomy every heartbeat carries (docs/recovery.md, "Slow ranks").

Each rank sends ``step_sums``: cumulative [steps timed, their wall s, its main thread's CPU s in them, the
wall s its main thread *waited* in them] (processor/collectives.py StepTimes, WaitClock). Its *own* time is
wall - wait: compute, and any time the rank was stopped or throttled from outside (SIGSTOP, a cgroup CPU
quota: the wait clock's tick comes late then, so that time is not counted as waiting). A window closes
once every scored rank timed ``MINDIO_SLOW_WINDOW`` steps in it (each rank sends an extra beat when it
timed a window's steps, so detection is counted in steps, not heartbeats). The straggler is the rank its peers
wait for: the rank that waits least, when their median wait per step exceeds its own by at least
``MINDIO_SLOW_MIN_WAIT`` of its step time and its own time per step is at least ``MINDIO_SLOW_RATIO`` times
its peers' median (cause "compute"). ``MINDIO_SLOW_K`` windows in a row report it once (again only after K
windows without it); ``MINDIO_SLOW_ACTION=switch`` then hot-switches it (controller/watch.py). A busy loop
elsewhere on the machine slows every rank alike: no straggler (but on an oversubscribed machine the
scheduler holds single ranks back for a while: docs/recovery.md, false alarms).

Limits. The wait clock tells a main thread that waits from one that runs; it cannot tell a wait in a
collective from a sleep or a data-loader wait in the loop, so no "communication" cause is named (that needs
the time spent inside the collectives). On CUDA the main thread spins while it waits for the device: its
own time is no measure of compute there (the extension point is StepTimes.anatomy: CUDA events / NCCL
completion hooks).

Per beat: :meth:`SlowScores.observe` stores one tuple (O(1)); :meth:`SlowScores.check` is O(ranks) per
closed window.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

from ... import _knobs

__all__ = ["SlowScores", "Slow"]


@dataclass
class Slow:
    """A finding: ``rank``, ``cause`` ("compute"), ``ratio``: its own time per step over its peers' median."""
    rank: int
    cause: str
    ratio: float


def _sane(raw) -> tuple | None:
    """``(steps, wall, cpu, wait)`` of a beat's sums; an older rank's three (no wait clock): wait = wall - CPU."""
    if raw.__class__ is not list or len(raw) not in (3, 4):
        return None
    n, *xs = raw
    if n.__class__ is not int or not all(x.__class__ in (int, float) for x in xs) or n < 0 or xs[0] < 0:
        return None
    wall, cpu = float(xs[0]), float(xs[1])
    return n, wall, cpu, float(xs[2]) if len(xs) == 3 else max(0.0, wall - cpu)


class SlowScores:
    def __init__(self, window: int | None = None, ratio: float | None = None, min_wait: float | None = None,
                 k: int | None = None):
        self.window = _knobs.get("MINDIO_SLOW_WINDOW") if window is None else window
        self.ratio = _knobs.get("MINDIO_SLOW_RATIO") if ratio is None else ratio
        self.min_wait = _knobs.get("MINDIO_SLOW_MIN_WAIT") if min_wait is None else min_wait
        self.k = _knobs.get("MINDIO_SLOW_K") if k is None else k
        self.action = _knobs.get("MINDIO_SLOW_ACTION")  # report | switch (watch.py acts on it)
        self.last: dict[int, tuple] = {}   # rank -> its latest sums
        self.base: dict[int, tuple] = {}   # rank -> its sums when the window opened
        self.ready: set[int] = set()       # ranks that timed the window's steps since it opened
        self.scores: dict[int, dict] = {}  # rank -> {"wall_s", "own_s", "wait_s", ...} per step, last window
        self.history: collections.deque = collections.deque(maxlen=max(1, self.k))  # closed windows:
        # {rank: (steps, wall s, wait s)} each
        self.streak: tuple = (None, 0)     # ((rank, cause), windows in a row)
        self.reported: tuple | None = None

    def observe(self, rank: int, raw) -> bool:
        """(I/O thread, each beat) Keep the rank's latest cumulative sums; True when this rank has just
        timed the open window's steps (the window may close: call :meth:`check`)."""
        if self.window <= 0:  # off: nothing kept, nothing checked
            return False
        got = _sane(raw)
        if got is None:
            return False
        if rank in self.last and got[0] < self.last[rank][0]:  # a new process (a replacement): start over
            self.base.pop(rank, None)
            self.ready.discard(rank)
        self.last[rank] = got
        base = self.base.setdefault(rank, got)  # its first window opens at its first sums
        if rank in self.ready or got[0] - base[0] < self.window:
            return False
        self.ready.add(rank)
        return True

    def reset(self) -> None:
        """A recovery or a pause: the next window opens at the next beats."""
        self.base.clear()
        self.ready.clear()
        self.history.clear()
        self.streak = (None, 0)

    def check(self, ranks) -> list[Slow]:
        """The findings to report now, given the ranks alive (once each; empty while a window is open)."""
        if self.window <= 0:
            return []
        ranks = [r for r in ranks if r in self.last]
        if len(ranks) < 2:
            return []
        for r in ranks:
            if r not in self.base:
                self.base[r] = self.last[r]
        if len(self.ready) < len(ranks) or any(self.last[r][0] - self.base[r][0] < self.window for r in ranks):
            return []
        window = {}
        for r in ranks:
            (n0, w0, c0, q0), (n1, w1, c1, q1) = self.base[r], self.last[r]
            n, wall = n1 - n0, max(w1 - w0, 1e-9)
            wait, cpu = min(max(0.0, q1 - q0), wall), min(max(0.0, c1 - c0), wall)
            window[r] = (n, wall, wait)
            self.scores[r] = {"wall_s": round(wall / n, 6), "own_s": round((wall - wait) / n, 6),
                              "compute_s": round(cpu / n, 6), "wait_s": round(wait / n, 6),
                              "wait": round(wait / wall, 4)}
            self.base[r] = self.last[r]
        self.ready.clear()
        self.history.append(window)
        return self._decide(ranks)

    def _decide(self, ranks) -> list[Slow]:
        """The straggler is the rank its peers wait for: it waits least, their median wait per step exceeds its
        own by ``min_wait`` of its step, and its own time per step is ``ratio`` times its peers' median. The
        same rank so ``k`` windows in a row is reported (once; again only after ``k`` windows without it)."""
        s = self.scores
        r = min(ranks, key=lambda q: s[q]["wait_s"])
        held = statistics.median(s[p]["wait_s"] for p in ranks if p != r) - s[r]["wait_s"]
        ratio = s[r]["own_s"] / max(statistics.median(s[p]["own_s"] for p in ranks if p != r), 1e-9)
        key = (r, "compute") if held >= self.min_wait * s[r]["wall_s"] and ratio >= self.ratio else None
        n = self.streak[1] + 1 if key == self.streak[0] else 1
        self.streak = (key, n)
        if self.reported is not None and self.reported != key and (key is not None or n >= self.k):
            self.reported = None  # it cleared (k windows without it), or another rank is slow now
        if key is None or n < self.k or self.reported == key:
            return []
        self.reported = key
        own = {}  # its own time per step over the last k windows against its peers' (the ranks in all of them)
        for q in ranks:
            got = [w[q] for w in list(self.history)[-self.k:] if q in w]
            if len(got) == self.k:
                own[q] = sum(w - q_ for _n, w, q_ in got) / sum(n_ for n_, _w, _q in got)
        peers = [v for q, v in own.items() if q != r]
        if r in own and peers:
            ratio = own[r] / max(statistics.median(peers), 1e-9)
        return [Slow(r, "compute", round(ratio, 2))]

    def status(self) -> dict:
        """For ``mindio status --json``: the last window's scores per rank and what was reported."""
        return {"window": self.window, "scores": {str(r): s for r, s in sorted(self.scores.items())},
                "slow": None if self.reported is None else {"rank": self.reported[0], "cause": self.reported[1]}}
