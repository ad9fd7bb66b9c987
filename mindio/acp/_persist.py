"""The daemon's persistence workers, retry policy, unserviceable state and crash recovery.

A worker takes the oldest ready pending entry, computes its checksums (format.checksummed_header),
writes it atomically next to its target (mindio.acp._storage.atomic_write), removes the in-progress
marker when no newer version is waiting, and journals the completion. Workers run at nice 19 and
the lowest best-effort I/O priority, and as SCHED_IDLE while they checksum and write, so the trainer
keeps its CPU (not for an entry committed more than _IDLE_FOR_S ago: on a machine whose CPUs are never
idle, SCHED_IDLE would starve it).

Failures: each entry gets MINDIO_ACP_PERSIST_RETRIES attempts with exponential back-off; then it is
FAILED (its bytes stay in the pool, retried every 5 s) and counts as one storage failure, unless the
target path itself was the cause (its directory removed, a directory in its place, no permission:
a user's error, see _storage.is_target_error), which never counts. After
MINDIO_ACP_UNSERVICEABLE_AFTER consecutive storage failures the daemon is unserviceable: ``alloc``
refuses and clients fall back to writing storage themselves. The first success clears the state.

Recovery: a restarted daemon reads the journal's unfinished commits. A record is refused (logged with
the reason, nothing written) unless it is well formed, its target is an absolute normalized path and
its bytes lie in a pool file of this daemon's own private pool directory. Each accepted one whose bytes
are still in the old pool file (/dev/shm survives a daemon's death) and whose header verifies is
persisted again; every other one is appended to ``lost.jsonl`` by path and reported to clients by
``initialize()``.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time

from .. import _knobs, _logging
from ..errors import CheckpointError
from . import format as fmt
from .._secure import open_private
from ._poolfile import lower_priority
from ._state import FAILED, PENDING, PERSISTED, PERSISTING, SUPERSEDED, Entry, Region
from ._storage import (atomic_write_direct, current_key, is_target_error, marker_path, remove_marker, stat_key,
                       target_problem)

__all__ = ["Persister"]

log = logging.getLogger(__name__)
_FAILED_RETRY_S = 5.0
_IDLE_FOR_S = 30.0      # entries committed longer ago than this are not written as SCHED_IDLE


class Persister:
    def __init__(self, daemon):
        self.d = daemon
        self.queue: list[Entry] = []
        self.unserviceable = False
        self._consecutive = 0
        self._retries = _knobs.get("MINDIO_ACP_PERSIST_RETRIES")
        self._delay = _knobs.get("MINDIO_ACP_PERSIST_DELAY")
        self._threshold = _knobs.get("MINDIO_ACP_UNSERVICEABLE_AFTER")
        self._path_locks: dict[str, threading.Lock] = {}
        self._stats = {"persisted": 0, "persist_failures": 0, "target_errors": 0, "bytes_persisted": 0}
        self._workers: list[threading.Thread] = []
        self.idle_policy = False

    # ---- scheduling -----------------------------------------------------------------------------
    def start(self, n: int) -> None:
        self.idle_policy = self._probe_idle_policy()
        for i in range(n):
            t = threading.Thread(target=self._work, name=f"persist-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def enqueue(self, entry: Entry) -> None:
        self.queue.append(entry)   # caller holds the daemon lock and notifies

    def health(self) -> str:
        return "unserviceable" if self.unserviceable else "ok"

    def gave_up(self, entry: Entry) -> bool:
        """True once every attempt at ``entry`` failed (it is FAILED, or in one of its 5-s retries)."""
        return entry.attempts >= self._retries

    def counters(self) -> dict:
        return dict(self._stats, queued=len(self.queue), sched_idle=self.idle_policy)

    def _cpu_idle(self, on: bool) -> None:
        """SCHED_IDLE for the byte work (checksums, writes): any waking trainer thread preempts it at
        once, which nice 19 alone does not guarantee. Switched off around the daemon lock, so a
        starved worker never holds up a save (no priority inversion); hence used only where the
        switch back is allowed (CAP_SYS_NICE or RLIMIT_NICE, probed once at start)."""
        if not self.idle_policy:
            return
        try:
            policy = os.SCHED_IDLE if on else os.SCHED_OTHER
            os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
        except OSError:
            pass

    @staticmethod
    def _probe_idle_policy() -> bool:
        """True when a thread may enter SCHED_IDLE and leave it again (tried on a throwaway thread)."""
        result = []

        def probe():
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, 19)
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                result.append(True)
            except (OSError, AttributeError):
                pass

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(5.0)
        return bool(result)

    def _take(self):
        lock = self.d.lock
        with lock:
            while True:
                now = time.monotonic()
                for i, entry in enumerate(self.queue):
                    if entry.state == SUPERSEDED:
                        self.queue.pop(i)
                        break
                    if entry.not_before <= now and self._path_lock(entry.path).acquire(blocking=False):
                        self.queue.pop(i)
                        entry.state = PERSISTING
                        return entry
                else:
                    if self._draining and not any(e.state == PENDING for e in self.queue):
                        return None
                    lock.wait(0.5)

    _draining = False

    def _path_lock(self, path: str) -> threading.Lock:
        return self._path_locks.setdefault(path, threading.Lock())

    def _work(self) -> None:
        lower_priority()
        while True:
            entry = self._take()
            if entry is None:
                return
            # an entry that has waited long (the CPUs are never idle: SCHED_IDLE would starve it)
            # is written at plain nice 19, which still gets a share of a busy machine
            self._cpu_idle(time.time() - entry.seq / 1e6 < _IDLE_FOR_S)
            try:
                result = self._write(entry)
            finally:
                self._cpu_idle(False)
                self._path_lock(entry.path).release()
            self._finish(entry, result)

    def drain(self, timeout: float = 600.0) -> None:
        """Let the workers finish every pending entry (bounded), then return."""
        with self.d.lock:
            self._draining = True
            self.d.lock.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))

    # ---- one file -------------------------------------------------------------------------------
    def _write(self, entry: Entry):
        region = entry.region
        if self._delay:
            time.sleep(self._delay)
        try:
            if entry.kind == "acp":
                header = fmt.checksummed_header(region.view, name=entry.path)
                aligned = mmap.mmap(-1, len(header))        # page aligned, as O_DIRECT needs
                aligned[:] = header
                parts = [aligned, region.padded[len(header):]]
            else:
                parts = [region.padded]
            def own(st) -> None:  # journalled (durably) before the rename: a recovery knows this version as its own
                self.d.journal.append({"r": entry.seq, "path": entry.path, "stat": stat_key(st)})

            st = atomic_write_direct(entry.path, parts, region.size, mode=entry.mode, tag=str(entry.seq),
                                     before_rename=own)
            return stat_key(st)
        except Exception as exc:  # storage errors of every kind are handled by the retry policy
            return exc

    def _finish(self, entry: Entry, result) -> None:
        d = self.d
        with d.lock:
            if isinstance(result, list):
                entry.stat, entry.error = result, ""
                self._stats["persisted"] += 1
                self._stats["bytes_persisted"] += entry.region.size
                if self.unserviceable:
                    log.warning("storage works again (%s persisted): daemon serviceable", entry.path)
                self.unserviceable, self._consecutive = False, 0
                d.journal.append({"d": entry.seq}, sync=False)
                if not any(e.state in (PENDING, PERSISTING, FAILED) for e in d.entries.values()) and \
                        os.path.getsize(d.journal_path) > (1 << 20):
                    d.journal.rewrite([])          # nothing unfinished: start a fresh journal
                newest = d.entries.get(entry.path) is entry
                if newest:
                    entry.state = PERSISTED
                    if not any(e.path == entry.path for e in self.queue):
                        remove_marker(entry.path)
                else:
                    entry.state = SUPERSEDED
                    entry.region.refs -= 1
                    entry.region.maybe_free()
                    if entry.deleted:
                        for p in (entry.path, marker_path(entry.path)):
                            try:
                                os.unlink(p)
                            except FileNotFoundError:
                                pass
            else:
                self._failed(entry, result)
            d.lock.notify_all()

    def _failed(self, entry: Entry, exc: Exception) -> None:
        entry.attempts += 1
        entry.error = f"{type(exc).__name__}: {exc}"
        if entry.attempts < self._retries:
            entry.state, entry.not_before = PENDING, time.monotonic() + 0.2 * 2 ** entry.attempts
        else:
            entry.state, entry.not_before = FAILED, time.monotonic() + _FAILED_RETRY_S
            if entry.attempts == self._retries:
                target = is_target_error(exc) or isinstance(exc, CheckpointError)   # path, or a bad image
                self._stats["target_errors" if target else "persist_failures"] += 1
                self._consecutive += 0 if target else 1
                log.error("persisting %s failed %d times (%s%s); its data stays in memory and is retried "
                          "every %.0f s", entry.path, entry.attempts, entry.error,
                          ": the target path is at fault, not a storage failure" if target else "", _FAILED_RETRY_S)
                _logging.event("acp_persist_failed", path=entry.path, error=entry.error, target=target)
                if self._consecutive >= self._threshold and not self.unserviceable:
                    self.unserviceable = True
                    log.error("ALARM: %d consecutive storage failures: daemon unserviceable, clients will "
                              "write storage directly until it recovers", self._consecutive)
                    _logging.event("acp_unserviceable", failures=self._consecutive)
        self.queue.append(entry)

    def give_up(self, entry: Entry, why: str) -> None:
        """Stop trying to persist ``entry`` (caller holds the lock): it is reported lost by path."""
        self._lost({"path": entry.path, "c": entry.seq}, f"{why} before it could be persisted ({entry.error})")
        self.d.journal.append({"x": entry.seq})
        entry.state = SUPERSEDED
        if entry in self.queue:
            self.queue.remove(entry)

    # ---- recovery -------------------------------------------------------------------------------
    def _distrust(self, rec) -> str:
        """Why a journal record must not be replayed ('' when it may)."""
        fields = {"c": int, "path": str, "file": str, "off": int, "size": int, "mode": int}
        if not isinstance(rec, dict) or any(not isinstance(rec.get(k, 0o644 if k == "mode" else None), t)
                                            for k, t in fields.items()):
            return "malformed record"
        if rec.get("kind") not in ("acp", "raw") or rec["off"] < 0 or rec["size"] < 0 or \
                not 0 <= rec.get("mode", 0o644) <= 0o777:
            return "malformed record"
        problem = target_problem(rec["path"])
        if problem:
            return problem
        if os.path.dirname(rec["file"]) != self.d.pool_dir or not os.path.basename(rec["file"]).startswith("pool-"):
            return f"its bytes would come from {rec['file']}, outside this daemon's pool directory {self.d.pool_dir}"
        return ""

    def recover(self, records: list) -> list:
        """Re-install unfinished commits from a previous daemon; returns the records still pending."""
        maps: dict = {}
        newest: dict = {}
        trusted = []
        for rec in records:
            why = self._distrust(rec)
            if why:
                log.error("refused journal record %.300r: %s; nothing is written for it", rec, why)
                _logging.event("acp_refused", what="journal record", reason=why)
            else:
                trusted.append(rec)
        for rec in trusted:
            if rec["path"] not in newest or rec["c"] > newest[rec["path"]]["c"]:
                newest[rec["path"]] = rec
        kept = []
        for rec in sorted(newest.values(), key=lambda r: r["c"]):
            if self._written_behind(rec):
                # written directly (fallback) after this commit: the file is newer, keep it
                log.warning("not recovering %s: the file on storage is newer than the unpersisted "
                            "version (seq %d)", rec["path"], rec["c"])
                remove_marker(rec["path"])
                continue
            try:
                padded = self._recovered_view(rec, maps)
                view = padded[: rec["size"]]
                if rec["kind"] == "acp":
                    fmt.header_info(view, name=rec["path"])
            except Exception as exc:
                self._lost(rec, f"{type(exc).__name__}: {exc}")
                continue
            region = Region(rec["file"], rec["off"], rec["size"], view, padded, self._release_recovered(maps))
            entry = Entry(rec["c"], rec["path"], region, rec["kind"], rec.get("mode", 0o644))
            region.refs += 1
            self.d.entries[entry.path] = entry
            self.d.by_seq[entry.seq] = entry
            self.d._last_seq = max(self.d._last_seq, entry.seq)
            self.enqueue(entry)
            kept.append(rec)
            log.warning("recovered unpersisted checkpoint %s from %s; persisting it now", rec["path"], rec["file"])
        return kept

    @staticmethod
    def _written_behind(rec: dict) -> bool:
        """True when the target of the unfinished commit ``rec`` was written by someone else after it.
        Told by identity: the file must be the version it was at the commit or one this daemon wrote
        (Journal.load's "known"); no file is no newer write. Journals of earlier versions have no "pre":
        there the file's mtime is compared with the commit's time (seq, microseconds), which a write within
        one tick of the file system's coarse clock after the commit can pass unseen."""
        now = current_key(rec["path"])
        if now is None:
            return False
        if "known" in rec:
            return now not in rec["known"]
        return now[1] // 1000 > rec["c"]

    @staticmethod
    def _recovered_view(rec: dict, maps: dict) -> memoryview:
        path = rec["file"]
        if path not in maps:
            fd = open_private(path, os.O_RDWR)
            try:
                maps[path] = [mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED), 0]
            finally:
                os.close(fd)
        mm = maps[path][0]
        if rec["off"] + rec["size"] > len(mm):
            raise ValueError(f"pool file {path} is shorter than the recorded region")
        maps[path][1] += 1
        end = min(len(mm), rec["off"] + -(-rec["size"] // mmap.PAGESIZE) * mmap.PAGESIZE)
        return memoryview(mm)[rec["off"]: end]

    @staticmethod
    def _release_recovered(maps: dict):
        def release(region: Region) -> None:
            entry = maps[region.file]
            entry[1] -= 1
            if entry[1] == 0:
                try:
                    os.unlink(region.file)   # last recovered region of an old pool: drop the file
                except OSError:
                    pass
        return release

    def _lost(self, rec: dict, reason: str) -> None:
        record = {"path": rec["path"], "seq": rec["c"], "reason": reason, "time": time.time()}
        fd = open_private(os.path.join(self.d.dir, "lost.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.error("acknowledged checkpoint %s (seq %d) is LOST: %s; its previous version on storage is intact",
                  rec["path"], rec["c"], reason)
        _logging.event("acp_lost", path=rec["path"], reason=reason)

    def lost_records(self) -> list:
        try:
            with os.fdopen(open_private(os.path.join(self.d.dir, "lost.jsonl"), os.O_RDONLY)) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (FileNotFoundError, ValueError):
            return []
