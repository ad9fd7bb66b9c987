"""Controller side of hangs: how long a stall may last (:class:`HangBound`) and whom to blame
(:func:`find_culprits`).

The bound: ``MINDIO_HANG_TIMEOUT`` when it is set (or the controller was given one); else, once every
live rank has timed ``MINDIO_HANG_MIN_STEPS`` steps (the p99 its heartbeat carries), the job's own:
``max(MINDIO_HANG_FLOOR, MINDIO_HANG_K x p99 step time)`` -- the slowest rank's p99 -- logged once;
``MINDIO_HANG_TIMEOUT``'s default before.

The culprit: every heartbeat carries, per process group, the sequence number of the last collective
the rank entered (processor/collectives.py). Members of a group enter its collectives in order, so in
a stall a member below its peers' number never entered the collective they wait in; the members at
the highest number are inside it. A rank that is behind in some group and inside none is the culprit
(a chain -- rank 2 waits in a group with rank 3, rank 0 waits for rank 2 in another -- blames rank 3
only). A rank behind in one group but inside another waits like its peers and is never blamed while a
chain ends elsewhere: when the rank at the end of the chain is still working (not stalled by the rules
below), nobody is blamed yet. Only in a cycle (every rank behind is inside some collective) are the
stalled ones behind blamed. (The Megatron hang test under the full suite's load: the hung rank 2's last
beat, 0.9 s old, said 1.1 s without progress, under the bound; rank 3, behind in the replica group
{1, 3} but waiting for rank 2 in {2, 3}, was blamed as "a cycle" and killed. The controller now also ages
each beat by the time since it was heard.) Without such evidence (every member at the same number, or
no numbers: a backend without counters) the older rule holds (policy.find_hung_ranks: a stalled rank
whose main thread is outside ``torch.distributed``), never blaming a rank that is inside a collective by
its number -- DDP's all-reduce runs from autograd, so the stack of a rank waiting in it shows no
``torch/distributed``.
Under a bound derived from the job's steps that rule also needs a stalled rank inside a collective:
every rank stalled outside one at once (a checkpoint all ranks write) is no hang. And under such a bound
a rank whose main thread is still working (its heartbeat's ``idle_age``: the thread used CPU, waited on
storage or was runnable -- starved of CPU -- within the bound: one rank writing a checkpoint alone) is not
stalled: it gets the bound given (``MINDIO_HANG_TIMEOUT``'s, 300 s by default). A rank hung while
spinning (a busy loop, a spinning device wait) therefore takes that long, as before the job-derived bound;
one that sleeps or blocks is found fast.

Evidence must be fresh: the culprit, and every member of its group behind with it (blamed too or not),
must have beaten at least half the bound after the stall of the peers waiting in the collective began. A
member whose last beat is older may have entered the collective since (its beat was sent just before it
did); a culprit whose beat is older may since have entered *another* collective, where it waits for the
real culprit (the Megatron hang test, under the full suite's load: rank 3, stale, looked behind in the
replica group {1, 3} while it already waited for the hung rank 2 in {2, 3}; rank 3 was killed). Half the
bound is at least 2.5 step times when the bound comes from the job's steps: every healthy rank has reached
the collective it blocks in by then. The decision waits for the next beats (one heartbeat interval at
most; a member that never beats again is declared dead by the liveness sweep), so that the rank named, and
the ranks said to wait, are what the group's members reported once the stall settled -- and a second rank
hung before the collective is named in the same decision, not in a second incident.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ... import _knobs, _logging
from . import policy

__all__ = ["HangBound", "Hung", "find_culprits"]

_log = logging.getLogger("mindio.ttp.controller")


class HangBound:
    """The hang bound of one controller (module docstring). ``fixed``: the bound given (the
    controller's ``hang_timeout`` argument or a set MINDIO_HANG_TIMEOUT); ``base``: that value."""

    def __init__(self, base: float, fixed: bool):
        self.base, self.fixed = base, fixed
        self.k, self.floor = _knobs.get("MINDIO_HANG_K"), _knobs.get("MINDIO_HANG_FLOOR")
        self.derived: float | None = None  # the job's bound, once known
        self.logged = False

    @property
    def value(self) -> float:
        """The bound in force (for ``mindio status``): the job's once known, else the one given."""
        return self.derived if self.derived is not None and not self.fixed and self.base > 0 else self.base

    def current(self, p99s) -> float:
        """The bound now, from the live ranks' p99 step times ``p99s`` (-1: not known yet)."""
        if self.fixed or self.base <= 0:
            return self.base
        p99s = p99s if isinstance(p99s, np.ndarray) else np.fromiter(p99s, np.float64)  # the table's column
        if not len(p99s) or p99s.min() < 0:
            return self.derived if self.derived is not None else self.base
        p99 = float(p99s.max())
        self.derived = max(self.floor, self.k * p99)
        if not self.logged:
            self.logged = True
            _log.info("hang bound from the job's step times: %.2f s = max(MINDIO_HANG_FLOOR %.2f s, "
                      "MINDIO_HANG_K %.1f x p99 step time %.3f s) (set MINDIO_HANG_TIMEOUT to fix it)",
                      self.derived, self.floor, self.k, p99)  # INFO: a fault-free run prints no WARNING
            _logging.event("hang_bound", bound_s=round(self.derived, 3), p99_s=round(p99, 6), k=self.k,
                           floor_s=self.floor)
        return self.derived


@dataclass
class Hung:
    """A rank to kill as hung, and why: ``group``/``seq`` the collective it never entered (``waiting``
    the ranks inside it), or no group when the stack rule blamed it."""
    rank: int
    group: str = ""
    seq: int = -1
    waiting: list = field(default_factory=list)

    def why(self) -> str:
        if self.group:
            return (f"it never entered collective #{self.seq} of process group {self.group!r}, which rank(s) "
                    f"{self.waiting[:8]}{' ...' if len(self.waiting) > 8 else ''} wait in")
        return "its main thread is outside a collective while its peers wait"


def _seqs(raw) -> dict:
    """A beat's {group: seq}, its well-formed entries only (a frame is authentic, not necessarily sane)."""
    if raw.__class__ is not dict:
        return {}
    return {g: s for g, s in raw.items() if g.__class__ is str and s.__class__ is int}


def find_culprits(views, timeout: float, need_waiter: bool = False, idle: dict | None = None,
                  patient: float = 0.0, heard_ago: dict | None = None) -> list[Hung]:
    """Ranks to kill as hung (module docstring). ``views``: (rank, progress_age_s, in_collective, step,
    {group: seq}) of live ranks; a negative age: not armed yet. ``need_waiter`` (a bound derived from
    the job's steps, seconds not minutes): the stack rule blames nobody unless a stalled rank is inside
    a collective -- every rank stalled outside one (a checkpoint saved by all) is no hang. ``idle``
    ({rank: seconds since its main thread last ran or waited on storage, -1 unknown}) with ``patient``
    (the bound given, MINDIO_HANG_TIMEOUT's): under a derived bound a rank whose main thread is working --
    rank 0 alone writing a checkpoint while its peers wait in the next collective -- is stalled only after
    ``patient`` s without a step. The ages are as of now: the controller adds to each beat's age the time
    since it was heard (a rank heard 0.9 s ago with 1.1 s has been stalled 2 s, not 1.1 s). ``heard_ago``
    ({rank: seconds since its last beat}): a culprit is named only once it and every member of its group
    behind with it have beaten ``timeout / 2`` s or more after the waiters' stall began (module
    docstring: fresh evidence); None: every beat counts as fresh."""
    if timeout <= 0:
        return []
    idle = idle or {}

    def working(r: int, age: float) -> bool:
        quiet = idle.get(r, -1.0)
        return need_waiter and 0 <= quiet < timeout and age < patient

    stalled = {r for r, age, *_ in views if age >= timeout and not working(r, age)}
    if not stalled:
        return []
    groups: dict[str, list] = {}
    for r, age, _c, _s, seqs in views:
        if age < 0:  # not armed (a standby, a replacement before its first step): no evidence either way
            continue
        for g, s in _seqs(seqs).items():
            groups.setdefault(g, []).append((r, s))
    behind: dict[int, tuple] = {}  # rank -> (group, seq it never entered, ranks waiting there)
    inside: set[int] = set()
    for g, members in sorted(groups.items()):
        top = max(s for _, s in members)
        waiting = sorted(r for r, s in members if s == top)
        if len(waiting) == len(members):
            continue
        inside.update(waiting)
        for r, s in members:
            if s < top:
                behind.setdefault(r, (g, s + 1, waiting))
    heads = [r for r in behind if r not in inside]  # where the chains of waiting ranks end
    # a rank behind but itself waiting inside a collective is blamed only in a cycle (no chain ends):
    # a chain that ends at a rank still working (not stalled) blames nobody yet (module docstring)
    blamed = sorted(r for r in heads if r in stalled) if heads else sorted(r for r in behind if r in stalled)
    if blamed:
        ages = {r: age for r, age, *_ in views}
        # every member behind in the culprit's group, blamed too or not: one hung before the collective as well
        # is named in the same decision (its age, extrapolated from an old beat, makes it a stale candidate)
        with_it = {r: [m for m, s in groups[behind[r][0]] if s < behind[r][1] and m != r] for r in blamed}
        return [Hung(r, *behind[r]) for r in blamed
                if _fresh(behind[r][2], [r] + with_it[r], ages, heard_ago, settle=timeout / 2)]
    rest = [(r, age, c, s) for r, age, c, s, _ in views if r not in inside]
    if need_waiter and not any(c for r, age, c, _ in rest if r in stalled):
        return []
    return [Hung(r) for r in policy.find_hung_ranks(rest, timeout)]


def _fresh(waiting: list, members: list, ages: dict, heard_ago: dict | None, settle: float = 0.0) -> bool:
    """Has every rank of ``members`` (the culprit, and the members of its group behind with it)
    beaten at least ``settle`` s after the ranks ``waiting`` in its collective stalled? A waiter's stall
    began its age (as of now) ago; the latest of them counts (module docstring: fresh evidence)."""
    if heard_ago is None or not members:
        return True
    began_ago = min(max(ages.get(w, 0.0), 0.0) for w in waiting)
    return all(heard_ago.get(m, 0.0) < began_ago - settle for m in members)
