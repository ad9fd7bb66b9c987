"""The controller's rank table as numpy columns (mindio/ttp/controller/ranks.py): the record view, the
vector queries, a relay's BEATS as slice updates, the liveness sweep's vector comparison, and the ratchet
that the heartbeat path touches no record (nothing per rank per frame in Python)."""
from __future__ import annotations

import gc
import threading
import time
import tracemalloc

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from mindio.ttp.controller.controller import Controller, _action_body
from mindio.ttp.controller.ranks import RankRecord, RankTable, Watched
from mindio.ttp.wire import protocol as P
from tests.ttp._harness import threadless_controller

KEY = b"rank-table-test-secret-0123456789"


def _table(n: int, ident: bytes = b"relay") -> RankTable:
    t = RankTable()
    for r in range(n):
        t[r] = RankRecord(r, ident, pid=100 + r, step=3, last_seen=10.0)
    return t


def test_a_record_in_the_table_is_a_view_of_its_row():
    t = _table(4)
    t[2].alive, t[2].step = False, 7
    assert t.col["alive"].tolist()[:4] == [True, True, False, True] and t.col["step"][2] == 7
    assert t[2].step == 7 and type(t[2].step) is int and type(t[2].alive) is bool  # Python values (JSON, status.py)
    old = t[1]
    t[1] = RankRecord(1, b"other", step=9)  # replaced: the old record keeps its values, the row the new ones
    assert old.step == 3 and old.ident == b"relay" and t[1].step == 9 and t.ident_of(int(t.conn[1])) == b"other"
    old.step = 11
    assert t[1].step == 9
    assert t.pop(3).pid == 103 and 3 not in t and not t.present[3]
    t[40] = RankRecord(40, b"far")  # the columns grow
    assert t[40].alive and t.live() == [0, 1, 40] and t.dead() == [2]


def test_vector_queries():
    t = _table(6)
    t[1].alive = t[4].alive = False
    t[5].registered = False
    t[0].step, t[3].step = 2, 9
    assert t.ranks_where(alive=True, registered=True) == [0, 2, 3]
    assert t.count(alive=False) == 2
    assert t.min_step(alive=True) == 2 and t.min_step([3, 5]) == 3 and t.min_step([], alive=True) is None
    assert t.column("step", [3, 0]) == [9, 2]
    views = t.views({0: None, 2: None, 4: None})  # the decision's: alive only if it answered the stop round
    assert [(v.rank, v.alive, v.step) for v in views] == [(0, True, 2), (1, False, 3), (2, True, 3), (3, False, 9),
                                                          (4, False, 3), (5, False, 3)]


def test_beats_update_the_relays_ranks_in_slices_and_name_the_strangers():
    t = _table(8)
    t[6] = RankRecord(6, b"elsewhere")  # registered through another connection
    t[7].left, t[7].registered = True, False  # said BYE: a late beat is no stranger
    conn = t.conn_id(b"relay")
    acc, unknown = t.beats([0, 1, 6, 7, 99], conn, [5, 6, 7, 8, 9], [1, 0, 0, 0, 0], [True, False, False, False, False],
                           [0.5, 0.25, 0, 0, 0], now=20.0)
    assert acc.tolist() == [0, 1] and unknown == [6, 99]
    assert t[0].step == 5 and t[1].step == 6 and t[0].data_status == 1 and t[0].in_collective
    assert t[0].last_seen == 20.0 and t[1].progress_age == 0.25 and t[2].last_seen == 10.0 and t[6].step == 0
    acc, unknown = t.beats([0, 1], conn, [8, 8], [0, 0], [False, False], [0.0, 0.0], now=21.0, skip=[1])
    assert acc.tolist() == [0] and unknown == [] and t[1].step == 6  # a replaced rank's old process: left alone


def test_liveness_is_a_vector_comparison_least_recently_heard_first():
    t = _table(5)
    seen = Watched(lambda: t)
    for r in range(5):
        seen[r] = None
    seen.pop(4)
    t[0].last_seen, t[1].last_seen, t[2].last_seen, t[3].last_seen = 3.0, 1.0, 9.5, 2.0
    t[3].alive = False
    assert t.expired(now=10.0, limit=5.0).tolist() == [1, 0]  # alive, watched, silent > 5 s; oldest first
    assert t.expired(now=10.0, limit=5.0, alive=False).tolist() == [1, 3, 0]
    assert 4 not in seen and 0 in seen and len(seen) == 4 and sorted(seen) == [0, 1, 2, 3]
    t.shift_clock(2.0)  # the controller stalled 2 s: nobody's fault
    assert t.expired(now=10.0, limit=5.0).tolist() == [1]


def test_a_relays_action_body_packed_once_decodes_as_the_action():
    params = {"step": 5, "save_info": [{"type": 0, "ranks": list(range(50))}]}
    env = P.Envelope(P.MsgType.ACTION, P.Action("save", params, [3, 4]), rank=-1, sn=7)
    frame = P.encode(env, KEY, body=_action_body("save", __import__("msgpack").packb(params, use_bin_type=True),
                                                  [3, 4]))
    assert P.decode(frame, KEY).body == P.Action("save", params, [3, 4])


@pytest.fixture
def relay_controller():
    """A real Controller (no threads) with a real ROUTER socket, 4,096 ranks registered through 8 relays."""
    n = 4096
    ctl, close = threadless_controller(n, KEY, per_relay=n // 8)
    try:
        yield ctl, n
    finally:
        close()


@pytest.mark.parametrize("v", [3, 4, 5], ids=["v3-columns", "v4-columns", "v5-packed"])
def test_heartbeat_handling_touches_no_record_and_allocates_nothing_per_rank(relay_controller, monkeypatch, v):
    """v4: the frames carry every heartbeat column (collective numbers, idle age, step p99, step sums) --
    before 2026-11-29 those were applied rank by rank, through the records; v5: the maps and lists packed in
    one byte string, as wire/relay.py ``_beats`` sends them (unpacked when read)."""
    ctl, n = relay_controller
    frames = []
    for relay in range(8):
        ranks = list(range(relay * n // 8, (relay + 1) * n // 8))
        k = len(ranks)
        seq, sums = [{"dp": 100 + r, "tp": 7} for r in ranks], [[3, 1.5, 1.0, 0.5]] * k
        extra = {} if v == 3 else dict(idle=[0.25] * k, p99=[0.75] * k, **(
            dict(seq=seq, sums=sums) if v == 4 else dict(packed=P.pack_extras(seq, sums))))
        frames.append((b"relay%d" % relay, P.Envelope(P.MsgType.BEATS, P.Beats(
            ranks=ranks, steps=[9] * k, status=[0] * k, coll=[False] * k, age=[0.5] * k, **extra))))
    touched, made = [0], [0]
    plain_get, plain_init = RankRecord.__getattribute__, RankRecord.__init__

    def counting_get(self, name):
        touched[0] += 1
        return plain_get(self, name)

    def counting_init(self, *a, **kw):
        made[0] += 1
        plain_init(self, *a, **kw)

    def one_round():
        for ident, env in frames:
            ctl._on_beats(ident, env, time.monotonic())
        ctl._flush_beats()

    monkeypatch.setattr(RankRecord, "__getattribute__", counting_get)
    monkeypatch.setattr(RankRecord, "__init__", counting_init)
    tracemalloc.start()
    try:
        one_round()  # warm, traced: the ack body (packed once per state), each frame's packed extras (v4's
        before = tracemalloc.get_traced_memory()[0]  # maps packed when kept: wire/beats.py) held until the next
        for _ in range(20):
            one_round()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert touched[0] == 0 and made[0] == 0  # 20 rounds x 4,096 beats: not one record read or made
    assert grown < 64 * 1024, grown  # nothing kept per rank per frame
    monkeypatch.undo()
    assert all(ctl.ranks[r].step == 9 for r in range(n)) and ctl.ranks.count(watched=True) == n
    assert np.all(ctl.ranks.col["progress_age"][:n] == 0.5)
    if v >= 4:  # what hangs.py reads
        assert np.all(ctl.ranks.col["idle_age"][:n] == 0.25) and np.all(ctl.ranks.col["step_p99"][:n] == 0.75)
        assert all(ctl.ranks[r].coll_seq == {"dp": 100 + r, "tp": 7} for r in (0, n // 2, n - 1))
        assert ctl.ranks.coll_seqs(range(n)) == [{"dp": 100 + r, "tp": 7} for r in range(n)]  # hangs.py's read


def test_a_relays_beats_through_the_socket_keep_its_ranks_alive_and_silence_kills_them():
    """End to end on a real socket, the controller's threads running: a relay (raw DEALER, protocol v3
    session) registers 16 ranks and beats for them with BEATS frames; the ack names a rank it is not
    registered for; when the relay stops beating for 8 of them, the sweep declares those dead (and only
    those) after misses x interval."""
    from mindio.ttp.wire.session import fresh
    from tests.ttp._harness import free_port, until

    n, port = 16, free_port()
    ctl = Controller(rank=-1, world_size=n, enabled={"dump"}, key=KEY, interval=0.5, misses=4, hang_timeout=0,
                     relays=True)
    ctl.start("127.0.0.1", port)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sess, ctr = [0], [0]

    def send(env):
        ctr[0] += 1
        sock.send(P.encode(env._replace(sess=sess[0], ctr=ctr[0]), KEY))

    kept: list = []  # frames beats() read while answering actions: recv() looks at them first

    def recv(mtype, timeout=10.0):
        for env in kept:
            if env.type is mtype:
                kept.remove(env)
                return env
        end = time.monotonic() + timeout
        while sock.poll(max(0, end - time.monotonic()) * 1000):
            env = P.decode(sock.recv(), KEY)
            if env.type is mtype:
                return env
        raise AssertionError(f"no {mtype.name} within {timeout} s")

    def beats(ranks):
        k = len(ranks)
        send(P.Envelope(P.MsgType.BEATS, P.Beats(ranks=ranks, steps=[4] * k, status=[0] * k, coll=[False] * k,
                                                 age=[0.0] * k)))
        while sock.poll(0):  # the incident the deaths open: every action answered at once, as a relay would
            env = P.decode(sock.recv(), KEY)
            if env.type is not P.MsgType.ACTION:
                kept.append(env)  # e.g. the ack of this very frame, when it came back at once
            else:
                detail = {"step": 4, "data_status": 0, "main": "parked"} if env.body.name == "stop" else {}
                send(P.Envelope(P.MsgType.BATCH, P.Batch([P.Envelope(P.MsgType.REPLY, P.Reply(ok=True, detail=detail),
                                                                     rank=r, sn=env.sn) for r in env.body.ranks])))

    try:
        nonce = fresh()
        sock.send(P.encode(P.Envelope(P.MsgType.HELLO, P.Hello(nonce), rank=-1), KEY))
        sess[0] = recv(P.MsgType.CHALLENGE).body.session
        send(P.Envelope(P.MsgType.REGISTER, P.Register(world_size=n, pid=1, host="h", role="relay")))
        recv(P.MsgType.REGISTER_ACK)
        send(P.Envelope(P.MsgType.BATCH, P.Batch([P.Envelope(P.MsgType.REGISTER, P.Register(
            world_size=n, pid=100 + r, host="h"), rank=r) for r in range(n - 1)])))  # rank 15 never registers
        assert until(lambda: len(ctl.ranks) == n - 1, 10)
        beats(list(range(n)))
        assert recv(P.MsgType.HEARTBEAT_ACK).body.unknown == [n - 1]
        assert until(lambda: all(ctl.ranks[r].step == 4 for r in range(n - 1)), 5)
        end = time.monotonic() + 15  # the silent half dies after 4 x 0.5 s (a sweep); the other half beats on
        while time.monotonic() < end and ctl.ranks.dead() != list(range(8, n - 1)):
            beats(list(range(8)))
            time.sleep(0.05)
        assert ctl.ranks.dead() == list(range(8, n - 1)) and ctl.ranks.live() == list(range(8))
        while time.monotonic() < end + 20 and not ctl.final.is_set():  # the incident ends (dump, exit)
            beats(list(range(8)))
            time.sleep(0.05)
    finally:
        sock.close(0)
        ctx.term()
        ctl.destroy()


def test_a_controller_in_a_process_of_its_own_freezes_the_registered_heap_and_unfreezes_it_at_close():
    """Issue 34: each garbage collection walked the 100k-rank table (a third of the controller's CPU per
    heartbeat round). A controller hosted by a process of its own (rank -1: mindio-run's agent) freezes the
    heap once every rank registered, and thaws it at close; one in a training rank's process (rank 0: the
    user's heap) never touches the collector."""
    gc.unfreeze()
    ctl, close = threadless_controller(16, KEY)
    try:
        assert ctl._frozen and gc.get_freeze_count() > 0
    finally:
        close()
        ctl.close(1.0)
    assert gc.get_freeze_count() == 0
    own = Controller(rank=0, world_size=1, enabled={"dump"}, key=KEY, interval=1.0, misses=3)
    own._chan = type("Chan", (), {"send": lambda *a, **k: None})()
    own._on_register(b"id0", 0, P.Register(world_size=1, pid=1, host="h"), 0.0)
    assert own.sm.state.name == "NORMAL" and not own._frozen and gc.get_freeze_count() == 0


def test_a_reply_proves_life_but_leaves_the_time_of_the_last_beat(relay_controller):
    """The hang rule ages each rank's progress and collective numbers by the time since its last *beat*
    (controller/watch.py): a reply to an action proves the rank alive (``last_seen``) but carries no such
    evidence, so it must not make that evidence look fresher (``beat_seen``)."""
    ctl, n = relay_controller
    ranks = list(range(n // 8))
    k = len(ranks)
    ctl._on_beats(b"relay0", P.Envelope(P.MsgType.BEATS, P.Beats(ranks=ranks, steps=[9] * k, status=[0] * k,
                                                                  coll=[False] * k, age=[0.5] * k)), 100.0)
    ctl._flush_beats()
    r = ctl.ranks[3]
    assert r.beat_seen == r.last_seen == 100.0 and r.progress_age == 0.5
    ctl.liveness.seen[3] = None
    ctl._dispatch(b"relay0", P.Envelope(P.MsgType.REPLY, P.Reply(ok=True), rank=3, sn=1), relay=True)
    assert r.last_seen > 100.0 and r.beat_seen == 100.0


def test_a_relays_batch_of_replies_is_recorded_at_once_and_only_for_its_own_ranks(relay_controller, monkeypatch):
    """A relay aggregates its ranks' answers to an action into one BATCH (a 100k-rank stop round is 100k
    replies): the controller records them with the rank table's columns and one call to the action engine,
    no rank record read; a reply for a rank registered through another relay is dropped (as one by one);
    the replies prove life (``last_seen``) but are no beat (``beat_seen`` stays)."""
    ctl, n = relay_controller
    ours = list(range(n // 8))  # relay0's ranks
    stranger = n // 8  # relay1's
    k = len(ours)
    ctl._on_beats(b"relay0", P.Envelope(P.MsgType.BEATS, P.Beats(ranks=ours, steps=[9] * k, status=[0] * k,
                                                                  coll=[False] * k, age=[0.5] * k)), 100.0)
    ctl._flush_beats()
    sn, drops, got = ctl.actions.sn + 1, ctl.drops.total, {}
    caller = threading.Thread(target=lambda: got.update(ctl.actions.call("stop", {}, ours, timeout=30)))
    caller.start()
    deadline = time.monotonic() + 10
    while ctl.actions.sn < sn and time.monotonic() < deadline:  # the action is in flight
        time.sleep(0.001)
    items = [P.Envelope(P.MsgType.REPLY, P.Reply(ok=True, detail={"main": "parked"}), rank=r, sn=sn)
             for r in ours + [stranger]]
    touched = [0]
    plain_get = RankRecord.__getattribute__

    def counting_get(self, name):
        touched[0] += 1
        return plain_get(self, name)

    monkeypatch.setattr(RankRecord, "__getattribute__", counting_get)
    t0 = time.monotonic()
    ctl._dispatch(b"relay0", P.Envelope(P.MsgType.BATCH, P.Batch(items)), relay=True)
    ctl._flush_replies()  # as at the end of the I/O thread's turn
    monkeypatch.undo()
    caller.join(10)
    assert not caller.is_alive()
    assert touched[0] == 0
    assert sorted(got) == ours and all(rep.detail == {"main": "parked"} for rep in got.values())
    assert ctl.drops.total == drops + 1  # the stranger's reply
    seen = ctl.ranks.col["last_seen"][ours]
    assert (seen >= t0).all() and (ctl.ranks.col["beat_seen"][ours] == 100.0).all()
    assert ctl.ranks.col["last_seen"][stranger] < t0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.just({}), st.fixed_dictionaries({}, optional={
    "uce": st.booleans(), "arf": st.booleans(), "zit": st.booleans()})), st.booleans()), max_size=12),
    st.data())
def test_the_strategies_the_ranks_ask_for_are_read_from_a_column_as_from_their_features(ranks, data):
    """RankTable.strategies_asked (the ``asks`` column, set with each record's features) answers what
    policy.strategies_of answers over the registered ranks' features, as they register, change their flags
    (a replacement's REGISTER) and leave."""
    from mindio.ttp.controller import policy
    from mindio.ttp.controller.ranks import RankRecord, RankTable

    t = RankTable()
    for r, (features, registered) in enumerate(ranks):
        t[r] = RankRecord(r, b"c", features=features, registered=registered)
    for r in data.draw(st.lists(st.integers(0, max(0, len(ranks) - 1)), max_size=4)) if ranks else []:
        t[r].features = data.draw(st.fixed_dictionaries({}, optional={"uce": st.booleans(), "arf": st.booleans()}))
        t[r].registered = data.draw(st.booleans())
    want = policy.strategies_of([rec.features for rec in t.values() if rec.registered])
    assert t.strategies_asked() == want
