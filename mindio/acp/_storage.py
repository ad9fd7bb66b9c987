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
import hashlib
import json
import logging
import os
import secrets
import socket
import stat
import threading

from .._secure import open_private, umask

__all__ = ["atomic_write", "atomic_write_direct", "atomic_torch_save", "stat_key", "current_key", "marker_path",
           "temp_path", "write_marker", "remove_marker", "Journal", "is_internal_name", "is_target_error",
           "target_problem", "sweep_temps", "file_mode", "fsync_dir"]

log = logging.getLogger(__name__)
_CHUNK = 64 << 20
_NAME_MAX = 255            # bytes in one file name (Linux file systems)
_PID_LIMIT = 1 << 22       # pids are below this (pid_max); journal seqs (microsecond times) far above
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]   # temp files on shared storage
# errors that come from the target path (a user error), not from the storage: they never count
# towards the daemon's unserviceable state
_TARGET_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.EACCES, errno.EPERM,
                  errno.ELOOP, errno.EEXIST}


def is_internal_name(name: str) -> bool:
    """True for the temp files and markers mindio leaves in checkpoint directories."""
    return name.startswith(".") and (".mindio-tmp." in name or name.endswith(".mindio-pending"))


def is_target_error(exc: BaseException) -> bool:
    """True when writing failed because of the target path (missing or replaced directory, a
    directory in the way, name too long, no permission), not because of the storage."""
    return isinstance(exc, OSError) and exc.errno in _TARGET_ERRNOS


def target_problem(path) -> str:
    """Why ``path`` cannot name a checkpoint file ('' when it can): it must be an absolute, normalized
    path whose file name fits the 255 bytes of a name."""
    if not isinstance(path, str) or "\0" in path or not os.path.isabs(path) or os.path.normpath(path) != path:
        return f"target {path!r} is not an absolute, normalized path"
    name = os.fsencode(os.path.basename(path))
    if not name:
        return f"target {path!r} names a directory, not a file"
    if len(name) > _NAME_MAX:
        return f"the file name of {path} has {len(name)} bytes, more than the {_NAME_MAX} a name may have"
    return ""


def file_mode() -> int:
    """The mode torch.save gives a new file: 0o666 less the process's current umask."""
    return 0o666 & ~umask()


def _sidecar(path: str, suffix: str) -> str:
    """``.<name><suffix>`` next to ``path``; when that exceeds a file name's 255 bytes, the name is cut
    and a hash of the whole name added, so every target still gets its own."""
    head, tail = os.path.split(path)
    name = f".{tail}{suffix}"
    if len(name.encode()) > _NAME_MAX:
        digest = hashlib.sha1(tail.encode()).hexdigest()[:12]
        keep = _NAME_MAX - len(f".~{digest}{suffix}".encode())
        name = f".{tail.encode()[:keep].decode(errors='ignore')}~{digest}{suffix}"
    return os.path.join(head, name)


def marker_path(path: str) -> str:
    return _sidecar(path, ".mindio-pending")


def temp_path(path: str, tag: str) -> str:
    """The temp file of one write of ``path`` (tag: the daemon's seq or the writer's pid)."""
    return _sidecar(path, f".mindio-tmp.{_HOST}.{tag}")


def write_marker(path: str, info: dict) -> None:
    """A new marker file (never through a link or into a file that was already there)."""
    marker = marker_path(path)
    _unlink(marker)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_marker(path: str) -> None:
    _unlink(marker_path(path))


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own_file(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _create_temp(path: str, tag: str, flags: int = 0) -> tuple:
    """(fd, name) of a new temp file next to ``path``: O_EXCL|O_NOFOLLOW, mode 0600 until written.
    A stale temp file of ours with the same name (a crash mid-write) is replaced; a name held by
    anything else is left alone and a random one used instead."""
    tmp = temp_path(path, tag)
    for attempt in range(3):
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | flags,
                           0o600), tmp
        except FileExistsError:
            if attempt == 0 and _own_file(tmp):
                _unlink(tmp)
            else:
                log.warning("temporary file name %s is taken by something that is not a file of ours "
                            "(planted by another user?): left alone, using another name", tmp)
                tmp = temp_path(path, f"{tag}-{secrets.token_hex(4)}")
    raise FileExistsError(errno.EEXIST, f"cannot create a temporary file next to {path}: every name tried exists")


def _atomic(path: str, fill, mode: int, tag: str, flags: int = 0, before_rename=None,
            durable: bool = True) -> os.stat_result:
    """Create a temp file, ``fill(fd)`` it, set ``mode``, fsync, rename over ``path``, fsync the
    directory; returns the new file's stat. ``before_rename(stat)`` is called with the file's final
    stat before it replaces ``path`` (the daemon journals it: mindio/acp/_persist.py). The temp file is
    removed on every failure. ``durable=False``: no fsync (the rename is still atomic for readers); the
    caller makes the file durable later (:func:`fsync_files`) before anything points at it."""
    fd, tmp = _create_temp(path, tag or str(os.getpid()), flags)
    try:
        try:
            fill(fd)
            os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename(st)
        os.rename(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))
    return st


def atomic_write(path: str, chunks, mode: int = 0o644, tag: str = "", before_rename=None,
                 durable: bool = True) -> os.stat_result:
    """Write the byte chunks to ``path`` atomically and (unless ``durable=False``: see :func:`_atomic`)
    durably; returns the new file's stat."""
    return _atomic(path, lambda fd: _write_all(fd, chunks), mode, tag, before_rename=before_rename,
                   durable=durable)


def fsync_files(paths) -> None:
    """Make files written with ``durable=False`` durable: fsync each (a file another process wrote too:
    its dirty pages are the file's, not the writer's), then each directory once. Only regular files are
    touched: a symlink or a FIFO planted under such a name is skipped (opened without following it and
    without blocking)."""
    dirs = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOENT, errno.ENXIO):  # a symlink, gone, a FIFO nobody writes
                continue
            raise
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fsync(fd)
        finally:
            os.close(fd)
        d = os.path.dirname(path)
        if d not in dirs:
            dirs.append(d)
    for d in dirs:
        fsync_dir(d)


def atomic_torch_save(obj, path: str, mode: int) -> os.stat_result:
    """torch.save ``obj`` to ``path`` through the same temp file + rename as atomic_write."""
    import torch

    def fill(fd: int) -> None:
        with os.fdopen(fd, "wb", closefd=False) as f:
            torch.save(obj, f)

    return _atomic(path, fill, mode, "")


def _write_all(fd: int, chunks) -> None:
    """Write every byte of every chunk, in pieces of at most _CHUNK bytes (short writes retried)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), _CHUNK):
            piece = view[start: start + _CHUNK]
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])


def atomic_write_direct(path: str, parts: list, size: int, mode: int = 0o644, tag: str = "",
                        before_rename=None) -> os.stat_result:
    """Like atomic_write, but with O_DIRECT: the bytes go from memory to the device without passing
    through the page cache (no page-cache allocation, almost no CPU). Every part must start page
    aligned and be a multiple of 4096 bytes long (the last may run past ``size``: the file is cut
    to ``size`` afterwards). Falls back to a buffered write where the file system refuses O_DIRECT.
    """
    def fill(fd: int) -> None:
        _write_all(fd, parts)
        os.ftruncate(fd, size)

    try:
        return _atomic(path, fill, mode, tag, os.O_DIRECT, before_rename)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    chunks, left = [], size            # the file system refuses O_DIRECT: buffered
    for part in parts:
        view = memoryview(part).cast("B")[:left]
        chunks.append(view)
        left -= len(view)
    return atomic_write(path, chunks, mode=mode, tag=tag, before_rename=before_rename)


def stat_key(st) -> list:
    """What identifies one version of a file: [inode, mtime in ns, size] (an atomic rename brings a new
    inode; a write in place a new mtime or size)."""
    return [st.st_ino, st.st_mtime_ns, st.st_size]


def current_key(path: str):
    """``stat_key`` of ``path`` now, or None where there is no file."""
    try:
        return stat_key(os.stat(path))
    except OSError:
        return None


def sweep_temps(records: list) -> list:
    """Remove the temp files a crash left next to the journal's targets: this daemon's own (tagged
    with a journalled seq) and those of writers on this host that are gone (tagged with a pid that no
    process has). Only regular files owned by the caller. Returns the removed paths."""
    seqs: dict = {}
    for rec in records:
        if isinstance(rec.get("path"), str) and os.path.isabs(rec["path"]) and isinstance(rec.get("c"), int):
            seqs.setdefault(os.path.dirname(rec["path"]), set()).add(str(rec["c"]))
    removed = []
    for directory, known in seqs.items():
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if not name.startswith(".") or f".mindio-tmp.{_HOST}." not in name:
                continue
            tag = name.rsplit(f".mindio-tmp.{_HOST}.", 1)[1].split("-")[0]
            if tag.isdigit() and (tag in known or (int(tag) < _PID_LIMIT and not _pid_alive(int(tag)))):
                path = os.path.join(directory, name)
                if _own_file(path):
                    _unlink(path)
                    removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Journal:
    """Append-only JSON-lines log of commits ("c"), completions ("d"), drops ("x") and the daemon's own
    writes ("r": the stat of a file it is about to rename over a target), fsynced per write. A commit
    records the target's stat at commit time ("pre"). Its file must be private to the daemon's user
    (opened O_NOFOLLOW and checked by descriptor)."""

    _FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._f = os.fdopen(open_private(path, self._FLAGS), "a", buffering=1)

    @staticmethod
    def load(path: str) -> tuple:
        """(commits without a matching completion or drop, every commit), in commit order. Each pending
        commit that records its target's stat at commit time gets ``"known"``: that stat and those of the
        daemon's own writes of the target, the versions of the file a recovery may replace."""
        commits: dict = {}
        every: list = []
        own: dict = {}
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return [], []
        with os.fdopen(fd) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a crash: its commit was never acknowledged
                if not isinstance(rec, dict):
                    continue
                if "c" in rec:
                    commits[rec["c"]] = rec
                    every.append(rec)
                elif "d" in rec:
                    commits.pop(rec["d"], None)
                elif "x" in rec:
                    commits.pop(rec["x"], None)
                elif "r" in rec and isinstance(rec.get("path"), str):
                    own.setdefault(rec["path"], []).append(rec.get("stat"))
        pending = list(commits.values())
        for rec in pending:
            if "pre" in rec:  # "known" already there: kept through an earlier recovery's rewrite
                prior = rec["known"] if isinstance(rec.get("known"), list) else []
                rec["known"] = [rec["pre"], *prior, *own.get(rec.get("path"), [])]
        return pending, every

    def append(self, record: dict, sync: bool = True) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            if sync:
                os.fdatasync(self._f.fileno())

    def rewrite(self, records: list) -> None:
        """Replace the journal with ``records`` (the still-pending commits), atomically and durably."""
        with self._lock:
            self._f.close()
            tmp = self.path + ".tmp"
            _unlink(tmp)
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.path)
            fsync_dir(os.path.dirname(self.path))
            self._f = os.fdopen(open_private(self.path, self._FLAGS), "a", buffering=1)

    def close(self) -> None:
        with self._lock:
            self._f.close()
