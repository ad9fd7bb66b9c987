"""Controller side: the rank table and a rank's record (its row).

Layout. :class:`RankTable` holds the fixed-size per-rank facts as numpy columns indexed by rank (``COLUMNS``: step,
last beat time, alive / faulty / registered / left / watched flags, generation, data_status, progress and idle ages,
step_p99, pid, and the number of the connection the rank speaks through), so that a relay's BEATS frame updates its
ranks with a few slice assignments (:meth:`RankTable.beats`), the liveness sweep is a vector comparison
(:meth:`RankTable.expired`) and the decision's queries (:meth:`live`, :meth:`dead`, :meth:`ranks_where`,
:meth:`min_step`) cost a pass over an array, not a loop over records. Each rank's collective numbers (``coll_seq``,
a dict sent with every beat and read only when a hang is suspected: hangs.py) are an object column,
:attr:`RankTable.seqs`, assigned with the other columns. What is rarely used and not fixed-size (the route
``ident``, host, replica layout, dp group, features) stays on the :class:`RankRecord`, touched only when it changes.
The table is also a ``{rank: RankRecord}`` dict for the cold paths: a record in the table is a view of its row
(``table[r].alive = False`` writes the column); a record made on its own keeps its values until it is put in a
table, which copies them into the row.

The record is shared by the registration (controller.py) and the flows that add ranks to the table
(elastic_flow.py's upgrade, recover.py's replacements); it lives here so that none of them imports the
controller.
"""
from __future__ import annotations

import functools
import logging

import numpy as np

from ...errors import ProtocolError
from ..wire.protocol import unpack_extras
from .policy import RankView, asks_of, no_gc, strategies_asked

_log = logging.getLogger("mindio.ttp.controller")

__all__ = ["RankRecord", "RankTable", "infer_layout", "COLUMNS"]

_new_view = functools.partial(tuple.__new__, RankView)  # RankView from one tuple of its fields, in C


# column name -> (dtype, value of a new record); every one is a RankRecord attribute (a view of the row)
COLUMNS: dict[str, tuple] = {
    "pid": (np.int64, 0),
    "last_seen": (np.float64, 0.0),  # its last frame (any: a reply proves life too)
    "beat_seen": (np.float64, 0.0),  # its last heartbeat: when its progress age and collective numbers were true
    "step": (np.int64, 0),
    "data_status": (np.int64, 0),
    "in_collective": (np.bool_, False),
    "progress_age": (np.float64, -1.0),
    "idle_age": (np.float64, -1.0),  # seconds since its main thread last ran or waited on storage (hangs.py)
    "step_p99": (np.float64, -1.0),  # p99 of the rank's recent step times, -1 until known (hangs.py)
    "alive": (np.bool_, True),
    "faulty": (np.bool_, False),
    "registered": (np.bool_, True),
    "gen": (np.int64, 0),  # generation the rank's process registered in (a replacement: the recovery's)
    "left": (np.bool_, False),  # said BYE: its late heartbeats are answered "BYE", never "register again"
    "asks": (np.int64, 0),  # its features (tft_init_processor's flags) as policy.ASK_* bits (strategies_asked)
}
_PY = {np.int64: int, np.float64: float, np.bool_: bool}


def _column(name: str):
    """A RankRecord attribute backed by column ``name`` of its table (or by the record while detached)."""
    conv = _PY[COLUMNS[name][0]]

    def get(self):
        t = self._t
        return self._v[name] if t is None else conv(t.col[name][self.rank])

    def put(self, value) -> None:
        t = self._t
        if t is None:
            self._v[name] = conv(value)
        else:
            t.col[name][self.rank] = value

    return property(get, put)


class RankRecord:
    """What the controller knows of one rank (its row of the table; module docstring). The constructor
    takes the fields by name as the former dataclass did."""

    __slots__ = ("rank", "_ident", "host", "_seq", "_replica", "dp_group", "_features", "_t", "_v")

    def __init__(self, rank: int, ident: bytes, pid: int = 0, host: str = "", last_seen: float = 0.0,
                 step: int = 0, data_status: int = 0, in_collective: bool = False, progress_age: float = -1.0,
                 coll_seq: dict | None = None, idle_age: float = -1.0, step_p99: float = -1.0,
                 replica: list | None = None, dp_group: list | None = None, alive: bool = True,
                 faulty: bool = False, registered: bool = True, features: dict | None = None, gen: int = 0,
                 left: bool = False):
        self.rank, self._ident, self.host, self._t = rank, ident, host, None
        self._seq = {} if coll_seq is None else coll_seq  # {group: last collective entered} (collectives.py)
        self.replica = replica
        self.dp_group = [] if dp_group is None else dp_group
        self._features = {} if features is None else features  # the processor's enable flags (retry.py)
        self._v = {"asks": asks_of(self._features), "pid": int(pid), "last_seen": float(last_seen),
                   "beat_seen": float(last_seen), "step": int(step),
                   "data_status": int(data_status),
                   "in_collective": bool(in_collective), "progress_age": float(progress_age),
                   "idle_age": float(idle_age), "step_p99": float(step_p99), "alive": bool(alive),
                   "faulty": bool(faulty), "registered": bool(registered), "gen": int(gen), "left": bool(left)}

    @property
    def features(self) -> dict:
        """The processor's enable flags (tft_init_processor: uce, arf, zit); assigned, never changed in place:
        their bits are the table's ``asks`` column."""
        return self._features

    @features.setter
    def features(self, value: dict) -> None:
        self._features = value
        self.asks = asks_of(value)

    @property
    def replica(self) -> tuple:
        """Its optimizer shards' layout: one {rank_list, replica_cnt, replica_shift} per optimizer type (its INFO).
        A tuple, replaced and never changed in place: a decision's views share it, and the shard map of the
        next decision sees by identity that the layout did not change (policy.ShardMap)."""
        return self._replica

    @replica.setter
    def replica(self, value) -> None:
        self._replica = () if value is None else tuple(value)

    @property
    def coll_seq(self) -> dict:
        """{group: sequence number of the last collective it entered} (its last beat's; the table's ``seqs``)."""
        t = self._t
        if t is None:
            return self._seq
        return t.coll_seqs((self.rank,))[0]

    @coll_seq.setter
    def coll_seq(self, value: dict) -> None:
        if self._t is None:
            self._seq = value
        else:
            self._t.seqs[self.rank] = value

    @property
    def ident(self) -> bytes:
        """The connection the rank speaks through (its route); b"": none."""
        return self._ident

    @ident.setter
    def ident(self, value: bytes) -> None:
        self._ident = value
        if self._t is not None:
            self._t.conn[self.rank] = self._t.conn_id(value)

    def __repr__(self) -> str:
        return (f"RankRecord(rank={self.rank}, ident={self._ident!r}, alive={self.alive}, step={self.step}, "
                f"registered={self.registered}, faulty={self.faulty})")


for _name in COLUMNS:
    setattr(RankRecord, _name, _column(_name))


class RankTable(dict):
    """The controller's rank table: ``{rank: RankRecord}`` over numpy columns (module docstring). Call
    its queries under the controller's lock (the I/O thread changes the rows)."""

    def __init__(self, records=(), capacity: int = 0):
        super().__init__()
        self.col: dict[str, np.ndarray] = {}
        self.present = np.zeros(0, np.bool_)  # a record of this rank is in the table
        self.watched = np.zeros(0, np.bool_)  # the liveness sweep watches this rank (watch.py)
        self.conn = np.zeros(0, np.int32)  # number of the rank's connection (conn_id), -1: none
        self.seqs = np.zeros(0, object)  # each rank's coll_seq dict, or its frame's packed bytes (coll_seqs)
        self.seqpos = np.zeros(0, np.int32)  # the rank's place in those bytes
        self._conns: dict[bytes, int] = {b"": -1}
        self._idents: list[bytes] = []  # conn id -> ident
        self._grow(max(capacity, 16))
        for rank, rec in dict(records).items():
            self[rank] = rec

    # ------------------------------------------------------------------ storage
    def _grow(self, need: int) -> None:
        size = len(self.present)
        if need <= size:
            return
        new = max(need, 2 * size)

        def wider(a, dtype, fill):
            out = np.full(new, fill, dtype)
            out[:size] = a
            return out

        for name, (dtype, default) in COLUMNS.items():
            self.col[name] = wider(self.col.get(name, np.zeros(0, dtype)), dtype, default)
        self.present = wider(self.present, np.bool_, False)
        self.watched = wider(self.watched, np.bool_, False)
        self.conn = wider(self.conn, np.int32, -1)
        self.seqs = wider(self.seqs, object, None)
        self.seqpos = wider(self.seqpos, np.int32, 0)

    def conn_id(self, ident: bytes) -> int:
        """The number of connection ``ident`` (one per connection ever seen; -1 for none)."""
        n = self._conns.get(ident)
        if n is None:
            n = self._conns[ident] = len(self._idents)
            self._idents.append(ident)
        return n

    def ident_of(self, conn: int) -> bytes:
        """The connection numbered ``conn`` (:meth:`conn_id`)."""
        return self._idents[conn]

    def __setitem__(self, rank: int, rec: RankRecord) -> None:
        if rank < 0:
            raise ValueError(f"rank {rank} in the rank table")
        self._grow(rank + 1)
        old = dict.get(self, rank)
        if old is not None and old is not rec:
            self._detach(old)
        if rec._t is not self:
            if rec._t is not None:
                rec._t._detach(rec)
            for name, value in rec._v.items():
                self.col[name][rank] = value
            self.seqs[rank], self.seqpos[rank] = rec._seq, 0
            rec._t, rec.rank = self, rank
        self.conn[rank] = self.conn_id(rec._ident)
        self.present[rank] = True
        dict.__setitem__(self, rank, rec)

    def _detach(self, rec: RankRecord) -> None:
        """``rec`` leaves the table: it keeps the values of its row."""
        rec._v = {name: getattr(rec, name) for name in COLUMNS}
        rec._seq = rec.coll_seq
        self.seqs[rec.rank] = None
        rec._t = None

    def __delitem__(self, rank: int) -> None:
        self._detach(dict.pop(self, rank))
        self.present[rank] = self.watched[rank] = False
        self.conn[rank] = -1

    def pop(self, rank, *default):
        if rank in self:
            rec = self[rank]
            del self[rank]
            return rec
        if default:
            return default[0]
        raise KeyError(rank)

    def clear(self) -> None:
        for rank in list(self):
            del self[rank]

    def update(self, other=(), **kw) -> None:
        for rank, rec in dict(other, **kw).items():
            self[rank] = rec

    def setdefault(self, rank, rec=None):
        if rank not in self:
            self[rank] = rec
        return self[rank]

    def popitem(self):
        rank = next(reversed(self))
        return rank, self.pop(rank)

    # ------------------------------------------------------------------ vectorized queries
    def mask(self, **conds) -> np.ndarray:
        """Rows present in the table whose columns equal ``conds`` (``alive=True, registered=True``;
        ``watched`` too)."""
        m = self.present.copy()
        for name, value in conds.items():
            col = self.watched if name == "watched" else self.col[name]
            m &= col == value
        return m

    def strategies_asked(self) -> set:
        """policy.strategies_of over the features of the registered ranks, from the ``asks`` column (a vector
        operation: a decision at 100,000 ranks read every record's features, 0.1 s)."""
        return strategies_asked(self.col["asks"][self.mask(registered=True)])

    def ranks_where(self, **conds) -> list[int]:
        """The ranks (sorted) whose columns equal ``conds``: ``ranks_where(alive=True, registered=True)``."""
        return np.flatnonzero(self.mask(**conds)).tolist()

    def live(self) -> list[int]:
        """The live ranks, sorted."""
        return self.ranks_where(alive=True)

    def dead(self) -> list[int]:
        """The dead ranks (known to the table), sorted."""
        return self.ranks_where(alive=False)

    def count(self, **conds) -> int:
        return int(np.count_nonzero(self.mask(**conds)))

    def min_step(self, ranks=None, **conds) -> int | None:
        """The lowest step of ``ranks`` (default: of the rows matching ``conds``); None when none."""
        if ranks is not None:
            idx = np.asarray(list(ranks), np.int64)
            idx = idx[(idx >= 0) & (idx < len(self.present))]
            idx = idx[self.present[idx]]
        else:
            idx = np.flatnonzero(self.mask(**conds))
        return int(self.col["step"][idx].min()) if len(idx) else None

    def views(self, replied) -> list:
        """The decision's view of every rank in the table (policy.RankView), alive only if it also
        ``replied`` (the stop round's replies): built from the columns, not from record attributes."""
        idx = np.flatnonzero(self.present)
        col = self.col
        alive = col["alive"][idx] & np.isin(idx, np.fromiter(replied, np.int64))
        ranks, get = idx.tolist(), dict.__getitem__
        with no_gc():  # 100k new tuples would run the collector over the whole table several times
            layouts = [get(self, r)._replica for r in ranks]  # the records' own tuples (RankRecord.replica)
            # tuple.__new__ straight from the columns: no Python-level call per rank
            return list(map(_new_view, zip(ranks, alive.tolist(), col["faulty"][idx].tolist(),
                                           col["step"][idx].tolist(), col["data_status"][idx].tolist(), layouts)))

    def after_stop(self, replies: dict) -> None:
        """The stop round's replies (``{rank: Reply}``): each rank that answered it sets its step (the one
        its reply names, else the one it had) and its data status (0 unless named), column assignments."""
        with no_gc():  # 100k short-lived tuples would run the collector over the whole table
            got = [(r, rep.detail) for r, rep in replies.items() if rep.ok]
            if not got:
                return
            idx = np.fromiter((r for r, _ in got), np.int64, len(got))
            step = self.col["step"]
            step[idx] = [d.get("step", s) for (_, d), s in zip(got, step[idx].tolist())]
            self.col["data_status"][idx] = [d.get("data_status", 0) for _, d in got]


    def through(self, ranks: np.ndarray, conns: np.ndarray) -> np.ndarray:
        """Whether each of ``ranks`` (an int64 array) is in the table and registered through the connection
        numbered (:meth:`conn_id`) as the same entry of ``conns``: a bool per entry (a relay speaks only for its
        own ranks)."""
        inside = (ranks >= 0) & (ranks < len(self.present))
        j = np.where(inside, ranks, 0)
        return inside & self.present[j] & (self.conn[j] == conns)

    def coll_seqs(self, ranks) -> list:
        """The coll_seq of each of ``ranks`` (RankRecord.coll_seq). A relay's BEATS frame packs its ranks' maps in
        one byte string (protocol v5), which the ``seqs`` column holds for each of them (``seqpos``: the rank's
        place), unpacked here once per frame -- only when read, a hang suspected: bytes are no container, so
        100,000 ranks' beats a second leave nothing for the garbage collector to walk. Content that does not
        unpack reads as no numbers (logged)."""
        seen: dict = {}
        out = []
        for r in ranks:
            got = self.seqs[r]
            if got.__class__ is bytes:
                seq = seen.get(id(got))
                if seq is None:
                    try:
                        seq = seen[id(got)] = unpack_extras(got)[0]
                    except ProtocolError as exc:
                        _log.warning("a relay's BEATS frame: %s (its ranks' collective numbers ignored)", exc)
                        seq = seen[id(got)] = []
                i = int(self.seqpos[r])
                got = seq[i] if 0 <= i < len(seq) else {}
            out.append(got)
        return out

    def column(self, name: str, ranks) -> list:
        """Column ``name`` of ``ranks`` as Python values."""
        return self.col[name][np.asarray(list(ranks), np.int64)].tolist()

    # ------------------------------------------------------------------ the I/O thread's hot paths
    def beats(self, ranks, conn: int, steps, status, coll, age, now: float, skip=()):
        """(I/O thread) One relay's BEATS frame (columns, wire/protocol.py ``Beats``) from connection
        number ``conn``: :meth:`beats_at`; returns (the accepted ranks, an index array; the ranks named that
        are not registered through this connection and did not leave, a list: the ack tells them to register)."""
        acc, unknown = self.beats_at(ranks, conn, steps, status, coll, age, now, skip)
        return acc, [ranks[i] for i in unknown.tolist()]

    def beats_at(self, ranks, conn, steps, status, coll, age, now, skip=(), extras=None):
        """(I/O thread) BEATS frames' columns, concatenated: the rows of the ranks registered through the connection
        numbered ``conn`` (one per rank, or one for all) get the beat's columns and ``last_seen = now`` (likewise),
        one slice assignment each; ranks in ``skip`` (a replaced rank's old process) are left alone. ``extras`` =
        (has, seq, pos, idle, p99): the v4/v5 columns (a bool per entry: the frame carried them; an object array of
        coll_seq dicts or of their frame's packed bytes; each entry's place in them; two float lists), set for the
        accepted entries that carry them. Returns (the accepted ranks; the positions in ``ranks`` of those not
        registered through their connection that did not leave), both index arrays."""
        idx = np.asarray(ranks, np.int64)
        inside = (idx >= 0) & (idx < len(self.present))
        j = np.where(inside, idx, 0)
        col = self.col
        ok = inside & self.present[j] & col["registered"][j] & (self.conn[j] == conn)
        other = ~ok
        if len(skip):
            skipped = np.isin(idx, np.asarray(skip, np.int64))
            ok &= ~skipped
            other &= ~skipped
        if ok.all() and (extras is None or extras[0].all()):  # the steady state: every rank is its relay's
            acc = idx
            col["step"][acc], col["data_status"][acc], col["in_collective"][acc] = steps, status, coll
            col["progress_age"][acc], col["last_seen"][acc], col["beat_seen"][acc] = age, now, now
            if extras is not None:
                self.seqs[acc], self.seqpos[acc] = extras[1], extras[2]
                col["idle_age"][acc], col["step_p99"][acc] = extras[3], extras[4]
            return acc, np.zeros(0, np.int64)
        if extras is not None:
            has = ok & extras[0]
            self.seqs[idx[has]], self.seqpos[idx[has]] = extras[1][has], extras[2][has]
            col["idle_age"][idx[has]] = np.asarray(extras[3], np.float64)[has]
            col["step_p99"][idx[has]] = np.asarray(extras[4], np.float64)[has]
        acc = idx[ok]
        col["step"][acc] = np.asarray(steps, np.int64)[ok]
        col["data_status"][acc] = np.asarray(status, np.int64)[ok]
        col["in_collective"][acc] = np.asarray(coll, np.bool_)[ok]
        col["progress_age"][acc] = np.asarray(age, np.float64)[ok]
        col["last_seen"][acc] = col["beat_seen"][acc] = now if np.ndim(now) == 0 else np.asarray(now)[ok]
        gone = inside & self.present[j] & col["left"][j]
        return acc, np.flatnonzero(other & ~gone)

    def expired(self, now: float, limit: float, alive: bool = True) -> np.ndarray:
        """(liveness sweep) Watched ranks (live ones only, unless ``alive=False``) silent for more than
        ``limit`` s, least recently heard first."""
        silent = self.watched & (now - self.col["last_seen"] > limit)
        if alive:
            silent &= self.col["alive"]
        idx = np.flatnonzero(silent)
        return idx[np.argsort(self.col["last_seen"][idx], kind="stable")] if len(idx) > 1 else idx

    def shift_clock(self, gap: float) -> None:
        """Every rank's last beat moves on by ``gap`` s (the controller itself stalled: watch.py)."""
        self.col["last_seen"][self.present] += gap
        self.col["beat_seen"][self.present] += gap


class Watched:
    """The ranks the liveness sweep watches, a dict-like face of the table's ``watched`` column (the
    former ``{rank: None}`` order of watch.py: ``seen[r] = None``, ``seen.pop(r, None)``, ``r in seen``)."""

    def __init__(self, table_of):
        self._table_of = table_of  # () -> the current RankTable (tests swap the controller's table)

    def _col(self, rank: int):
        t = self._table_of()
        t._grow(rank + 1)
        return t.watched

    def __setitem__(self, rank: int, _value) -> None:
        self._col(rank)[rank] = True

    def __contains__(self, rank) -> bool:
        w = self._table_of().watched
        return 0 <= rank < len(w) and bool(w[rank])

    def pop(self, rank: int, default=None):
        if rank in self:
            self._table_of().watched[rank] = False
            return None
        return default

    def move_to_end(self, rank: int) -> None:
        """Nothing to do: the sweep orders by the beat times (kept for the former OrderedDict's callers)."""

    def __len__(self) -> int:
        return int(np.count_nonzero(self._table_of().watched))

    def __iter__(self):
        return iter(np.flatnonzero(self._table_of().watched).tolist())


def infer_layout(rank: int, records) -> tuple[list, list]:
    """(replica, dp_group) of ``rank`` as the other ranks' records tell it: a DP group's replica entry
    ({rank_list, replica_cnt}) is the same on every member, so a rank that never registered here (a
    backup controller taking over after the primary's node died with it) gets the entry of any member
    that did, per optimizer type. Empty when no record names ``rank``."""
    replica: dict = {}
    dp_group: list = []
    for r in records:
        if not r.registered:
            continue
        for t, entry in enumerate(r.replica or ()):
            if entry and rank in entry.get("rank_list", ()):
                replica.setdefault(t, dict(entry))
        if not dp_group and rank in (r.dp_group or ()):
            dp_group = list(r.dp_group)
    return [replica.get(t, {}) for t in range(max(replica) + 1)] if replica else [], dp_group
