"""Durable-storage side of the checkpoint store: atomic file writes, in-progress markers, the journal.

Atomic write protocol (daemon and client fallback alike): write ``.<name>.mindio-tmp.<tag>`` in the
target directory, fsync it, rename it over the target, fsync the directory. A reader therefore sees
either the previous file or the complete new one, never a torn one.

A marker ``.<name>.mindio-pending`` sits next to a checkpoint whose newest version is only in memory;
the daemon removes it after the rename. The journal (in the runtime directory) records, fsynced
before a save is acknowledged, every commit and its completion, so a restarted daemon knows which
acknowledged saves it must still persist or report lost by name.
"""
from __future__ import annotations

import errno
import json
import os
import threading

__all__ = ["atomic_write", "atomic_write_direct", "marker_path", "write_marker", "remove_marker", "Journal", "is_internal_name"]

_CHUNK = 64 << 20


def is_internal_name(name: str) -> bool:
    """True for the temp files and markers mindio leaves in checkpoint directories."""
    return name.startswith(".") and (".mindio-tmp." in name or name.endswith(".mindio-pending"))


def marker_path(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.mindio-pending")


def write_marker(path: str, info: dict) -> None:
    with open(marker_path(path), "w") as f:
        json.dump(info, f)


def remove_marker(path: str) -> None:
    try:
        os.unlink(marker_path(path))
    except FileNotFoundError:
        pass


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, chunks, mode: int = 0o644, tag: str = "") -> os.stat_result:
    """Write the byte chunks to ``path`` atomically and durably; returns the new file's stat."""
    head, tail = os.path.split(path)
    tmp = os.path.join(head, f".{tail}.mindio-tmp.{tag or os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        _write_all(fd, chunks)
        os.fsync(fd)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.rename(tmp, path)
    fsync_dir(head)
    return os.stat(path)


def _write_all(fd: int, chunks) -> None:
    """Write every byte of every chunk, in pieces of at most _CHUNK bytes (short writes retried)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), _CHUNK):
            piece = view[start: start + _CHUNK]
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])


def atomic_write_direct(path: str, parts: list, size: int, mode: int = 0o644, tag: str = "") -> os.stat_result:
    """Like atomic_write, but with O_DIRECT: the bytes go from memory to the device without passing
    through the page cache (no page-cache allocation, almost no CPU). Every part must start page
    aligned and be a multiple of 4096 bytes long (the last may run past ``size``: the file is cut
    to ``size`` afterwards). Falls back to a buffered write where the file system refuses O_DIRECT.
    """
    head, tail = os.path.split(path)
    tmp = os.path.join(head, f".{tail}.mindio-tmp.{tag or os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return _buffered_fallback(path, parts, size, mode, tag)
    try:
        _write_all(fd, parts)
        os.ftruncate(fd, size)
        os.fsync(fd)
        os.fchmod(fd, mode)
    except OSError as exc:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno == errno.EINVAL:
            return _buffered_fallback(path, parts, size, mode, tag)
        raise
    os.close(fd)
    os.rename(tmp, path)
    fsync_dir(head)
    return os.stat(path)


def _buffered_fallback(path, parts, size, mode, tag):
    chunks, left = [], size
    for part in parts:
        view = memoryview(part).cast("B")[:left]
        chunks.append(view)
        left -= len(view)
    return atomic_write(path, chunks, mode=mode, tag=tag)


class Journal:
    """Append-only JSON-lines log of commits ("c"), completions ("d") and drops ("x"), fsynced per write."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)

    @staticmethod
    def pending(path: str) -> list:
        """Commits without a matching completion or drop, in commit order."""
        commits: dict = {}
        try:
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a torn last line from a crash: its commit was never acknowledged
                    if "c" in rec:
                        commits[rec["c"]] = rec
                    elif "d" in rec:
                        commits.pop(rec["d"], None)
                    elif "x" in rec:
                        commits.pop(rec["x"], None)
        except FileNotFoundError:
            pass
        return list(commits.values())

    def append(self, record: dict, sync: bool = True) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            if sync:
                os.fdatasync(self._f.fileno())

    def rewrite(self, records: list) -> None:
        """Replace the journal with ``records`` (the still-pending commits), atomically."""
        with self._lock:
            self._f.close()
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.path)
            self._f = open(self.path, "a", buffering=1)

    def close(self) -> None:
        with self._lock:
            self._f.close()
