"""Pure decisions of the controller: no I/O, no clocks, no globals; property-tested with hypothesis.

* :func:`classify` -- an exception message -> :class:`ReportState` (first match wins; a generic
  exception raised outside the optimizer update window is RS_RETRY: retried once, rank side
  mindio/ttp/processor/repeats.py).
* :func:`shard_key`, :func:`select_dump_ranks` -- one usable rank per optimizer shard saves the dump
  (not one of the ranks that already failed to write it: the next holder); :func:`describe_shard`.
* :func:`select_repair_sources` -- a usable replica for every rank to repair (used by retry/recover).
* :func:`choose_lock_step`, :func:`stale_ranks` -- the step every rank goes back to, and the healthy
  ranks whose state is at another step (a stop that reached the ranks on both sides of their fence);
  :func:`ranks_to_advance` -- the ranks held before an update another rank made or started.
* :func:`strategies_of` -- the strategies a job's processors ask for with their enable flags.
* :func:`feasible_strategies` -- the fallback order retry -> recover-in-place -> recover -> downgrade
  -> dump -> exit, restricted to what is enabled and possible.
* :func:`find_hung_ranks` -- who is hung when the job stalls.

A rank is *usable* at lock step ``L`` when it is healthy (alive, not itself the faulty one), its
optimizer state is UPDATED and its step equals ``L``. Shard index of a rank = position in its sorted DP
group mod (d / R), R = replica_cnt: the DP group is cut into R contiguous parts that hold the same shards.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from ... import vocab
from .._enums import OsStatus, ReportState

__all__ = [
    "REFERENCE_PATTERNS", "SECONDARY_PATTERNS", "INCIDENT_SECONDARY_PATTERNS", "classify",
    "secondary_in_incident", "is_primary", "can_do_uce_repair", "RankView",
    "shard_key", "shards_of", "usable", "DumpPlan", "select_dump_ranks", "plan_dump", "describe_shard",
    "select_repair_sources", "choose_lock_step", "stale_ranks", "ranks_to_advance",
    "STRATEGY_ORDER", "strategies_of", "strategies_asked", "asks_of", "Incident", "INTACT", "feasible_strategies", "find_hung_ranks",
]

# The reference table (SPEC §2); first match wins. HBM MULTI BIT ECC is resolved by timing in classify().
REFERENCE_PATTERNS: tuple[tuple[str, ReportState], ...] = (
    ("UCE ERROR", ReportState.RS_UCE),
    ("HBM MULTI BIT ECC", ReportState.RS_UCE),
    ("FORCE STOP", ReportState.RS_NORMAL),
    ("ARF FINISH", ReportState.RS_PREREPAIR_FINISH),
    ("STEP FINISH", ReportState.RS_STEP_FINISH),
    ("HCCL OP RETRY FAILED", ReportState.RS_HCCL_FAILED),
    ("SUSPECT REMOTE ERROR", ReportState.RS_HCCL_FAILED),
    ("UB LINK ERROR", ReportState.RS_HCCL_FAILED),
    ("HCCS LINK ERROR", ReportState.RS_HCCL_FAILED),
    # the replica cross-check found the model state itself corrupt (mindio.adapter.crosscheck,
    # mindio.megatron.verified): never a retry, which would train on from the corrupt shard
    ("ReplicaMismatch:", ReportState.RS_UNKNOWN),
    ("SubHealthyRank:", ReportState.RS_UNKNOWN),
)
# Secondary failures: this rank's collective failed because a *peer* died or tore down its groups.
# Such a rank is healthy (treated like FORCE STOP): its optimizer state stays usable for dump/repair.
SECONDARY_PATTERNS: tuple[str, ...] = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
    "NCCL communicator was aborted", "ProcessGroupNCCL is aborted", "process group has been destroyed",
    "peer closed", "Socket Timeout",
)
# Once an incident has begun, these mean the same: a rank's collective timed out waiting for a peer that
# was stopped or tore its groups down, or its own group was aborted or destroyed under it by the
# recovery. Before an incident a timeout is a fault of its own (something hung).
INCIDENT_SECONDARY_PATTERNS: tuple[str, ...] = (
    "Timed out", "timed out", "Timeout", "timeout", "aborted", "Aborted", "destroyed",
    "process group has not been initialized", "Invalid process group",
)


def classify(message: str, user_patterns: Sequence[tuple[str, ReportState]] = (),
             uce_repairable: bool = True, during_incident: bool = False, outside_update: bool = False) -> ReportState:
    """ReportState for an exception message. User patterns (tft_register_exception_handler) are tried
    first, so a user can override the reference table; then the reference table, then the secondary
    (peer-failure) patterns -- with ``during_incident`` (a recovery has begun) also
    :data:`INCIDENT_SECONDARY_PATTERNS`; anything else is RS_RETRY when ``outside_update`` (raised while
    the optimizer update window was known to be closed, before any incident: forward, backward, data
    loading, the loss -- the model state is intact, the step can run again), else RS_UNKNOWN.
    ``uce_repairable`` False turns an ``HBM MULTI BIT ECC`` into RS_UCE_CORRUPTED (the error hit inside
    the optimizer update window)."""
    for pattern, state in user_patterns:
        if pattern in message:
            return ReportState(state)
    for pattern, state in REFERENCE_PATTERNS:
        if pattern in message:
            if pattern == "HBM MULTI BIT ECC" and not uce_repairable:
                return ReportState.RS_UCE_CORRUPTED
            return state
    for pattern in SECONDARY_PATTERNS:
        if pattern in message:
            return ReportState.RS_NORMAL
    if during_incident and secondary_in_incident(message):
        return ReportState.RS_NORMAL
    return ReportState.RS_RETRY if outside_update and not during_incident else ReportState.RS_UNKNOWN


def secondary_in_incident(message: str) -> bool:
    """Is ``message`` what a rank sees because of an incident already under way (a peer's failure or
    the recovery's own stop/teardown), not a fault of its own? (:data:`INCIDENT_SECONDARY_PATTERNS`
    and the always-secondary peer-failure patterns)"""
    return any(p in message for p in SECONDARY_PATTERNS) or any(p in message for p in INCIDENT_SECONDARY_PATTERNS)


def is_primary(state: ReportState) -> bool:
    """Does this report name its own rank as faulty? (RS_NORMAL = stopped/secondary: healthy.)"""
    return state not in (ReportState.RS_NORMAL, ReportState.RS_STEP_FINISH, ReportState.RS_INIT_FINISH,
                         ReportState.RS_PREREPAIR_FINISH)


def can_do_uce_repair(hbm_error_time: int, start_time: int | None, end_time: int | None) -> bool:
    """False when the error time falls inside the optimizer update window [start, end] (data may be
    corrupted mid-update); True otherwise or when no window is known."""
    if start_time is None:
        return True
    if end_time is None or end_time < start_time:  # update still running (or a stale end): open window
        return hbm_error_time < start_time
    return not (start_time <= hbm_error_time <= end_time)


class RankView(NamedTuple):
    """What the controller knows about one rank at decision time. A named tuple, not a frozen dataclass:
    a decision at 100,000 ranks builds one per rank (1.8 s as dataclasses, issue 34); change one with
    ``view._replace(alive=False)``."""
    rank: int
    alive: bool = True
    faulty: bool = False          # reported a primary error, died, or was killed as hung
    step: int = 0
    data_status: int = OsStatus.UPDATED
    replica: tuple = ()           # ({"rank_list", "replica_cnt", "replica_shift"}, ...) per optimizer type


def shard_key(rank: int, opt_type: int, entry: Mapping | None) -> tuple:
    """(optimizer type, sorted DP group, shard index) of ``rank``; a rank without replica info is a
    shard of its own (conservative: its state exists nowhere else)."""
    if not entry or not entry.get("rank_list"):
        return (opt_type, (rank,), 0)
    group = tuple(sorted(int(r) for r in entry["rank_list"]))
    r = max(1, int(entry.get("replica_cnt", 1)))
    if rank not in group:
        raise ValueError(f"rank {rank} is not in its own DP group {list(group)}")
    if len(group) % r:
        raise ValueError(f"DP group of size {len(group)} is not divisible by replica_cnt {r}")
    return (opt_type, group, group.index(rank) % (len(group) // r))


def shards_of(view: RankView, memo: dict | None = None) -> list[tuple]:
    """Shard keys of ``view.rank`` per optimizer type. ``memo`` (a dict the caller keeps for one
    decision) caches each DP group's layout, so 100k ranks in groups cost one sort per group."""
    entries = view.replica or ({},)
    if memo is None:
        return [shard_key(view.rank, t, e) for t, e in enumerate(entries)]
    out = []
    for t, e in enumerate(entries):
        if not e or not e.get("rank_list"):
            out.append((t, (view.rank,), 0))
            continue
        key = (t, tuple(e["rank_list"]), e.get("replica_cnt", 1))
        layout = memo.get(key)
        if layout is None:
            group = shard_key(view.rank, t, e)[1]
            per = len(group) // max(1, int(e.get("replica_cnt", 1)))
            layout = memo[key] = (group, {r: i % per for i, r in enumerate(group)})
        group, index = layout
        if view.rank not in index:
            raise ValueError(f"rank {view.rank} is not in its own DP group {list(group)}")
        out.append((t, group, index[view.rank]))
    return out


def usable(view: RankView, lock_step: int) -> bool:
    return view.alive and not view.faulty and view.data_status == OsStatus.UPDATED and view.step == lock_step


@dataclass(frozen=True)
class DumpPlan:
    save_info: list              # [{"type": t, "ranks": [...]}, ...] in optimizer-type order
    ranks: tuple                 # every rank that saves, sorted
    missing: tuple = ()          # shards with no usable rank (plan impossible when non-empty)

    @property
    def possible(self) -> bool:
        return not self.missing and bool(self.ranks)


# set by the controller in a process of its own (Controller._freeze_heap: a mindio-run agent's, not a training
# rank's, whose heap is the user's): what no_gc() built is frozen too
FREEZE_AFTER_NO_GC = False


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector off while a decision builds one object per rank (issue 34: at 100,000
    ranks its passes over the controller's heap took half the time of building the views); such objects
    hold no cycles, and reference counting frees them as before. In the controller's own process
    (:data:`FREEZE_AFTER_NO_GC`) they are then frozen (``gc.freeze``), as the rank table is: otherwise the
    collector, enabled again, walks the 100,000 new objects in its next passes, a full one included (0.16 s
    at 100,000 ranks, within the decision); reference counting still frees them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if FREEZE_AFTER_NO_GC:
            gc.freeze()
        if was:
            gc.enable()


class ShardMap:
    """Every rank's optimizer shards for one decision, as arrays (issue 34: a decision at 100,000 ranks
    looked the shards up three times, one Python object per rank each time). Built once from the views
    (one :func:`shards_of` per rank, DP group layouts memoised); :func:`select_dump_ranks`,
    :func:`choose_lock_step` and :func:`select_repair_sources` accept it in place of the views and answer
    with a few vector operations per step tried."""

    # (ranks, layouts, rows) of the last map built: the rows (which view holds which shard) depend on each view's
    # rank and replica layout alone, which change only when ranks join, leave or send another INFO; the next
    # decision over the same layouts (compared by identity first: the rank table's views share its records'
    # tuples, ranks.py) reuses them (at 100,000 ranks: 0.24 s of the decision -> a list comparison, issue 34)
    _last: tuple | None = None

    def __init__(self, views: Iterable[RankView]):
        views = views if isinstance(views, list) else list(views)
        n = len(views)
        fields = list(zip(*views)) if n else [()] * 6  # one tuple per RankView field, in C
        self.rank = np.fromiter(fields[0], np.int64, n)
        self.alive = np.fromiter(fields[1], bool, n)
        self.healthy = self.alive & ~np.fromiter(fields[2], bool, n)
        self.step = np.fromiter(fields[3], np.int64, n)
        self.updated = np.fromiter(fields[4], np.int64, n) == OsStatus.UPDATED
        layouts = fields[5]
        last = ShardMap._last
        if last is not None and last[1] == layouts and np.array_equal(last[0], self.rank):
            rows = last[2]
        else:
            rows = self._rows(views)
            ShardMap._last = (self.rank, layouts, rows)
        self.keys, self.row_view, self.row_shard, self.types, self.key_type = rows
        self.row_rank = self.rank[self.row_view]

    @staticmethod
    def _rows(views: list) -> tuple:
        """(keys: shard id -> shard key, row_view, row_shard: one row per (rank, optimizer type) in type order,
        the optimizer types, each shard id's type) of ``views``."""
        ids: dict[tuple, int] = {}
        keys: list[tuple] = []
        row_view, row_shard, memo = [], [], {}
        with no_gc():
            for i, v in enumerate(views):
                for key in shards_of(v, memo):
                    sid = ids.get(key)
                    if sid is None:
                        sid = ids[key] = len(keys)
                        keys.append(key)
                    row_view.append(i)
                    row_shard.append(sid)
        return (keys, np.asarray(row_view, np.int64), np.asarray(row_shard, np.int64), sorted({k[0] for k in keys}),
                np.fromiter((k[0] for k in keys), np.int64, len(keys)))

    def usable(self, lock_step: int) -> np.ndarray:
        """Per view: :func:`usable` at ``lock_step``."""
        return self.healthy & self.updated & (self.step == lock_step)

    def lowest_holders(self, lock_step: int, unable: Iterable[int] = ()) -> np.ndarray:
        """Per shard id: the lowest usable rank that holds it, not of ``unable``; -1 when none."""
        ok = self.usable(lock_step)[self.row_view]
        unable = list(unable)
        if unable:
            ok &= ~np.isin(self.row_rank, np.asarray(unable, np.int64))
        big = np.iinfo(np.int64).max
        best = np.full(len(self.keys), big, np.int64)
        np.minimum.at(best, self.row_shard[ok], self.row_rank[ok])
        best[best == big] = -1
        return best


def _shard_map(views) -> ShardMap:
    return views if isinstance(views, ShardMap) else ShardMap(views)


def select_dump_ranks(views, lock_step: int, unable: Iterable[int] = ()) -> DumpPlan:
    """For every optimizer shard, the lowest usable rank that holds it, except the ranks of ``unable``
    (they failed to write this dump: another holder of their shards, a replica, writes instead).
    ``views``: the ranks' :class:`RankView`, or their :class:`ShardMap`."""
    m = _shard_map(views)
    best = m.lowest_holders(lock_step, unable)
    missing = tuple(sorted(m.keys[i] for i in np.flatnonzero(best < 0).tolist()))
    save_info = [{"type": t, "ranks": np.unique(best[(m.key_type == t) & (best >= 0)]).tolist()} for t in m.types]
    every = tuple(np.unique(best[best >= 0]).tolist())
    return DumpPlan(save_info=save_info, ranks=every, missing=missing)


def plan_dump(views, lock_step: int) -> DumpPlan:
    """The dump of an incident at ``lock_step`` (:func:`select_dump_ranks`); at step 0 none (no ranks):
    the state of step 0 is the one this run started from -- its initialisation, or the checkpoint it
    loaded, which a dump would label step 0 -- so there is nothing to save (dump.py says so)."""
    return select_dump_ranks(views, lock_step) if lock_step > 0 else DumpPlan(save_info=[], ranks=())


def describe_shard(key: tuple) -> str:
    """A shard key (:func:`shard_key`) for a log line: 'shard 1 of optimizer 0 (DP group [0, 1, 2, 3])'."""
    t, group, index = key
    shown = ", ".join(map(str, group[:8])) + (", ..." if len(group) > 8 else "")
    return f"shard {index} of optimizer {t} (DP group [{shown}])"


def select_repair_sources(views, lock_step: int, targets: Iterable[int]) -> dict:
    """{(dst rank, optimizer type): src rank} -- a usable replica of the same shard for each target (the
    lowest other than itself); raises ValueError naming the shard when a target has none. ``views``:
    the ranks' :class:`RankView`, or their :class:`ShardMap`."""
    m = _shard_map(views)
    ok = m.usable(lock_step)[m.row_view]
    shard, rank = m.row_shard[ok], m.row_rank[ok]
    order = np.lexsort((rank, shard))  # usable holders by shard, lowest rank first
    shard, rank = shard[order], rank[order]
    first = np.searchsorted(shard, np.arange(len(m.keys)), "left")  # each shard's first and last+1 holder
    end = np.searchsorted(shard, np.arange(len(m.keys)), "right")
    where = {r: i for i, r in enumerate(m.rank.tolist())}  # (a rank listed twice: its last view, as before)
    plan = {}
    for dst in sorted(set(targets)):
        i = where[dst]  # KeyError: a target that is not among the views
        lo, hi = np.searchsorted(m.row_view, [i, i + 1])  # its rows (rows are in view order)
        for t, row in enumerate(range(int(lo), int(hi))):
            sid = int(m.row_shard[row])
            srcs = rank[first[sid]:end[sid]][:2].tolist()
            srcs = [r for r in srcs if r != dst]
            if not srcs:
                raise ValueError(f"no usable replica of shard {m.keys[sid]} for rank {dst} at step {lock_step}")
            plan[(dst, t)] = srcs[0]
    return plan


def choose_lock_step(views) -> int:
    """The step every rank goes back to: the highest step of a healthy rank at which every optimizer
    shard still has a usable copy; with no such step, the highest healthy step (nothing can be dumped
    or repaired then; the caller finds out from :func:`select_dump_ranks`).

    Healthy ranks normally all stop at one step. A stop that reaches them on both sides of their fence
    leaves some at step ``L`` (held before the update of ``L + 1``) and others at ``L + 1``; when the
    faulty ranks took the only copy at ``L + 1`` of some shard, ``L`` is chosen and the ranks at
    ``L + 1`` are :func:`stale_ranks`, repaired from replicas like the faulty ones."""
    m = _shard_map(views)
    steps = (set(m.step[m.healthy].tolist()) or set(m.step[m.alive].tolist()) or {0})
    for step in sorted(steps, reverse=True):
        if select_dump_ranks(m, step).possible:
            return step
    return max(steps)


def stale_ranks(views: Iterable[RankView], lock_step: int, among: Iterable[int] | None = None) -> list:
    """Ranks of ``among`` (default: the healthy ones, alive and not faulty) whose optimizer state is not
    of ``lock_step`` and UPDATED: of another step, caught mid-update, or gone with a dead rank. Retry
    and recover repair them from replicas."""
    views = list(views)
    among = {v.rank for v in views if v.alive and not v.faulty} if among is None else set(among)
    return sorted(v.rank for v in views if v.rank in among and not (
        v.alive and v.step == lock_step and v.data_status == OsStatus.UPDATED))


def ranks_to_advance(views: Iterable[RankView], fenced: Iterable[int]) -> tuple[int, list]:
    """(step S, ranks): the healthy ranks the stop held at their fence before an update S that another
    live rank already made or started (S = the furthest such update: a rank's step, plus one while its
    update is under way); their state is of step S - 1, UPDATED. Such a rank passed the collectives that
    precede the update of S (its gradients are complete: the rank that made or started S passed them with
    it), so it may finish that update -- the reference's prelock: "lock step = the highest step; each
    healthy rank finishes its update up to it". A peer blocked in a collective inside that update waits
    for exactly this rank and completes with it. ``(S, [])`` when none."""
    views = list(views)
    fenced = set(fenced)
    started = max((v.step + (v.data_status != OsStatus.UPDATED) for v in views if v.alive), default=0)
    return started, sorted(v.rank for v in views if v.rank in fenced and v.alive and not v.faulty
                           and v.step == started - 1 and v.data_status == OsStatus.UPDATED)


STRATEGY_ORDER = vocab.STRATEGY_ORDER


# a processor's enable flags as bits (the rank table keeps them in a column: RankTable.strategies_asked)
ASK_FLAGS, ASK_NO_UCE, ASK_ARF, ASK_ZIT = 1, 2, 4, 8


def asks_of(features: Mapping) -> int:
    """``features`` (tft_init_processor's flags: uce, arf, zit) as ASK_* bits; 0: no flags sent."""
    if not features:
        return 0
    return ASK_FLAGS | (0 if features.get("uce", True) else ASK_NO_UCE) | (ASK_ARF if features.get("arf") else 0) | (
        ASK_ZIT if features.get("zit") else 0)


def strategies_asked(asks: np.ndarray) -> set:
    """:func:`strategies_of` from the processors' flags as bits (:func:`asks_of`), one int per processor."""
    flags = asks[(asks & ASK_FLAGS) != 0]
    out = set()
    if len(flags) and not (flags & ASK_NO_UCE).any():
        out.add("retry")
    if (flags & ASK_ARF).any():
        out |= {"recover-in-place", "recover"}
    if (flags & ASK_ZIT).any():
        out.add("elastic-training")
    return out


def strategies_of(features: Iterable[Mapping]) -> set:
    """The strategies a job's processors ask for with their ``tft_init_processor`` flags: ``retry``
    when every one registered with ``enable_uce`` (the reference default; one that turned it off
    refuses a retry anyway), ``recover-in-place`` and ``recover`` when any registered with
    ``enable_arf``, ``elastic-training`` when any registered with ``enable_zit``. Processors that sent
    no flags ask for nothing."""
    return strategies_asked(np.fromiter(map(asks_of, features), np.int64))


@dataclass(frozen=True)
class Incident:
    """Facts about one fault, as seen at decision time."""
    states: Mapping[int, ReportState] = field(default_factory=dict)  # primary reports by rank
    dead: frozenset = frozenset()        # ranks whose process is gone (heartbeats lost / killed)
    repair_possible: bool = False        # every faulty rank's shards have a usable replica
    dump_possible: bool = False
    spare_available: bool = False
    in_place_possible: bool = True       # every live rank registered the repair and rollback handlers


_RETRYABLE = {ReportState.RS_UCE, ReportState.RS_HCCL_FAILED, ReportState.RS_RETRY}
# reports after which no state was lost: a retry rebuilds and rolls back, it repairs nothing
INTACT = frozenset({ReportState.RS_HCCL_FAILED, ReportState.RS_RETRY})


def feasible_strategies(enabled: Iterable[str], incident: Incident) -> list[str]:
    """Strategies in fallback order that are enabled and possible for this incident; ends with "exit"."""
    on = set(enabled)
    states = set(incident.states.values())
    out = []
    intact = bool(states) and states <= INTACT and not incident.dead
    if "retry" in on and not incident.dead and states and states <= _RETRYABLE and (
            incident.repair_possible or intact) and incident.in_place_possible:
        out.append("retry")
    if incident.repair_possible and (incident.dead or states):
        if "recover-in-place" in on and incident.in_place_possible:
            out.append("recover-in-place")
        if "recover" in on and incident.spare_available and incident.in_place_possible:
            out.append("recover")
        if "elastic-training" in on or "downgrade" in on:
            out.append("downgrade")
    if "dump" in on and incident.dump_possible:
        out.append("dump")
    out.append("exit")
    return out


def find_hung_ranks(views: Iterable[tuple[int, float, bool, int]], timeout: float) -> list[int]:
    """Ranks to kill as hung. ``views``: (rank, progress_age_s, in_collective, step) of live ranks;
    a negative age means "not armed yet" (no step finished). A rank stalled for ``timeout`` whose main
    thread is *not* inside a collective is hung (its peers wait for it inside one). When every stalled
    rank is inside a collective, the ones behind (lowest step) are hung if steps differ; else nobody can
    be blamed and the list is empty."""
    if timeout <= 0:
        return []
    stalled = [(r, c, s) for r, age, c, s in views if age >= timeout]
    if not stalled:
        return []
    outside = sorted(r for r, c, _ in stalled if not c)
    if outside:
        return outside
    steps = {s for _, _, s in stalled}
    if len(steps) > 1:
        low = min(steps)
        return sorted(r for r, _, s in stalled if s == low)
    return []
