"""A training process's side of the checkpoint store: daemon connection, pool mapping, leases.

One ``Client`` per process (re-created after fork). ``connect`` reaches the daemon of the runtime
directory, starting it if absent (``mindio-acp-server --detach``: double fork + setsid, so it
outlives the trainer; its lock file makes concurrent starts safe), maps the pool once and faults the
mapping in, so that a save is a memcpy into warm pages. The runtime directory must be private
(mindio._secure), the daemon must run as our uid (SO_PEERCRED), and the pool comes as a file
descriptor over the socket, so no other user can stand in for either.

Accelerator tensors move between the device and this mapping directly (mindio.acp._device: the
mapping is registered as page-locked memory once, at connect when CUDA/NPU is already in use).

``save_image`` = alloc -> copy -> commit. ``open_region`` returns a copy-on-write view of a committed
region (from the pre-faulted whole-pool view of mindio.acp._loadview, else a fresh private mapping)
and holds a lease on it until the view is garbage collected, so the daemon cannot reuse those bytes
while tensors view them. Every request has a deadline; a daemon that
stops answering raises ServerUnavailable and the caller falls back to storage.
"""
from __future__ import annotations

import functools
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref

from .. import _knobs, _native, _secure
from ..errors import ServerUnavailable
from . import _config, _poolfile, _wire
from ._device import DevicePool
from ._loadview import LoadView

__all__ = ["Client", "PoolFull"]

log = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23
_MADV_POPULATE_READ = 22
_START_TIMEOUT_S = 60.0


class PoolFull(Exception):
    """The daemon has no room (or is unserviceable): the caller should write storage directly."""


_CHUNK = 2 << 20  # a client puts its mapping's page tables in place in chunks of this size


def _populate(pool: mmap.mmap, chunks: bytearray, halt: threading.Event, done: threading.Event) -> None:
    """(its own thread, at the lowest CPU priority) :func:`_fault_in` every chunk of ``pool`` not yet done, one
    small chunk at a time (each madvise holds the process's mmap lock: the load view's mappings wait behind
    it); ``done`` is set when it ended."""
    _poolfile.lower_priority()
    try:
        for i in range(len(chunks)):
            if halt.is_set():
                return
            if not chunks[i]:
                _fault_in(pool, chunks, i * _CHUNK, _CHUNK)
    except (BufferError, TypeError, ValueError):  # the mapping was closed meanwhile
        return
    finally:
        done.set()


def _fault_in(pool: mmap.mmap, chunks: bytearray, offset: int, size: int) -> None:
    """MADV_POPULATE_WRITE over the chunks of ``pool`` that [offset, offset + size) touches and that this
    process has not done yet, through ctypes (the GIL released); where the kernel lacks it, read-touch their
    pages (the native core, no GIL). Marks them done in ``chunks``. The copy into them then never faults."""
    first, last = offset // _CHUNK, min(len(chunks), -(-(offset + size) // _CHUNK))
    todo = [i for i in range(first, last) if not chunks[i]]
    if not todo:
        return
    addr, anchor = _poolfile.address(pool)  # pins the mapping while its address is used
    try:
        for i in todo:
            length = min(_CHUNK, len(pool) - i * _CHUNK)
            try:
                _poolfile.madvise(addr + i * _CHUNK, length, _MADV_POPULATE_WRITE)
            except OSError:  # kernel < 5.14: no MADV_POPULATE_WRITE
                with memoryview(pool) as whole, whole[i * _CHUNK: i * _CHUNK + length] as part:
                    _native.touch_pages(part, write=False)
            chunks[i] = 1
    finally:
        del anchor


class Client:
    def __init__(self, cfg: _config.ServerConfig, run_dir: str, server_info: dict | None):
        self.cfg, self.dir, self.server_info = cfg, run_dir, server_info or {}
        self.pid = os.getpid()
        self._lock = threading.RLock()
        self._sock = None
        self._releases: list[int] = []
        self.pool = None
        self._pool_fd: int | None = None
        self.loadview: LoadView | None = None
        self.device: DevicePool | None = None
        self.hello: dict = {}
        self._chunks = bytearray()  # which chunks of the pool's mapping have their page tables (_fault_in)
        self._halt = threading.Event()
        self.populated = threading.Event()  # every chunk's page tables are in place (_populate)

    # ---- connection -----------------------------------------------------------------------------
    @property
    def sock_path(self) -> str:
        return os.path.join(self.dir, "acp.sock")

    def _dial(self, timeout: float = 10.0) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(self.sock_path)
            pid, uid = _secure.peer_uid(s)
        except OSError:
            s.close()
            raise
        if uid != os.geteuid():
            s.close()
            raise ServerUnavailable(f"{self.sock_path} is served by pid {pid} of uid {uid}, not by your uid "
                                    f"{os.geteuid()}: refusing to talk to it")
        return s

    def connect(self) -> None:
        """Reach (or start) the daemon and map its pool; raises ServerUnavailable on failure.

        A daemon that is exiting at this very moment (idle exit, shutdown) may accept and then drop
        the connection: that is retried a few times with a fresh daemon. Raises InsecurePath when the
        runtime directory is not private to us.
        """
        self.dir = _secure.private_dir(self.dir)
        for attempt in range(5):
            try:
                try:
                    self._sock = self._dial()
                except OSError:
                    self._start_daemon()
                self.hello = self.request({"op": "hello", "fd": True, "pool_bytes": self.cfg.pool_bytes})
                if not self.hello.get("fd"):
                    raise ServerUnavailable(f"mindio-acp-server pid {self.hello.get('pid')} in {self.dir} predates "
                                            "the pool hand-over by descriptor: stop it (mindio.acp.shutdown_server() "
                                            "from an older mindio, or kill that pid) or wait for its idle exit")
                self._pool_fd = _wire.recv_fd(self._sock)
                break
            except ServerUnavailable as exc:
                if attempt == 4 or "cannot start" in str(exc):
                    raise
                time.sleep(0.2 * (attempt + 1))
        theirs = self.hello["config"]
        if self.hello["pool_bytes"] < self.cfg.pool_bytes:     # a daemon grows when asked: this one could not
            log.warning("mindio-acp-server in %s keeps a %d MiB pool, less than the %d MiB asked for (%s); "
                        "saves that do not fit it write storage directly", self.dir, self.hello["pool_bytes"] >> 20,
                        self.cfg.pool_bytes >> 20, self.hello.get("grow_error") or
                        "that daemon predates pool growth: stop it or wait for its idle exit")
        if theirs["block_bytes"] != self.cfg.block_bytes:
            log.info("mindio-acp-server in %s allocates in blocks of %d MiB; this process's %d MiB is not applied",
                     self.dir, theirs["block_bytes"] >> 20, self.cfg.block_bytes >> 20)
        self._map_pool(self.hello["pool"], self.hello["pool_bytes"], self.hello.get("regions", []))

    def _start_daemon(self) -> None:
        """Launch a daemon and connect to it. A launch that finds another daemon holding the
        directory waits up to a second for its socket (it may be starting), else is repeated (that
        one is exiting: its socket is already gone) until it has left; all within _START_TIMEOUT_S."""
        env = dict(os.environ, MINDIO_ACP_DIR=self.dir)
        cmd = [sys.executable, "-m", "mindio.acp.server", "--dir", self.dir,
               "--config", json.dumps(self.server_info), "--detach"]
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                rc = subprocess.run(cmd, env=env, timeout=_START_TIMEOUT_S, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            except (subprocess.SubprocessError, OSError) as exc:
                raise ServerUnavailable(f"cannot start mindio-acp-server in {self.dir}: {exc}") from exc
            launched = time.monotonic()
            if rc.returncode not in (0, 3):
                raise ServerUnavailable(f"cannot start mindio-acp-server in {self.dir}: "
                                        f"{rc.stderr.decode(errors='replace').strip()}")
            while True:
                try:
                    self._sock = self._dial()
                    log.info("started mindio-acp-server (runtime dir %s)", self.dir)
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise ServerUnavailable(
                            f"mindio-acp-server did not come up in {self.dir} within {_START_TIMEOUT_S:.0f} s; "
                            f"see {os.path.join(self.dir, 'server.log')}") from None
                    if rc.returncode == 3 and time.monotonic() - launched > 1.0:
                        break                   # the holder is leaving: launch again once it is gone
                    time.sleep(0.05)
            time.sleep(0.1)

    def _map_pool(self, path: str, size: int, regions: list) -> None:
        self.pool = mmap.mmap(self._pool_fd, size, flags=mmap.MAP_SHARED)   # the daemon's file (fd)
        # page tables in place so that saves do not fault: by a background thread at nice 19 in 2 MiB chunks
        # (in here for the whole pool, each of four ranks took 1.1 s of a relaunch at 1g, a 2.3 GiB pool; in
        # 64 MiB chunks the relaunch's load, through the load view, waited behind them: 1.64 -> 2.75 s), and by
        # a save for the chunks it writes that the background has not done yet (save_image)
        self._halt.set()  # a mapping this one replaces (the pool grew) needs its populate no more
        self._halt, self._chunks = threading.Event(), bytearray(-(-size // _CHUNK))
        self.populated = threading.Event()
        threading.Thread(target=_populate, args=(self.pool, self._chunks, self._halt, self.populated),
                         name="mindio-acp-populate", daemon=True).start()
        self.view = memoryview(self.pool)
        self.device = DevicePool(self.pool, size, self._copy_many)
        self.device.prepare()          # registers the mapping now if this process already uses CUDA/NPU
        if not _knobs.get("MINDIO_ACP_LOAD_VIEW"):
            return
        try:
            self.loadview = LoadView(self._pool_fd, size, first=regions)
        except OSError as exc:
            log.warning("no copy-on-write view of the pool (%s): each load maps its region afresh", exc)

    def ensure_mapped(self, end: int) -> None:
        """Map the pool anew when ``end`` lies past this process's mapping: the daemon grew its pool
        (for a later client that asked for more) since this one connected."""
        if self.pool is not None and end > len(self.pool):
            size = os.fstat(self._pool_fd).st_size
            log.info("the pool grew to %d MiB: mapping it again", size >> 20)
            self._map_pool(self.hello["pool"], size, [])

    def close(self) -> None:
        self._halt.set()  # a populate still running stops at its next chunk
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._pool_fd is not None:
                os.close(self._pool_fd)
                self._pool_fd = None

    def alive(self) -> bool:
        return self._sock is not None and os.getpid() == self.pid

    def request(self, message: dict, timeout: float = 30.0) -> dict:
        """One request/reply on the shared connection (queued lease releases ride along first)."""
        with self._lock:
            if self._sock is None:
                raise ServerUnavailable(f"not connected to mindio-acp-server in {self.dir}")
            try:
                self._sock.settimeout(timeout)
                if self._releases:          # no extra round trip: the daemon handles these first
                    leases, self._releases = self._releases, []
                    message = dict(message, release=leases)
                _wire.send(self._sock, message)
                reply = _wire.recv(self._sock)
            except (OSError, ConnectionError) as exc:
                self._sock.close()
                self._sock = None
                raise ServerUnavailable(f"mindio-acp-server in {self.dir} stopped answering: {exc}") from exc
        if not reply.get("ok"):
            if reply.get("full") or reply.get("unserviceable"):
                raise PoolFull(reply.get("error", "pool unavailable"))
            raise ServerUnavailable(f"mindio-acp-server refused {message.get('op')}: {reply.get('error')}")
        return reply

    def side_request(self, message: dict, timeout: float) -> dict:
        """A request on a fresh connection, for long waits that must not block saves."""
        try:
            with self._dial(timeout + 10) as s:
                _wire.send(s, message)
                reply = _wire.recv(s)
        except (OSError, ConnectionError) as exc:
            raise ServerUnavailable(f"mindio-acp-server in {self.dir} stopped answering: {exc}") from exc
        if not reply.get("ok"):
            raise ServerUnavailable(f"mindio-acp-server refused {message.get('op')}: {reply.get('error')}")
        return reply

    # ---- data -----------------------------------------------------------------------------------
    def save_image(self, size: int, write, paths: list, kind: str = "acp", mode: int = 0o644, stat=None) -> list:
        """Allocate ``size`` bytes, let ``write(buffer, copy_many)`` fill them, commit under ``paths``."""
        reply = self.request({"op": "alloc", "size": size})
        alloc, offset = reply["alloc"], reply["offset"]
        try:
            with self._lock:
                self.ensure_mapped(offset + size)
            _fault_in(self.pool, self._chunks, offset, size)  # the chunks the background has not done yet
            write(self.view[offset: offset + size], self._copy_many)
        except BaseException:
            try:
                self.request({"op": "abort", "alloc": alloc})
            except ServerUnavailable:
                pass
            raise
        return self.request({"op": "commit", "alloc": alloc, "paths": paths, "kind": kind,
                             "mode": mode, "stat": stat})["seqs"]

    def _copy_many(self, dst, jobs: list) -> None:
        """One parallel pass (memfs.write.parallel.*) copying every (offset, src) of ``jobs`` into ``dst``."""
        _native.copy_many(dst, jobs, self.cfg.copy_threads(), self.cfg.slice_bytes)

    def device_reader(self, reply: dict):
        """``to_device`` for format.load_buffer: device copies of the region ``reply`` names, read from
        this process's shared (page-locked once registered) mapping of the pool; None for a region of
        another pool file (a recovered one)."""
        if self.device is None or reply["file"] != self.hello.get("pool"):
            return None
        return functools.partial(self.device.to_device, self.view[reply["offset"]: reply["offset"] + reply["size"]])

    def open_region(self, path: str):
        """(copy-on-write view, lookup reply) of the newest pooled version of ``path``, or None."""
        with self._lock:
            reply = self.request({"op": "lookup", "path": path})
            if not reply["hit"]:
                return None
            view = None
            try:
                if reply["file"] == self.hello.get("pool"):
                    self.ensure_mapped(reply["offset"] + reply["size"])
                if self.loadview is not None and reply["file"] == self.hello.get("pool"):
                    view = self.loadview.acquire(reply["offset"], reply["size"])
                if view is None:
                    view = self._private_map(reply)
            except BaseException:
                self._releases.append(reply["lease"])
                raise
            weakref.finalize(view, self._releases.append, reply["lease"])
        return view, reply

    def _private_map(self, reply: dict):
        """A fresh private mapping of the region: a range already viewed (from the pool's descriptor),
        or a recovered pool file (a private file of ours in the daemon's private pool directory)."""
        pool_fd = self._pool_fd if reply["file"] == self.hello.get("pool") else None
        fd = pool_fd if pool_fd is not None else _secure.open_private(reply["file"], os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, reply["size"], flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=reply["offset"])
        finally:
            if fd != pool_fd:
                os.close(fd)
        try:
            mm.madvise(_MADV_POPULATE_READ)   # map the shared pages in one go (no copy: still copy-on-write)
        except OSError:
            pass
        return mm
