"""Outage tolerance on one host: a rank's control stream that stalls for less than the liveness bound
is no death, and each such silence is recorded (``heartbeat_gap``); past the bound the rank is dead.

The stream runs through a loopback proxy that stops forwarding (both directions) for a while, as a
network outage does; everything sent meanwhile arrives when it resumes, as TCP retransmits it.
docs/recovery.md, "Outage tolerance", gives the bound across hosts (TCP's retransmission schedule).
"""
import select
import socket
import threading
import time

import pytest

from mindio import _logging
from mindio.ttp.states import State

from ._harness import stop_plane, until

KEY = b"o" * 32
INTERVAL, MISSES = 0.2, 10  # dead after 2 s of silence


class StallProxy(threading.Thread):
    """A loopback TCP proxy to ``port``; while :attr:`held` is set it reads nothing in either direction,
    so every frame waits in the kernel's buffers (as in a network outage)."""

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
                        try:
                            data = s.recv(65536)
                            if data:
                                self.pairs[s].sendall(data)
                        except OSError:  # a peer closed with a reset (zmq's linger 0 at the teardown)
                            data = b""
                        if not data:
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
def proxied():
    """A controller, 2 processors whose control streams run through a :class:`StallProxy`, and the
    events the controller records."""
    from mindio._ports import free_port
    from mindio.ttp.controller import Controller
    from mindio.ttp.processor import Processor

    port = free_port()
    ctl = Controller(rank=0, world_size=2, enabled={"dump"}, key=KEY, interval=INTERVAL, misses=MISSES,
                     hang_timeout=0)
    ctl.start("127.0.0.1", port)
    proxy = StallProxy(port)
    proxy.start()
    events: list = []
    _logging.add_listener(events.append)
    procs = [Processor(r, 2) for r in range(2)]
    try:
        for p in procs:
            p.start(f"tcp://127.0.0.1:{proxy.port}", KEY)
        assert until(lambda: ctl.sm.state is State.NORMAL), ctl.sm.state
        yield ctl, proxy, events
    finally:
        _logging.remove_listener(events.append)
        proxy.held.clear()
        stop_plane(ctl, procs)
        proxy.stop()


def _stall(proxy, seconds: float) -> None:
    proxy.held.set()
    time.sleep(seconds)
    proxy.held.clear()


@pytest.mark.timeout(60)
def test_an_outage_within_the_bound_is_ridden_out_and_recorded(proxied):
    ctl, proxy, events = proxied
    _stall(proxy, 1.0)  # half the bound: 5 beats of each rank wait, then arrive
    gaps = lambda: {e["from_rank"]: e["silent_s"] for e in events if e["kind"] == "heartbeat_gap"}
    assert until(lambda: set(gaps()) == {0, 1}, 10.0), events
    assert all(s >= 0.9 for s in gaps().values()), gaps()  # the whole outage, seen from the controller
    time.sleep(3 * INTERVAL)
    assert all(r.alive and not r.faulty for r in ctl.ranks.values())
    assert not [e for e in events if e["kind"] == "rank_dead"] and ctl._incident is None
    assert ctl.sm.state is State.NORMAL


@pytest.mark.timeout(60)
def test_an_outage_past_the_bound_is_a_death(proxied):
    ctl, proxy, events = proxied
    proxy.held.set()
    t0 = time.monotonic()
    assert until(lambda: not any(r.alive for r in ctl.ranks.values()), 20.0)
    assert time.monotonic() - t0 >= MISSES * INTERVAL - 0.1  # never before the bound (sweep granularity)
    dead = {e["dead_rank"]: e for e in events if e["kind"] == "rank_dead"}
    assert set(dead) == {0, 1} and all(e["cause"] == "heartbeat" for e in dead.values())
    assert all(e["silent_s"] >= MISSES * INTERVAL for e in dead.values()), dead
