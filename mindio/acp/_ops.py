"""The requests mindio-acp-server answers (see mindio.acp.server for the protocol), as a mixin.

``Operations`` holds every ``op_<name>`` handler and the namespace rules they share (allocation with
eviction of persisted entries only, commit with journal and in-progress marker, newest version wins,
leases that keep a region's bytes from reuse). ``Daemon`` (mindio.acp.server) supplies the state:
``lock`` (one Condition guarding everything here), ``entries``, ``by_seq``, ``alloc``, ``pool_file``,
``pool_view``, ``journal``, ``persist``, ``cfg`` and the connection count. Every handler takes the
request and the connection's own state (``allocs`` and ``leases`` it holds) and returns the reply.
"""
from __future__ import annotations

import logging
import mmap
import os
import time

from ._state import FAILED, LIVE, PENDING, PERSISTED, SUPERSEDED, Entry, Region
from ._storage import current_key, target_problem, write_marker

__all__ = ["Operations"]

log = logging.getLogger("mindio.acp.server")   # one log for the whole daemon


class Operations:
    """op_* handlers of the daemon; mixed into mindio.acp.server.Daemon."""

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
        want = req.get("pool_bytes")
        grow_error = self.grow_pool(want) if type(want) is int and want > self.cfg.pool_bytes else None
        with self.lock:     # regions holding checkpoints now: a new client faults these in first
            regions = sorted({(e.region.offset, e.region.size) for e in self.entries.values()
                              if e.region.file == self.pool_file})
        return {"ok": True, "pool": self.pool_file, "pool_bytes": self.cfg.pool_bytes, "pid": os.getpid(),
                "config": self.cfg.to_wire(), "state": self.persist.health(), "prefaulted": self.prefaulted,
                "regions": [list(r) for r in regions], "fd": bool(req.get("fd")), "grow_error": grow_error}

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
        kind, mode, paths = req.get("kind", "acp"), req.get("mode", 0o644), list(req["paths"])
        with self.lock:
            region = state["allocs"].pop(req["alloc"])
            problem = next(filter(None, map(target_problem, paths)), "") or (
                "" if kind in ("acp", "raw", "cache") else f"unknown kind {kind!r}") or (
                "" if isinstance(mode, int) and 0 <= mode <= 0o777 else f"mode {mode!r} is not in [0, 0o777]")
            if problem:                       # a client's error: refused here, never a storage failure
                region.maybe_free()
                log.warning("refused commit of %s: %s", paths, problem)
                return {"ok": False, "error": f"commit refused: {problem}"}
            seqs = []
            for path in paths:
                entry = Entry(self._next_seq(), path, region, kind, mode)
                region.refs += 1
                if kind == "cache":
                    entry.state, entry.stat = PERSISTED, req.get("stat")
                else:
                    # "pre": the target as it is now; a recovery replaces only this version or one the daemon
                    # wrote itself, never a file written behind its back after this commit (_persist.recover)
                    self.journal.append({"c": entry.seq, "path": path, "file": region.file, "off": region.offset,
                                         "size": region.size, "kind": kind, "mode": mode,
                                         "pre": current_key(path)})
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
                    "pool_bytes": self.cfg.pool_bytes,
                    "prefaulted": self.prefaulted, "state": self.persist.health(), **self.persist.counters()}

    def op_ping(self, req, state):
        return {"ok": True}

    def op_shutdown(self, req, state):
        self._close_listener()      # before replying: no client may connect to a daemon that is leaving
        return {"ok": True}

    # the daemon's requests: {"op" of a request: its handler(self, req, state)} -- an explicit table
    OPS = {"hello": op_hello, "alloc": op_alloc, "abort": op_abort, "commit": op_commit, "delete": op_delete,
           "lookup": op_lookup, "release": op_release, "wait": op_wait, "flush": op_flush, "lost": op_lost,
           "stat": op_stat, "ping": op_ping, "shutdown": op_shutdown}
