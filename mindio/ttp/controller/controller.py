"""The controller: watches every rank and drives recovery through the state table (states.py).

Two threads. The *I/O thread* owns the ROUTER socket: it registers processors, answers heartbeats,
records reports, marks a rank dead after ``misses * interval`` s of silence, finds hung ranks (and
orders them SIGKILLed), and hands action replies to the *driver thread*, which runs one incident at a
time with one action in flight (actions.ActionEngine: sequence number, resend every 2 heartbeat
intervals to ranks that have not answered, deadline TTP_NORMAL_ACTION_TIME_LIMIT; processors replay
cached replies for a repeated sn).

The incident flow (what happens after a fault) is in incident.py.

Backups: a backup controller binds its own socket, announces itself to the primary (which advertises
it to processors in every ack; only when the primary accepts backups, MINDIO_BACKUP_CONTROLLERS) and
stays passive until the primary is silent *and* more than half of the ranks registered with it; then it
drives the job. While passive its acks say so: ranks that failed over to it go back to the primary as
soon as it answers again (wire/home.py), and it forgets those it no longer hears (watch.py).

Every frame belongs to a session (session.py): a connection speaks for a rank only after an
authenticated REGISTER in a session this controller offered it, and a rank's route (where its ACTIONs
go) changes only through such a REGISTER. With CURVE, a ZAP handler lets in only the job's client key
(derived from the secret) and the client keys it was given.
"""
from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import queue
import threading
import time

import msgpack
import numpy as np
import zmq

from ... import _knobs, _logging
from . import policy
from ..wire import beats, protocol as P
from .._enums import ReportState, Strategy
from .ranks import RankRecord as _Rank, infer_layout  # _Rank: the old name, still imported by tests
from .states import Result, State
from .actions import ActionEngine
from .brain import Brain
from .incident import IncidentFlow
from .pause import PauseFlow
from .core import SHARED, Core
from .retry import Retry
from .stopround import StopRound
from .elastic_flow import Downgrade, Elastic
from .recover import Replace, Replacements
from .dump import Dump
from .hotswitch import HotSwitch
from .watch import Liveness
from ...errors import ConfigError, ProtocolError, SessionError
from .. import shutdown
from ..wire.session import Sessions
from ..wire.transport import Channel, Link, Waker, job_curve_keypair

__all__ = ["Controller"]

_log = logging.getLogger("mindio.ttp.controller")
_SEND_SLICE_S = 0.05  # the longest the I/O thread sends queued frames before it reads again
_RECV_SLICE_S = 0.2  # the longest it reads frames before it sweeps and sends again


def _action_body(name: str, params: bytes, ranks: list) -> bytes:
    """The packed body of ``P.Action(name, <params>, ranks)`` with ``params`` packed already (a map;
    the decoder takes its fields in any order)."""
    return b"".join((_action_head(name), msgpack.packb(ranks), _PARAMS_KEY, params))


_PARAMS_KEY = msgpack.packb("params")


@functools.lru_cache(maxsize=64)
def _action_head(name: str) -> bytes:
    """:func:`_action_body` up to the rank list: the same for every relay of one broadcast (packed once,
    not once per relay: 12,500 relays at 100k ranks)."""
    pack = msgpack.packb
    return b"\x83" + pack("name") + pack(name, use_bin_type=True) + pack("ranks")


# frames of a rank that show it is there: one that has not confirmed the job's exit order gets it (incident.py)
_HEARD = (P.MsgType.HEARTBEAT, P.MsgType.REGISTER, P.MsgType.REPORT, P.MsgType.REQUEST)


def _shared(name: str) -> property:
    """A controller attribute that is the Core's ``name`` (core.py)."""
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value))


class Controller:
    """See the module docstring; composed of parts that own their state (``__init__``)."""

    # The strategies an incident may run: {name: strategy.Strategy}. Each ``run(ctl, ctx)`` returns an
    # Outcome: RESUMED (the job trains again), ENDED (dump + exit) or FAILED (the incident falls back to
    # the next strategy of its order). A new strategy: a file of its own, and one line here.
    STRATEGIES = {
        Strategy.RETRY: Retry(),
        Strategy.RECOVER_IN_PLACE: Replace(Strategy.RECOVER_IN_PLACE),
        Strategy.RECOVER: Replace(Strategy.RECOVER),
        Strategy.DOWNGRADE: Downgrade(),
        Strategy.DUMP: Dump(),
    }

    def __init__(self, rank: int, world_size: int, enabled, key: bytes, backup: bool = False,
                 curve: dict | None = None, interval: float | None = None, misses: int | None = None,
                 curve_client: dict | None = None, curve_clients=(),
                 hang_timeout: float | None = None, backups_allowed: int | None = None,
                 relays: bool | None = None):
        self.rank, self.key, self.curve = rank, key, curve or {}
        # a backup's link to the primary is a CURVE client too: its keys, or the job's client keypair and
        # the public key of the server keypair shared with the primary (which it then authenticates)
        if curve_client is None and self.curve.get(zmq.CURVE_SECRETKEY):
            curve_client = {zmq.CURVE_SERVERKEY: zmq.curve_public(self.curve[zmq.CURVE_SECRETKEY])}
        self.curve_client = curve_client or {}
        # CURVE clients let in (ZAP): the job's own key and the ones given (tls_info client_public)
        self.curve_clients = {job_curve_keypair(key)[0], *curve_clients}
        interval = interval or _knobs.get("MINDIO_HEARTBEAT_INTERVAL")
        # what the parts share (core.py): each part gets it, not the controller; the controller's attributes
        # named in core.SHARED (gen, exit_code, action_limit, ...) are the Core's
        self.core = core = Core(
            world_size, enabled, self.STRATEGIES, interval=interval,
            misses=misses or _knobs.get("MINDIO_HEARTBEAT_MISSES"),
            action_limit=_knobs.get("TTP_NORMAL_ACTION_TIME_LIMIT"),
            hang_timeout=_knobs.get("MINDIO_HANG_TIMEOUT") if hang_timeout is None else hang_timeout,
            # given (here or MINDIO_HANG_TIMEOUT): the bound; else the job's step times set it (hangs.py)
            hang_fixed=hang_timeout is not None or _knobs.is_set("MINDIO_HANG_TIMEOUT"), active=not backup)
        self.sm, self.ranks = core.sm, core.ranks  # the state machine, {rank: RankRecord} (ranks.py)
        self.backup = backup
        self.backups: list[str] = []
        self.drops = P.DropCounter()
        self.sessions = Sessions(max_pending=2 * world_size + 64,
                                 backups=_knobs.get("MINDIO_BACKUP_CONTROLLERS") if backups_allowed is None
                                 else backups_allowed,
                                 relays=_knobs.get("MINDIO_RELAYS") if relays is None else relays)
        self._relays: set[bytes] = set()  # connections of relay sessions
        # relay connection -> (when, body) of its last HEARTBEAT_ACK: a relay's BEATS are acked every other
        # interval, at once when the body changed (the same bytes object while it does not: _ack_body_of)
        self._relay_acked: dict[bytes, tuple] = {}
        self._frozen = False  # gc.freeze() called (_freeze_heap), undone by close()
        self._beats: list = []  # (ident, gen) of the BEATS frames read in this turn, applied together (_flush_beats)
        # (connection, REPLIES item) read in this turn, recorded together (_flush_replies)
        self._replies_held: list = []
        self._reader = beats.reader(key)  # their columns (wire/beats.py: native when the core is built)
        self.address = ""
        self.final = core.final
        self._lock, self._cond, self._stop = core.lock, core.cond, core.stop
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._primary_link: Link | None = None
        self._threads: list[threading.Thread] = []
        self._ack_body: bytes = b""
        self._reg_ack_body, self._reg_ack_version = b"", None
        self._reg_acks: tuple | None = None  # (relay ident, [rank]) acks held while a relay's REGISTERs are read
        self.io_gap_max = 0.0  # the longest the I/O thread went without returning to its poll, s (bench/controller_scale.py)
        self.actions = ActionEngine(self._cond, self._send_many, lambda r: self.ranks[r].alive, self.interval,
                                    backlog=lambda: time.monotonic() - core.drained_at > 0.5,
                                    alive_of=self._alive_of)
        self._call = self.actions.call
        core.use_actions(self.actions)
        core.send, core.sessions = self._send, self.sessions
        core.ack_register, core.take_over, core.primary_link = self._ack_register, self._take_over, \
            lambda: self._primary_link
        self._ack_version: tuple = ()
        self._poller: zmq.Poller | None = None
        self._ctx: zmq.Context | None = None
        self._auth = None
        self.status_server = None  # status.py's server, when MINDIO_STATUS_PORT is set
        # the parts: each owns its state and gets the Core (core.py), where it finds its peers
        core.incidents = self.incidents = IncidentFlow(core)  # the open incident, the driver thread (incident.py)
        core.pause = self.pause = PauseFlow(core)  # the cluster brain's pause (pause.py)
        core.liveness = self.liveness = Liveness(core)  # dead, starved and hung ranks; the pid probe (watch.py)
        core.stop_round = self.stop_round = StopRound(core)  # the stop round of every fault incident (stopround.py)
        core.replacements = self.replacements = Replacements(core)  # the launcher's replacer (recover.py)
        core.hot_switch = self.hot_switch = HotSwitch(core)  # backups, pause, switch out and in (hotswitch.py)
        core.elastic = self.elastic = Elastic(core)  # members, removed ranks, standbys, upgrade (elastic_flow.py)

    # ------------------------------------------------------------------ lifecycle
    @property
    def registered(self) -> int:
        """How many ranks are registered now (a backup controller's launcher reads it at a takeover)."""
        return self.core.registered

    def start(self, bind_ip: str, port: int, primary: str | None = None) -> None:
        ctx = self._ctx = zmq.Context()  # its own: the ZAP handler below serves this context's sockets
        if self.curve:
            self._start_zap(ctx)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * P.MAX_FRAME)  # zmq drops the connection of a flooding peer
        sock.setsockopt(zmq.BACKLOG, 4096)  # thousands of ranks connect at once; a short accept queue drops SYNs
        # no ROUTER_HANDOVER and no identities chosen by peers: zmq names every connection, so a rank that
        # reconnects (its link found us silent) before we dropped its old connection is a new connection
        # that registers afresh, and nobody can take a rank's route by connecting with its identity
        for opt, val in self.curve.items():
            sock.setsockopt(opt, val)
        if self.curve:  # no ZAP handler, no connection (rather than CURVE without client authentication)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"mindio")
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        try:
            if port == 0:  # any free port, chosen by the bind itself (no window for another socket to take it)
                port = sock.bind_to_random_port(f"tcp://{bind_ip}", min_port=20000, max_port=65535, max_tries=1000)
            else:
                sock.bind(f"tcp://{bind_ip}:{port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            if self._auth is not None:
                self._auth.stop()
                atexit.unregister(self._auth.stop)
                self._auth = None
            ctx.term()
            self._ctx = None
            if exc.errno == zmq.EADDRINUSE:  # one line for the user (launch/failures.py), not zmq's traceback
                raise ConfigError(f"controller port {port} on {bind_ip} is already in use (another job's "
                                  f"controller, or one still running?): give tft_start_controller a free port "
                                  f"(TTP_PORT in the examples)") from None
            raise ConfigError(f"the controller cannot listen on tcp://{bind_ip}:{port}: {exc}") from None
        self.port = port
        self.address = f"tcp://{bind_ip}:{port}"
        self._chan = Channel(sock, self.key, self.drops, sess=self.sessions.epoch)
        if self.backup:
            if not primary:
                raise ValueError("a backup controller needs the primary's address")
            hello = lambda: P.Register(world_size=self.world_size, pid=0, host="", role="backup", addr=self.address)
            beat = lambda: P.Heartbeat(step=0, data_status=0)
            self._primary_link = Link(-1000 - max(self.rank, 0), self.key, [primary], hello, beat,
                                      lambda env: None, curve=self.curve_client, interval=self.interval, misses=self.misses,
                                      follow_backups=False)
            self._primary_link.start()
        shutdown.track(self)  # stopped and joined at process exit if still running
        for target, name in ((self._io_loop, "io"), (self.incidents.drive, "driver")):
            t = threading.Thread(target=target, name=f"mindio-ctl-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        status_port = _knobs.get("MINDIO_STATUS_PORT")
        if status_port and not self.backup:  # mindio status / Prometheus (status.py): one read-only observer
            from . import status
            self.status_server = status.serve(self, bind_ip, status_port)
        _log.info("controller %s listening on %s (world %d, strategies %s)",
                  "backup" if self.backup else "primary", self.address, self.world_size, sorted(self.enabled))

    def _start_zap(self, ctx: zmq.Context) -> None:
        """CURVE client authentication: a ZAP handler (pyzmq's ThreadAuthenticator) that lets in only the
        client keys in ``self.curve_clients`` and logs each refusal."""
        from zmq.auth.thread import ThreadAuthenticator

        allowed, refused = self.curve_clients, [0]

        class _Keys:
            def callback(self, domain, key):
                if key in allowed:
                    return True
                refused[0] += 1
                if refused[0] <= 5 or refused[0] % 1000 == 0:
                    _log.warning("refused CURVE client #%d: key %s is not a key of this job (the job's own, "
                                 "derived from its secret, or tls_info's client_public)", refused[0], key.decode())
                return False

        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("mindio.ttp.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("mindio", _Keys())  # the ROUTER's ZAP_DOMAIN
        atexit.register(self._auth.stop)  # stopped while the interpreter still runs threads normally

    def destroy(self) -> None:
        self.close(timeout=4)

    def close(self, timeout: float) -> bool:
        """Stop the status server and the threads and join them, at most ``timeout`` s in all; whether
        every one ended (the I/O thread closes the socket as it ends). Called again: nothing more."""
        server, self.status_server = self.status_server, None
        if server is not None:
            server.observer.close()
            server.shutdown()
            server.server_close()
        self._stop.set()
        self.actions.close()  # an incident in flight ends at its action (actions.ControllerClosed), not after it
        self.incidents.wakeup.set()
        self._waker.wake()
        end = time.monotonic() + timeout
        parts = list(self._threads) + ([self._primary_link] if self._primary_link is not None else [])
        if self._primary_link is not None:
            self._primary_link.stop()
        for t in parts:
            t.join(timeout=max(0.0, end - time.monotonic()))
        if self._auth is not None:
            atexit.unregister(self._auth.stop)
            self._auth.stop()
            self._auth = None
        ended = not any(t.is_alive() for t in parts)
        if self._ctx is not None and ended:
            self._ctx.term()  # the I/O thread closed the socket
            self._ctx = None
        if self._frozen:  # the job's heap may be collected again (a process that hosts several jobs: tests)
            self._frozen = False
            policy.FREEZE_AFTER_NO_GC = False
            gc.unfreeze()
        return ended

    # ------------------------------------------------------------------ I/O thread
    def _send(self, rank: int, body, mtype=P.MsgType.ACTION, sn: int = 0, ident: bytes | None = None) -> None:
        """(any thread) Queue a message for ``rank``; the envelope's rank names the rank it concerns (the
        recipient here), so a relay can deliver it. The I/O thread signs it (session.py: the counter of
        the controller's frames follows the order they are sent in). A rank without a route is skipped.
        ``ident``: to that connection instead of the rank's route (an elastic standby: in no rank table)."""
        if ident is None:
            r = self.ranks.get(rank)
            if r is None or not r.ident:
                return
            ident = r.ident
            if mtype is P.MsgType.ACTION and ident in self._relays:
                body = P.Action(body.name, body.params, [rank])
        self._out.put(((ident,), P.Envelope(mtype, body, rank=rank, sn=sn), None))
        self._waker.wake()

    def _send_many(self, ranks, body: P.Action, sn: int) -> None:
        """(any thread) Broadcast one ACTION to many ranks: one frame (envelope rank -1), signed once, for
        all ranks with a connection of their own, and one frame per relay listing its ranks; a single
        wake-up of the I/O thread. Signing per rank was most of a 10k-rank stop round. The ranks are
        grouped by connection with the rank table's ``conn`` column (one sort, not a loop over records),
        and the params are packed once: a relay's body is the packed params spliced with its rank list
        (a dump's save_info names every saver: packed per relay it stalled the I/O thread for tens of s)."""
        with self._lock:
            t = self.ranks
            idx = np.fromiter(ranks, np.int64)
            idx = idx[(idx >= 0) & (idx < len(t.conn))]
            cid = t.conn[idx]
            keep = t.present[idx] & (cid >= 0)
            idx, cid = idx[keep], cid[keep]
            order = np.argsort(cid, kind="stable")
            idx, cid = idx[order], cid[order]
            starts = np.flatnonzero(np.r_[True, cid[1:] != cid[:-1]]) if len(cid) else np.zeros(0, np.int64)
            groups = [(t.ident_of(int(cid[a])), idx[a:b].tolist())
                      for a, b in zip(starts.tolist(), starts[1:].tolist() + [len(idx)])]
        relay_idents = self._relays
        direct = [ident for ident, _ in groups if ident not in relay_idents]
        if direct:
            self._out.put((direct, P.Envelope(P.MsgType.ACTION, body, rank=-1, sn=sn), None))
        relayed = [(ident, rs) for ident, rs in groups if ident in relay_idents]
        if relayed:
            params = msgpack.packb(body.params, use_bin_type=True)
            for ident, rs in relayed:
                env = P.Envelope(P.MsgType.ACTION, P.Action(body.name, body.params, rs), rank=-1, sn=sn)
                self._out.put(((ident,), env, _action_body(body.name, params, rs)))
        self._waker.wake()

    def _alive_of(self, ranks) -> set:
        """(under the lock) The live ones of ``ranks`` (the action engine's waiting set): one vector lookup."""
        t = self.ranks
        idx = np.fromiter(ranks, np.int64)
        idx = idx[(idx >= 0) & (idx < len(t.present))]
        return set(idx[t.present[idx] & t.col["alive"][idx]].tolist())

    def _io_loop(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._chan.sock, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        period = min(0.1, self.interval / 4)
        next_sweep = next_hang = last_turn = time.monotonic()
        probe, liveness = self.liveness.probe, self.liveness
        while not self._stop.is_set():
            wake_at = probe.next_due() or next_sweep
            events = dict(poller.poll(max(0.0, min(next_sweep, wake_at) - time.monotonic()) * 1000))
            now = time.monotonic()
            if now - last_turn > period + self.interval:
                liveness.stalled(now - last_turn - period)
            self.io_gap_max = max(self.io_gap_max, now - last_turn)
            last_turn = now
            if self._waker.rfd in events:
                self._waker.drain()
            send_raw, budget = self._chan.send_raw, time.monotonic() + _SEND_SLICE_S
            while time.monotonic() < budget:  # a send storm (an action to 12,500 relays) yields to the inbound
                try:
                    idents, env, body = self._out.get_nowait()
                except queue.Empty:
                    break
                frame = self._chan.frame(env, body)
                for ident in idents:
                    send_raw(frame, ident)
            else:
                self._waker.wake()  # more to send: the next turn does not wait in poll
            if self._chan.sock in events:
                budget = time.monotonic() + _RECV_SLICE_S
                while True:  # at most _RECV_SLICE_S of frames per turn: the sweep and the sends run between
                    try:
                        got = self._chan.recv_frame()
                    except zmq.Again:
                        self._drained_at = time.monotonic()
                        break
                    if got is not None:
                        try:
                            env = self._reader.read(got[1])  # a BEATS frame's columns wait in the reader
                        except ProtocolError as exc:
                            self.drops.drop(exc, origin=repr(got[0]))
                        else:
                            self._on_frame(got[0], env)
                    if time.monotonic() >= budget:
                        self._waker.wake()  # more to read: the next turn does not wait in poll
                        break
                self._flush_beats()
                self._flush_replies()
            else:
                self._drained_at = time.monotonic()
            now = time.monotonic()
            if now - last_turn > self.interval:
                # this thread stalled inside the turn (its work takes milliseconds): not counted either, and
                # compensated before the sweep looks at anyone (else the ranks' silence during our own stall
                # declares them dead, and the stall is seen only at the next turn)
                liveness.stalled(now - last_turn)
                last_turn = now
            if probe.watched or probe.next_due() is not None:
                probe.on_events(events, now, poller)
                for rank, pid in probe.due(now):
                    r = self.ranks.get(rank)
                    if self.active and r is not None and r.registered and r.pid == pid:
                        self.declare_dead([rank], "pid", pid=pid)
            if now >= next_sweep:
                next_sweep = now + period
                liveness.sweep(now, check_hang=now >= next_hang)
                if now >= next_hang:
                    next_hang = now + self.interval
        probe.close(poller)
        self._chan.sock.close(0)

    def _on_frame(self, ident: bytes, env: P.Envelope) -> None:
        """One authentic frame from connection ``ident``: admitted only within its session (session.py)."""
        try:
            s = self.sessions.receive(ident, env, self.backups, self._chan.send)
            if s is None:
                return  # a HELLO, answered
            if s.role == "relay" and env.type is P.MsgType.REGISTER and ident not in self._relays:
                self._relays.add(ident)
                _log.info("relay %r registered", ident)
            if s.role != "relay" and env.type in (P.MsgType.BEATS, P.MsgType.BATCH):
                raise SessionError(f"{env.type.name} from a {s.role} session (only a relay may send it)", "refused")
        except SessionError as exc:
            self.drops.drop(exc, origin=repr(ident))
            return
        if s.role == "relay" and env.type is P.MsgType.REGISTER:
            self._chan.send(P.Envelope(P.MsgType.REGISTER_ACK, self.register_ack()), ident)
            return
        self._dispatch(ident, env, relay=s.role == "relay")

    def _dispatch(self, ident: bytes, env: P.Envelope, relay: bool = False) -> None:
        body, now = env.body, time.monotonic()
        if env.type is P.MsgType.BEATS:
            self._on_beats(ident, env, now)
            return
        if self._beats:  # frames of other kinds see the beats read before them
            self._flush_beats()
        if self._replies_held and env.type is not P.MsgType.BATCH:  # and the replies (a BATCH: _on_batch)
            self._flush_replies()
        if relay and env.rank >= 0 and env.type is not P.MsgType.REGISTER:
            r = self.ranks.get(env.rank)
            if r is None or r.ident != ident:  # a relay speaks only for the ranks that registered through it
                self.drops.drop(SessionError(f"{env.type.name} for rank {env.rank}, which is not registered through "
                                             "this relay", "session"), origin=repr(ident))
                return
        if env.rank >= 0 and self.replacements.refuse_stale(env):  # a replaced rank's old process (recover.py)
            return
        if env.type is P.MsgType.HEARTBEAT:
            r = self.ranks.get(env.rank)
            if r is not None and r.registered:
                if now - r.last_seen > 1.5 * self.interval and r.alive:
                    self.liveness.gap(env.rank, now - r.last_seen)
                r.last_seen, r.beat_seen, r.step, r.data_status = now, now, body.step, body.data_status
                if r.alive:
                    self.liveness.touch(env.rank)
                r.in_collective, r.progress_age = body.in_collective, body.progress_age
                r.coll_seq, r.step_p99, r.idle_age = body.coll_seq, body.step_p99, body.idle_age  # hangs.py
                if self.liveness.slow.observe(env.rank, body.step_sums):  # slow.py: a window may close
                    self.liveness.check_slow()
            state = "UNKNOWN" if (r is None or not r.registered or r.ident != ident) and env.rank >= 0 \
                else self.sm.state.value
            if r is not None and r.left:  # a beat sent after its BYE: it must not register again (then die)
                state = "BYE"
            self._ack(ident, env.rank, state)
            if self.incidents.dump_wanted is not None and body.step > 0:  # asked before the first step
                self.incidents.serve_dump_request()
        elif env.type is P.MsgType.REGISTER:
            self._on_register(ident, env.rank, body, now, env.gen)
        elif env.type is P.MsgType.REPORT and env.rank in self.ranks:
            state = ReportState(body.state) if body.state in ReportState._value2member_map_ else ReportState.RS_UNKNOWN
            _logging.event("report_received", from_rank=env.rank, state=state.name, step=body.step)
            with self._lock:
                r = self.ranks[env.rank]
                state = self.incidents.secondary(env.rank, state, body.message)
                r.last_seen, r.step = now, body.step
                if r.alive:
                    self.liveness.touch(env.rank)
                if policy.is_primary(state):
                    r.faulty = True
                if not self.active:  # a passive backup: acted on if it takes over (the rank reports once)
                    self._held_reports.append((env.rank, state, body.message))
            self.incidents.open(env.rank, state, message=body.message)
        elif env.type is P.MsgType.INFO and env.rank in self.ranks:
            self.ranks[env.rank].replica, self.ranks[env.rank].dp_group = body.replica, body.dp_group
        elif env.type is P.MsgType.BYE and env.rank in self.ranks:
            _log.info("rank %d left (%s)", env.rank, body.reason)
            # confirmed, so the rank exits only after we read this (the pid probe must not see a death)
            self._chan.send(P.Envelope(P.MsgType.HEARTBEAT_ACK, P.HeartbeatAck("BYE"), rank=env.rank), ident)
            with self._cond:
                self.ranks[env.rank].alive = False
                self.ranks[env.rank].registered = False
                self.ranks[env.rank].left = True
                self._registered -= 1
                self._cond.notify_all()
                done = self.elastic.standbys and all(
                    (x := self.ranks.get(r)) is not None and x.left for r in self.elastic.job_ranks())
            if done:  # every rank of the world finished its training: a waiting standby is not needed
                self.elastic.tell_standbys(0)
        elif env.type is P.MsgType.REPLY:
            self._reply_heard(env, now)
        elif env.type is P.MsgType.REQUEST and env.rank in self.ranks:
            if env.body.name == "dump":
                self.request_dump(f"rank {env.rank}: {env.body.reason}")
            elif env.body.name == "switch":  # sub-healthy ranks, this one among them (hotswitch.py)
                self.hot_switch.asked(env.rank, env.body.reason)
            elif env.body.name == "gone":  # its launcher stops it because these workers ended (preempt.py)
                self.declare_dead([int(r) for r in env.body.reason.split(",") if r.isdigit()],
                                  f"its process ended; rank {env.rank}'s launcher stops the other workers")
            else:
                _log.warning("rank %d asked for %r, which is no request this controller knows", env.rank,
                             env.body.name[:40])
        elif env.type is P.MsgType.BATCH:
            self._on_batch(ident, body.items, now)
        elif env.type is P.MsgType.REPLIES:  # (a relay sends them in its BATCH: _on_batch)
            self._on_reply_columns(ident, env)
        if self.incidents.order is not None and env.rank >= 0 and env.type in _HEARD:
            self.incidents.carry(env.rank)  # the job's exit order, to a rank it has not reached (incident.py)

    def _on_batch(self, ident: bytes, items: list, now: float) -> None:
        """A relay's BATCH, item by item in order, except that its ranks' answers to an action are recorded in
        columns (REPLIES items; a run of REPLY items is folded into one: protocol.fold_replies) with the turn's
        others (:meth:`_on_reply_columns`), and a run of REGISTER items is answered with one BATCH of
        REGISTER_ACKs (protocol v6; sent before anything else is handled)."""
        try:
            for item in P.fold_replies(items):
                if item.type is P.MsgType.REGISTER:
                    if self._reg_acks is None:
                        self._reg_acks = (ident, [])
                elif self._reg_acks is not None:  # (a stop round's batches are 12,500 REPLIES: no call each)
                    self._send_reg_acks()
                if item.type is P.MsgType.REPLIES:
                    self._on_reply_columns(ident, item)
                    continue
                self._dispatch(ident, item, relay=True)
        finally:
            self._send_reg_acks()

    def _send_reg_acks(self) -> None:
        """The REGISTER_ACKs held for a relay's run of REGISTERs (:meth:`_ack_register`), as one BATCH."""
        held, self._reg_acks = self._reg_acks, None
        if held and held[1]:
            ack = self.register_ack()
            self._chan.send(P.Envelope(P.MsgType.BATCH, P.Batch(
                [P.Envelope(P.MsgType.REGISTER_ACK, ack, rank=rank) for rank in held[1]])), held[0])

    def _on_reply_columns(self, ident: bytes, env: P.Envelope) -> None:
        """A relay's REPLIES item (protocol v7): its ranks' answers to action ``env.sn``, in columns. Kept until
        the end of the I/O thread's read (or the next frame of another kind), then recorded with the turn's other
        REPLIES at once (:meth:`_flush_replies`), as BEATS are."""
        self._replies_held.append((self.ranks.conn_id(ident), env))

    def _flush_replies(self) -> None:
        """Record the REPLIES items read (:meth:`_on_reply_columns`): what :meth:`_dispatch` does for a REPLY,
        over all of them at once and with no envelope per rank -- entries for ranks not registered
        through the relay that sent them are dropped, a replaced rank's old process is refused, the live
        watched ranks were heard, and the action engine records the rest (ActionEngine.on_columns)."""
        held, self._replies_held = self._replies_held, []
        if not held:
            return
        now, table = time.monotonic(), self.ranks
        sizes = [len(env.body.ranks) for _conn, env in held]
        ranks = np.fromiter(itertools.chain.from_iterable(env.body.ranks for _conn, env in held), np.int64,
                            sum(sizes))
        keep = table.through(ranks, np.repeat(np.fromiter((c for c, _env in held), np.int64, len(held)), sizes))
        if not keep.all():
            pos = 0
            for (conn, env), n in zip(held, sizes):
                for i in np.flatnonzero(~keep[pos:pos + n]).tolist():
                    self.drops.drop(SessionError(f"REPLY for rank {env.body.ranks[i]}, which is not registered "
                                                 "through this relay", "session"), origin=repr(table.ident_of(conn)))
                pos += n
        replaced = self.replacements.replaced
        if replaced:  # only the entries of ranks ever replaced are looked at (a dict lookup each, not 100k)
            gens = np.repeat(np.fromiter((env.gen for _c, env in held), np.int64, len(held)), sizes)
            suspects = keep & np.isin(ranks, np.fromiter(replaced, np.int64, len(replaced)))
            for i in np.flatnonzero(suspects).tolist():
                keep[i] = not self.replacements.refuse_stale(P.Envelope(P.MsgType.REPLY, None, int(ranks[i]), 0,
                                                                        int(gens[i])))
        heard = ranks[keep]
        heard = heard[table.present[heard] & table.col["alive"][heard] & table.watched[heard]]
        table.col["last_seen"][heard] = now
        pos = 0
        for (_conn, env), n in zip(held, sizes):
            cols, mine = env.body, keep[pos:pos + n]
            pos += n
            if not mine.all():
                kept = mine.tolist()
                cols = P.Replies(*([x for x, k in zip(col, kept) if k] for col in (cols.ranks, cols.ok, cols.code,
                                                                                       cols.detail)))
            if self.incidents.order is not None:
                for r in cols.ranks:
                    self.incidents.confirmed(r, env.sn)
            if cols.ranks:
                self.actions.on_columns(env.sn, cols)

    def _reply_heard(self, env: P.Envelope, now: float) -> None:
        """A REPLY frame admitted (a rank's own connection): the rank, if live and watched, was heard
        (``last_seen``: any frame proves life; no beat: a reply carries no progress evidence), the exit order
        counts as carried to it if this confirms it, and the action engine records it. (A relay's replies:
        :meth:`_flush_replies`.)"""
        table = self.ranks
        r = table.get(env.rank)
        if r is not None and r.alive and table.watched[r.rank]:
            r.last_seen = now
        if self.incidents.order is not None:
            self.incidents.confirmed(env.rank, env.sn)
        self.actions.on_replies([env])

    def _on_beats(self, ident: bytes, env: P.Envelope, now: float) -> None:
        """A relay's heartbeats for many ranks: kept until the end of the I/O thread's read (or the next
        frame of another kind), then applied with the turn's other BEATS frames (:meth:`_flush_beats`). The
        frame's columns are in the reader (``env.body`` is beats.HELD) or, decoded elsewhere, its body."""
        conn = self.ranks.conn_id(ident)
        if env.body is beats.HELD:
            self._reader.keep(conn, now)
        else:
            self._reader.add(env.body, conn, now, env.gen, beats.pack_of(env.body))
        self._beats.append((ident, env.gen))

    def _flush_beats(self) -> None:
        """Apply the BEATS frames read (the same bookkeeping as HEARTBEAT): their columns (the reader's, one
        array per field for all of them) in one RankTable.beats_at call -- a few slice assignments, nothing per
        rank in Python -- then the acks: one signed frame for the turn, sent to each relay heard that was not acked
        in the last 1.5 intervals (protocol.RELAY_ACK_GAP: every other BEATS of a relay) or whose ack changed since,
        and one of its own to a frame that named ranks not registered through its relay, listing them."""
        frames, self._beats = self._beats, []
        if not frames:
            return
        ranks, steps, status, coll, age, idle, p99, ends, conns, nows, gens, has, packs = self._reader.take()
        table, replaced = self.ranks, self.replacements.replaced  # ranks replaced by a recovery (recover.py)
        counts = np.diff(ends, prepend=0)
        skip = ()
        if replaced:  # a replaced rank's old process (its generation is older than the replacement's): refused
            old = np.fromiter(replaced.keys(), np.int64, len(replaced))
            new_gen = np.fromiter(replaced.values(), np.int64, len(replaced))
            order = np.argsort(old)
            at = np.clip(np.searchsorted(old[order], ranks), 0, len(old) - 1)
            hit = old[order][at] == ranks
            skip = ranks[hit & (new_gen[order][at] > np.repeat(gens, counts))]
        extras = None
        if has.any():
            seqs = np.empty(len(packs), object)
            seqs[:] = packs  # bytes (unpacked only when read: RankTable.coll_seqs) or None: one reference per frame
            pos = (np.arange(len(ranks), dtype=np.int64) - np.repeat(ends - counts, counts)).astype(np.int32)
            extras = (np.repeat(has, counts), np.repeat(seqs, counts), pos, idle, p99)
        # no lock, as for HEARTBEAT: the driver thread reads these columns under it, never writes them
        acc, unknown = table.beats_at(ranks, np.repeat(conns.astype(np.int32), counts), steps, status, coll, age,
                                      np.repeat(nows, counts), skip, extras)
        table.watched[acc[table.col["alive"][acc]]] = True
        if self.liveness.slow.window > 0:  # slow-rank scoring on (slow.py): each rank's step sums, in Python
            for (ident, gen), pack, end, n in zip(frames, packs, ends.tolist(), counts.tolist()):
                sums = self._sums_of(pack, n) if pack is not None else []
                if sums:
                    self._beat_sums(ident, ranks[end - n:end].tolist(), sums, gen)
        if self.incidents.dump_wanted is not None:  # asked before the first step (incident.py)
            self.incidents.serve_dump_request()
        if self.incidents.order is not None:  # the job's exit order, to ranks it has not reached (incident.py)
            for rank in ranks.tolist():
                self.incidents.carry(rank)
        strangers: dict[int, list] = {}  # frame -> the ranks it named that are not registered through it
        if len(unknown):
            for i, pos in zip(np.searchsorted(ends, unknown, side="right").tolist(), unknown.tolist()):
                strangers.setdefault(i, []).append(int(ranks[pos]))
        state = self.sm.state.value
        body, last, gap = self._ack_body_of(state), self._relay_acked, P.RELAY_ACK_GAP * self.interval
        ack, acked, none = None, set(), (-1e18, None)
        for i, ((ident, _gen), now) in enumerate(zip(frames, nows.tolist())):
            if i in strangers:
                self._chan.send(P.Envelope(P.MsgType.HEARTBEAT_ACK, self._heartbeat_ack(state, strangers[i])), ident)
                last[ident] = (now, body)
            elif ident not in acked:  # one ack a turn to a relay that sent two frames in it (the counter is the
                acked.add(ident)  # same: a second copy would be a replay to it)
                at, what = last.get(ident, none)
                if now - at < gap and what is body:  # acked lately with this content: every other interval
                    continue
                last[ident] = (now, body)
                if ack is None:  # the same bytes for every relay, as a broadcast ACTION: one counter, one signature
                    ack = self._chan.frame(P.Envelope(P.MsgType.HEARTBEAT_ACK, None, rank=-1), body)
                self._chan.send_raw(ack, ident)

    def _sums_of(self, pack: bytes, n: int) -> list:
        """The step sums in a BEATS frame's ``packed`` (protocol v5); none when it does not unpack (dropped)."""
        try:
            return P.unpack_extras(pack, n)[1]
        except ProtocolError as exc:
            self.drops.drop(exc, origin="a relay's BEATS.packed")
            return []

    def _beat_sums(self, ident: bytes, ranks: list, sums: list, env_gen: int) -> None:
        """BEATS' step sums (slow.py) for the ranks of this relay, one by one (only while scoring is on)."""
        get, observe = self.ranks.get, self.liveness.slow.observe
        replaced, gen = self.replacements.replaced, env_gen
        closed = False
        for rank, step_sums in zip(ranks, sums):
            r = get(rank)
            if r is not None and r.registered and r.ident == ident and not (replaced and replaced.get(rank, -1) > gen):
                closed = observe(rank, step_sums) or closed
        if closed:  # slow.py: a window closed, as for a rank's own heartbeat
            self.liveness.check_slow()

    def register_ack(self) -> P.RegisterAck:
        """What a REGISTER is answered with: the generation, the beat interval, where to fail over to, and
        whether this is a passive backup (the rank then goes back to its primary once it answers: wire/home.py)."""
        return P.RegisterAck(gen=self.gen, interval=self.interval, backups=list(self.backups), passive=not self.active)

    def _register_ack_body(self) -> bytes:
        """:meth:`register_ack` packed, again only when it changes: 100,000 registrations get the same one."""
        core = self.core  # (the Core's attributes directly: the controller's are properties, per registration)
        version = (core.gen, core.interval, tuple(self.backups), core.active)
        if self._reg_ack_version != version:
            self._reg_ack_body = P.pack_body(P.Envelope(P.MsgType.REGISTER_ACK, self.register_ack()))
            self._reg_ack_version = version
        return self._reg_ack_body

    def _heartbeat_ack(self, state: str, unknown=()) -> P.HeartbeatAck:
        return P.HeartbeatAck(state, list(self.backups), list(unknown), passive=not self.active)

    def _ack(self, ident: bytes, rank: int, state: str) -> None:
        """Send the HEARTBEAT_ACK for ``rank``. The hot path of a large job is one beat and one ack per rank
        per interval; each ack has its own counter (session.py), but its body only changes with the state
        or the backup list (or a backup's takeover), so it is packed once per change. A passive backup
        says so (``passive``): the rank goes back to its primary once that answers (wire/home.py)."""
        self._chan.send(P.Envelope(P.MsgType.HEARTBEAT_ACK, None, rank=rank), ident, body=self._ack_body_of(state))

    def _ack_body_of(self, state: str) -> bytes:
        """The HEARTBEAT_ACK body for ``state``, packed again only when it or the backups change."""
        version = (state, tuple(self.backups), self.active)
        if self._ack_version != version:
            self._ack_body = P.pack_body(P.Envelope(P.MsgType.HEARTBEAT_ACK, self._heartbeat_ack(state)))
            self._ack_version = version
        return self._ack_body

    def _on_register(self, ident: bytes, rank: int, body: P.Register, now: float, gen: int = 0) -> None:
        core, ws = self.core, self.core.world_size  # read once: the controller's shared attributes are properties
        if body.role == "backup":  # its session was accepted: backups are allowed (session.py)
            if body.addr and body.addr != self.address and body.addr not in self.backups and len(self.backups) < 2:
                self.backups.append(body.addr)
                _log.info("backup controller %s announced", body.addr)
        elif rank in self.elastic.removed and body.world_size == ws:
            self.elastic.on_standby(ident, rank, body, now)  # a standby offers a removed rank back
            return
        elif not 0 <= rank < ws or body.world_size != ws:
            _log.error("refused registration of rank %d with world size %d (job: %d)", rank, body.world_size, ws)
            return
        else:
            with self._lock:
                old = self.ranks.get(rank)
                if old is not None and old.ident and old.ident != ident and old.ident not in self._relays:
                    self.sessions.close(old.ident)  # the rank's previous connection speaks for it no more
                r = _Rank(rank, ident, body.pid, body.host, now, body.step, body.data_status,
                          replica=body.replica, dp_group=body.dp_group, gen=gen)
                r.faulty = old is not None and old.faulty
                r.features = dict(body.features)
                self.ranks[rank] = r
                self.liveness.touch(rank)
                if old is None or not old.registered:
                    core.registered += 1  # a counter, not a scan: 100k registrations stay O(n)
                    if core.registered % 8192 == 0:  # the table so far, out of the collector's walks too
                        self._freeze_heap()
            if self._poller is not None:
                self.liveness.probe.watch(rank, body.pid, body.pidns, self._poller)
        self._ack_register(ident, rank)
        if core.active and core.registered == ws and self.sm.state is State.INIT:
            self._send_reg_acks()  # the job starts: the last ranks' acks go first
            self.sm.fire(Result.ALL_REGISTERED, ranks=core.registered)
            self._freeze_heap()
            self.incidents.serve_dump_request()  # a preemption before every rank registered
            _log.info("every rank registered; the job's strategies: %s (asked for by the controller: %s, by "
                      "the ranks' tft_init_processor flags: %s)", sorted(self.brain.enabled(self.job_strategies())),
                      sorted(self.enabled), sorted(self._ranks_ask()))

    # ------------------------------------------------------------------ the launcher's replacer (recover.py)
    def attach_replacer(self, replacer, timeout: float | None = None) -> None:
        """(launcher agent) Enable recover-in-place / recover / hot switch (recover.Replacements.attach)."""
        self.replacements.attach(replacer, timeout)

    def replacement_died(self, rank: int, why: str) -> None:
        """(launcher, any thread) A replacement process exited (recover.Replacements.died)."""
        self.replacements.died(rank, why)

    # ------------------------------------------------------------------ liveness (watch.py)
    def _freeze_heap(self) -> None:
        """Every rank registered (and every 8,192 registrations before): in a process of its own (``rank``
        -1: hosted by a mindio-run agent, not by a training rank's process, whose heap is the user's), move
        what exists now -- the rank table, one record per rank -- out of the cyclic garbage collector's reach
        (``gc.freeze``): it lives as long as the job, and each collection walked all of it. At 100,000 ranks
        that was a third of the controller's CPU per heartbeat round (``bench/beats_cpu.py --n 100000``
        against the commit before: 400 -> 265 ms per round) and a quarter of its registrations' (100k by hand,
        tests/ttp/_harness.threadless_controller: 1.83 -> 1.37 CPU-s)."""
        if self.rank < 0:  # (no gc.get_freeze_count() here: it walks every frozen object)
            gc.freeze()
            self._frozen = True
            policy.FREEZE_AFTER_NO_GC = True  # a decision's views too (policy.no_gc)

    def declare_dead(self, ranks, cause: str, log: bool = True, **detail) -> list[int]:
        """(any thread) Ranks ``ranks`` are dead because of ``cause`` (watch.Liveness.declare_dead)."""
        return self.liveness.declare_dead(ranks, cause, log=log, **detail)

    def heard(self, ranks, within: float) -> list[int]:
        """(any thread) Those of ``ranks`` heard from in the last ``within`` s (watch.Liveness.heard)."""
        return self.liveness.heard(ranks, within)

    # ------------------------------------------------------------------ the cluster brain (incident.py, pause.py)
    @property
    def brain(self) -> Brain:
        """The built-in cluster brain (brain.py): table from MINDIO_FAULT_TABLE or the default; assign a
        :class:`mindio.ttp.controller.brain.Brain` to use another table."""
        return self.core.brain

    @brain.setter
    def brain(self, value: Brain) -> None:
        self.core.brain = value

    def notify_dump(self) -> int:
        """Cluster brain: a dump at the current step, then the exit (incident.IncidentFlow.notify_dump)."""
        return self.incidents.notify_dump()

    def request_dump(self, why: str) -> None:
        """(I/O thread, or node 0's agent) A preemption's last words (incident.IncidentFlow.request_dump)."""
        self.incidents.request_dump(why)

    def notify_stop_train(self, fault_ranks: dict, wait: float | None = None) -> int:
        """Cluster brain: an incident for ``fault_ranks`` (incident.IncidentFlow.notify_stop_train)."""
        return self.incidents.notify_stop_train(fault_ranks, wait)

    def notify_pause(self, fault_ranks: dict, timeout: float | None = None) -> int:
        """Cluster brain: pause every rank at one step (pause.PauseFlow.notify_pause)."""
        return self.pause.notify_pause(fault_ranks, timeout)

    def change_strategy(self, strategy: str) -> int:
        """The cluster brain's choice (incident.IncidentFlow.change_strategy)."""
        return self.incidents.change_strategy(strategy)

    def notify_prepare_action(self, action: str, ranks: list) -> int:
        """Cluster brain: a hot switch of ``ranks`` or "stop switch" (hotswitch.HotSwitch)."""
        return self.hot_switch.notify_prepare_action(action, ranks)

    def implemented_strategies(self) -> tuple:
        """Strategies (policy names) this controller can run, in fallback order: those policy.py knows
        that are in its ``STRATEGIES`` table (strategy.py: each ``run`` returns an Outcome)."""
        return self.core.implemented_strategies()

    def job_strategies(self) -> set:
        """The strategies the job asked for, in any of the reference ways: the controller's list
        (HIGH_AVAILABILITY, or dump + tft_init_controller's enable_arf / enable_zit, or the launcher's
        --high-availability) and what its processors registered with (policy.strategies_of:
        enable_uce -> retry, enable_arf -> recover-in-place / recover, enable_zit -> elastic-training)."""
        return self.core.job_strategies()

    def uce_refused(self) -> list:
        """Live ranks whose processor registered with ``enable_uce=False``: the job's ranks did not
        allow step retry (a processor that sent no flags allows it, as the reference default does)."""
        return self.core.uce_refused()

    def _ranks_ask(self) -> set:
        return self.core.ranks_ask()

    def _ack_register(self, ident: bytes, rank: int) -> None:
        """(I/O thread) Answer a REGISTER of ``rank`` on connection ``ident`` (an elastic standby's too); held
        while a relay's run of REGISTERs is read, then sent with the others in one BATCH (:meth:`_on_batch`)."""
        held = self._reg_acks
        if held is not None and held[0] == ident:
            held[1].append(rank)
            return
        self._chan.send(P.Envelope(P.MsgType.REGISTER_ACK, None, rank=rank), ident, body=self._register_ack_body())

    def _take_over(self, now: float, n: int) -> None:
        _log.warning("primary controller lost; backup %s takes over with %d/%d ranks", self.address, n, self.world_size)
        _logging.event("backup_takeover", address=self.address, ranks=n)
        with self._lock:
            for rank in range(self.world_size):  # ranks that never come are declared dead by the sweep
                rec = self.ranks.get(rank)
                if rec is None:
                    self.ranks[rank] = _Rank(rank, b"", last_seen=now, registered=False)  # no route yet
                    self.liveness.seen[rank] = None
                elif not rec.registered and not rec.left and rec.alive:
                    rec.last_seen = now  # was here once, went back to the primary (watch.Liveness._forget_gone)
                    self.liveness.seen[rank] = None
            for rank in [r for r, rec in self.ranks.items() if not rec.registered and not rec.replica]:
                # its shard layout as its DP group's registered members know it (the dump plan needs it)
                self.ranks[rank].replica, self.ranks[rank].dp_group = infer_layout(rank, self.ranks.values())
            self.active = True
            held, self._held_reports = self._held_reports, []
            dead = [r.rank for r in self.ranks.values() if r.registered and not r.alive]
        self.sm.fire(Result.ALL_REGISTERED, ranks=n, takeover=True)
        self._freeze_heap()
        # a rank that failed over and reported (or died) in the moment before the takeover must not be
        # forgotten: its report reached this backup while it was passive, and it will not report again
        for rank, state, message in held:
            _log.warning("acting on rank %d's %s report received before the takeover", rank, state.name)
            self.incidents.open(rank, state, message=message)
        for rank in dead:
            self.incidents.open(rank, None)


for _name, _attr in SHARED.items():  # the job's state and configuration the parts share: the Core's
    setattr(Controller, _name, _shared(_attr))
