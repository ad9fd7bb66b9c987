"""The wire format of the control plane: the only module that touches bytes.

A frame is ``msgpack([v, type, sn, rank, gen, sess, ctr, body]) + HMAC-SHA256(secret, msgpack-bytes)``.

* ``v``    protocol version (:data:`VERSION`); any other version is rejected.
* ``type`` a :class:`MsgType`; ``body`` is the payload dataclass for that type, as a dict.
* ``sn``   the action sequence number for ACTION / REPLY (0 for other messages).
* ``rank`` the sender's rank (-1 for a controller, -1000-k for backup controller k's link); on a controller's
           ACTION, -1 means "every rank this frame is delivered to" (one signed frame per broadcast).
* ``gen``  the job generation; a processor of an older generation is refused by a later issue's rebuild.
* ``sess`` the session the frame belongs to (v3): on the way up, the session the controller offered in its
           CHALLENGE; on the way down, the controller's epoch (a random number drawn at its start).
* ``ctr``  the sender's counter in that session (v3): strictly increasing, so a receiver drops a frame that
           repeats or precedes one it already accepted (a replay, or an old frame delivered late).

Version 2 added batching, so that one frame carries the traffic of many ranks (a node agent relaying for
its ranks, or the scale benchmark's multiplexer; relays are off unless enabled, see session.py):

* BEATS: the heartbeats of many ranks, in columns (``ranks``, ``steps``, ``status``, ``coll``, ``age``);
  liveness stays per rank -- a relay lists only the ranks it heard from in the last interval. The
  controller answers with one HEARTBEAT_ACK whose ``unknown`` lists the ranks it does not know.
* BATCH: ``items`` = ``[[type, sn, rank, body], ...]``, each item validated exactly like a frame of its
  own (a bad item drops the whole frame); used for many REPLY / REGISTER / REPORT at once.
* ACTION.ranks: a relay delivers the action to these ranks (empty: to the recipient itself).

Version 4 carries the whole heartbeat through a relay: BEATS gained the columns ``seq`` (each rank's
``coll_seq`` map), ``idle`` (``idle_age``), ``p99`` (``step_p99``) and ``sums`` (``step_sums``), so that
hang culprits (controller/hangs.py) and slow ranks (controller/slow.py) work behind a node agent's relay
(mindio/ttp/wire/relay.py). A peer of another version is refused: its frames are dropped with a line
naming both versions.

Version 5 packs BEATS' per-rank maps and lists into one byte string: ``packed`` = msgpack ``[seq, sums]``
(:func:`pack_extras`), which the controller unpacks only when it reads them (:func:`unpack_extras`: a hang
suspected, slow-rank scoring on). Unpacked at every beat, a relay's frame of 8 ranks made 16 containers
at the controller: 200,000 objects a second at 100,000 ranks; per heartbeat round 790-980 ms of CPU then,
444-468 ms packed (bench/beats_cpu.py --n 100000).

Version 6: the controller answers a relay's run of REGISTER items (one BATCH) with one BATCH of REGISTER_ACK
items, which the relay hands to its ranks one by one: 100,000 ranks behind 12,500 relays registered with 100,000
acks sent one frame each before. And it acks a relay's BEATS every other interval (:data:`RELAY_ACK_GAP`; at
once when the ack's content changed), which the relay's link allows for.

Version 7: a relay sends its ranks' replies to one action as one REPLIES item of its BATCH -- ``ranks``, ``ok``,
``code``, ``detail``, one entry per rank, the action's ``sn`` on the item -- instead of one REPLY item per rank: a
stop round at 100,000 ranks was 100,000 REPLY items, each parsed and checked as a message of its own (~6 us each,
bench/replies_cpu.py), now 12,500 whose columns are checked at C speed.

Version 3 added sessions (mindio/ttp/wire/session.py): a connection says HELLO (a fresh nonce), the controller
answers CHALLENGE (that nonce, and a fresh session number), the REGISTER carries the session number as its
``sess``; only then does the connection speak for a rank, and every later frame carries that ``sess`` and a
higher ``ctr``. A captured frame replayed on another connection, into a later session or after a newer
one, is dropped.

Authentication is always on: every frame carries an HMAC over its bytes with the per-job secret, and
the MAC is checked *before* anything is unpacked. A frame that is oversize, unauthenticated, not valid
msgpack, of a wrong version or an unknown type, or whose body does not match its payload type raises
:class:`mindio.errors.ProtocolError` (or :class:`mindio.errors.AuthError`); receivers drop it and count
it in a :class:`DropCounter`, by reason. Nothing is ever pickled.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from ...errors import AuthError, ProtocolError
from ...vocab import MsgType  # the vocabulary (mindio/vocab.py)

__all__ = [
    "VERSION", "RELAY_ACK_GAP", "MAX_FRAME", "MsgType", "Envelope", "Register", "RegisterAck", "Heartbeat",
    "HeartbeatAck", "Report", "Info", "Action", "Reply", "Replies", "Bye", "Request", "Beats", "Batch", "Hello",
    "Challenge",
    "encode", "pack_body", "decode", "decode_payload", "DropCounter", "BODY_TYPES", "pack_extras", "unpack_extras",
    "fold_replies",
]

VERSION = 7
# heartbeat intervals: the controller acks a relay's BEATS when its last ack to that relay is at least this old
# (every other BEATS frame, v6: at 100,000 ranks behind 12,500 relays the acks were half of libzmq's work), and a
# relay's link allows one interval more of the controller's silence than a rank's before it fails over
RELAY_ACK_GAP = 1.5
MAX_FRAME = 1 << 20  # 1 MiB: control messages are small; anything bigger is an attack or a bug
_MAC_LEN = 32
_log = logging.getLogger("mindio.ttp.protocol")


@dataclass(frozen=True)
class Register:
    world_size: int
    pid: int
    host: str
    step: int = 0
    data_status: int = 0
    replica: list = field(default_factory=list)   # tft_set_optimizer_replica's replica_info
    dp_group: list = field(default_factory=list)  # tft_set_dp_group_info's dp_rank_list
    role: str = "processor"                       # "processor" | "backup" | "relay" (session.py)
    addr: str = ""                                # a backup controller's tcp://host:port
    pidns: str = ""                               # pidprobe.host_token(): same host + pid namespace (v2)
    features: dict = field(default_factory=dict)  # tft_init_processor's enable flags {"uce", "arf", "zit"}


@dataclass(frozen=True)
class RegisterAck:
    gen: int
    interval: float
    backups: list = field(default_factory=list)   # addresses to fail over to, in order
    passive: bool = False                         # a backup that has not taken over: go back to the primary


@dataclass(frozen=True)
class Heartbeat:
    step: int
    data_status: int
    in_collective: bool = False   # main thread is inside torch.distributed right now
    progress_age: float = 0.0     # seconds since this rank last made step progress
    coll_seq: dict = field(default_factory=dict)  # {process group name: sequence number of the last collective entered}
    idle_age: float = -1.0        # seconds since the main thread last ran or waited on storage; -1 unknown (processor/collectives.py)
    step_p99: float = -1.0        # p99 of this rank's recent step times (s); -1 until enough steps (processor/collectives.py)
    step_sums: list = field(default_factory=list)  # [steps timed, their wall s, main thread CPU s, s waited], cumulative (controller/slow.py)


@dataclass(frozen=True)
class HeartbeatAck:
    state: str = ""                               # "UNKNOWN": the controller does not know this rank
    backups: list = field(default_factory=list)   # current backup controller addresses
    unknown: list = field(default_factory=list)   # answer to BEATS: ranks the controller does not know
    passive: bool = False                         # a backup that has not taken over: go back to the primary


@dataclass(frozen=True)
class Report:
    state: int        # ReportState value
    message: str
    step: int


@dataclass(frozen=True)
class Info:
    replica: list
    dp_group: list


@dataclass(frozen=True)
class Action:
    name: str
    params: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)     # for a relay: deliver to these ranks (empty: recipient)


@dataclass(frozen=True, slots=True)  # (no __dict__: a stop round at 100,000 ranks builds 100,000 of them)
class Reply:
    ok: bool
    code: int = 0
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Replies:
    """REPLYs of ``len(ranks)`` ranks to one action (the item's ``sn``); entry i of every list is ``ranks[i]``'s
    (v7: a relay's BATCH item)."""
    ranks: list
    ok: list
    code: list
    detail: list

    def replies(self) -> list:
        """(rank, Reply) of each entry."""
        return [(r, Reply(o, c, d)) for r, o, c, d in zip(self.ranks, self.ok, self.code, self.detail)]


@dataclass(frozen=True)
class Bye:
    reason: str = ""


@dataclass(frozen=True)
class Request:
    name: str         # "dump": a last-words checkpoint at the current step, then exit (EXIT_CODE_DUMPED)
    reason: str = ""  # why, for the log ("SIGTERM")


@dataclass(frozen=True)
class Beats:
    """Heartbeats of ``len(ranks)`` ranks; column i of every list belongs to ``ranks[i]``."""
    ranks: list
    steps: list
    status: list
    coll: list
    age: list
    seq: list = field(default_factory=list)    # coll_seq maps (v4; empty: none sent, else one per rank)
    idle: list = field(default_factory=list)   # idle_age
    p99: list = field(default_factory=list)    # step_p99
    sums: list = field(default_factory=list)   # step_sums
    packed: bytes = b""  # v5: seq and sums packed (pack_extras; then both lists above are empty)


@dataclass(frozen=True)
class Batch:
    items: list   # after decode: a list of Envelope (gen, sess, ctr and v of the outer frame)


@dataclass(frozen=True)
class Hello:
    nonce: int    # random, fresh for this HELLO: the CHALLENGE that echoes it answers this HELLO


@dataclass(frozen=True)
class Challenge:
    nonce: int    # the HELLO's nonce
    session: int  # random, single use: the ``sess`` of the REGISTER that opens the session


BODY_TYPES: dict[MsgType, type] = {
    MsgType.REGISTER: Register, MsgType.REGISTER_ACK: RegisterAck, MsgType.HEARTBEAT: Heartbeat,
    MsgType.HEARTBEAT_ACK: HeartbeatAck, MsgType.REPORT: Report, MsgType.INFO: Info,
    MsgType.ACTION: Action, MsgType.REPLY: Reply, MsgType.BYE: Bye, MsgType.BEATS: Beats, MsgType.BATCH: Batch,
    MsgType.HELLO: Hello, MsgType.CHALLENGE: Challenge, MsgType.REQUEST: Request, MsgType.REPLIES: Replies,
}
_PY_TYPES = {"int": (int,), "str": (str,), "float": (float, int), "bool": (bool,), "list": (list,), "dict": (dict,),
             "bytes": (bytes,)}


class Envelope(NamedTuple):
    """One message (immutable). A NamedTuple rather than a frozen dataclass: the controller builds one
    per heartbeat, and this is ~3x cheaper to construct."""
    type: MsgType
    body: Any
    rank: int = -1
    sn: int = 0
    gen: int = 0
    sess: int = 0
    ctr: int = 0
    v: int = VERSION


_TYPES = {int(t): t for t in MsgType}
_INT = {int}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# per payload type: (field name, accepted python types, type name, required), computed once
_SPECS = {cls: tuple((f.name, _PY_TYPES[f.type], f.type,
                      f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                     for f in dataclasses.fields(cls)) for cls in BODY_TYPES.values()}


_NAMES = {cls: frozenset(name for name, *_ in spec) for cls, spec in _SPECS.items()}
_ITEM_TYPES = {int(t): t for t in MsgType
               if t not in (MsgType.BEATS, MsgType.BATCH, MsgType.HELLO, MsgType.CHALLENGE)}
_BEAT_COLS = (("steps", {int}, "int"), ("status", {int}, "int"), ("coll", {bool}, "bool"), ("age", {float, int}, "float"))
_BEAT_EXTRAS = (("seq", {dict}, "map"), ("idle", {float, int}, "float"), ("p99", {float, int}, "float"),
                ("sums", {list}, "list"))


def _body_from(mtype: MsgType, raw: Any, outer: tuple = (0, 0, 0)):
    """The body of a ``mtype`` message from its decoded map; ``outer``: (gen, sess, ctr) of the frame, which a
    BATCH's items carry."""
    cls = BODY_TYPES[mtype]
    if raw.__class__ is not dict:
        raise ProtocolError(f"{mtype.name} body must be a map, got {type(raw).__name__}")
    spec = _SPECS[cls]
    if not raw.keys() <= _NAMES[cls]:
        unknown = set(raw) - _NAMES[cls]
        raise ProtocolError(f"{mtype.name} body has unknown fields {sorted(map(str, unknown))}")
    for name, ok, tname, required in spec:
        if name not in raw:
            if required:
                raise ProtocolError(f"{mtype.name} body lacks field {name!r}")
            continue
        value = raw[name]
        if not isinstance(value, ok) or (tname == "int" and value.__class__ is bool):
            raise ProtocolError(f"{mtype.name}.{name} must be {tname}, got {type(value).__name__}")
        if tname == "int" and not _INT64_MIN <= value <= _INT64_MAX:  # the rank table's columns are int64
            raise ProtocolError(f"{mtype.name}.{name} must fit 64 bits, got {value}")
    if cls is Beats:
        _check_beats(raw)
    elif cls is Replies:
        _check_replies(raw)
    elif cls is Batch:
        return Batch(items=[_item(x, *outer) for x in raw["items"]])
    return cls(**raw)


def _check_columns(kind: str, raw: dict, cols: tuple, int64: tuple) -> list:
    """A frame body of columns (BEATS, REPLIES): ``ranks`` integers, each of ``cols`` (name, types, type name) one
    entry per rank of those exact types, the ``int64`` columns within 64 bits; returns the ranks."""
    # exact types through set(map(type, ...)): C speed, and a bool is not an int here (type(True) is bool)
    ranks = raw["ranks"]
    if not set(map(type, ranks)) <= {int}:
        raise ProtocolError(f"{kind}.ranks must be integers")
    for name, ok, tname in cols:
        col = raw[name]
        if len(col) != len(ranks):
            raise ProtocolError(f"{kind}.{name} has {len(col)} entries for {len(ranks)} ranks")
        if not set(map(type, col)) <= ok:
            raise ProtocolError(f"{kind}.{name} entries must be {tname}")
    for name in int64:  # the rank table's int64 columns take them (min, max: C speed)
        col = raw[name]
        if col and (min(col) < _INT64_MIN or max(col) > _INT64_MAX):
            raise ProtocolError(f"{kind}.{name} entries must fit 64 bits")
    return ranks


def _check_beats(raw: dict) -> None:
    ranks = _check_columns("BEATS", raw, _BEAT_COLS, ("ranks", "steps", "status"))
    for name, ok, tname in _BEAT_EXTRAS:  # optional columns (v4): absent, or one entry per rank
        col = raw.get(name)
        if col and len(col) != len(ranks):
            raise ProtocolError(f"BEATS.{name} has {len(col)} entries for {len(ranks)} ranks")
        if col and not set(map(type, col)) <= ok:
            raise ProtocolError(f"BEATS.{name} entries must be {tname}")


_REPLY_COLS = (("ok", {bool}, "bool"), ("code", {int}, "int"), ("detail", {dict}, "map"))


def _check_replies(raw: dict) -> None:
    _check_columns("REPLIES", raw, _REPLY_COLS, ("ranks", "code"))


def fold_replies(items: list) -> list:
    """``items`` (a BATCH's) with each run of REPLYs to one action (one ``sn``) as one REPLIES item (v7): what a
    relay sends, and how the controller records a BATCH's REPLY items however they came."""
    out: list = []
    for e in items:
        if e.type is not MsgType.REPLY:
            out.append(e)
            continue
        last = out[-1] if out else None
        if last is None or last.type is not MsgType.REPLIES or last.sn != e.sn:
            last = Envelope(MsgType.REPLIES, Replies([], [], [], []), rank=-1, sn=e.sn, gen=e.gen)
            out.append(last)
        cols = last.body
        cols.ranks.append(e.rank)
        cols.ok.append(e.body.ok)
        cols.code.append(e.body.code)
        cols.detail.append(e.body.detail)
    return out


def pack_extras(seq: list, sums: list) -> bytes:
    """BEATS' ``packed`` (v5): the ranks' coll_seq maps and step_sums lists, one entry per rank each."""
    return msgpack.packb([seq, sums])


def unpack_extras(packed: bytes, n: int = -1) -> tuple[list, list]:
    """(seq, sums) of a BEATS frame's ``packed`` for its ``n`` ranks (-1: as many as it holds): a list of
    {str: int} maps and a list of lists, of one length. The frame was authenticated, but its content is
    checked as any frame's: ProtocolError if not."""
    try:
        got = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise ProtocolError(f"malformed BEATS.packed ({exc.__class__.__name__})") from None
    if got.__class__ is not list or len(got) != 2 or any(c.__class__ is not list for c in got) \
            or len(got[0]) != len(got[1]) or n not in (-1, len(got[0])):
        raise ProtocolError("BEATS.packed must be [seq, sums], one entry per rank each")
    seq, sums = got
    if not set(map(type, seq)) <= {dict} or not set(map(type, sums)) <= {list}:
        raise ProtocolError("BEATS.packed: seq entries must be maps, sums entries lists")
    for m in seq:
        if not set(map(type, m.values())) <= {int}:
            raise ProtocolError("BEATS.packed: collective numbers must be integers")
    return seq, sums


def _item(x: Any, gen: int = 0, sess: int = 0, ctr: int = 0) -> Envelope:
    if x.__class__ is not list or len(x) != 4:
        raise ProtocolError("BATCH item must be a 4-element array [type, sn, rank, body]")
    mtype, sn, rank, body = x
    if not (mtype.__class__ is int and sn.__class__ is int and rank.__class__ is int):
        raise ProtocolError("BATCH item type/sn/rank must be integers")
    t = _ITEM_TYPES.get(mtype)
    if t is None:
        raise ProtocolError(f"BATCH item of unknown or nested type {mtype}")
    return Envelope(t, _body_from(t, body), rank, sn, gen, sess, ctr)


def _raw_body(body) -> dict:
    return {name: getattr(body, name) for name, *_ in _SPECS[type(body)]}


def pack_body(env: Envelope) -> bytes:
    """The msgpack bytes of ``env``'s body, for :func:`encode`'s ``body``: a sender that sends the same body
    many times (the controller's heartbeat acks) packs it once."""
    if env.type is MsgType.BATCH:
        return msgpack.packb({"items": [[int(e.type), e.sn, e.rank, _raw_body(e.body)] for e in env.body.items]},
                             use_bin_type=True)
    return msgpack.packb(_raw_body(env.body), use_bin_type=True)


def encode(env: Envelope, key: bytes, body: bytes | None = None, sess: int | None = None,
           ctr: int | None = None) -> bytes:
    """Serialize and sign one envelope (``body``: its :func:`pack_body`, when the caller has it already;
    ``sess`` / ``ctr``: instead of the envelope's). Raises ProtocolError if the result would be oversize."""
    head = msgpack.packb([env.v, env.type, env.sn, env.rank, env.gen, env.sess if sess is None else sess,
                   env.ctr if ctr is None else ctr])
    payload = b"%c%b%b" % (0x98, head[1:], pack_body(env) if body is None else body)  # fixarray of 7 -> of 8
    if len(payload) + _MAC_LEN > MAX_FRAME:
        raise ProtocolError(f"oversize {env.type.name} frame ({len(payload)} bytes > {MAX_FRAME})")
    return payload + hmac.digest(key, payload, "sha256")


def decode(frame: bytes, key: bytes) -> Envelope:
    """Verify and parse one frame. Raises AuthError / ProtocolError; never anything else."""
    if len(frame) > MAX_FRAME:
        raise ProtocolError(f"oversize frame ({len(frame)} > {MAX_FRAME} bytes)")
    if len(frame) <= _MAC_LEN:
        raise ProtocolError(f"short frame ({len(frame)} bytes)")
    view = memoryview(frame)
    payload, mac = view[:-_MAC_LEN], view[-_MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.digest(key, payload, "sha256")):
        raise AuthError("frame failed HMAC verification (wrong secret or forged sender)")
    return decode_payload(payload)


def decode_payload(payload) -> Envelope:
    """Parse a frame's bytes before its HMAC, which the caller verified (:func:`decode`; wire/beats.py).
    Raises ProtocolError; never anything else."""
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise ProtocolError(f"malformed msgpack ({exc.__class__.__name__})") from None
    if not isinstance(items, list) or not items:
        raise ProtocolError("envelope must be an array [v, type, sn, rank, gen, sess, ctr, body]")
    if items[0] != VERSION:
        raise ProtocolError(f"protocol version {items[0]!r} is not supported (this side speaks {VERSION}): the peer "
                            "runs another mindio release; run the same mindio on every node")
    if len(items) != 8:
        raise ProtocolError("envelope must be an 8-element array [v, type, sn, rank, gen, sess, ctr, body]")
    v, mtype, sn, rank, gen, sess, ctr, body = items
    if not set(map(type, items[1:7])) <= _INT:  # exact ints (a bool is not one), at C speed: once per frame
        raise ProtocolError("envelope type/sn/rank/gen/sess/ctr must be integers")
    mtype = _TYPES.get(mtype)
    if mtype is None:
        raise ProtocolError(f"unknown message type {items[1]}")
    body = _body_from(mtype, body, (gen, sess, ctr))  # a BATCH's items get the frame's gen, sess and ctr
    return Envelope(mtype, body, rank, sn, gen, sess, ctr, v)


class DropCounter:
    """Counts rejected frames by reason; logs the first few of each reason, then every 1000th."""

    def __init__(self) -> None:
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def drop(self, exc: Exception, origin: str = "") -> None:
        """Count ``exc`` under its reason (``auth``, ``protocol``, and for frames outside a session
        ``session`` / ``replay`` / ``refused``: errors.SessionError) and log it with that reason."""
        reason = getattr(exc, "reason", "protocol")
        with self._lock:
            self._counts[reason] += 1
            n = self._counts[reason]
        if n <= 5 or n % 1000 == 0:
            _log.warning("dropped frame #%d (%s) from %s: %s", n, reason, origin or "?", exc)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
