"""Slow ranks from the step anatomy every heartbeat carries (docs/recovery.md, "Slow ranks").

Each rank sends ``step_sums``: cumulative [steps timed, their wall s, its main thread's CPU s in them, the
wall s its main thread *waited* in them] (processor/collectives.py StepTimes, processor/waitclock.py). Its
*own* time is wall - wait: compute, and any time the rank was stopped or throttled from outside (a cgroup CPU
quota, a busy machine: the kernel's run-queue delay; SIGSTOP: the wait clock's tick comes late then -- so that
time is not counted as waiting). A window closes
once every scored rank timed ``MINDIO_SLOW_WINDOW`` steps in it (each rank sends an extra beat when it
timed a window's steps, so detection is counted in steps, not heartbeats). The straggler is the rank its peers
wait for: the rank that waits least, when their median wait per step exceeds its own by at least
``MINDIO_SLOW_MIN_WAIT`` of its step time and its own time per step is at least ``MINDIO_SLOW_RATIO`` times
its peers' median (cause "compute"). ``MINDIO_SLOW_K`` windows in a row report it once (again only after K
windows without it); ``MINDIO_SLOW_ACTION=switch`` then hot-switches it (controller/watch.py). A busy loop
elsewhere on the machine slows every rank alike: no straggler (but on an oversubscribed machine the
scheduler holds single ranks back for a while: docs/recovery.md, false alarms).

Slow communication. The wait clock also charges each wait to the process group whose collective the main
thread entered last (a fifth item of ``step_sums``: {group key: s}). With no straggler in a window, a group is
slow (cause "communication") when *every* member waited in its collectives, per step, at least
``MINDIO_SLOW_RATIO`` times what that group's members usually wait (its floor: the median of its last windows,
``_HISTORY`` of them or 3 x ``MINDIO_SLOW_K`` if more, without the run of windows found slow that the judged one
may continue and without the group's first, the warm-up; judged once ``MINDIO_SLOW_K`` windows, its first
counted, are behind it) and by at least ``MINDIO_SLOW_MIN_WAIT`` of their step
time more, while their own time per step (the median member's) stayed under ``MINDIO_SLOW_RATIO`` times its
floor or grew by less than ``MINDIO_SLOW_MIN_WAIT`` of a step (their compute is not what slowed). A median,
not the least ever seen: the least of many noisy windows only falls as a run goes on until an ordinary window
is 1.2x above it (a fault-free DDP loop beside a busy loop was named after 90 steps that way). A slowdown is
judged against the windows before it; one that lasts the whole history is the group's new pace (its floor
then). The minimum over the members is what tells the group that is slow from the groups that wait for it: the
members of a slow group all wait in it; a group whose members wait for a rank busy in another group's
collective has that rank not waiting in it. ``MINDIO_SLOW_K`` windows in a row report it once.

Limits. A wait that follows a collective with no compute in between (a sleep, a data loader right after
the step's last all-reduce) is charged to that collective's group; a steady one raises the group's floor
and names nothing. Collectives of several groups entered within one tick are ordered by the groups'
creation, not by time: on Megatron (several collectives a tick) the wait goes to the wrong group and nothing is
named (docs/recovery.md, "Slow communication"). On CUDA the main thread spins while it waits for the
device: its own time is no measure of compute there (the extension point is StepTimes.anatomy: CUDA
events / NCCL completion hooks).

Per beat: :meth:`SlowScores.observe` stores one tuple (O(1)); :meth:`SlowScores.check` is O(ranks x their
groups) per closed window.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

from ... import _knobs

__all__ = ["SlowScores", "Slow"]

_HISTORY = 8  # windows a group's floor is the median of (at least; 3 x K if that is more)


@dataclass
class Slow:
    """A finding: ``rank``, ``cause`` ("compute"), ``ratio``: its own time per step over its peers' median;
    or (cause "communication", ``rank`` -1) the process ``group`` whose collectives are slow, its
    ``ranks``, ``ratio``: their least wait in it per step over the group's floor."""
    rank: int
    cause: str
    ratio: float
    group: str = ""
    ranks: tuple = ()


class _Streak:
    """The same finding ``k`` windows in a row is reported once; again only after ``k`` windows without it
    (or once another finding took its place)."""

    def __init__(self, k: int):
        self.k, self.key, self.n, self.reported = k, None, 0, None

    def see(self, key) -> bool:
        """This window's finding (None: none): True when it is to be reported now."""
        self.n = self.n + 1 if key == self.key else 1
        self.key = key
        if self.reported is not None and self.reported != key and (key is not None or self.n >= self.k):
            self.reported = None  # it cleared (k windows without it), or another one is found now
        if key is None or self.n < self.k or self.reported == key:
            return False
        self.reported = key
        return True

    def restart(self) -> None:
        self.key, self.n = None, 0


def _sane(raw) -> tuple | None:
    """``((steps, wall, cpu, wait), {group: s waited} or None)`` of a beat's sums; an older rank's three (no
    wait clock): wait = wall - CPU."""
    if raw.__class__ is not list or len(raw) not in (3, 4, 5):
        return None
    groups = raw[4] if len(raw) == 5 else None
    if groups is not None and (groups.__class__ is not dict or len(groups) > 4096 or not all(
            k.__class__ is str and v.__class__ in (int, float) and v >= 0 for k, v in groups.items())):
        return None
    n, *xs = raw[:4]
    if n.__class__ is not int or not all(x.__class__ in (int, float) for x in xs) or n < 0 or xs[0] < 0:
        return None
    wall, cpu = float(xs[0]), float(xs[1])
    return (n, wall, cpu, float(xs[2]) if len(xs) == 3 else max(0.0, wall - cpu)), groups


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
        self.streak = _Streak(max(1, self.k))  # (rank, cause) found, windows in a row, what was reported
        # slow communication: each rank's {group: s waited in its collectives} (latest, at the window's
        # opening), per group the last window's figures and its floors, the streak and what was reported
        self.glast: dict[int, dict] = {}
        self.gbase: dict[int, dict] = {}
        self.groups: dict[str, dict] = {}  # group -> {"ranks", "wait_s", "own_s", "floor_wait_s", ...}
        self.floors: dict[str, collections.deque] = {}  # group -> its last windows' (wait, own) per step, and
        # whether it was found slow in each
        self.gstreak = _Streak(max(1, self.k))  # the same for a group

    def observe(self, rank: int, raw) -> bool:
        """(I/O thread, each beat) Keep the rank's latest cumulative sums; True when this rank has just
        timed the open window's steps (the window may close: call :meth:`check`)."""
        if self.window <= 0:  # off: nothing kept, nothing checked
            return False
        sane = _sane(raw)
        if sane is None:
            return False
        got, groups = sane
        if rank in self.last and got[0] < self.last[rank][0]:  # a new process (a replacement): start over
            self.base.pop(rank, None)
            self.gbase.pop(rank, None)
            self.ready.discard(rank)
        self.last[rank] = got
        if groups is not None:
            self.glast[rank] = groups
        base = self.base.setdefault(rank, got)  # its first window opens at its first sums
        self.gbase.setdefault(rank, self.glast.get(rank, {}))
        if rank in self.ready or got[0] - base[0] < self.window:
            return False
        self.ready.add(rank)
        return True

    def reset(self) -> None:
        """A recovery or a pause: the next window opens at the next beats."""
        self.base.clear()
        self.gbase.clear()
        self.ready.clear()
        self.history.clear()
        self.streak.restart()
        self.gstreak.restart()

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
                self.gbase[r] = self.glast.get(r, {})
        if len(self.ready) < len(ranks) or any(self.last[r][0] - self.base[r][0] < self.window for r in ranks):
            return []
        window, waited = {}, {}
        for r in ranks:
            (n0, w0, c0, q0), (n1, w1, c1, q1) = self.base[r], self.last[r]
            n, wall = n1 - n0, max(w1 - w0, 1e-9)
            wait, cpu = min(max(0.0, q1 - q0), wall), min(max(0.0, c1 - c0), wall)
            window[r] = (n, wall, wait)
            self.scores[r] = {"wall_s": round(wall / n, 6), "own_s": round((wall - wait) / n, 6),
                              "compute_s": round(cpu / n, 6), "wait_s": round(wait / n, 6),
                              "wait": round(wait / wall, 4)}
            g0, g1 = self.gbase.get(r, {}), self.glast.get(r, {})
            waited[r] = {g: (v - g0.get(g, 0.0)) / n for g, v in g1.items()}
            self.base[r], self.gbase[r] = self.last[r], g1
        self.ready.clear()
        self.history.append(window)
        found = self._decide(ranks)
        comm = self._decide_groups(ranks, waited)
        return found or comm

    def _decide(self, ranks) -> list[Slow]:
        """The straggler is the rank its peers wait for: it waits least, their median wait per step exceeds its
        own by ``min_wait`` of its step, and its own time per step is ``ratio`` times its peers' median. The
        same rank so ``k`` windows in a row is reported (once; again only after ``k`` windows without it)."""
        s = self.scores
        r = min(ranks, key=lambda q: s[q]["wait_s"])
        held = statistics.median(s[p]["wait_s"] for p in ranks if p != r) - s[r]["wait_s"]
        ratio = s[r]["own_s"] / max(statistics.median(s[p]["own_s"] for p in ranks if p != r), 1e-9)
        key = (r, "compute") if held >= self.min_wait * s[r]["wall_s"] and ratio >= self.ratio else None
        if not self.streak.see(key):
            return []
        own = {}  # its own time per step over the last k windows against its peers' (the ranks in all of them)
        for q in ranks:
            got = [w[q] for w in list(self.history)[-self.k:] if q in w]
            if len(got) == self.k:
                own[q] = sum(w - q_ for _n, w, q_ in got) / sum(n_ for n_, _w, _q in got)
        peers = [v for q, v in own.items() if q != r]
        if r in own and peers:
            ratio = own[r] / max(statistics.median(peers), 1e-9)
        return [Slow(r, "compute", round(ratio, 2))]

    def _decide_groups(self, ranks, waited: dict) -> list[Slow]:
        """Slow communication (module docstring): with no straggler this window, the group whose members
        all wait in its collectives ``ratio`` times its floor and ``min_wait`` of a step more, their own
        time not grown; ``k`` windows in a row report it once (again only after ``k`` windows without it)."""
        members: dict[str, list] = {}
        for r in ranks:
            for g in waited[r]:
                members.setdefault(g, []).append(r)
        s, flagged = self.scores, []
        self.groups = {}
        for g, rs in members.items():
            if len(rs) < 2:  # a group of one waits for nobody (or only some members ever waited in it)
                continue
            wait = min(waited[r][g] for r in rs)
            own = statistics.median(s[r]["own_s"] for r in rs)
            wall = statistics.median(s[r]["wall_s"] for r in rs)
            past = self.floors.get(g)
            if past is None:
                past = self.floors[g] = collections.deque(maxlen=max(_HISTORY, 3 * self.k))
            before = list(past)
            while before and before[-1][2]:  # the windows before its slow run (all of them: its new pace)
                before.pop()
            before = before or list(past)
            usual = [w for w in before if not w[3]]  # its first window (the warm-up) is in no floor
            fw, fo = (statistics.median(v) for v in list(zip(*usual))[:2]) if usual else (wait, own)
            self.groups[g] = {"ranks": sorted(rs), "wait_s": round(wait, 6), "own_s": round(own, 6),
                              "floor_wait_s": round(fw, 6), "floor_own_s": round(fo, 6)}
            # judged once K windows are behind it (its first counted) and its floor is the median of those after
            # its first: a floor from the first window (the job's warm-up, in which the wait clock may not see
            # the group's collectives yet) named a fault-free DDP loop's group, and at K = 2 a floor half warm-up
            # named a 4-rank toy's world group (tests/ttp/test_slow.py)
            slow = len(before) >= self.k and bool(usual) and wait >= self.ratio * fw and \
                wait - fw >= self.min_wait * wall and (
                    own < self.ratio * fo or own - fo < self.min_wait * wall)  # their compute did not grow
            if slow:
                flagged.append((wait - fw, g))
            past.append((wait, own, slow, not past))
        key = max(flagged)[1] if flagged and self.streak.key is None else None
        if not self.gstreak.see(key):
            return []
        got = self.groups[key]
        ratio = got["wait_s"] / max(got["floor_wait_s"], 1e-4)
        return [Slow(-1, "communication", round(ratio, 2), group=key, ranks=tuple(got["ranks"]))]

    def status(self) -> dict:
        """For ``mindio status --json``: the last window's scores per rank and per process group, and what
        was reported."""
        rank, group = self.streak.reported, self.gstreak.reported
        return {"window": self.window, "scores": {str(r): s for r, s in sorted(self.scores.items())},
                "groups": dict(sorted(self.groups.items(),  # the 16 that waited most above their floor
                                      key=lambda kv: kv[1]["floor_wait_s"] - kv[1]["wait_s"])[:16]),
                "slow": None if rank is None else {"rank": rank[0], "cause": rank[1]},
                "slow_group": None if group is None else {
                    "group": group, "ranks": self.groups.get(group, {}).get("ranks", []), "cause": "communication"}}
