"""The controller's BEATS readers (mindio/ttp/wire/beats.py): the native one (mindio/_native/_beats.pyx) and the
Python one accept the same frames with the same columns, and refuse the same frames with the same error.

Frames are signed with the job's key after they are made or changed, so that each case reaches the parser
(a wrong signature is its own case). Both readers are fed the same bytes; a refusal must be the error
protocol.decode raises (type and message), an acceptance the same Envelope head and the same columns.
"""
from __future__ import annotations

import hmac
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mindio.errors import AuthError, ProtocolError
from mindio.ttp.wire import beats as B
from mindio.ttp.wire import protocol as P

KEY = b"reader-test-key-0123456789abcdef"

try:
    from mindio._native._beats import BeatsReader  # noqa: F401

    NATIVE = True
except ImportError:  # the Cython core is not built here: the Python reader is what the controller uses
    NATIVE = False

needs_native = pytest.mark.skipif(not NATIVE, reason="the native core (mindio._native._beats) is not built")


def _readers():
    native = B.reader(KEY) if NATIVE else None
    return native, B.PyBeatsReader(KEY)


def _sign(payload: bytes) -> bytes:
    return payload + hmac.digest(KEY, payload, "sha256")


def _frame(body: dict, head=(P.VERSION, int(P.MsgType.BEATS), 0, -1, 3, 77, 5)) -> bytes:
    return _sign(msgpack.packb([*head, body], use_bin_type=True))


def _body(n=3, packed=True, **over) -> dict:
    ranks = list(range(10, 10 + n))
    seq, sums = [{"dp": 100 + r} for r in ranks], [[4, 1.0, 0.5, 0.25]] * n
    body = dict(ranks=ranks, steps=[7] * n, status=[0] * n, coll=[False, True, False][:n] + [False] * (n - 3),
                age=[0.5] * n, seq=[], idle=[0.1] * n, p99=[0.9] * n, sums=[],
                packed=P.pack_extras(seq, sums) if packed else b"")
    body.update(over)
    return body


def _outcome(reader, frame: bytes):
    """What a reader makes of ``frame``: ("error", type, message), or ("env", head, columns) / ("other", env)."""
    try:
        env = reader.read(frame)
    except ProtocolError as exc:
        return ("error", type(exc).__name__, str(exc))
    if env.type is not P.MsgType.BEATS:
        return ("other", env)
    if env.body is B.HELD:  # as the controller keeps a frame (Controller._on_beats)
        reader.keep(4, 1.25)
    else:  # a BEATS frame the native parser left to protocol.decode
        reader.add(env.body, 4, 1.25, env.gen, B.pack_of(env.body))
    cols = reader.take()
    return ("env", tuple(env[2:]), tuple(c.tolist() if isinstance(c, np.ndarray) else c for c in cols))


def _same(frame: bytes):
    native, py = _readers()
    want = _outcome(py, frame)
    if native is not None:
        assert _outcome(native, frame) == want
    return want


def test_a_relays_frame_gives_the_same_columns_from_both_readers():
    frame = P.encode(P.Envelope(P.MsgType.BEATS, P.Beats(**_body()), rank=-1, gen=3), KEY, sess=77, ctr=5)
    kind, head, cols = _same(frame)
    assert kind == "env" and head == (-1, 0, 3, 77, 5, P.VERSION)
    ranks, steps, status, coll, age, idle, p99, ends, conns, nows, gens, has, packs = cols
    assert ranks == [10, 11, 12] and steps == [7] * 3 and coll == [False, True, False] and idle == [0.1] * 3
    assert ends == [3] and conns == [4] and nows == [1.25] and gens == [3] and has == [True]
    assert P.unpack_extras(packs[0])[0] == [{"dp": 110}, {"dp": 111}, {"dp": 112}]


@pytest.mark.parametrize("case", [
    "no-idle-p99", "no-packed", "int-age", "v4-unpacked", "ints-every-width", "float32", "str-packed", "bool-rank",
    "short-column", "unknown-field", "missing-field", "trailing-bytes", "wrong-version", "not-beats", "big-rank",
    "duplicate-key", "float-step", "int-coll", "ranks-not-first", "bad-packed", "truncated",
])
def test_both_readers_agree_on_every_kind_of_frame(case):
    b = _body()
    head = (P.VERSION, int(P.MsgType.BEATS), 0, -1, 3, 77, 5)
    if case == "no-idle-p99":
        b.update(idle=[], p99=[])
    elif case == "no-packed":
        b.update(packed=b"")
    elif case == "int-age":
        b.update(age=[1, 2, 3])
    elif case == "v4-unpacked":
        b.update(packed=b"", seq=[{"dp": 1}] * 3, sums=[[1, 1.0, 1.0, 1.0]] * 3)
    elif case == "float-step":
        b.update(steps=[7.0] * 3)
    elif case == "int-coll":
        b.update(coll=[0, 1, 0])
    elif case == "str-packed":
        b.update(packed="abc")
    elif case == "bool-rank":
        b.update(ranks=[True, 11, 12])
    elif case == "short-column":
        b.update(steps=[7, 7])
    elif case == "unknown-field":
        b.update(extra=[1])
    elif case == "missing-field":
        del b["status"]
    elif case == "big-rank":
        b.update(ranks=[2 ** 63, 11, 12])
    elif case == "bad-packed":
        b.update(packed=b"\x92\x90")
    elif case == "ranks-not-first":
        b = {"steps": b.pop("steps"), **b}
    elif case == "wrong-version":
        head = (P.VERSION - 1, *head[1:])
    elif case == "not-beats":
        head = (head[0], int(P.MsgType.HEARTBEAT), *head[2:])
        b = {"step": 3, "data_status": 0}
    if case == "ints-every-width":  # each integer of the frame in a wider encoding than msgpack's smallest
        def wide(v):
            return b"\xd3" + struct.pack(">q", v) if v < 0 else b"\xcf" + struct.pack(">Q", v)

        raw = bytearray(b"\x98" + b"".join(wide(v) for v in head))
        raw += b"\x8a"
        for k in ("ranks", "steps", "status"):
            raw += msgpack.packb(k) + b"\xdc" + struct.pack(">H", 3) + b"".join(
                [b"\xce" + struct.pack(">I", v) for v in b[k]] if k != "status" else [b"\xd0\x00"] * 3)
        for k in ("coll", "age", "seq", "idle", "p99", "sums", "packed"):
            raw += msgpack.packb(k) + msgpack.packb(b[k], use_bin_type=True)
        frame = _sign(bytes(raw))
    elif case == "float32":
        frame = _sign(msgpack.packb([*head, b], use_bin_type=True, use_single_float=True))
    elif case == "duplicate-key":
        raw = msgpack.packb([*head, b], use_bin_type=True)
        at = len(msgpack.packb(list(head)))  # the body map's header (10 fields) after the 7 head entries
        assert raw[at] == 0x8a
        frame = _sign(raw[:at] + b"\x8b" + raw[at + 1:] + msgpack.packb("steps") + msgpack.packb([1, 2, 3]))
    elif case == "trailing-bytes":
        frame = _sign(msgpack.packb([*head, b], use_bin_type=True) + b"\x00")
    elif case == "truncated":
        frame = _sign(msgpack.packb([*head, b], use_bin_type=True)[:-5])
    else:
        frame = _sign(msgpack.packb([*head, b], use_bin_type=True))
    got = _same(frame)
    accepted = {"no-idle-p99", "no-packed", "int-age", "v4-unpacked", "ints-every-width", "float32", "not-beats",
                "ranks-not-first", "duplicate-key", "bad-packed"}
    assert (got[0] != "error") == (case in accepted), got


def test_a_frame_with_a_wrong_signature_or_size_is_refused_by_both():
    frame = _frame(_body())
    for bad in (frame[:-1] + bytes([frame[-1] ^ 1]), frame[:20], b"", b"x" * (P.MAX_FRAME + 1)):
        got = _same(bad)
        assert got[0] == "error"
    assert _same(frame[:-1] + bytes([frame[-1] ^ 1]))[1] == AuthError.__name__


@settings(max_examples=300)
@given(st.data())
def test_any_change_to_a_signed_frame_is_judged_alike(data):
    """Random bytes changed, cut or added in a relay's frame, signed again: both readers say the same."""
    raw = bytearray(msgpack.packb([P.VERSION, int(P.MsgType.BEATS), 0, -1, 3, 77, 5, _body(n=data.draw(
        st.integers(0, 9)), packed=data.draw(st.booleans()))], use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["set", "cut", "add"]))
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "set" and raw:
            raw[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[at:at + data.draw(st.integers(1, 8))]
        else:
            raw[at:at] = bytes(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=8)))
    _same(_sign(bytes(raw)))


@needs_native
def test_a_frame_the_session_refused_is_not_kept_and_columns_accumulate_in_order():
    native, _ = _readers()
    a, b = _frame(_body()), _frame(_body(ranks=[20, 21, 22]))
    native.read(a)  # refused by its session: never kept
    native.read(b)
    native.keep(1, 2.0)
    native.read(a)
    native.keep(2, 3.0)
    native.add(P.Beats(**_body(ranks=[30, 31, 32], packed=False, idle=[], p99=[])), 3, 4.0, 9, None)
    assert native.pending == 3
    ranks, *_, idle, p99, ends, conns, nows, gens, has, packs = native.take()
    assert ranks.tolist() == [20, 21, 22, 10, 11, 12, 30, 31, 32] and ends.tolist() == [3, 6, 9]
    assert conns.tolist() == [1, 2, 3] and gens.tolist() == [3, 3, 9] and has.tolist() == [True, True, False]
    assert idle.tolist()[-3:] == [-1.0] * 3 and packs[2] is None and native.pending == 0
    with pytest.raises(RuntimeError):
        native.keep(1, 0.0)  # nothing read since the take


def test_an_integer_past_64_bits_is_refused_where_the_rank_table_would_take_it():
    """msgpack carries unsigned 64-bit integers; the rank table's columns are int64: a heartbeat's step of 2**63
    was accepted, and setting the rank table's column with it raises OverflowError."""
    hb = _sign(msgpack.packb([P.VERSION, int(P.MsgType.HEARTBEAT), 0, 1, 0, 77, 5,
                              {"step": 2 ** 63, "data_status": 0}]))
    got = _same(hb)
    assert got[0] == "error" and "HEARTBEAT.step must fit 64 bits" in got[2]
    got = _same(_frame(_body(steps=[7, 2 ** 64 - 1, 7])))
    assert got[0] == "error" and "BEATS.steps entries must fit 64 bits" in got[2]
