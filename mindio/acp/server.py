"""mindio-acp-server: the per-user, per-node daemon that owns the checkpoint pool and persists it.

Protocol (one Unix socket ``<dir>/acp.sock``, frames of mindio.acp._wire; a client's allocations and
leases die with its connection):

    hello {fd?}                    -> pool file, size, config, state ("ok" | "unserviceable"); with
                                      "fd": true the pool file's descriptor follows (SCM_RIGHTS)
    alloc {size}                   -> {alloc, offset}   (evicts persisted entries if needed)
    abort {alloc}                  -> frees an uncommitted allocation
    commit {alloc, paths, kind, mode, stat?} -> {seqs}  (journal fsynced, markers written, queued)
    lookup {path}                  -> {hit, file, offset, size, lease, persisted, stat}
    release {leases}               -> drops leases (the bytes may be reused afterwards); any request
                                      may also carry "release": [leases], handled before it
    delete {path}                  -> forgets the path's pooled versions (create_file(...).drop())
    wait {seqs, timeout}           -> {entries}  once each is persisted/failed/superseded or at timeout
    flush {timeout}                -> {failed: [paths], pending: n} once nothing is pending
    lost                           -> {lost: [{path, seq, reason}]}
    stat                           -> counters;  shutdown -> drains the queue and exits

Call order of a save: alloc -> (client copies the image into the pool) -> commit. Nothing is visible
to lookup or persisted before commit; a client killed before commit leaves no trace.

Only processes of the daemon's own uid are served (SO_PEERCRED); the runtime and pool directories
are private (mindio._secure), and the pool is handed to clients as a descriptor, never by name.

Modules: this one holds the process (start-up, lock, socket, connections, idle exit, shutdown, CLI);
mindio.acp._ops the request handlers; mindio.acp._poolfile the pool file; mindio.acp._persist the
persistence workers; mindio.acp._state the namespace objects.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time

from .. import _knobs, _secure
from . import _config, _wire
from ._ops import Operations
from ._persist import Persister
from ._pool import BlockAllocator
from ._poolfile import MADV_POPULATE_WRITE, address, check_pool_fits, create_pool, lower_priority, madvise
from ._state import LIVE, Entry
from ._storage import Journal, sweep_temps

__all__ = ["Daemon", "main", "check_pool_fits"]

log = logging.getLogger(__name__)


class Daemon(Operations):
    def __init__(self, run_dir: str, cfg: _config.ServerConfig, idle_exit: float):
        self.dir, self.cfg, self.idle_exit = run_dir, cfg, idle_exit
        self.lock = threading.Condition()
        self.entries: dict[str, Entry] = {}
        self.by_seq: dict[int, Entry] = {}
        self.conns = 0
        self.last_active = time.monotonic()
        self.stopping = threading.Event()
        self.leaving = False            # set (under the lock) once the daemon decided to exit
        self._ids = 0
        self._last_seq = 0
        self.prefaulted = 0
        self._grow_lock = threading.Lock()
        self.persist = Persister(self)

    # ---- start-up -------------------------------------------------------------------------------
    def start(self) -> bool:
        self.dir = _secure.private_dir(self.dir)
        self._lockf = _secure.open_private(os.path.join(self.dir, "daemon.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another mindio-acp-server owns %s; exiting", self.dir)
            return False
        self.pool_dir = _secure.private_dir(_config.pool_dir(self.dir), sticky_parents=False)
        self.journal_path = os.path.join(self.dir, "journal.jsonl")
        pending, every = Journal.load(self.journal_path)
        for path in sweep_temps(every):
            log.info("removed %s, a temporary file left by a crash", path)
        recovered = self.persist.recover(pending)
        self.journal = Journal(self.journal_path)
        self.journal.rewrite(recovered)
        self._create_pool()
        self.sock_path = os.path.join(self.dir, "acp.sock")
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self.server.listen(64)
        self.last_active = time.monotonic()      # idle time counts from here, not from a slow start-up
        # ... and not before the launcher heard "ok" (main: up()); under load the main thread can stall
        # longer than a short idle timeout between here and that write, and an idle exit then looked like
        # a death during start-up to the client (tests/acp/test_api.py::test_daemon_exits_when_idle, load 16)
        self.announced = threading.Event()
        for target in (self._accept_loop, self._prefault, self._monitor):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        self.persist.start(self.cfg.persist_threads())
        log.info("mindio-acp-server up: dir=%s pool=%s (%d MiB, blocks of %d MiB)", self.dir, self.pool_file,
                 self.cfg.pool_bytes >> 20, self.cfg.block_bytes >> 20)
        return True

    def _create_pool(self) -> None:
        keep = {e.region.file for e in self.entries.values()}
        self.pool_file, self.pool_map, self.pool_fd = create_pool(self.pool_dir, self.cfg.pool_bytes, keep)
        self.pool_view = memoryview(self.pool_map)
        self.alloc = BlockAllocator(self.cfg.pool_bytes, self.cfg.block_bytes)

    def grow_pool(self, want: int) -> str | None:
        """Grow the pool file in place to ``want`` bytes (a later client asked for more than the first).
        The file only grows, so every offset handed out stays valid; clients map the new size when
        they first meet an offset past their mapping (Client.ensure_mapped). None when the pool is at
        least ``want`` bytes now, else why it cannot grow (the client says so at initialize)."""
        want = want // self.cfg.block_bytes * self.cfg.block_bytes
        with self._grow_lock:
            old = self.cfg.pool_bytes
            if want <= old:
                return None
            try:
                check_pool_fits(self.pool_dir, want - old)
                os.posix_fallocate(self.pool_fd, old, want - old)    # reserved now, not SIGBUS later
            except OSError as exc:
                os.ftruncate(self.pool_fd, old)
                return f"cannot grow the pool to {want >> 20} MiB: {exc.strerror or exc}"
            grown = mmap.mmap(self.pool_fd, want, flags=mmap.MAP_SHARED)
            with self.lock:          # regions handed out keep their views of the old mapping
                self.pool_map, self.pool_view = grown, memoryview(grown)
                self.alloc.grow(want)
                self.cfg = dataclasses.replace(self.cfg, pool_bytes=want)
        log.info("grew the pool from %d MiB to %d MiB (a client asked for more)", old >> 20, want >> 20)
        threading.Thread(target=self._prefault, args=(old, want), daemon=True, name="prefault-grown").start()
        return None

    def _prefault(self, begin: int = 0, end: int | None = None) -> None:
        """Fault the pool (or its grown part, [begin, end)) in once, at low priority, so saves copy into
        warm pages. Through a GIL-releasing madvise: with mmap.madvise each 64 MiB step held the GIL for
        ~25 ms, and a trainer's first saves after start-up waited that long for their alloc/commit replies."""
        lower_priority()
        step = 64 << 20
        end = self.cfg.pool_bytes if end is None else end
        pool_map, view = self.pool_map, self.pool_view
        addr, _anchor = address(pool_map)
        for start in range(begin, end, step):
            if self.stopping.is_set():
                return
            length = min(step, end - start)
            try:
                madvise(addr + start, length, MADV_POPULATE_WRITE)
            except OSError:
                from .. import _native
                with self.lock:   # write-touch only blocks nobody owns
                    if self.alloc.largest_free() == self.cfg.pool_bytes:
                        _native.touch_pages(view[start: start + length], write=True)
            self.prefaulted = max(self.prefaulted, start + length)

    # ---- connections ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            pid, uid = _secure.peer_uid(conn)
            if uid != os.geteuid():
                log.warning("refused a connection from pid %d (uid %d): this daemon serves uid %d only",
                            pid, uid, os.geteuid())
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state = {"allocs": {}, "leases": {}}
        with self.lock:
            if self.leaving:                # exit decided: the client retries with a new daemon
                conn.close()
                return
            self.conns += 1
            self.last_active = time.monotonic()
        try:
            while True:
                try:
                    req = _wire.recv(conn)
                except (ConnectionError, OSError):
                    return
                try:
                    reply = self._dispatch(req, state)
                except Exception as exc:  # a bad request must never take the daemon down
                    log.exception("request %r failed", req.get("op"))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                _wire.send(conn, reply)
                if reply.get("fd"):     # hello: the pool itself, not a name another user could swap
                    _wire.send_fd(conn, self.pool_fd)
                if req.get("op") == "shutdown":
                    threading.Thread(target=self.shutdown, daemon=True).start()
        except Exception:
            log.exception("connection handler failed")
        finally:
            conn.close()
            with self.lock:
                self.conns -= 1
                self.last_active = time.monotonic()
                for region in state["allocs"].values():   # died before commit: no trace left
                    region.maybe_free()
                for region in state["leases"].values():
                    region.leases -= 1
                    region.maybe_free()

    def _dispatch(self, req: dict, state: dict) -> dict:
        if req.get("release"):              # lease releases ride along with any request
            self.op_release({"leases": req["release"]}, state)
        op = req.get("op")
        handler = self.OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return handler(self, req, state)

    def _close_listener(self) -> None:
        with self.lock:
            if getattr(self, "_listener_closed", False):
                return
            self._listener_closed = True
        try:
            os.unlink(self.sock_path)
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()

    # ---- life cycle -----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Something in memory is still on its way to storage (failed entries are not: they wait)."""
        return any(e.state in LIVE and not self.persist.gave_up(e) for e in self.entries.values())

    def up(self) -> None:
        """(main) The start-up was reported: from now on an idle daemon may exit."""
        with self.lock:
            self.last_active = time.monotonic()
        self.announced.set()

    def _monitor(self) -> None:
        while not self.stopping.wait(0.5):
            if not self.announced.is_set():
                continue
            with self.lock:         # decided with the connection count it reads: no client slips in
                idle = self.conns == 0 and not self.busy() and time.monotonic() - self.last_active > self.idle_exit
                self.leaving = self.leaving or idle
            if idle:
                log.info("idle for %.0f s with nothing left to persist: exiting", self.idle_exit)
                self.shutdown(give_up=True)
                return

    def shutdown(self, give_up: bool = False) -> None:
        """Stop accepting, persist everything still in memory, remove the pool, exit. Entries whose
        persistence failed stay in the pool for the next daemon, unless ``give_up`` (idle exit: nobody
        may start a daemon for days): then they are reported lost by path and the pool is freed."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        with self.lock:
            self.leaving = True
        self._close_listener()
        self.persist.drain()
        with self.lock:
            if give_up:
                for entry in [e for e in self.entries.values() if e.state in LIVE]:
                    self.persist.give_up(entry, "the idle daemon exited")
            unpersisted = any(e.state in LIVE for e in self.entries.values())
        if not unpersisted:
            for path in {self.pool_file} | {e.region.file for e in self.entries.values()}:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            try:
                os.rmdir(self.pool_dir)
            except OSError:
                pass
        log.info("mindio-acp-server stopped%s", " with unpersisted data left in the pool" if unpersisted else "")
        logging.shutdown()
        os._exit(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mindio-acp-server", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="runtime directory (default: MINDIO_ACP_DIR or /tmp/mindio-acp-<uid>)")
    parser.add_argument("--config", default="{}", help="server_info as a JSON object")
    parser.add_argument("--detach", action="store_true", help="fork into the background (setsid) and return")
    args = parser.parse_args(argv)
    os.umask(0o077)           # whatever the daemon creates for itself is private
    cfg = _config.parse_server_info(json.loads(args.config))
    try:
        run_dir = _secure.private_dir(args.dir or _config.runtime_dir())
    except (_secure.InsecurePath, OSError) as exc:
        print(f"mindio-acp-server failed to start: {exc}", file=sys.stderr)
        return 1
    ready_r = ready_w = None
    if args.detach:
        ready_r, ready_w = os.pipe()
        if os.fork() > 0:           # the launcher: report the daemon's start-up result, then return
            os.close(ready_w)
            with os.fdopen(ready_r) as ready:
                status = ready.read()
            if status.startswith("ok"):
                return 0
            if status.startswith("owned"):      # another daemon holds the directory (maybe exiting)
                return 3
            print(f"mindio-acp-server failed to start: {status or 'it died during start-up'}", file=sys.stderr)
            return 1
        os.close(ready_r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        logf = _secure.open_private(os.path.join(run_dir, "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(devnull, 0)
        os.dup2(logf, 1)
        os.dup2(logf, 2)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s mindio-acp-server[{os.getpid()}] %(levelname)s %(message)s")
    daemon = Daemon(run_dir, cfg, _knobs.get("MINDIO_ACP_IDLE_EXIT"))
    try:
        started = daemon.start()
    except Exception as exc:
        log.exception("start-up failed")
        if ready_w is not None:
            os.write(ready_w, f"{type(exc).__name__}: {exc}".encode())
        return 1
    if ready_w is not None:
        os.write(ready_w, b"ok" if started else b"owned")
        os.close(ready_w)
    if not started:
        return 0
    daemon.up()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=daemon.shutdown).start())
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=daemon.shutdown).start())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an oversize write must fail with EFBIG, not kill us
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
