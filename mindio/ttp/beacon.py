"""Heartbeat datagrams: a rank's beat that does not wait behind a stalled TCP stream.

Why: heartbeats and their acks ride one long-lived TCP connection per rank (transport.Link, zmq). When
a link flaps, a segment lost in a down window is retransmitted after TCP's retransmission timeout,
which doubles on every loss (200 ms, 400, 800, 1.6 s, 3.2 s ...), and every later frame of the stream
waits behind it. On a host whose NIC loses carrier in each outage the kernel also drops its ARP entry
for the controller's host, and a segment sent in a down window waits for ARP's own 1 s retry, which
lands in the next outage when the link flaps about once a second. Measured across network namespaces
(switch port down 100 ms every ~1.1 s): single beats 1-2 s late on a stream that was idle 90 % of the
time, and in the drill (`scripts/drills.sh`) silences past the 3 s bound -- live ranks and their node
declared dead.

What: when the previous beat of a rank's link got no answer yet (no frame from the controller since
it was sent), the link also sends the beat as one UDP datagram (``BEACON``) to the controller's beacon
port (advertised in REGISTER_ACK: the same number as its TCP port where free), and the controller
answers each authentic one with a ``BEACON_ACK`` datagram. A datagram is never retransmitted, so one
lost in an outage costs one beat, not a backoff: during flapping each beat that finds the link up
arrives. In steady state (every beat answered on the stream) no datagram is sent.

Authentication: the same HMAC as every frame (protocol.py). A BEACON carries the rank's TCP session
number (session.py) and a counter of its own (``Session.beacon_rx``: strictly increasing, separate
from the stream's counter, which datagrams would otherwise reorder); it is accepted only for a
registered, live processor rank whose current session it names. A BEACON_ACK carries the controller's
epoch and its own counter. Neither type is accepted on the stream, nor the stream's types here. An
unauthentic datagram is dropped (counted) and never answered, so the port reflects nothing for
strangers.
"""
from __future__ import annotations

import errno
import logging
import socket

from ..errors import SessionError
from . import protocol as P
from .session import Session

__all__ = ["Server", "Client", "udp_socket"]

_log = logging.getLogger("mindio.ttp.controller")
_MAX_DGRAM = 4096  # a beacon is ~100 bytes


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def udp_socket(host: str, port: int) -> socket.socket:
    """A non-blocking UDP socket bound to ``host`` (``*`` or empty: any) and ``port`` (0: any free)."""
    host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
    sock = socket.socket(_family(host), socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Server:
    """The controller's beacon port (I/O thread only, besides :meth:`close`)."""

    def __init__(self, ctl, host: str, port: int):
        self.ctl = ctl
        try:
            self.sock = udp_socket(host, port)  # the stream's port number, so that a firewall rule covers both
        except OSError:
            self.sock = udp_socket(host, 0)
        self.port = self.sock.getsockname()[1]
        self.key = ctl.key
        self.ctr = 0
        self.received = 0  # authentic beacons (status / tests)

    def fileno(self) -> int:
        return self.sock.fileno()

    def on_readable(self, now: float) -> None:
        for _ in range(10000):
            try:
                data, addr = self.sock.recvfrom(_MAX_DGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP errors of an earlier ack (the rank's port closed): nothing to read
                continue
            try:
                env = P.decode(data, self.key)
                self._accept(env)
            except Exception as exc:  # AuthError, ProtocolError, SessionError: dropped, counted, no answer
                self.ctl.drops.drop(exc, origin=f"beacon {addr[0]}:{addr[1]}")
                continue
            self.received += 1
            self._on_beacon(env, now)
            self._answer(env, addr)

    def _accept(self, env: P.Envelope) -> Session:
        if env.type is not P.MsgType.BEACON:
            raise SessionError(f"{env.type.name} on the beacon port (only BEACON)", "refused")
        ctl = self.ctl
        r = ctl.ranks.get(env.rank)
        s = ctl.sessions.by_ident.get(r.ident) if r is not None and r.ident else None
        if s is None or s.role != "processor" or s.rank != env.rank or s.sid != env.sess:
            raise SessionError(f"BEACON for rank {env.rank} outside its current session", "session")
        if env.ctr <= s.beacon_rx:
            raise SessionError(f"BEACON for rank {env.rank} with counter {env.ctr}, at or below {s.beacon_rx}",
                               "replay")
        s.beacon_rx = env.ctr
        return s

    def _on_beacon(self, env: P.Envelope, now: float) -> None:
        ctl = self.ctl
        if ctl.replacements.refuse_stale(env):
            return
        r, body = ctl.ranks[env.rank], env.body
        if not r.registered or r.left:
            return
        if now - r.last_seen > ctl.interval * 1.5 and r.alive:
            ctl.liveness.gap(env.rank, now - r.last_seen, "datagram")
        r.last_seen, r.step, r.data_status = now, body.step, body.data_status
        r.in_collective, r.progress_age = body.in_collective, body.progress_age
        if r.alive:
            ctl.liveness.touch(env.rank)

    def _answer(self, env: P.Envelope, addr) -> None:
        self.ctr += 1
        ack = P.Envelope(P.MsgType.BEACON_ACK, P.HeartbeatAck(self.ctl.sm.state.value), rank=env.rank)
        try:
            self.sock.sendto(P.encode(ack, self.key, sess=self.ctl.sessions.epoch, ctr=self.ctr), addr)
        except OSError:  # the rank's link is down again: its next beacon gets the next answer
            pass

    def close(self) -> None:
        self.sock.close()


class Client:
    """A link's beacon socket for one session (the link's I/O thread only)."""

    def __init__(self, key: bytes, address: str, port: int, sess: int, epoch: int):
        host = address.rpartition("://")[2].rpartition(":")[0].strip("[]")
        self.key, self.sess, self.epoch = key, sess, epoch
        self.sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.connect((host, port))  # a connected socket: only the controller's datagrams arrive
        self.ctr = self.peer_ctr = 0
        self.sent = self.answered = 0
        self.drops = P.DropCounter()
        self.unanswered: float | None = None  # when the oldest beat with no frame of the controller since went
        self.next_send = 0.0

    def beat_sent(self, now: float) -> None:
        """A beat went on the stream at ``now``."""
        if self.unanswered is None:
            self.unanswered = now

    def heard(self) -> None:
        """A frame of the controller arrived (stream or datagram): the beats sent so far are answered."""
        self.unanswered = None

    def due(self, interval: float) -> float | None:
        """When the next datagram beat is due: a quarter ``interval`` after a beat that got no answer, then
        every quarter interval until some frame of the controller arrives; None while none is."""
        if self.unanswered is None:
            return None
        return max(self.unanswered + interval / 4, self.next_send)

    def send_due(self, now: float, interval: float, make) -> None:
        """Send the BEACON ``make()`` returns if one is due at ``now``."""
        due = self.due(interval)
        if due is not None and now >= due:
            self.next_send = now + interval / 4
            self.send(make())

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, env: P.Envelope) -> None:
        """Send ``env`` (a BEACON) as one datagram; an outage loses it, nothing waits or retries."""
        self.ctr += 1
        try:
            self.sock.send(P.encode(env, self.key, sess=self.sess, ctr=self.ctr))
            self.sent += 1
        except OSError as exc:  # ENETUNREACH, ECONNREFUSED (the port is gone), EAGAIN: this beat is lost
            if exc.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.EAGAIN,
                                 errno.ENOBUFS, errno.EHOSTDOWN, errno.ENETDOWN):
                _log.debug("beacon not sent: %s", exc)

    def on_readable(self) -> bool:
        """Read the answers that arrived; whether an authentic, fresh BEACON_ACK was among them."""
        fresh = False
        for _ in range(1000):
            try:
                data = self.sock.recv(_MAX_DGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # ECONNREFUSED from an earlier beacon: the controller's port is closed
                continue
            try:
                env = P.decode(data, self.key)
                if env.type is not P.MsgType.BEACON_ACK or env.sess != self.epoch or env.ctr <= self.peer_ctr:
                    raise SessionError(f"{env.type.name} on the beacon socket outside this link's session or "
                                       "replayed", "session")
            except Exception as exc:
                self.drops.drop(exc, origin="beacon")
                continue
            self.peer_ctr = env.ctr
            self.answered += 1
            fresh = True
        return fresh

    def close(self) -> None:
        self.sock.close()

