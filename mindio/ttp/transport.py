"""ZeroMQ plumbing of the control plane: sockets, the job secret, CURVE, and the processor's link.

* The controller binds a ROUTER; each processor connects a DEALER whose identity is its rank.
* :class:`Channel` signs/verifies every frame (protocol.encode/decode) and drops bad frames, counting
  them; a frame whose envelope rank differs from the sender's identity is dropped as forged.
* :class:`Link` is the processor's side: one I/O thread that registers, beats every ``interval``,
  hands controller messages to a callback, and fails over -- in order -- to the backup controllers the
  controller advertised when no frame came from the current one for ``misses * interval`` seconds.
  Other threads send through :meth:`Link.send` (a queue plus a wake-up pipe: zmq sockets are not
  thread-safe, so only the I/O thread touches the socket).
* The per-job secret (:func:`job_secret`) comes from MINDIO_SECRET, or from the job's torch.distributed
  store (published by the controller's rank under ``mindio/ttp/secret``), or is generated for a
  controller and exported to MINDIO_SECRET for child processes. Users configure nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from datetime import timedelta
from typing import Callable

import zmq

from .. import _knobs, _logging
from ..errors import ConfigError, NoController, ProtocolError
from . import protocol as P
from . import shutdown

__all__ = ["job_secret", "published_secret", "curve_options", "context", "close_context", "Channel", "Waker", "Link", "RELAY_PREFIX"]

_log = logging.getLogger(__name__)
# A connection whose identity starts with this prefix relays for several ranks (a node agent, or the
# scale benchmark's multiplexer): its envelopes may carry any rank, and replies are routed back to it.
RELAY_PREFIX = b"agent-"
_STORE_KEY = "mindio/ttp/secret"
_NB = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_ctx: zmq.Context | None = None
_ctx_lock = threading.Lock()


def context() -> zmq.Context:
    """mindio's own zmq context (never the application's ``Context.instance()``), so that the exit
    teardown (shutdown.py) can terminate it without waiting on sockets the application left open."""
    global _ctx
    with _ctx_lock:
        if _ctx is None or _ctx.closed:
            _ctx = zmq.Context()
        return _ctx


def close_context() -> None:
    """Close what is left of mindio's sockets and terminate its zmq context (its I/O threads end). Call
    only once no mindio thread uses a socket any more (shutdown.py joins them first)."""
    global _ctx
    with _ctx_lock:
        ctx, _ctx = _ctx, None
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)


def _default_store():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # torch absent or a private API moved: fall back to the environment
        return None
    return None


def published_secret(store, controller: str) -> str:
    """The secret the controller's rank published in ``store``, waiting for it at most
    MINDIO_CONTROLLER_WAIT s (not the store's own timeout: the process group's, 30 min by default)."""
    wait = _knobs.get("MINDIO_CONTROLLER_WAIT")
    try:
        store.wait([_STORE_KEY], timedelta(seconds=wait))
    except RuntimeError as exc:  # DistStoreError: the wait timed out (or the store went away)
        raise NoController(
            f"no controller for {controller or 'this processor'}: the job secret it publishes in the job's "
            f"torch.distributed store (key {_STORE_KEY!r}) did not appear within {wait:.0f} s "
            f"(MINDIO_CONTROLLER_WAIT; store: {exc}). Start one -- tft_init_controller + tft_start_controller "
            "on its rank, or launch with mindio-run -- at that address, or give every rank the same "
            "MINDIO_SECRET") from None
    return store.get(_STORE_KEY).decode()


def job_secret(create: bool, controller: str = "") -> bytes:
    """The 32-byte key that signs control frames (see module docstring for where it comes from).
    ``controller``: the address a processor will connect to, named when no controller publishes one."""
    text = _knobs.get("MINDIO_SECRET")
    store = _default_store()
    if not text and store is not None:
        if create:
            text = secrets.token_hex(32)
            store.set(_STORE_KEY, text)
        else:
            text = published_secret(store, controller)
    if not text:
        if not create:
            raise ConfigError("no job secret: set MINDIO_SECRET (same value on every rank) or call "
                              "torch.distributed.init_process_group before tft_init_processor")
        text = secrets.token_hex(32)
    os.environ["MINDIO_SECRET"] = text  # children (and later calls in this process) use the same secret
    return hashlib.sha256(text.encode()).digest()


_CURVE_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


def _parse_tls_info(tls_info) -> dict:
    """tls_info as a dict: a dict, JSON text, or the reference's ``"field: value; field: value"`` text
    (optionally wrapped in parentheses). A value may be a z85 key (40 characters) or a file holding one."""
    info = tls_info
    if isinstance(info, str):
        text = info.strip()
        if text.startswith("(") and text.endswith(")"):
            # one pair of brackets around the reference layout; not str.strip("()"): "(" and ")" are z85
            # characters, so a key may begin or end with them
            text = text[1:-1].strip()
        if not text:
            return {}
        if text.startswith("{"):
            try:
                info = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"tls_info is not valid JSON ({exc})") from None
        else:
            info = {}
            for part in filter(None, (p.strip() for p in text.split(";"))):
                name, sep, value = part.partition(":")
                if not sep:
                    raise ConfigError(f"tls_info field {part!r} is not 'name: value'")
                info[name.strip()] = value.strip()
    if not isinstance(info, dict):
        raise ConfigError(f"tls_info must be a dict or text, got {type(info).__name__}")
    unknown = set(info) - set(_CURVE_FIELDS)
    if unknown:
        raise ConfigError(f"tls_info fields {sorted(unknown)} are not supported: mindio encrypts with ZeroMQ "
                          f"CURVE, configured by z85 keys {list(_CURVE_FIELDS)} (make them with "
                          "zmq.curve_keypair()), not X.509 certificates")
    out = {}
    for name, value in info.items():
        value = value.decode() if isinstance(value, bytes) else str(value)
        if len(value) != 40 and os.path.isfile(value):
            with open(value) as f:
                value = f.read().strip()
        if len(value) != 40:
            raise ConfigError(f"tls_info {name} must be a 40-character z85 CURVE key (or a file holding one)")
        out[name] = value.encode()
    return out


_warned_unencrypted = False


def _warn_unencrypted() -> None:
    """Once per process: enable_tls=True (the reference default) without keys means no encryption."""
    global _warned_unencrypted
    if not _warned_unencrypted:
        _warned_unencrypted = True
        _logging.setup()  # tft_init_processor reads its TLS options before it configures logging
        _log.warning("enable_tls=True but tls_info holds no CURVE keys: control traffic is signed with the job "
                     "secret but NOT encrypted. To encrypt it pass tls_info with server_public (processors) and "
                     "server_secret (controller), made with zmq.curve_keypair() (docs/ttp.md, Encryption); "
                     "enable_tls=False says you mean it and silences this warning")


def curve_options(enable_tls: bool, tls_info, server: bool) -> dict:
    """ZeroMQ CURVE socket options (encryption + server authentication) from ``tls_info`` (see
    :func:`_parse_tls_info`; fields ``server_public``, ``server_secret``, optionally ``client_public`` /
    ``client_secret``). The server side needs server_secret; a client needs server_public, and uses its
    own client keypair when given, else a fresh one. Empty when TLS is off or no keys are supplied
    (frames are then signed, not encrypted). A client with the wrong server_public never completes the
    handshake, so it cannot talk to the controller."""
    if not enable_tls:
        return {}
    info = _parse_tls_info(tls_info)
    if not info:
        _warn_unencrypted()
        return {}
    if not zmq.has("curve"):
        raise ConfigError("enable_tls with CURVE keys, but this libzmq was built without CURVE support")
    need = ("server_secret",) if server else ("server_public",)
    missing = [k for k in need if k not in info]
    if missing or ("client_public" in info) != ("client_secret" in info):
        raise ConfigError(f"tls_info lacks CURVE key(s) {missing or ['client_public/client_secret pair']}; "
                          "generate keys with zmq.curve_keypair()")
    if server:
        return {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: info["server_secret"]}
    pub, sec = info.get("client_public"), info.get("client_secret")
    if pub is None:
        pub, sec = zmq.curve_keypair()
    return {zmq.CURVE_SERVERKEY: info["server_public"], zmq.CURVE_PUBLICKEY: pub, zmq.CURVE_SECRETKEY: sec}


class Waker:
    """A pipe another thread writes to so that a zmq poll returns at once."""

    def __init__(self) -> None:
        self.rfd, self._wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self._wfd, False)

    def wake(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):  # pipe full (a wake-up is pending) or already closed
            pass

    def drain(self) -> None:
        try:
            while os.read(self.rfd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self.rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.rfd = self._wfd = -1


class Channel:
    """A socket plus the key: ``send`` signs, ``recv`` verifies and drops (counting) bad frames."""

    def __init__(self, sock: zmq.Socket, key: bytes, drops: P.DropCounter | None = None):
        self.sock, self.key = sock, key
        self.drops = drops or P.DropCounter()

    def send(self, env: P.Envelope, ident: bytes | None = None) -> None:
        frame = P.encode(env, self.key)
        if ident is None:
            try:
                self.sock.send(frame, _NB)
            except zmq.Again:
                _log.warning("send queue full, dropped %s", env.type.name)
        else:
            self.send_raw(frame, ident)

    def send_raw(self, frame: bytes, ident: bytes) -> None:
        """Send an already signed frame to ``ident`` (ROUTER side; see Controller._ack)."""
        try:
            self.sock.send(ident, _MORE)  # plain int flags: pyzmq's enum arithmetic costs per message
            self.sock.send(frame, _NB)
        except zmq.Again:
            _log.warning("send queue full, dropped a frame to %r", ident)

    def recv(self):
        """(identity or None, Envelope) for the next good frame, or None if it was dropped."""
        parts = self.sock.recv_multipart(zmq.NOBLOCK)
        ident = parts[0] if len(parts) == 2 else None
        try:
            if len(parts) not in (1, 2):
                raise ProtocolError(f"{len(parts)}-part message")
            env = P.decode(parts[-1], self.key)
            if ident is not None and not ident.startswith(RELAY_PREFIX):
                if env.rank >= 0 and ident != str(env.rank).encode():
                    raise ProtocolError(f"envelope rank {env.rank} does not match socket identity {ident!r}")
                if env.type is P.MsgType.BEATS or env.type is P.MsgType.BATCH:
                    raise ProtocolError(f"{env.type.name} from {ident!r}, which is not a relay "
                                        f"(identity {RELAY_PREFIX.decode()}*)")
        except ProtocolError as exc:
            self.drops.drop(exc, origin=repr(ident))
            return None
        return ident, env


class Link(threading.Thread):
    """The processor's connection to the active controller (see module docstring)."""

    def __init__(self, rank: int, key: bytes, addrs: list[str], hello: Callable[[], P.Register],
                 beat: Callable[[], P.Heartbeat], on_message: Callable[[P.Envelope], None],
                 curve: dict | None = None, interval: float | None = None, misses: int | None = None,
                 on_registered: Callable[[], None] | None = None, follow_backups: bool = True):
        super().__init__(name=f"mindio-link-{rank}", daemon=True)
        self.rank, self.key, self.addrs = rank, key, list(addrs)
        self.hello, self.beat, self.on_message, self.curve = hello, beat, on_message, curve or {}
        self.on_registered = on_registered
        self.follow_backups = follow_backups  # False for a backup controller's own link to the primary
        self.interval = interval or _knobs.get("MINDIO_HEARTBEAT_INTERVAL")
        self.misses = misses or _knobs.get("MINDIO_HEARTBEAT_MISSES")
        self.gen = 0
        self.registered = threading.Event()
        self.failovers = 0
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._halt = threading.Event()
        self._ctx = context()
        self._target = 0
        self.drops = P.DropCounter()

    # -- any thread --
    def send(self, env: P.Envelope, wait: float = 0.0) -> bool:
        """Queue ``env`` for the I/O thread. With ``wait`` > 0, block (GIL released) up to that long
        until the I/O thread has handed it to zmq: a caller about to hold the GIL for a while (a
        rank's teardown runs a full garbage collection) would otherwise keep its own report queued
        behind it. Returns whether it was handed over (always True without ``wait``)."""
        done = threading.Event() if wait > 0 else None
        self._out.put((env, done))
        self._waker.wake()
        return done is None or done.wait(wait)

    def start(self) -> None:
        shutdown.track(self)  # stopped and joined at process exit if still running
        super().start()

    def stop(self) -> None:
        self._halt.set()
        self._waker.wake()

    def close(self, timeout: float) -> bool:
        """(exit teardown) Stop and join the I/O thread, at most ``timeout`` s; whether it ended."""
        if self.is_alive():
            self.stop()
            self.join(timeout)
        return not self.is_alive()

    @property
    def address(self) -> str:
        return self.addrs[self._target]

    # -- the I/O thread --
    def _flush(self, chan: Channel) -> bool:
        """Send everything queued by :meth:`send` (releasing its waiters); whether a BYE was among it."""
        bye = False
        while True:
            try:
                env, done = self._out.get_nowait()
            except queue.Empty:
                return bye
            chan.send(P.Envelope(env.type, env.body, rank=self.rank, sn=env.sn, gen=self.gen))
            if done is not None:
                done.set()
            bye = bye or env.type is P.MsgType.BYE

    def _connect(self) -> Channel:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, str(self.rank).encode())
        sock.setsockopt(zmq.LINGER, 0)
        for opt, val in self.curve.items():
            sock.setsockopt(opt, val)
        sock.connect(self.address)
        chan = Channel(sock, self.key, self.drops)
        chan.send(P.Envelope(P.MsgType.REGISTER, self.hello(), rank=self.rank, gen=self.gen))
        return chan

    def run(self) -> None:
        chan = self._connect()
        poller = zmq.Poller()
        poller.register(chan.sock, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        last_rx = next_beat = last_beat = last_turn = time.monotonic()
        try:
            while not self._halt.is_set():
                wait = max(0.0, next_beat - time.monotonic())
                events = dict(poller.poll(wait * 1000))
                now = time.monotonic()
                if now - last_turn > wait + self.interval:
                    # this thread did not run (its process stopped or starved): the controller's silence
                    # in that time was not observed; it gets its full window from now on
                    _log.warning("link I/O thread did not run for %.1f s (process stalled?)", now - last_turn - wait)
                    last_rx += now - last_turn - wait
                last_turn = now
                if self._waker.rfd in events:
                    self._waker.drain()
                self._flush(chan)
                if chan.sock in events:
                    while True:
                        try:
                            got = chan.recv()
                        except zmq.Again:
                            break
                        if got is not None:
                            last_rx = time.monotonic()
                            self._handle(chan, got[1])
                now = time.monotonic()
                next_beat = min(next_beat, last_beat + self.interval)  # the controller may set a shorter interval
                if now >= next_beat:
                    chan.send(P.Envelope(P.MsgType.HEARTBEAT, self.beat(), rank=self.rank, gen=self.gen))
                    last_beat, next_beat = now, now + self.interval
                if now - last_rx > self.misses * self.interval + self.interval / 2:
                    poller.unregister(chan.sock)
                    chan.sock.close(0)
                    self._target = (self._target + 1) % len(self.addrs)
                    self.failovers += 1
                    self.registered.clear()
                    _log.warning("controller silent for %.1f s; connecting to %s", now - last_rx, self.address)
                    chan = self._connect()
                    poller.register(chan.sock, zmq.POLLIN)
                    last_rx = now
        finally:
            if self._flush(chan):  # what other threads queued (a BYE, the reply to "exit") before closing
                self._await_bye_ack(chan)
            chan.sock.close(500)
            self._waker.close()

    def _await_bye_ack(self, chan: Channel, timeout: float = 1.0) -> None:
        """Wait (bounded) until the controller confirms our BYE, so that it has read the BYE before this
        process exits: a controller watching our pid (pidprobe.py) must never take a normal exit for a
        death. Without an answer we leave anyway."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0 and chan.sock.poll(left * 1000):
            try:
                got = chan.recv()
            except zmq.Again:
                continue
            if got is not None and got[1].type is P.MsgType.HEARTBEAT_ACK and got[1].body.state == "BYE":
                return
        _log.info("no confirmation of BYE from %s within %.1f s", self.address, timeout)

    def _adopt_backups(self, backups: list) -> None:
        if not self.follow_backups:
            return
        current = self.address
        addrs = [current] + [a for a in backups if a != current]
        if addrs != self.addrs:
            _log.info("controller %s; fail-over order %s", current, addrs[1:])
        self.addrs, self._target = addrs, 0

    def _handle(self, chan: Channel, env: P.Envelope) -> None:
        if env.type is P.MsgType.REGISTER_ACK:
            self.gen = env.body.gen
            self.interval = env.body.interval
            self._adopt_backups(env.body.backups)
            self.registered.set()
            if self.on_registered is not None:
                self.on_registered()
        elif env.type is P.MsgType.HEARTBEAT_ACK:
            self._adopt_backups(env.body.backups)
            if env.body.state == "UNKNOWN":  # the controller does not know us (it restarted): hello again
                chan.send(P.Envelope(P.MsgType.REGISTER, self.hello(), rank=self.rank, gen=self.gen))
        else:
            self.on_message(env)
