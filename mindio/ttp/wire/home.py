"""A processor's way back to its primary controller while a passive backup holds it (issue 16).

A rank's link (transport.Link) fails over to a backup controller once its controller was silent for
``MINDIO_HEARTBEAT_MISSES`` x ``MINDIO_HEARTBEAT_INTERVAL`` (+ half an interval). That backup may be
*passive*: it has not taken over (under mindio-run it does only once node 1's agent found node 0's store
unreachable, mindio/launch/backup.py), because the primary only stalled -- a long GC pause, a SIGSTOP, a
host swapping. A passive backup says so in its acks (``passive``). While it does, the link keeps a HELLO
pending at its primary (:class:`HomeProbe`) and goes back the moment the primary answers it with a
CHALLENGE: the primary, running again, hears the rank within its own bound (the silence while it was
stopped is not counted, watch.Liveness.stalled) instead of declaring a live rank dead.

A primary that is gone never answers: the rank stays with the backup, registered there and beating,
so the backup counts it when it takes over. Whether the rank failed over before or after node 1's
agent armed the backup makes no difference: the backup accepts it either way, and only a primary that
answers takes it back. A backup that took over sends ``passive`` false: the probe ends.

The pending HELLO is renewed (a fresh connection and nonce) every ``misses x interval`` s without an
answer, so a connection whose handshake zmq gave up on (a stall longer than its handshake interval)
does not leave the rank waiting on nothing.
"""
from __future__ import annotations

import time
from typing import Callable

import zmq

from . import protocol as P
from .session import fresh

__all__ = ["HomeProbe"]


class HomeProbe:
    """A HELLO pending at ``home`` (the primary) on a connection of its own; one per link, I/O thread only."""

    def __init__(self, home: str, channel: Callable, rank: int, renew: float):
        self.home, self.rank = home, rank
        self.channel = channel  # address -> a new transport.Channel connected there (Link._channel)
        self.renew = renew  # s without an answer before the HELLO is sent again on a fresh connection
        self.chan = None    # transport.Channel of the pending HELLO, or None
        self.nonce = 0
        self.sent_at = 0.0
        self.since = 0.0    # when this link found itself with a passive backup (0: it is not)

    def keep(self, poller: zmq.Poller, gen: int, now: float) -> None:
        """Have a HELLO pending at home: open one, or renew one unanswered for ``renew`` s."""
        if self.chan is not None and now - self.sent_at < self.renew:
            return
        if not self.since:
            self.since = now
        self.close(poller, keep_since=True)
        self.chan = self.channel(self.home)
        self.nonce, self.sent_at = fresh(), now
        self.chan.send(P.Envelope(P.MsgType.HELLO, P.Hello(self.nonce), rank=self.rank, gen=gen))
        poller.register(self.chan.sock, zmq.POLLIN)

    def answer(self, events: dict) -> P.Envelope | None:
        """The primary's CHALLENGE to the pending HELLO, if it came (other frames are dropped, counted)."""
        if self.chan is None or self.chan.sock not in events:
            return None
        while True:
            try:
                got = self.chan.recv()
            except zmq.Again:
                return None
            if got is not None and got[1].type is P.MsgType.CHALLENGE and got[1].body.nonce == self.nonce:
                return got[1]

    def take(self):
        """Hand the answered connection over to the link (it stays registered with the poller)."""
        chan, self.chan, self.nonce, self.since = self.chan, None, 0, 0.0
        return chan

    def close(self, poller: zmq.Poller, keep_since: bool = False) -> None:
        if self.chan is not None:
            poller.unregister(self.chan.sock)
            self.chan.sock.close(0)
            self.chan = None
        self.nonce = 0
        if not keep_since:
            self.since = 0.0

    def away(self) -> float:
        """How long this link has been with a passive backup (0: it is not)."""
        return time.monotonic() - self.since if self.since else 0.0
