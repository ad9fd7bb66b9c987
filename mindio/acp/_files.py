"""File-style access (open_file/create_file), completion checkers and the async save handle.

``open_file(path)`` reads the newest pooled bytes of a path, else the file. ``create_file(path)``
buffers ``write``s and, on ``close``, stores the bytes in the pool (persisted in the background) or,
without a daemon, writes the file atomically; ``drop`` discards them and deletes the file.
``register_checker`` watches directories on a thread and calls ``callback(0 | 1, user_context)``.
``async_save`` saves like ``save`` and returns a handle whose ``wait`` re-raises a persistence failure.
"""
from __future__ import annotations

import io
import logging
import os
import threading
import time

from ..errors import CheckpointError, ConfigError, ServerUnavailable
from .. import _secure
from . import _storage, api

__all__ = ["open_file", "open_stream", "create_file", "register_checker", "async_save", "SaveHandle"]

log = logging.getLogger(__name__)


class _ReadableFileWrapper:
    def __init__(self, path: str):
        self.path = path
        self._data = api._pooled(path)
        if self._data is None:
            with open(path, "rb") as f:
                self._data = f.read()
        self.size = len(self._data)

    def read(self, offset: int = 0, count: int = -1) -> bytes:
        if self._data is None:
            raise ValueError(f"{self.path} is closed")
        if count == -1:
            count = self.size - offset
        if not (0 <= offset <= self.size and 0 <= count and offset + count <= self.size) or (
                self.size and offset == self.size and count):
            raise ValueError(f"read(offset={offset}, count={count}) outside {self.path} ({self.size} bytes): "
                             "need 0 <= offset, 0 < count, offset + count <= file size")
        return bytes(self._data[offset: offset + count])

    def close(self) -> None:
        self._data = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ViewStream(io.RawIOBase):
    """A read-only, seekable binary stream over a buffer (the pooled bytes of a file): ``readinto`` is
    one copy from the buffer into the caller's, nothing is read that is not asked for."""

    def __init__(self, view, path: str):
        super().__init__()
        self._view = memoryview(view).cast("B")
        self._pos = 0
        self.name = path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset} in {self.name}: negative position")
        self._pos = base + offset
        return self._pos

    def readinto(self, b) -> int:
        if self.closed:
            raise ValueError(f"{self.name} is closed")
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._view.release()  # the pool's lease goes with the last reference to the region
        super().close()


def open_stream(path) -> io.RawIOBase:
    """A seekable binary stream of the newest version of ``path``: a view of its pooled bytes (read in
    place, only the ranges asked for) when the pool holds it, else the file on storage. Close it (or use
    it as a context manager)."""
    path = api._resolve(path)
    view = api._pooled(path)
    if view is None:
        return open(path, "rb", buffering=0)
    return _ViewStream(view, path)


class _WriteableFileWrapper:
    def __init__(self, path: str, mode: int):
        self.path, self.mode = path, mode
        self._chunks: list[bytes] | None = []

    def write(self, data) -> int:
        if self._chunks is None:
            raise ValueError(f"{self.path} is closed")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write() takes bytes, not {type(data).__name__}")
        self._chunks.append(bytes(data))
        return len(data)

    def drop(self) -> None:
        """Discard what was written and delete the file (from the pool and from storage)."""
        self._chunks = None
        client = api._get_client()
        if client is not None:
            try:
                client.request({"op": "delete", "path": self.path})
            except ServerUnavailable:
                pass
        for p in (self.path, _storage.marker_path(self.path)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def _store(self) -> int:
        data = b"".join(self._chunks or [])
        client = api._get_client()
        if client is not None:
            try:
                client.save_image(len(data), lambda buf, copy: copy(buf, [(0, data)]) if data else None,
                                  [self.path], kind="raw", mode=self.mode)
                return 1
            except (api.PoolFull, ServerUnavailable) as exc:
                api._note_fallback("direct write", str(exc))
        _storage.atomic_write(self.path, [data], mode=self.mode)
        return 2

    def close(self) -> None:
        if self._chunks is not None:
            self._store()
            self._chunks = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self._chunks = None


def open_file(path) -> _ReadableFileWrapper:
    """Open a checkpoint file for reading, from the memory pool when it is there: ``read(offset=0,
    count=-1)`` returns bytes, ``close()``; usable as a context manager. The path resolves as the OS
    resolves it."""
    return _ReadableFileWrapper(api._resolve(path))


def create_file(path, mode: int = 0o600) -> _WriteableFileWrapper:
    """Create a file through the store: ``write(bytes)`` appends, ``close()`` commits it (persisted in
    the background), ``drop()`` discards it; usable as a context manager. ``mode`` (default 0o600)
    less the umask (as open() applies it) is the file's permission bits on storage."""
    if not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ConfigError(f"create_file mode={mode!r}: expected an int in [0o000, 0o777]")
    return _WriteableFileWrapper(api._target(path), mode & ~_secure.umask())


def write_region(path, size: int, write, mode: int = 0o600) -> bool:
    """Commit ``size`` bytes under ``path``, written in place into a region of the memory pool (no
    intermediate buffer): ``write(buf, copy_many)`` fills ``buf``, a writable memoryview of exactly
    ``size`` bytes; ``copy_many(buf, [(offset, src), ...])`` copies big sources with the store's parallel
    copy. True once committed (persisted in the background); False when there is no pool to write into
    (no daemon, pool full, unserviceable: logged once) -- the caller writes the file another way. An
    exception of ``write`` aborts the region and propagates. ``mode`` less the umask is the file's mode."""
    client = api._get_client()
    if client is None or size <= 0:
        return False
    try:
        client.save_image(size, write, [api._target(path)], kind="raw", mode=mode & ~_secure.umask())
        return True
    except (api.PoolFull, ServerUnavailable) as exc:
        api._note_fallback("direct write", str(exc))
        return False


def _count_files(directory: str) -> int:
    try:
        return sum(1 for e in os.scandir(directory)
                   if e.is_file(follow_symlinks=False) and not _storage.is_internal_name(e.name))
    except FileNotFoundError:
        return -1


def register_checker(callback, check_dict, user_context, timeout_sec):
    """Call ``callback(0, user_context)`` once every directory holds its file count on storage (all
    persisted), or ``callback(1, user_context)`` after ``timeout_sec``. Returns 1, or None on bad input."""
    if not callable(callback) or not isinstance(check_dict, dict) or not check_dict:
        log.error("register_checker: need a callable and a non-empty {directory: file_count} dict")
        return None
    if not isinstance(timeout_sec, (int, float)) or not 1 <= timeout_sec <= 3600:
        log.error("register_checker: timeout_sec=%r outside [1, 3600]", timeout_sec)
        return None
    dirs = {os.path.abspath(d): int(n) for d, n in check_dict.items()}

    def watch():
        deadline = time.monotonic() + timeout_sec
        while True:
            ok = all(_count_files(d) == n and not any(_storage.is_internal_name(x) for x in os.listdir(d))
                     for d, n in dirs.items() if os.path.isdir(d)) and all(os.path.isdir(d) for d in dirs)
            if ok or time.monotonic() >= deadline:
                if not ok:
                    log.error("watching checkpoint failed: %s not complete after %s s", dirs, timeout_sec)
                try:
                    callback(0 if ok else 1, user_context)
                except Exception:
                    log.exception("register_checker callback raised")
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="mindio-acp-checker", daemon=True).start()
    return 1


class SaveHandle:
    """Completion of one async_save: ``done()`` polls, ``wait(timeout)`` blocks and re-raises failures."""

    def __init__(self, paths: list, seqs: list, rc: int):
        self.paths, self.seqs, self.rc = paths, seqs, rc
        self._final: list | None = None if seqs else []

    def _check(self, entries: list) -> bool:
        busy = [e for e in entries if e["state"] in ("pending", "persisting")]
        failed = [e for e in entries if e["state"] in ("failed", "unknown")]
        if failed:
            raise CheckpointError(f"persisting {[e.get('path', e['seq']) for e in failed]} failed: "
                                  f"{[e.get('error', 'daemon lost it') for e in failed]}")
        if not busy:
            self._final = entries
        return not busy

    def done(self) -> bool:
        """Has the save reached storage? Never blocks."""
        if self._final is not None:
            return True
        return self.wait(timeout=0, _raise_timeout=False)

    def wait(self, timeout: float | None = None, _raise_timeout: bool = True) -> bool:
        """Block until the save reached storage and return True; TimeoutError after ``timeout`` s (default
        3600); re-raises a persistence failure."""
        if self._final is not None:
            return True
        client = api._get_client()
        if client is None:
            raise CheckpointError(f"cannot learn whether {self.paths} persisted: daemon unavailable")
        limit = 3600.0 if timeout is None else float(timeout)
        reply = client.side_request({"op": "wait", "seqs": self.seqs, "timeout": limit}, limit)
        finished = self._check(reply["entries"])
        if not finished and _raise_timeout:
            raise TimeoutError(f"{self.paths} not persisted within {limit} s")
        return finished


def async_save(obj, path, open_way: str = "memfs") -> SaveHandle:
    """Save (blocking only for the copy into memory) and return a handle on the persistence."""
    target = api._target(path)
    rc, seqs = api._save(obj, [target], open_way)
    if rc == -1:
        raise CheckpointError(f"saving {target} failed on every path; see the log")
    return SaveHandle([target], seqs, rc)
