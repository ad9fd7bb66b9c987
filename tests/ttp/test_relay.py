"""A node's relay (mindio/ttp/wire/relay.py) between real ranks' links and a real controller, in this process
over real sockets (IPC below the relay, TCP above it): what goes up (beats with every heartbeat field,
registrations, reports, acknowledgements), what comes down (one ACTION fanned out to the ranks), and what a
rank cannot do through it (speak for another rank, register a rank of another node)."""
from __future__ import annotations

import os
import stat
import threading

import msgpack
import pytest
import zmq

from mindio.errors import ProtocolError
from mindio.ttp.controller.controller import Controller
from mindio.ttp.wire import protocol as P
from mindio.ttp.wire.relay import Relay
from mindio.ttp.wire.session import fresh
from mindio.ttp.wire.transport import Link, context

from ._harness import free_port, until

KEY = b"k" * 32


class _Rank:
    """A rank's link to the relay (the processor's transport.Link) and what it was sent."""

    def __init__(self, rank: int, relay: Relay, world: int):
        self.got: list = []
        self.link = Link(rank, KEY, [relay.address], lambda: P.Register(world_size=world, pid=os.getpid(), host="h"),
                         lambda: P.Heartbeat(step=3 + rank, data_status=0, coll_seq={"dp": 10 + rank},
                                             idle_age=0.5 + rank, step_p99=0.25, step_sums=[4, 2.0 + rank, 1.0]),
                         self.got.append, interval=0.1)


@pytest.fixture
def plane(monkeypatch):
    monkeypatch.setenv("MINDIO_SLOW_WINDOW", "5")  # slow-rank scoring on: the controller keeps the step sums
    port = free_port()
    ctl = Controller(rank=-1, world_size=2, enabled={"dump"}, key=KEY, interval=0.1, misses=30, hang_timeout=0)
    ctl.start("127.0.0.1", port)
    relay = Relay(KEY, f"tcp://127.0.0.1:{port}", lambda: (0, 1), world_size=2)
    relay.start()
    ranks = [_Rank(r, relay, 2) for r in (0, 1)]
    for r in ranks:
        r.link.start()
    try:
        yield ctl, relay, ranks
    finally:
        for r in ranks:
            r.link.close(2)
        relay.close(2)
        ctl.destroy()


def test_ranks_register_and_beat_through_one_relay_with_every_heartbeat_field(plane):
    ctl, relay, ranks = plane
    assert stat.S_IMODE(os.stat(relay.dir).st_mode) == 0o700  # only this user reaches the relay's socket
    assert until(lambda: ctl.registered == 2 and all(ctl.ranks[r].step == 3 + r for r in (0, 1)))
    assert len(ctl._relays) == 1 and {ctl.ranks[r].ident for r in (0, 1)} == ctl._relays  # one connection
    assert until(lambda: all(ctl.ranks[r].coll_seq == {"dp": 10 + r} for r in (0, 1)))  # hangs.py's culprits
    assert [ctl.ranks[r].idle_age for r in (0, 1)] == [0.5, 1.5] and ctl.ranks[1].step_p99 == 0.25
    assert until(lambda: ctl.liveness.slow.last.get(1, (0,))[0] == 4)  # slow.py's step sums
    # the REGISTER_ACKs come down through the relay on their own time (the controller's table is no signal
    # that they arrived: a 0.7 s stall of this process in a full suite left one in transit)
    assert until(lambda: all(r.link.registered.is_set() for r in ranks))
    assert ranks[0].link.addrs == [relay.address]  # a rank never learns (nor fails over to) the controllers


def test_one_action_is_fanned_out_to_the_ranks_and_their_replies_come_back(plane):
    ctl, relay, ranks = plane
    assert until(lambda: ctl.registered == 2)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(ctl.actions.call("probe", {}, [0, 1], timeout=10)))
    t.start()
    assert until(lambda: all(any(e.type is P.MsgType.ACTION for e in r.got) for r in ranks))
    for r in ranks:
        act = next(e for e in r.got if e.type is P.MsgType.ACTION)
        assert act.body.name == "probe" and act.rank == r.link.rank
        r.link.send(P.Envelope(P.MsgType.REPLY, P.Reply(ok=True, detail={"me": r.link.rank}), sn=act.sn))
    t.join(15)
    assert not t.is_alive()
    assert sorted(result) == [0, 1] and all(result[r].ok and result[r].detail == {"me": r} for r in (0, 1)), result


def _raw_session(relay: Relay, rank: int):
    """A hand-made connection to the relay holding the job secret: HELLO, CHALLENGE, REGISTER as ``rank``."""
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(relay.address)
    nonce = fresh()
    sock.send(P.encode(P.Envelope(P.MsgType.HELLO, P.Hello(nonce), rank=rank), KEY))
    assert sock.poll(10000)
    ch = P.decode(sock.recv(), KEY)
    assert ch.type is P.MsgType.CHALLENGE and ch.body.nonce == nonce
    sess = ch.body.session
    sock.send(P.encode(P.Envelope(P.MsgType.REGISTER, P.Register(world_size=2, pid=1, host="x"), rank=rank,
                                  sess=sess, ctr=1), KEY))
    return sock, sess


def test_a_rank_cannot_speak_for_another_rank_or_register_a_rank_of_another_node(plane):
    ctl, relay, _ranks = plane
    assert until(lambda: ctl.registered == 2)
    sock, sess = _raw_session(relay, 1)  # rank 1 again: its newer process, say
    # in rank 1's session, a report claiming to be rank 0's: dropped at the relay, never reaches the controller
    sock.send(P.encode(P.Envelope(P.MsgType.REPORT, P.Report(state=3, message="forged", step=1), rank=0,
                                  sess=sess, ctr=2), KEY))
    assert until(lambda: relay.drops.snapshot().get("session", 0) >= 1), relay.drops.snapshot()
    assert not ctl.ranks[0].faulty and ctl.incidents.order is None
    other, _ = _raw_session(relay, 5)  # not a rank of this node
    assert until(lambda: relay.drops.snapshot().get("refused", 0) >= 1), relay.drops.snapshot()
    assert 5 not in relay.routes
    sock.close(0)
    other.close(0)


def test_beats_extras_are_checked_and_another_protocol_version_is_refused_by_name():
    cols = dict(ranks=[1, 2], steps=[1, 1], status=[0, 0], coll=[False, False], age=[0.0, 0.0])
    good = P.Envelope(P.MsgType.BEATS, P.Beats(**cols, seq=[{}, {"dp": 1}], idle=[1.0, 2.0], p99=[-1.0, 0.1],
                                               sums=[[], [3, 1.0, 0.5]]))
    assert P.decode(P.encode(good, KEY), KEY).body.seq == [{}, {"dp": 1}]
    with pytest.raises(ProtocolError, match="BEATS.idle has 1 entries for 2 ranks"):
        P.decode(P.encode(P.Envelope(P.MsgType.BEATS, P.Beats(**cols, idle=[1.0])), KEY), KEY)
    with pytest.raises(ProtocolError, match="BEATS.seq entries must be map"):
        P.decode(P.encode(P.Envelope(P.MsgType.BEATS, P.Beats(**cols, seq=[1, 2])), KEY), KEY)
    # v5: the maps and lists packed, unpacked (and checked) when read
    packed = P.decode(P.encode(P.Envelope(P.MsgType.BEATS, P.Beats(**cols, packed=P.pack_extras(
        [{}, {"dp": 1}], [[], [3, 1.0, 0.5]]))), KEY), KEY).body.packed
    assert P.unpack_extras(packed, 2) == ([{}, {"dp": 1}], [[], [3, 1.0, 0.5]])
    for bad, why in [(b"\xc1", "malformed"), (msgpack.packb([[{}], [[]]]), "one entry per rank"),
                     (msgpack.packb([[1, 2], [[], []]]), "seq entries must be maps"),
                     (msgpack.packb([[{"dp": "x"}, {}], [[], []]]), "must be integers")]:
        with pytest.raises(ProtocolError, match=why):
            P.unpack_extras(bad, 2)
    # a peer of protocol v3 (before the columns): one line naming both versions
    old = msgpack.packb([3, int(P.MsgType.HEARTBEAT), 0, 0, 0, 0, 0, {"step": 1, "data_status": 0}])
    import hmac
    with pytest.raises(ProtocolError, match=rf"protocol version 3 is not supported \(this side speaks {P.VERSION}\): "
                                            r"the peer runs another mindio release"):
        P.decode(old + hmac.digest(KEY, old, "sha256"), KEY)



def test_the_relays_heard_in_one_turn_get_one_ack_frame_each_and_share_it():
    """The controller acks a turn's BEATS with one signed frame sent to every relay heard (controller.py
    ``_flush_beats``; the same bytes, one counter, as a broadcast ACTION): a relay heard twice in the turn gets
    it once (a second copy would be a replay to its link), the next turn's frame has a higher counter, and a
    frame that named a rank not registered through its relay gets an ack of its own that lists it. A relay is
    acked every other interval (protocol v6, ``RELAY_ACK_GAP``): not again within 1.5 intervals of its last ack
    unless the ack's content changed (here: the backup list)."""
    from ._harness import threadless_controller

    ctl, close = threadless_controller(16, KEY, per_relay=8)  # relay0: ranks 0-7, relay1: ranks 8-15
    sent: list = []
    ctl._chan.send_raw = lambda frame, ident: sent.append((ident, P.decode(frame, KEY), frame))
    assert P.RELAY_ACK_GAP == 1.5 and ctl.interval == 1.0

    def beats(ident: bytes, ranks: list, now: float) -> None:
        k = len(ranks)
        ctl._on_beats(ident, P.Envelope(P.MsgType.BEATS, P.Beats(ranks=ranks, steps=[1] * k, status=[0] * k,
                                                                 coll=[False] * k, age=[0.0] * k)), now)

    try:
        beats(b"relay0", list(range(8)), 10.0)
        beats(b"relay1", list(range(8, 16)), 10.0)
        beats(b"relay0", list(range(8)), 10.0)  # heard twice in the turn
        ctl._flush_beats()
        assert sorted(i for i, _, _ in sent) == [b"relay0", b"relay1"] and sent[0][2] == sent[1][2]
        first = sent[0][1]
        assert first.type is P.MsgType.HEARTBEAT_ACK and first.rank == -1 and first.body.unknown == []
        sent.clear()
        beats(b"relay0", list(range(8)), 11.0)  # one interval later: acked 1 s ago, not now
        beats(b"relay1", [8, 9, 3], 11.0)  # rank 3 is relay0's: this frame gets its own ack, listing it
        ctl._flush_beats()
        assert [(i, e.body.unknown) for i, e, _ in sent] == [(b"relay1", [3])]
        sent.clear()
        beats(b"relay0", list(range(8)), 12.0)  # two intervals after its last ack: acked
        beats(b"relay1", list(range(8, 16)), 12.0)  # its own ack was 1 s ago: not
        ctl._flush_beats()
        assert [i for i, _, _ in sent] == [b"relay0"] and sent[0][1].ctr > first.ctr
        sent.clear()
        ctl.backups.append("tcp://10.0.0.2:1234")  # a backup announced: the ack changes, every relay gets it now
        beats(b"relay0", list(range(8)), 12.5)
        beats(b"relay1", list(range(8, 16)), 12.5)
        ctl._flush_beats()
        assert sorted(i for i, _, _ in sent) == [b"relay0", b"relay1"]
        assert all(e.body.backups == ["tcp://10.0.0.2:1234"] for _, e, _ in sent)
    finally:
        close()


def test_a_relays_run_of_registers_is_answered_with_one_batch_of_register_acks():
    """Protocol v6: a relay's BATCH of REGISTER items is answered with one BATCH of REGISTER_ACK items (controller.py
    ``_on_batch``), sent before the next item of another kind is handled, so that nothing reaches a rank before its
    ack; a refused registration gets no ack, as before; a REGISTER on its own frame (a rank's direct connection)
    still gets its own REGISTER_ACK."""
    from ._harness import threadless_controller

    ctl, close = threadless_controller(16, KEY, per_relay=8)
    sent: list = []
    ctl._chan.send = lambda env, ident, body=None: sent.append((ident, env, body))

    def reg(rank: int) -> P.Envelope:
        return P.Envelope(P.MsgType.REGISTER, P.Register(world_size=16, pid=2000 + rank, host="h"), rank=rank)

    try:
        info = P.Envelope(P.MsgType.INFO, P.Info(replica=[], dp_group=[0, 1]), rank=0)
        ctl._on_batch(b"relay0", [reg(0), reg(1), reg(99), reg(2), info, reg(3)], 0.0)  # 99: no such rank
        assert [(i, e.type, [x.rank for x in e.body.items]) for i, e, _ in sent] == [
            (b"relay0", P.MsgType.BATCH, [0, 1, 2]), (b"relay0", P.MsgType.BATCH, [3])]
        items = [x for _, e, _ in sent for x in e.body.items]
        assert {x.type for x in items} == {P.MsgType.REGISTER_ACK} and all(x.body == ctl.register_ack() for x in items)
        assert ctl.ranks[0].dp_group == [0, 1]  # the INFO was handled after the first acks went
        sent.clear()
        ctl._dispatch(b"relay1", reg(8), relay=True)  # one REGISTER, not in a BATCH: one REGISTER_ACK
        assert [(i, e.type, e.rank) for i, e, _ in sent] == [(b"relay1", P.MsgType.REGISTER_ACK, 8)]
    finally:
        close()


def test_a_relays_link_allows_one_interval_more_of_silence_than_a_ranks():
    """The controller acks a relay's BEATS every other interval (protocol.RELAY_ACK_GAP), so the relay's link
    waits one interval more before it fails over: a controller's stall is tolerated as long as on a rank's link
    (whose beats are acked every interval)."""
    from mindio.ttp.wire.transport import Link

    def link(relay: bool) -> Link:
        return Link(-1 if relay else 0, KEY, ["tcp://127.0.0.1:1"], lambda: None, lambda: None, lambda env: None,
                    interval=0.5, misses=3, relay=relay)

    rank, relay = link(False), link(True)
    assert rank.silence() == 3 * 0.5 + 0.25 and relay.silence() == rank.silence() + 0.5
    # the longest a relay goes unacked while it beats every interval: its acks are RELAY_ACK_GAP apart at least,
    # so every other beat is acked; that leaves the rank's margin over its own one-interval ack gap
    assert relay.silence() - 2 * 0.5 == rank.silence() - 0.5


def test_a_relay_sends_its_ranks_replies_to_one_action_as_one_replies_item_of_columns():
    """Protocol v7: in what a relay sends up (protocol.fold_replies), each run of REPLYs to one action is one REPLIES item
    (ranks, ok, code, detail), in place: other items keep their order, another action's replies start another
    item; the columns are checked as a frame's fields are (lengths, exact types, 64 bits)."""
    def reply(rank, sn, ok=True):
        return P.Envelope(P.MsgType.REPLY, P.Reply(ok, 0 if ok else 3, {"r": rank}), rank=rank, sn=sn)

    report = P.Envelope(P.MsgType.REPORT, P.Report(state=3, message="x", step=1), rank=2)
    got = P.fold_replies([reply(0, 5), reply(1, 5, ok=False), report, reply(2, 5), reply(3, 6)])
    assert [(e.type, e.sn) for e in got] == [(P.MsgType.REPLIES, 5), (P.MsgType.REPORT, 0), (P.MsgType.REPLIES, 5),
                                             (P.MsgType.REPLIES, 6)]
    assert got[0].body == P.Replies([0, 1], [True, False], [0, 3], [{"r": 0}, {"r": 1}])
    frame = P.decode(P.encode(P.Envelope(P.MsgType.BATCH, P.Batch(got), gen=4), KEY), KEY)
    assert [e.body for e in frame.body.items] == [e.body for e in got] and frame.body.items[0].gen == 4
    assert got[0].body.replies() == [(0, P.Reply(True, 0, {"r": 0})), (1, P.Reply(False, 3, {"r": 1}))]
    for cols, why in [(([1, 2], [True], [0, 0], [{}, {}]), "REPLIES.ok has 1 entries for 2 ranks"),
                      (([1], [1], [0], [{}]), "REPLIES.ok entries must be bool"),
                      (([1], [True], [True], [{}]), "REPLIES.code entries must be int"),
                      (([1], [True], [0], [[]]), "REPLIES.detail entries must be map"),
                      ((["1"], [True], [0], [{}]), "REPLIES.ranks must be integers"),
                      (([1 << 63], [True], [0], [{}]), "REPLIES.ranks entries must fit 64 bits")]:
        bad = P.Envelope(P.MsgType.BATCH, P.Batch([P.Envelope(P.MsgType.REPLIES, P.Replies(*cols), sn=1)]))
        with pytest.raises(ProtocolError, match=why.replace(".", r"\.")):
            P.decode(P.encode(bad, KEY), KEY)


def test_the_controller_records_a_relays_replies_columns_for_its_own_ranks_only():
    """Protocol v7 at the controller (controller.py ``_flush_replies``, ActionEngine.on_columns): REPLIES items
    read in one turn are recorded together; entries for ranks registered through another relay are dropped, a
    replaced rank's old process is refused, a failure ends a fail-fast action, another action's replies count
    for nothing, and a frame of another kind sees the replies read before it."""
    from mindio.ttp.controller import actions
    from ._harness import threadless_controller

    ctl, close = threadless_controller(16, KEY, per_relay=8)
    engine = ctl.actions

    def replies(ranks, sn, ok=True, gen=0):
        return P.Envelope(P.MsgType.REPLIES, P.Replies(list(ranks), [ok] * len(ranks), [0] * len(ranks),
                                                       [{"step": 5}] * len(ranks)), sn=sn, gen=gen)

    try:
        engine._pending = actions._Pending(7, "stop", set(range(16)), outstanding=16)
        ctl._on_batch(b"relay0", [replies(range(0, 4), 7), replies([8, 9], 7), replies([4], 6)], 0.0)
        assert engine._pending.replies == {}  # held until the turn ends (or a frame of another kind)
        ctl._flush_replies()
        assert sorted(engine._pending.replies) == [0, 1, 2, 3] and engine._pending.outstanding == 12
        assert ctl.drops.snapshot().get("session") == 2  # 8 and 9 belong to relay1
        assert engine._pending.replies[2] == P.Reply(True, 0, {"step": 5})
        ctl.replacements.replaced[10] = 3  # rank 10's process was replaced in generation 3: its old one is refused
        ctl._on_batch(b"relay1", [replies([8, 9, 10], 7, gen=2)], 0.0)
        ctl._dispatch(b"relay1", P.Envelope(P.MsgType.INFO, P.Info(replica=[], dp_group=[8, 9]), rank=8), relay=True)
        assert sorted(engine._pending.replies) == [0, 1, 2, 3, 8, 9] and ctl.replacements.stale_refused == 1
        assert ctl.ranks[8].dp_group == [8, 9]
        ctl._on_batch(b"relay0", [replies([0, 4], 7)], 0.0)  # 0 answered already: counted once
        ctl._flush_replies()
        assert engine._pending.outstanding == 9 and sorted(engine._pending.replies)[-3:] == [4, 8, 9]
        engine._pending = actions._Pending(8, "clean", set(range(16)), outstanding=16, fail_fast=True)
        ctl._on_batch(b"relay0", [replies([5], 8, ok=False)], 0.0)
        ctl._flush_replies()
        assert engine._pending.failed and not engine._pending.replies[5].ok
    finally:
        close()
