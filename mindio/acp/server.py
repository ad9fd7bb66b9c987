"""mindio-acp-server: the per-user, per-node daemon that owns the checkpoint pool and persists it.

Protocol (one Unix socket ``<dir>/acp.sock``, frames of mindio.acp._wire; a client's allocations and
leases die with its connection):

    hello                          -> pool file, size, config, state ("ok" | "unserviceable")
    alloc {size}                   -> {alloc, offset}   (evicts persisted entries if needed)
    abort {alloc}                  -> frees an uncommitted allocation
    commit {alloc, paths, kind, mode, stat?} -> {seqs}  (journal fsynced, markers written, queued)
    lookup {path}                  -> {hit, file, offset, size, lease, persisted, stat}
    release {leases}               -> drops leases (the bytes may be reused afterwards)
    delete {path}                  -> forgets the path's pooled versions (create_file(...).drop())
    wait {seqs, timeout}           -> {entries}  once each is persisted/failed/superseded or at timeout
    flush {timeout}                -> {failed: [paths], pending: n} once nothing is pending
    lost                           -> {lost: [{path, seq, reason}]}
    stat                           -> counters;  shutdown -> drains the queue and exits

Call order of a save: alloc -> (client copies the image into the pool) -> commit. Nothing is visible
to lookup or persisted before commit; a client killed before commit leaves no trace.
"""
from __future__ import annotations

import argparse
import errno
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

from .. import _knobs
from . import _config, _wire
from ._persist import Persister
from ._pool import BlockAllocator
from ._state import FAILED, LIVE, PENDING, PERSISTED, SUPERSEDED, Entry, Region
from ._storage import Journal, write_marker

__all__ = ["Daemon", "main", "check_pool_fits"]

log = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23


def check_pool_fits(pool_dir: str, pool_bytes: int) -> None:
    """Refuse, before allocating anything, a pool its file system (e.g. a small /dev/shm) cannot hold."""
    st = os.statvfs(pool_dir)
    free = st.f_bavail * st.f_frsize
    if pool_bytes > free:
        raise OSError(errno.ENOSPC, f"a {pool_bytes >> 20} MiB pool does not fit {pool_dir} ({free >> 20} MiB free "
                      "there): lower memfs.data_block_pool_capacity_in_gb or set MINDIO_ACP_POOL_MB")
    available = _mem_available()
    if available is not None and pool_bytes > available * 0.8:
        raise OSError(errno.ENOMEM, f"a {pool_bytes >> 20} MiB pool would take more than 80% of the "
                      f"{available >> 20} MiB of memory available now: lower "
                      "memfs.data_block_pool_capacity_in_gb or set MINDIO_ACP_POOL_MB")


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Daemon:
    def __init__(self, run_dir: str, cfg: _config.ServerConfig, idle_exit: float):
        self.dir, self.cfg, self.idle_exit = run_dir, cfg, idle_exit
        self.lock = threading.Condition()
        self.entries: dict[str, Entry] = {}
        self.by_seq: dict[int, Entry] = {}
        self.conns = 0
        self.last_active = time.monotonic()
        self.stopping = threading.Event()
        self._ids = 0
        self._last_seq = 0
        self.prefaulted = 0
        self.persist = Persister(self)

    # ---- start-up -------------------------------------------------------------------------------
    def start(self) -> bool:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._lockf = open(os.path.join(self.dir, "daemon.lock"), "a+")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another mindio-acp-server owns %s; exiting", self.dir)
            return False
        self.pool_dir = _config.pool_dir(self.dir)
        os.makedirs(self.pool_dir, mode=0o700, exist_ok=True)
        self.journal_path = os.path.join(self.dir, "journal.jsonl")
        recovered = self.persist.recover(Journal.pending(self.journal_path))
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
        for target in (self._accept_loop, self._prefault, self._monitor):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        self.persist.start(self.cfg.persist_threads())
        log.info("mindio-acp-server up: dir=%s pool=%s (%d MiB, blocks of %d MiB)", self.dir, self.pool_file,
                 self.cfg.pool_bytes >> 20, self.cfg.block_bytes >> 20)
        return True

    def _create_pool(self) -> None:
        self.pool_file = os.path.join(self.pool_dir, f"pool-{os.getpid()}-{time.time_ns()}")
        live = {e.region.file for e in self.entries.values()}
        for name in os.listdir(self.pool_dir):
            path = os.path.join(self.pool_dir, name)
            if path not in live:
                os.unlink(path)  # a pool of a daemon that died with nothing left to persist
        check_pool_fits(self.pool_dir, self.cfg.pool_bytes)
        fd = os.open(self.pool_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve every page now: a pool its file system cannot hold must fail here, clearly,
            # not with SIGBUS in a trainer's copy later
            os.posix_fallocate(fd, 0, self.cfg.pool_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.pool_file)
            raise OSError(exc.errno, f"cannot reserve a {self.cfg.pool_bytes >> 20} MiB pool in "
                          f"{self.pool_dir}: {exc.strerror}") from None
        self.pool_map = mmap.mmap(fd, self.cfg.pool_bytes, flags=mmap.MAP_SHARED)
        os.close(fd)
        self.pool_view = memoryview(self.pool_map)
        self.alloc = BlockAllocator(self.cfg.pool_bytes, self.cfg.block_bytes)

    def _prefault(self) -> None:
        """Fault the whole pool in once, at low priority, so saves copy into warm pages."""
        self.persist.lower_priority()
        step = 64 << 20
        for start in range(0, self.cfg.pool_bytes, step):
            if self.stopping.is_set():
                return
            length = min(step, self.cfg.pool_bytes - start)
            try:
                self.pool_map.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError:
                from .. import _native
                with self.lock:   # write-touch only blocks nobody owns
                    if self.alloc.largest_free() == self.cfg.pool_bytes:
                        _native.touch_pages(self.pool_view[start: start + length], write=True)
            self.prefaulted = start + length

    # ---- connections ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        state = {"allocs": {}, "leases": {}}
        with self.lock:
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
        op = req.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return handler(req, state)

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _next_seq(self) -> int:
        self._last_seq = max(self._last_seq + 1, time.time_ns() // 1000)
        return self._last_seq

    def _free_region(self, region: Region) -> None:
        self.alloc.free(region.offset, region.size)

    # ---- operations -----------------------------------------------------------------------------
    def op_hello(self, req, state):
        return {"ok": True, "pool": self.pool_file, "pool_bytes": self.cfg.pool_bytes, "pid": os.getpid(),
                "config": self.cfg.to_wire(), "state": self.persist.health(), "prefaulted": self.prefaulted}

    def op_alloc(self, req, state):
        size = int(req["size"])
        if self.persist.unserviceable:
            return {"ok": False, "unserviceable": True, "error": "storage is failing: daemon unserviceable"}
        with self.lock:
            offset = self.alloc.allocate(size)
            while offset is None and self._evict_one():
                offset = self.alloc.allocate(size)
            if offset is None:
                live = sum(e.region.size for e in self.entries.values() if e.state in LIVE)
                return {"ok": False, "full": True, "error":
                        f"pool full: {size} bytes needed, {self.alloc.largest_free()} free in one run, "
                        f"{live} bytes not yet persisted"}
            padded = self.pool_view[offset: offset + -(-size // mmap.PAGESIZE) * mmap.PAGESIZE]
            region = Region(self.pool_file, offset, size, padded[:size], padded, self._free_region)
            alloc_id = self._next_id()
            state["allocs"][alloc_id] = region
            self.last_active = time.monotonic()
        return {"ok": True, "alloc": alloc_id, "offset": offset}

    def _evict_one(self) -> bool:
        victims = [e for e in self.entries.values() if e.state == PERSISTED and e.region.leases == 0]
        if not victims:
            return False
        victim = min(victims, key=lambda e: e.last_used)
        del self.entries[victim.path]
        victim.region.refs -= 1
        victim.region.maybe_free()
        log.info("evicted persisted %s from the pool", victim.path)
        return True

    def op_abort(self, req, state):
        with self.lock:
            region = state["allocs"].pop(req["alloc"], None)
            if region is not None:
                region.maybe_free()
        return {"ok": True}

    def op_commit(self, req, state):
        kind, mode, paths = req.get("kind", "acp"), int(req.get("mode", 0o644)), list(req["paths"])
        with self.lock:
            region = state["allocs"].pop(req["alloc"])
            seqs = []
            for path in paths:
                entry = Entry(self._next_seq(), path, region, kind, mode)
                region.refs += 1
                if kind == "cache":
                    entry.state, entry.stat = PERSISTED, req.get("stat")
                else:
                    self.journal.append({"c": entry.seq, "path": path, "file": region.file, "off": region.offset,
                                         "size": region.size, "kind": kind, "mode": mode})
                    try:
                        write_marker(path, {"seq": entry.seq, "daemon": os.getpid(), "time": time.time()})
                    except OSError as exc:
                        log.warning("cannot write in-progress marker for %s: %s", path, exc)
                self._install(entry)
                seqs.append(entry.seq)
            self.lock.notify_all()
        return {"ok": True, "seqs": seqs}

    def _install(self, entry: Entry) -> None:
        """Make ``entry`` the newest version of its path (caller holds the lock)."""
        old = self.entries.get(entry.path)
        if old is not None and old.state in (PENDING, FAILED, PERSISTED):
            if old.state != PERSISTED:
                old.state = SUPERSEDED
                self.journal.append({"x": old.seq}, sync=False)
            old.region.refs -= 1
            old.region.maybe_free()
        self.entries[entry.path] = entry
        self.by_seq[entry.seq] = entry
        if len(self.by_seq) > 8192:            # forget the outcome of old, finished saves
            for seq in [s for s, e in self.by_seq.items() if e.state in (PERSISTED, SUPERSEDED)][:4096]:
                del self.by_seq[seq]
        if entry.state == PENDING:
            self.persist.enqueue(entry)

    def op_delete(self, req, state):
        """Forget every pooled version of a path; one still being written is removed after its rename."""
        with self.lock:
            entry = self.entries.pop(req["path"], None)
            if entry is not None:
                if entry.state == "persisting":
                    entry.deleted = True
                else:
                    if entry.state != PERSISTED:
                        entry.state = SUPERSEDED
                        self.journal.append({"x": entry.seq}, sync=False)
                    entry.region.refs -= 1
                    entry.region.maybe_free()
            self.lock.notify_all()
        return {"ok": True}

    def op_lookup(self, req, state):
        with self.lock:
            entry = self.entries.get(req["path"])
            if entry is None:
                return {"ok": True, "hit": False}
            entry.last_used = time.monotonic()
            region = entry.region
            region.leases += 1
            lease = self._next_id()
            state["leases"][lease] = region
            return {"ok": True, "hit": True, "file": region.file, "offset": region.offset, "size": region.size,
                    "lease": lease, "kind": entry.kind, "persisted": entry.state == PERSISTED, "stat": entry.stat}

    def op_release(self, req, state):
        with self.lock:
            for lease in req.get("leases", []):
                region = state["leases"].pop(lease, None)
                if region is not None:
                    region.leases -= 1
                    region.maybe_free()
        return {"ok": True}

    def op_wait(self, req, state):
        deadline = time.monotonic() + float(req.get("timeout", 60))
        seqs = list(req["seqs"])
        with self.lock:
            while True:
                entries = [self.by_seq.get(s) for s in seqs]
                busy = [e for e in entries if e is not None and e.state in (PENDING, "persisting")]
                left = deadline - time.monotonic()
                if not busy or left <= 0:
                    return {"ok": True, "entries": [e.wire() if e else {"seq": s, "state": "unknown"}
                                                    for s, e in zip(seqs, entries)]}
                self.lock.wait(min(left, 1.0))

    def op_flush(self, req, state):
        deadline = time.monotonic() + float(req.get("timeout", 3600))
        with self.lock:
            while True:
                busy = [e for e in self.entries.values() if e.state in (PENDING, "persisting")]
                if not busy or time.monotonic() >= deadline:
                    failed = [e.path for e in self.entries.values() if e.state == FAILED]
                    return {"ok": True, "failed": failed, "pending": len(busy)}
                self.lock.wait(1.0)

    def op_lost(self, req, state):
        return {"ok": True, "lost": self.persist.lost_records()}

    def op_stat(self, req, state):
        with self.lock:
            counts: dict = {}
            for e in self.entries.values():
                counts[e.state] = counts.get(e.state, 0) + 1
            return {"ok": True, "entries": counts, "free": self.alloc.free_bytes(), "conns": self.conns,
                    "prefaulted": self.prefaulted, "state": self.persist.health(), **self.persist.counters()}

    def op_ping(self, req, state):
        return {"ok": True}

    def op_shutdown(self, req, state):
        self._close_listener()      # before replying: no client may connect to a daemon that is leaving
        return {"ok": True}

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
        return any(e.state in LIVE for e in self.entries.values())

    def _monitor(self) -> None:
        while not self.stopping.wait(0.5):
            with self.lock:
                idle = self.conns == 0 and not self.busy() and time.monotonic() - self.last_active > self.idle_exit
            if idle:
                log.info("idle for %.0f s with nothing to persist: exiting", self.idle_exit)
                self.shutdown()
                return

    def shutdown(self) -> None:
        """Stop accepting, persist everything still in memory, remove the pool, exit."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._close_listener()
        self.persist.drain()
        with self.lock:
            unpersisted = self.busy()
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
    run_dir = os.path.abspath(args.dir) if args.dir else _config.runtime_dir()
    cfg = _config.parse_server_info(json.loads(args.config))
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    ready_r = ready_w = None
    if args.detach:
        ready_r, ready_w = os.pipe()
        if os.fork() > 0:           # the launcher: report the daemon's start-up result, then return
            os.close(ready_w)
            with os.fdopen(ready_r) as ready:
                status = ready.read()
            if status.startswith("ok"):
                return 0
            print(f"mindio-acp-server failed to start: {status or 'it died during start-up'}", file=sys.stderr)
            return 1
        os.close(ready_r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        logf = os.open(os.path.join(run_dir, "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
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
        os.write(ready_w, b"ok")
        os.close(ready_w)
    if not started:
        return 0
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=daemon.shutdown).start())
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=daemon.shutdown).start())
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an oversize write must fail with EFBIG, not kill us
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
