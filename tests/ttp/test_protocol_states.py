"""Wire format and state table."""
import msgpack
import pytest
from hypothesis import given, strategies as st

from mindio.errors import AuthError, IllegalTransition, ProtocolError
from mindio.ttp import protocol as P
from mindio.ttp.states import TRANSITIONS, Result, State, StateMachine

KEY = b"k" * 32


def test_roundtrip_every_type():
    bodies = [P.Register(world_size=4, pid=1, host="h", replica=[{"rank_list": [0, 1]}]),
              P.RegisterAck(gen=1, interval=1.0, backups=["tcp://a:1"]), P.Heartbeat(step=3, data_status=0),
              P.HeartbeatAck(state="NORMAL"), P.Report(state=2, message="UCE ERROR", step=3),
              P.Info(replica=[], dp_group=[0, 1]), P.Action(name="save", params={"step": 3}),
              P.Reply(ok=True, detail={"x": 1})]
    for body in bodies:
        mtype = next(t for t, c in P.BODY_TYPES.items() if c is type(body))
        env = P.Envelope(type=mtype, body=body, rank=3, sn=7, gen=2)
        assert P.decode(P.encode(env, KEY), KEY) == env


def _frame(items, key=KEY):
    import hashlib, hmac
    payload = msgpack.packb(items)
    return payload + hmac.new(key, payload, hashlib.sha256).digest()


@pytest.mark.parametrize("items,match", [
    ([2, 3, 0, 1, 0, {"step": 1, "data_status": 0}], "version"),
    ([1, 99, 0, 1, 0, {}], "unknown message type"),
    ([1, 3, 0, 1, 0, {"step": "x", "data_status": 0}], "must be int"),
    ([1, 3, 0, 1, 0, {"step": 1, "data_status": 0, "evil": 1}], "unknown fields"),
    ([1, 3, 0, 1, 0, {"data_status": 0}], "lacks field"),
    ([1, 3, 0], "6-element"),
    ([1, 3, "0", 1, 0, {}], "integers"),
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
    c = P.DropCounter()
    c.drop(AuthError("x")); c.drop(ProtocolError("y")); c.drop(ProtocolError("z"))
    assert c.snapshot() == {"auth": 1, "protocol": 2} and c.total == 3


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
