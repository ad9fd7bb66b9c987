"""Wire format and state table."""
import msgpack
import pytest
from hypothesis import given, strategies as st

from mindio.errors import AuthError, IllegalTransition, ProtocolError
from mindio.ttp.wire import protocol as P
from mindio.ttp.controller.states import TRANSITIONS, Result, State, StateMachine

KEY = b"k" * 32
_BEATS_BODY = {"ranks": [1, 2], "steps": [3, 3], "status": [0, 0], "coll": [False, True], "age": [0.5, 1.0]}


def test_roundtrip_every_type():
    bodies = [P.Register(world_size=4, pid=1, host="h", replica=[{"rank_list": [0, 1]}]),
              P.RegisterAck(gen=1, interval=1.0, backups=["tcp://a:1"]), P.Heartbeat(step=3, data_status=0),
              P.HeartbeatAck(state="NORMAL"), P.Report(state=2, message="UCE ERROR", step=3),
              P.Info(replica=[], dp_group=[0, 1]), P.Action(name="save", params={"step": 3}),
              P.Reply(ok=True, detail={"x": 1}), P.Bye("done"), P.Beats(**_BEATS_BODY),
              P.Action(name="stop", params={}, ranks=[4, 5]), P.HeartbeatAck(state="NORMAL", unknown=[7]),
              P.Hello(nonce=(1 << 63) - 1), P.Challenge(nonce=5, session=9)]
    for body in bodies:
        mtype = next(t for t, c in P.BODY_TYPES.items() if c is type(body))
        env = P.Envelope(type=mtype, body=body, rank=3, sn=7, gen=2, sess=(1 << 62) + 3, ctr=11)
        assert P.decode(P.encode(env, KEY), KEY) == env


def test_batch_roundtrip_items_take_the_frame_generation_and_session():
    items = [P.Envelope(P.MsgType.REPLY, P.Reply(ok=True, detail={"step": 5}), rank=r, sn=9) for r in range(3)]
    items.append(P.Envelope(P.MsgType.REGISTER, P.Register(world_size=4, pid=1, host="h"), rank=3))
    got = P.decode(P.encode(P.Envelope(P.MsgType.BATCH, P.Batch(items), rank=-1, gen=4, sess=8, ctr=2), KEY), KEY)
    assert got.type is P.MsgType.BATCH and got.gen == 4
    assert got.body.items == [e._replace(gen=4, sess=8, ctr=2) for e in items]


def _frame(items, key=KEY):
    import hashlib, hmac
    payload = msgpack.packb(items)
    return payload + hmac.new(key, payload, hashlib.sha256).digest()


V = P.VERSION
_BEATS = {"ranks": [1, 2], "steps": [3, 3], "status": [0, 0], "coll": [False, True], "age": [0.5, 1.0]}


@pytest.mark.parametrize("items,match", [
    ([V + 1, 3, 0, 1, 0, 0, 0, {"step": 1, "data_status": 0}], "version"),
    ([1, 3, 0, 1, 0, 0, 0, {"step": 1, "data_status": 0}], "version"),  # v1 peers are refused, not misread
    ([V, 99, 0, 1, 0, 0, 0, {}], "unknown message type"),
    ([V, 3, 0, 1, 0, 0, 0, {"step": "x", "data_status": 0}], "must be int"),
    ([V, 3, 0, 1, 0, 0, 0, {"step": 1, "data_status": 0, "evil": 1}], "unknown fields"),
    ([V, 3, 0, 1, 0, 0, 0, {"data_status": 0}], "lacks field"),
    ([V, 3, 0], "8-element"),
    ([V, 3, 0, 1, 0, 0, 0, {"step": 1, "data_status": 0}, 9], "8-element"),
    ([V, 3, 0, 1, 0, "0", 0, {"step": 1, "data_status": 0}], "integers"),
    ([2, 3, 0, 1, 0, {"step": 1, "data_status": 0}], "version"),  # v2 (no session) is refused
    ([V, 3, "0", 1, 0, 0, 0, {}], "integers"),
    ([V, 10, 0, -1, 0, 0, 0, dict(_BEATS, steps=[3])], "1 entries for 2 ranks"),
    ([V, 10, 0, -1, 0, 0, 0, dict(_BEATS, ranks=[1, "2"])], "ranks must be integers"),
    ([V, 10, 0, -1, 0, 0, 0, dict(_BEATS, coll=[0, 1])], "coll entries must be bool"),
    ([V, 10, 0, -1, 0, 0, 0, dict(_BEATS, steps=[True, 3])], "steps entries must be int"),
    ([V, 11, 0, -1, 0, 0, 0, {"items": [[3, 0, 1]]}], "4-element"),
    ([V, 11, 0, -1, 0, 0, 0, {"items": [[11, 0, 1, {"items": []}]]}], "nested"),
    ([V, 11, 0, -1, 0, 0, 0, {"items": [[3, 0, 1, {"step": "x", "data_status": 0}]]}], "must be int"),
    ([V, 11, 0, -1, 0, 0, 0, {"items": [[3, 0, "1", {"step": 1, "data_status": 0}]]}], "integers"),
])
def test_bad_frames_rejected(items, match):
    with pytest.raises(ProtocolError, match=match):
        P.decode(_frame(items), KEY)


def test_forged_and_oversize_rejected():
    good = P.encode(P.Envelope(type=P.MsgType.HEARTBEAT, body=P.Heartbeat(1, 0)), KEY)
    with pytest.raises(AuthError):
        P.decode(good, b"other-secret")
    with pytest.raises(AuthError):
        P.decode(good[:-1] + bytes([good[-1] ^ 1]), KEY)
    with pytest.raises(ProtocolError, match="oversize"):
        P.decode(b"x" * (P.MAX_FRAME + 1), KEY)
    with pytest.raises(ProtocolError, match="oversize"):
        P.encode(P.Envelope(type=P.MsgType.REPORT, body=P.Report(8, "x" * P.MAX_FRAME, 0)), KEY)


@given(st.binary(max_size=300))
def test_garbage_never_crashes(data):
    with pytest.raises(ProtocolError):
        P.decode(data, KEY)
    with pytest.raises(ProtocolError):  # even correctly signed garbage
        import hashlib, hmac
        P.decode(data + hmac.new(KEY, data, hashlib.sha256).digest(), KEY) if data else P.decode(b"", KEY)


def test_drop_counter():
    from mindio.errors import SessionError

    c = P.DropCounter()
    c.drop(AuthError("x")); c.drop(ProtocolError("y")); c.drop(ProtocolError("z"))
    c.drop(SessionError("a", "replay")); c.drop(SessionError("b"))
    assert c.snapshot() == {"auth": 1, "protocol": 2, "replay": 1, "session": 1} and c.total == 5


def test_dump_path_and_illegal_transition():
    sm = StateMachine()
    for r in (Result.ALL_REGISTERED, Result.FAULT, Result.DUMP, Result.OK, Result.OK):
        sm.fire(r)
    assert sm.state is State.FINAL
    with pytest.raises(IllegalTransition, match="FINAL"):
        sm.fire(Result.FAULT)


def test_table_is_consistent():
    assert set(State) == {s for s, _ in TRANSITIONS} | {State.FINAL}
    reachable, todo = {State.INIT}, [State.INIT]
    while todo:
        s = todo.pop()
        for (a, _r), b in TRANSITIONS.items():
            if a is s and b not in reachable:
                reachable.add(b); todo.append(b)
    assert reachable == set(State)  # every state of SPEC §2 is reachable
