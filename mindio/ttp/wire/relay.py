"""A node's relay: its ranks talk to it, it talks to the controller on one connection (protocol v4).

A node agent (``mindio-run --high-availability``, unless ``MINDIO_RELAYS=0``) starts one :class:`Relay` per
round. Its ranks connect to it, not to the controller:

* **Where.** A ZeroMQ ROUTER on an IPC socket in a directory created with mode 0700 (``tempfile.mkdtemp``):
  only the job's user reaches it. Under mindio-run it runs in a process of its own (mindio/launch/relay.py). The workers get its address as
  ``MINDIO_RELAY_ADDR``; a rank's link (transport.Link) is unchanged -- to it the relay is its controller.
* **Authentication, re-done here.** Every frame a rank sends is verified with the job secret (HMAC) and
  admitted only in the rank's own session, opened with the same HELLO / CHALLENGE / REGISTER handshake
  the controller runs (session.py, this relay's own epoch and counters): a frame carrying another rank
  than its session's is dropped (reason ``session``), a replayed one too (``replay``). A REGISTER for a
  rank this node does not run is refused (``refused``). A newer registration of a rank (its replacement)
  closes the older one's session, so only the rank's latest process speaks for it.
* **Upstream.** One Link (transport.py, role ``relay``) to the controller, which fails over to backup
  controllers and goes back home as a rank's link does. Per interval one BEATS frame carries the latest
  heartbeat of each rank heard since the last one (every field: ``coll_seq``, ``idle_age``, ``step_p99``,
  ``step_sums`` too; the maps and lists packed in one byte string the controller unpacks when it reads
  them, protocol v5), for the ranks the controller acknowledged; REGISTER, REPORT, INFO, REPLY (the
  acknowledgements of actions: a run of them to one action as one REPLIES item of columns, v7), BYE and REQUEST
  go up in one BATCH per turn of this thread. A frame keeps
  its rank's generation (one BATCH / BEATS per generation), so a replaced rank's old process is refused
  upstream as on a direct connection.
* **Downstream.** An ACTION for many ranks (``ACTION.ranks``) is fanned out to each of them; a
  REGISTER_ACK or HEARTBEAT_ACK for a rank goes to that rank (without the backup list: the relay, not the
  rank, fails over); the controller answers a BATCH of REGISTERs with one BATCH of REGISTER_ACKs (v6), handed
  out one by one. A rank the controller does not know (BEATS' ack lists it, or this relay registered again,
  e.g. with a backup controller) is told UNKNOWN and registers again through the relay.
* **Its death** (the agent is killed) is its node's loss: the relay and the ranks die with their agent
  (PR_SET_PDEATHSIG) and the controller sees their beats stop, as for a node whose agent was lost. A
  stall of the agent alone is not: the relay is a process of its own.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
from typing import Callable, Collection

import zmq

from ...errors import ProtocolError, SessionError
from .. import shutdown
from . import protocol as P
from .session import Sessions
from .transport import Channel, Link, Waker, context

__all__ = ["Relay"]

_log = logging.getLogger("mindio.ttp.relay")
_LOCAL_UP = (P.MsgType.REGISTER, P.MsgType.REPORT, P.MsgType.INFO, P.MsgType.REPLY, P.MsgType.BYE,
             P.MsgType.REQUEST)
_MAX_ITEMS = 512  # items per BATCH / ranks per BEATS: far below the 1 MiB frame bound


class Relay(threading.Thread):
    """One node's relay (see the module docstring). ``ranks``: the ranks this node may register."""

    def __init__(self, key: bytes, controller: str, ranks: Callable[[], Collection[int]], world_size: int,
                 interval: float | None = None, misses: int | None = None, dir: str = ""):
        super().__init__(name="mindio-relay", daemon=True)
        self.key, self.ranks = key, ranks
        # ``dir``: made by the caller with mode 0700 (mindio/launch/relay.py); else here (mkdtemp: 0700)
        self.dir = dir or tempfile.mkdtemp(prefix="mindio-relay-")
        self.address = f"ipc://{self.dir}/s"
        self.drops = P.DropCounter()
        self.sessions = Sessions(max_pending=256, backups=0, relays=False)  # ranks only
        sock = context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._chan = Channel(sock, key, self.drops, sess=self.sessions.epoch)
        self.routes: dict[int, bytes] = {}   # rank -> its local connection (its latest registration)
        self._acked: set[int] = set()        # ranks the controller acknowledged through this relay
        self._beats: dict[int, P.Envelope] = {}  # rank -> its latest HEARTBEAT since the last BEATS
        self._lock = threading.Lock()        # _beats and _acked: the link's thread reads them (beat)
        self._up: list[P.Envelope] = []
        self._registrations = 0  # of this relay with a controller (a failover or a return home: again)
        self._down: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._halt = threading.Event()
        self._ack_body = P.pack_body(P.Envelope(P.MsgType.HEARTBEAT_ACK, P.HeartbeatAck()))
        host = socket.gethostname()
        self.link = Link(-1, key, [controller], lambda: P.Register(world_size, os.getpid(), host, role="relay"),
                         self._collect, self._from_controller, interval=interval, misses=misses,
                         on_registered=lambda: self._down.put(None) or self._waker.wake(), relay=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        shutdown.track(self)
        super().start()
        self.link.start()
        _log.info("relay for this node's ranks on %s -> controller %s (MINDIO_RELAYS)", self.address,
                  self.link.address)

    def stop(self) -> None:
        self._halt.set()
        self._waker.wake()

    def close(self, timeout: float) -> bool:
        """Stop the relay and its link (at most ``timeout`` s each); whether both ended."""
        self.stop()
        if self.is_alive():
            self.join(timeout)
        done = self.link.close(timeout)
        shutil.rmtree(self.dir, ignore_errors=True)
        return done and not self.is_alive()

    # -- the link's thread ------------------------------------------------------------------------
    def _collect(self) -> list[P.Envelope]:
        """(link thread, each interval) The BEATS frames: the ranks heard since the last ones, by generation.
        An empty BEATS when none was heard keeps the relay's own session alive."""
        with self._lock:
            beats, self._beats = self._beats, {}
            acked = self._acked.copy()
        by_gen: dict[int, list] = {}
        for rank, env in beats.items():
            if rank in acked:
                by_gen.setdefault(env.gen, []).append(env)
        out = [_beats(envs[i:i + _MAX_ITEMS], gen) for gen, envs in by_gen.items()
               for i in range(0, len(envs), _MAX_ITEMS)]
        return out or [P.Envelope(P.MsgType.BEATS, P.Beats([], [], [], [], []), rank=-1, gen=self.link.gen)]

    def _from_controller(self, env: P.Envelope) -> None:
        self._down.put(env)
        self._waker.wake()

    # -- the relay's thread -----------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._chan.sock, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        try:
            while not self._halt.is_set():
                events = dict(poller.poll(1000))
                if self._waker.rfd in events:
                    self._waker.drain()
                while True:
                    try:
                        self._down_one(self._down.get_nowait())
                    except queue.Empty:
                        break
                if self._chan.sock in events:
                    while True:
                        try:
                            got = self._chan.recv()
                        except zmq.Again:
                            break
                        if got is not None:
                            self._local(*got)
                self._send_up()
        finally:
            self._chan.sock.close(0)
            self._waker.close()

    def _local(self, ident: bytes, env: P.Envelope) -> None:
        """One authentic frame from a rank's connection: admitted only in that rank's session."""
        try:
            if env.type is P.MsgType.REGISTER and env.rank not in self.ranks():
                raise SessionError(f"REGISTER for rank {env.rank}, which does not run on this node", "refused")
            if self.sessions.receive(ident, env, [], self._chan.send) is None:
                return  # a HELLO, answered
            if env.type is P.MsgType.REGISTER:
                old = self.routes.get(env.rank)
                if old is not None and old != ident:
                    self.sessions.close(old)  # the rank's older process speaks for it no more
                self.routes[env.rank] = ident
                with self._lock:
                    self._acked.discard(env.rank)
            if env.type is not P.MsgType.HEARTBEAT and env.type not in _LOCAL_UP:
                raise SessionError(f"{env.type.name} from rank {env.rank}: not a rank's message", "refused")
        except (SessionError, ProtocolError) as exc:
            self.drops.drop(exc, origin=f"local {ident!r}")
            return
        if env.type is P.MsgType.HEARTBEAT:
            with self._lock:
                self._beats[env.rank] = env
            self._chan.send(P.Envelope(P.MsgType.HEARTBEAT_ACK, None, rank=env.rank), ident, body=self._ack_body)
        else:
            self._up.append(env)

    def _send_up(self) -> None:
        """What the ranks sent this turn, in order: one BATCH per run of one generation."""
        up, self._up, i = self._up, [], 0
        while i < len(up):
            j, gen = i, up[i].gen
            while j < len(up) and j - i < _MAX_ITEMS and up[j].gen == gen:
                j += 1
            self.link.send(P.Envelope(P.MsgType.BATCH, P.Batch(P.fold_replies(up[i:j])), rank=-1, gen=gen))
            i = j

    def _to(self, rank: int, env: P.Envelope) -> None:
        ident = self.routes.get(rank)
        if ident is not None and ident in self.sessions.by_ident:
            self._chan.send(env, ident)

    def _unknown(self, ranks) -> None:
        """Tell ``ranks`` the controller does not know them: each registers again (through us)."""
        with self._lock:
            self._acked.difference_update(ranks)
        for rank in ranks:
            self._to(rank, P.Envelope(P.MsgType.HEARTBEAT_ACK, P.HeartbeatAck("UNKNOWN"), rank=rank))

    def _down_one(self, env: P.Envelope | None) -> None:
        """One message from the controller (None: this relay registered again upstream)."""
        if env is None:
            self._registrations += 1
            if self._registrations == 1:
                return  # the first: what the ranks sent meanwhile waited for it in the link's queue
            if self.routes:
                _log.info("relay registered with %s: its ranks %s register again", self.link.address,
                          sorted(self.routes))
            self._unknown(list(self.routes))
            return
        body, t = env.body, env.type
        if t is P.MsgType.BATCH:  # the answers to a run of our ranks' REGISTERs (protocol v6), one by one
            for item in body.items:
                if item.rank >= 0:
                    self._down_one(item)
            return
        if t is P.MsgType.ACTION:
            one = P.Action(body.name, body.params)
            for rank in body.ranks or [env.rank]:
                self._to(rank, P.Envelope(t, one, rank=rank, sn=env.sn))
        elif t is P.MsgType.REGISTER_ACK:
            with self._lock:
                self._acked.add(env.rank)
            self._to(env.rank, P.Envelope(t, P.RegisterAck(body.gen, body.interval), rank=env.rank))
        elif t is P.MsgType.HEARTBEAT_ACK and env.rank < 0:
            self._unknown(body.unknown)
        elif t is P.MsgType.HEARTBEAT_ACK:
            self._to(env.rank, P.Envelope(t, P.HeartbeatAck(body.state), rank=env.rank))
        elif env.rank >= 0:
            self._to(env.rank, env)


def _beats(envs: list, gen: int) -> P.Envelope:
    hb = [e.body for e in envs]
    return P.Envelope(P.MsgType.BEATS, P.Beats(
        ranks=[e.rank for e in envs], steps=[b.step for b in hb], status=[b.data_status for b in hb],
        coll=[b.in_collective for b in hb], age=[float(b.progress_age) for b in hb],
        idle=[float(b.idle_age) for b in hb], p99=[float(b.step_p99) for b in hb],
        packed=P.pack_extras([b.coll_seq for b in hb], [list(b.step_sums) for b in hb])), rank=-1, gen=gen)
