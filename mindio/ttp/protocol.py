"""The wire format of the control plane: the only module that touches bytes.

A frame is ``msgpack([v, type, sn, rank, gen, body]) + HMAC-SHA256(secret, msgpack-bytes)``.

* ``v``    protocol version (:data:`VERSION`); any other version is rejected.
* ``type`` a :class:`MsgType`; ``body`` is the payload dataclass for that type, as a dict.
* ``sn``   the action sequence number for ACTION / REPLY (0 for other messages).
* ``rank`` the sender's rank (-1 for a controller, -2 for a backup controller's hello); on a controller's
           ACTION, -1 means "every rank this frame is delivered to" (one signed frame per broadcast).
* ``gen``  the job generation; a processor of an older generation is refused by a later issue's rebuild.

Version 2 added batching, so that one frame carries the traffic of many ranks (a node agent relaying for
its ranks, or the scale benchmark's multiplexer; see transport.RELAY_PREFIX):

* BEATS: the heartbeats of many ranks, in columns (``ranks``, ``steps``, ``status``, ``coll``, ``age``);
  liveness stays per rank -- a relay lists only the ranks it heard from in the last interval. The
  controller answers with one HEARTBEAT_ACK whose ``unknown`` lists the ranks it does not know.
* BATCH: ``items`` = ``[[type, sn, rank, body], ...]``, each item validated exactly like a frame of its
  own (a bad item drops the whole frame); used for many REPLY / REGISTER / REPORT at once.
* ACTION.ranks: a relay delivers the action to these ranks (empty: to the recipient itself).

Authentication is always on: every frame carries an HMAC over its bytes with the per-job secret, and
the MAC is checked *before* anything is unpacked. A frame that is oversize, unauthenticated, not valid
msgpack, of a wrong version or an unknown type, or whose body does not match its payload type raises
:class:`mindio.errors.ProtocolError` (or :class:`mindio.errors.AuthError`); receivers drop it and count
it in a :class:`DropCounter`. Nothing is ever pickled.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import hmac
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from ..errors import AuthError, ProtocolError

__all__ = [
    "VERSION", "MAX_FRAME", "MsgType", "Envelope", "Register", "RegisterAck", "Heartbeat", "HeartbeatAck",
    "Report", "Info", "Action", "Reply", "Bye", "Request", "Beats", "Batch", "encode", "decode", "DropCounter", "BODY_TYPES",
]

VERSION = 2
MAX_FRAME = 1 << 20  # 1 MiB: control messages are small; anything bigger is an attack or a bug
_MAC_LEN = 32
_log = logging.getLogger(__name__)


class MsgType(enum.IntEnum):
    REGISTER = 1       # processor -> controller: hello (also a backup controller's hello, rank -2)
    REGISTER_ACK = 2   # controller -> processor: accepted; heartbeat interval, backup addresses
    HEARTBEAT = 3      # processor -> controller: liveness + step progress
    HEARTBEAT_ACK = 4  # controller -> processor: controller liveness
    REPORT = 5         # processor -> controller: an error caught on the rank (wakes the controller)
    INFO = 6           # processor -> controller: optimizer replica layout / DP group changed
    ACTION = 7         # controller -> processor: do something (sn identifies it)
    REPLY = 8          # processor -> controller: result of ACTION sn
    BYE = 9            # processor -> controller: leaving normally (training finished); not a fault
    BEATS = 10         # relay -> controller: heartbeats of many ranks in one frame (v2)
    BATCH = 11         # relay <-> controller: many messages of other types in one frame (v2)
    REQUEST = 12       # processor -> controller: ask for a graceful action ("dump": preemption, preempt.py)


@dataclass(frozen=True)
class Register:
    world_size: int
    pid: int
    host: str
    step: int = 0
    data_status: int = 0
    replica: list = field(default_factory=list)   # tft_set_optimizer_replica's replica_info
    dp_group: list = field(default_factory=list)  # tft_set_dp_group_info's dp_rank_list
    role: str = "processor"                       # "processor" | "backup"
    addr: str = ""                                # a backup controller's tcp://host:port
    pidns: str = ""                               # pidprobe.host_token(): same host + pid namespace (v2)
    features: dict = field(default_factory=dict)  # tft_init_processor's enable flags {"uce", "arf", "zit"}


@dataclass(frozen=True)
class RegisterAck:
    gen: int
    interval: float
    backups: list = field(default_factory=list)   # addresses to fail over to, in order


@dataclass(frozen=True)
class Heartbeat:
    step: int
    data_status: int
    in_collective: bool = False   # main thread is inside torch.distributed right now
    progress_age: float = 0.0     # seconds since this rank last made step progress


@dataclass(frozen=True)
class HeartbeatAck:
    state: str = ""                               # "UNKNOWN": the controller does not know this rank
    backups: list = field(default_factory=list)   # current backup controller addresses
    unknown: list = field(default_factory=list)   # answer to BEATS: ranks the controller does not know


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


@dataclass(frozen=True)
class Reply:
    ok: bool
    code: int = 0
    detail: dict = field(default_factory=dict)


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


@dataclass(frozen=True)
class Batch:
    items: list   # after decode: a list of Envelope (gen and v of the outer frame)


BODY_TYPES: dict[MsgType, type] = {
    MsgType.REGISTER: Register, MsgType.REGISTER_ACK: RegisterAck, MsgType.HEARTBEAT: Heartbeat,
    MsgType.HEARTBEAT_ACK: HeartbeatAck, MsgType.REPORT: Report, MsgType.INFO: Info,
    MsgType.ACTION: Action, MsgType.REPLY: Reply, MsgType.BYE: Bye, MsgType.BEATS: Beats, MsgType.BATCH: Batch,
    MsgType.REQUEST: Request,
}
_PY_TYPES = {"int": (int,), "str": (str,), "float": (float, int), "bool": (bool,), "list": (list,), "dict": (dict,)}


class Envelope(NamedTuple):
    """One message (immutable). A NamedTuple rather than a frozen dataclass: the controller builds one
    per heartbeat, and this is ~3x cheaper to construct."""
    type: MsgType
    body: Any
    rank: int = -1
    sn: int = 0
    gen: int = 0
    v: int = VERSION


_TYPES = {int(t): t for t in MsgType}
# per payload type: (field name, accepted python types, type name, required), computed once
_SPECS = {cls: tuple((f.name, _PY_TYPES[f.type], f.type,
                      f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                     for f in dataclasses.fields(cls)) for cls in BODY_TYPES.values()}


_NAMES = {cls: frozenset(name for name, *_ in spec) for cls, spec in _SPECS.items()}
_ITEM_TYPES = {int(t): t for t in MsgType if t not in (MsgType.BEATS, MsgType.BATCH)}
_BEAT_COLS = (("steps", {int}, "int"), ("status", {int}, "int"), ("coll", {bool}, "bool"), ("age", {float, int}, "float"))


def _body_from(mtype: MsgType, raw: Any):
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
    if cls is Beats:
        _check_beats(raw)
    elif cls is Batch:
        return Batch(items=[_item(x) for x in raw["items"]])
    return cls(**raw)


def _check_beats(raw: dict) -> None:
    # exact types through set(map(type, ...)): C speed, and a bool is not an int here (type(True) is bool)
    ranks = raw["ranks"]
    if not set(map(type, ranks)) <= {int}:
        raise ProtocolError("BEATS.ranks must be integers")
    for name, ok, tname in _BEAT_COLS:
        col = raw[name]
        if len(col) != len(ranks):
            raise ProtocolError(f"BEATS.{name} has {len(col)} entries for {len(ranks)} ranks")
        if not set(map(type, col)) <= ok:
            raise ProtocolError(f"BEATS.{name} entries must be {tname}")


def _item(x: Any) -> Envelope:
    if x.__class__ is not list or len(x) != 4:
        raise ProtocolError("BATCH item must be a 4-element array [type, sn, rank, body]")
    mtype, sn, rank, body = x
    if not (mtype.__class__ is int and sn.__class__ is int and rank.__class__ is int):
        raise ProtocolError("BATCH item type/sn/rank must be integers")
    t = _ITEM_TYPES.get(mtype)
    if t is None:
        raise ProtocolError(f"BATCH item of unknown or nested type {mtype}")
    return Envelope(type=t, body=_body_from(t, body), rank=rank, sn=sn)


def _raw_body(body) -> dict:
    return {name: getattr(body, name) for name, *_ in _SPECS[type(body)]}


def encode(env: Envelope, key: bytes) -> bytes:
    """Serialize and sign one envelope. Raises ProtocolError if the result would be oversize."""
    if env.type is MsgType.BATCH:
        body = {"items": [[int(e.type), e.sn, e.rank, _raw_body(e.body)] for e in env.body.items]}
    else:
        body = _raw_body(env.body)
    payload = msgpack.packb([env.v, int(env.type), env.sn, env.rank, env.gen, body], use_bin_type=True)
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
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise ProtocolError(f"malformed msgpack ({exc.__class__.__name__})") from None
    if not isinstance(items, list) or len(items) != 6:
        raise ProtocolError("envelope must be a 6-element array [v, type, sn, rank, gen, body]")
    v, mtype, sn, rank, gen, body = items
    if v != VERSION:
        raise ProtocolError(f"protocol version {v!r} is not supported (this side speaks {VERSION})")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (mtype, sn, rank, gen)):
        raise ProtocolError("envelope type/sn/rank/gen must be integers")
    mtype = _TYPES.get(mtype)
    if mtype is None:
        raise ProtocolError(f"unknown message type {items[1]}")
    body = _body_from(mtype, body)
    if mtype is MsgType.BATCH:
        body = Batch(items=[e._replace(gen=gen) for e in body.items])
    return Envelope(type=mtype, body=body, rank=rank, sn=sn, gen=gen, v=v)


class DropCounter:
    """Counts rejected frames by reason; logs the first few of each reason, then every 1000th."""

    def __init__(self) -> None:
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def drop(self, exc: Exception, origin: str = "") -> None:
        reason = "auth" if isinstance(exc, AuthError) else "protocol"
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
