"""Heartbeat datagrams (mindio/ttp/beacon.py): a stalled TCP stream is not a dead rank.

A flapping link stalls a rank's control stream for seconds (TCP's doubling retransmission delay; ARP
retries on a host whose NIC loses carrier), far beyond the few outages themselves. Here the stream is
stalled on one host by a proxy between the processors and the controller that stops forwarding (in both
directions) for longer than the liveness bound; the datagrams go straight to the controller's beacon
port, as they do when a retransmission timer, not the link, holds the stream.
"""
import select
import socket
import threading
import time

import pytest

from mindio.ttp import protocol as P
from mindio.ttp.states import State

from ._harness import stop_plane, until

KEY = b"b" * 32
INTERVAL, MISSES = 0.2, 3  # dead after 0.6 s of silence
STALL = 2.0                # the stream is held for more than 3x that bound


class StallProxy(threading.Thread):
    """A loopback TCP proxy to ``port``; while :attr:`held` is set it reads nothing in either direction,
    so every frame waits in the kernel's buffers (as behind a segment being retransmitted)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held, self.done = threading.Event(), threading.Event()
        self.pairs: dict = {}

    def run(self) -> None:
        try:
            while not self.done.is_set():
                watch = [self.listener] + ([] if self.held.is_set() else list(self.pairs))
                ready, _, _ = select.select(watch, [], [], 0.02)
                for s in ready:
                    if s is self.listener:
                        a, _ = s.accept()
                        b = socket.create_connection(("127.0.0.1", self.upstream))
                        self.pairs[a], self.pairs[b] = b, a
                    elif not self.held.is_set() and s in self.pairs:
                        data = s.recv(65536)
                        if data:
                            self.pairs[s].sendall(data)
                        else:
                            other = self.pairs.pop(s)
                            self.pairs.pop(other, None)
                            s.close()
                            other.close()
        finally:
            for s in [self.listener, *self.pairs]:
                s.close()

    def stop(self) -> None:
        self.done.set()
        self.join(5)


@pytest.fixture
def datagrams():
    return True  # parametrize ``datagrams`` to override


@pytest.fixture
def proxied(datagrams, monkeypatch):
    """A controller, and 2 processors whose control streams run through a :class:`StallProxy`."""
    if not datagrams:
        monkeypatch.setenv("MINDIO_HEARTBEAT_DATAGRAMS", "0")
    from mindio._ports import free_port
    from mindio.ttp.controller import Controller
    from mindio.ttp.processor import Processor

    port = free_port()
    ctl = Controller(rank=0, world_size=2, enabled={"dump"}, key=KEY, interval=INTERVAL, misses=MISSES,
                     hang_timeout=0)
    ctl.start("127.0.0.1", port)
    proxy = StallProxy(port)
    proxy.start()
    procs = [Processor(r, 2) for r in range(2)]
    try:
        for p in procs:
            p.start(f"tcp://127.0.0.1:{proxy.port}", KEY)
        assert until(lambda: ctl.sm.state is State.NORMAL), ctl.sm.state
        yield ctl, procs, proxy
    finally:
        proxy.held.clear()
        stop_plane(ctl, procs)
        proxy.stop()


@pytest.mark.timeout(60)
def test_a_stalled_stream_is_ridden_out_with_datagram_beats(proxied):
    ctl, procs, proxy = proxied
    assert ctl.beacon.port and all(p.link._beacon is not None for p in procs)  # advertised, opened
    assert ctl.beacon.received == 0  # every beat answered on the stream: no datagram
    proxy.held.set()
    end = time.monotonic() + STALL
    while time.monotonic() < end:
        assert all(r.alive for r in ctl.ranks.values()), (ctl.beacon.received, ctl.drops.snapshot(), [(p.link._beacon.sent, p.link._beacon.answered, p.link._beacon.drops.snapshot()) for p in procs])
        time.sleep(0.02)
    assert ctl.beacon.received >= 2 * int(STALL / INTERVAL) - 2, ctl.beacon.received  # both ranks, each beat
    assert all(p.link._beacon.answered > 0 for p in procs)
    proxy.held.clear()
    assert until(lambda: all(p.link._beacon.unanswered is None for p in procs), 5.0)  # the stream again
    assert all(p.link.failovers == 0 for p in procs)  # the datagram answers kept the controller alive to them
    assert ctl.sm.state is State.NORMAL and ctl._incident is None and ctl.last_decision == {}
    assert all(r.alive and not r.faulty for r in ctl.ranks.values())
    assert ctl.drops.total == 0, ctl.drops.snapshot()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("datagrams", [False])
def test_without_datagrams_the_same_stall_is_a_death(proxied):
    """The cause, shown: the stream alone is silent for as long as it is stalled, and the controller
    cannot tell that from a death (MINDIO_HEARTBEAT_DATAGRAMS=0: no beacon port advertised)."""
    ctl, procs, proxy = proxied
    assert all(p.link._beacon is None for p in procs)
    proxy.held.set()
    t0 = time.monotonic()
    assert until(lambda: not any(r.alive for r in ctl.ranks.values()), STALL)
    assert time.monotonic() - t0 < STALL  # declared dead while the stream was held, as a flap did in the drill
    assert ctl.beacon.received == 0


@pytest.mark.timeout(60)
def test_unauthentic_datagrams_are_dropped_and_never_answered(proxied):
    ctl, procs, _ = proxied
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    try:
        dest = ("127.0.0.1", ctl.beacon.port)
        r1 = ctl.ranks[1]
        sid = ctl.sessions.by_ident[r1.ident].sid
        beat = P.Envelope(P.MsgType.BEACON, P.Heartbeat(step=0, data_status=0), rank=1)
        good = P.encode(beat, KEY, sess=sid, ctr=1_000_000)
        for frame in (b"\x00garbage" * 4,                                        # malformed
                      P.encode(beat, b"wrong-secret", sess=sid, ctr=1_000_001),   # forged
                      P.encode(beat, KEY, sess=sid ^ 2, ctr=1_000_002),           # another session
                      P.encode(beat._replace(rank=0), KEY, sess=sid, ctr=1_000_003),  # rank 0 in rank 1's session
                      P.encode(beat._replace(type=P.MsgType.HEARTBEAT), KEY, sess=sid, ctr=1_000_004)):  # a stream type
            s.sendto(frame, dest)
        assert until(lambda: ctl.drops.total >= 5, 5.0), ctl.drops.snapshot()
        with pytest.raises(socket.timeout):
            s.recv(4096)  # nothing answered
        s.sendto(good, dest)  # authentic, in rank 1's session: answered once
        env = P.decode(s.recv(4096), KEY)
        assert env.type is P.MsgType.BEACON_ACK and env.sess == ctl.sessions.epoch
        s.sendto(good, dest)  # the same datagram again: a replay
        assert until(lambda: ctl.drops.snapshot().get("replay") == 1, 5.0), ctl.drops.snapshot()
        with pytest.raises(socket.timeout):
            s.recv(4096)
        assert ctl.drops.snapshot() == {"protocol": 1, "auth": 1, "session": 2, "refused": 1, "replay": 1}
    finally:
        s.close()
    assert ctl.sm.state is State.NORMAL and all(r.alive for r in ctl.ranks.values())
