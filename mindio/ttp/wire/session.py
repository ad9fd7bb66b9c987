"""Sessions: what binds every control frame to one authenticated conversation (protocol v3).

The HMAC (protocol.py) says a frame was made by someone who holds the job secret. It does not say *when*:
a frame captured off the wire stays valid forever. A session adds freshness and a route:

1. A connection sends HELLO with a fresh random nonce.
2. The controller answers CHALLENGE: the nonce back (so the sender knows the answer is fresh) and a fresh
   random session number, remembered for this connection only and good for one use.
3. The connection sends REGISTER with that session number as the envelope's ``sess`` and counter 1. The
   controller accepts it only from the connection it offered the number to; only then does the
   connection speak for the rank it registered (its *route*: where the rank's ACTIONs go).
4. Every later frame carries the same ``sess`` and a higher ``ctr``. A frame of another session, of no
   session, or with a counter at or below the highest accepted one, is dropped and counted (reasons
   ``session`` / ``replay``), and logged with that reason.

The controller's own frames carry its *epoch* (a random number drawn at its start; the CHALLENGE
carries it) and one counter for all its frames, numbered when the I/O thread sends them, so that each
connection sees them in strictly increasing order; a processor drops a frame of another epoch or with a
counter it has passed (transport.Link).

What follows: a captured HEARTBEAT replayed on another connection belongs to no session there; on the
rank's own connection its counter is old. A captured REGISTER names a session that was offered to another
connection, once. A connection that merely takes a rank's ZeroMQ identity gets nothing: routes are
connection identities zmq assigns, changed only by an accepted REGISTER (no ``ROUTER_HANDOVER``).

Roles (REGISTER.role): ``processor`` (a rank; its frames must carry its rank), ``backup`` (a backup
controller's link: it is advertised to every processor, so it is accepted only when the primary allows
backups, MINDIO_BACKUP_CONTROLLERS), ``relay`` (one connection carrying many ranks' BEATS / BATCH;
only when MINDIO_RELAYS=1). Anything else is refused with reason ``refused``.
"""
from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass

from ...errors import SessionError
from . import protocol as P

__all__ = ["Session", "Sessions", "fresh"]

ROLES = ("processor", "backup", "relay")


def fresh() -> int:
    """A random non-zero 63-bit number (a nonce, a session number, an epoch)."""
    return secrets.randbits(63) | 1


@dataclass
class Session:
    sid: int
    role: str
    rank: int   # processor: its rank; backup: its link's rank (-1000-k); relay: -1
    rx: int     # the highest counter accepted


class Sessions:
    """The controller's sessions, by connection identity (I/O thread only)."""

    def __init__(self, max_pending: int, backups: int, relays: bool):
        self.epoch = fresh()
        self.backups_allowed, self.relays_allowed = backups, relays
        self._pending: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._max_pending = max_pending
        self.by_ident: dict[bytes, Session] = {}

    def challenge(self, ident: bytes) -> int:
        """A new session number offered to ``ident`` (replacing one it was offered before). At most
        ``max_pending`` offers are kept; the oldest goes first."""
        sid = fresh()
        self._pending.pop(ident, None)
        self._pending[ident] = sid
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
        return sid

    def open(self, ident: bytes, env: P.Envelope, backups: list) -> Session:
        """Open the session a REGISTER asks for, or raise SessionError saying why not (``backups``: the
        backup addresses accepted so far; one of them may register again)."""
        if self._pending.get(ident) != env.sess:
            raise SessionError(f"REGISTER for rank {env.rank} in session {env.sess:#x}, which this controller did not "
                               "offer to this connection (replayed, or sent without a HELLO)", "session")
        role = env.body.role
        if role not in ROLES:
            raise SessionError(f"REGISTER with unknown role {role!r}", "refused")
        if role == "backup" and env.body.addr not in backups and len(backups) >= self.backups_allowed:
            raise SessionError(f"backup controller {env.body.addr!r} refused: this controller accepts "
                               f"{self.backups_allowed} backup(s) (MINDIO_BACKUP_CONTROLLERS)", "refused")
        if role == "relay" and not self.relays_allowed:
            raise SessionError("relay refused: relays are off (MINDIO_RELAYS=0)", "refused")
        if role == "processor" and env.rank < 0:
            raise SessionError(f"processor REGISTER with rank {env.rank}", "refused")
        del self._pending[ident]
        s = self.by_ident[ident] = Session(env.sess, role, -1 if role == "relay" else env.rank, env.ctr)
        return s

    def receive(self, ident: bytes, env: P.Envelope, backups: list, send) -> Session | None:
        """The session a frame from ``ident`` belongs to, or SessionError: a HELLO is answered here
        (``send(envelope, ident)``, a CHALLENGE; returns None), a REGISTER outside the connection's session
        opens one (:meth:`open`), anything else must be admitted (:meth:`admit`). The controller and a
        node's relay (relay.py) both receive through this."""
        if env.type is P.MsgType.HELLO:
            send(P.Envelope(P.MsgType.CHALLENGE, P.Challenge(env.body.nonce, self.challenge(ident)), rank=env.rank), ident)
            return None
        s = self.by_ident.get(ident)
        if env.type is P.MsgType.REGISTER and (s is None or s.sid != env.sess):
            return self.open(ident, env, backups)
        return self.admit(ident, env)

    def admit(self, ident: bytes, env: P.Envelope) -> Session:
        """The session of ``ident`` if ``env`` belongs to it and is new; else SessionError."""
        s = self.by_ident.get(ident)
        if s is None or s.sid != env.sess:
            raise SessionError(f"{env.type.name} for rank {env.rank} outside any session of this connection "
                               f"(session {env.sess:#x})", "session")
        if env.ctr <= s.rx:
            raise SessionError(f"{env.type.name} for rank {env.rank} with counter {env.ctr}, at or below {s.rx} "
                               "already received in its session (replayed or reordered)", "replay")
        if s.role != "relay" and env.rank != s.rank:
            raise SessionError(f"{env.type.name} for rank {env.rank} in the session of rank {s.rank}", "session")
        s.rx = env.ctr
        return s

    def close(self, ident: bytes) -> None:
        self.by_ident.pop(ident, None)
        self._pending.pop(ident, None)
