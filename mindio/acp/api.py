"""The ACP functions with the reference's names, arguments and return codes.

save/multi_save return 1 (kept in the memory pool, persisted in the background), 2 (written to
storage directly: open_way='fopen', daemon absent/full/unserviceable), 0 (fell back to torch.save:
the object cannot be expressed in the mindio format) or -1 / None (failed; the reason is logged).
Every fallback is logged once per process and counted (``fallback_counts()``).

load reads the newest pooled version of a path when the daemon has one (zero-copy, copy-on-write),
otherwise the file: a mindio container (verified) or a plain torch.save file (torch.load).

Paths resolve as the OS resolves them (symbolic links, then ``..``), like torch.save and torch.load.
A target torch.save could not write (a directory, a missing directory, a name too long, no
permission) is refused by save() itself: -1 and a logged reason, never handed to the daemon. New
files get torch.save's mode: 0o666 less the caller's umask.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import pickle
import struct
import threading
import time

from .. import _knobs
from ..errors import CheckpointError, ConfigError, CorruptCheckpoint, ServerUnavailable
from . import _config, _storage
from . import format as fmt
from .client import Client, PoolFull

__all__ = ["initialize", "save", "multi_save", "load", "preload", "flush", "convert",
           "fallback_counts", "lost_checkpoints", "server_stat", "shutdown_server", "reset"]

log = logging.getLogger(__name__)

_lock = threading.RLock()
_client: Client | None = None
_cfg: _config.ServerConfig | None = None
_server_info: dict | None = None
_retry_after = 0.0
_counts: dict = {}
_lost: list = []
_RETRY_S = 60.0          # after a failed start, saves write storage directly for this long


def _note_fallback(kind: str, why: str) -> None:
    _counts[kind] = _counts.get(kind, 0) + 1
    if _counts[kind] == 1:
        log.warning("checkpoint fallback to %s: %s (logged once; see mindio.acp.fallback_counts())", kind, why)


def fallback_counts() -> dict:
    """How many saves took each fallback path in this process."""
    return dict(_counts)


def lost_checkpoints() -> list:
    """Acknowledged saves a crashed daemon could not persist: [{path, seq, reason, time}]."""
    return list(_lost)


def initialize(server_info: dict | None = None) -> int:
    """Validate ``server_info``, start or reach the daemon, map its pool. 0 ok, -1 failure (logged).

    Raises ConfigError for unknown keys or out-of-range values.
    """
    global _client, _cfg, _server_info, _retry_after
    cfg = _config.parse_server_info(server_info)
    with _lock:
        _cfg, _server_info = cfg, dict(server_info or {})
        if _knobs.get("MINDIO_ACP_DISABLE"):
            log.info("MINDIO_ACP_DISABLE=1: checkpoints are written to storage directly")
            return 0
        if _client is not None and _client.alive():
            return 0
        try:
            _client = Client(cfg, _config.runtime_dir(), server_info)
            _client.connect()
            lost = _client.request({"op": "lost"})["lost"]
        except (CheckpointError, OSError) as exc:   # unreachable, or an insecure runtime directory
            log.error("mindio.acp.initialize failed: %s; saves will write storage directly (next attempt "
                      "in %.0f s at the earliest)", exc, _RETRY_S)
            _client = None
            _retry_after = time.monotonic() + _RETRY_S
            return -1
        for rec in lost:
            if rec not in _lost:
                _lost.append(rec)
                log.error("checkpoint %s was acknowledged but LOST when the daemon died (%s); the previous "
                          "version of that file, if any, is intact", rec["path"], rec["reason"])
    return 0


def _get_client() -> Client | None:
    """The connected client, (re)connecting when needed; None means 'write storage directly'."""
    global _client, _retry_after
    with _lock:
        if _client is not None and _client.alive():
            return _client
        if _knobs.get("MINDIO_ACP_DISABLE") or time.monotonic() < _retry_after:
            return None
        if _client is not None and _client.pid != os.getpid():
            _client = None            # forked child: never share the parent's socket
        if initialize(_server_info) != 0:
            return None
        return _client


def _resolve(path) -> str:
    """``path`` made absolute with every symbolic link and ``..`` resolved as the OS does."""
    return os.path.realpath(os.fspath(path))


def _target(path) -> str:
    """The file a save of ``path`` writes; raises OSError (errno and message as torch.save would meet
    them) for a target that cannot be written, so that it never reaches the daemon."""
    path = _resolve(path)
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, f"cannot save {path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"cannot save {path}: it is a directory; pass a file path")
    problem = _storage.target_problem(path)
    if problem or len(os.fsencode(path)) >= os.pathconf(parent, "PC_PATH_MAX"):
        raise OSError(errno.ENAMETOOLONG, f"cannot save {path}: {problem or 'the path is too long'}")
    if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids) and \
            not os.statvfs(parent).f_flag & os.ST_RDONLY:     # a read-only file system is a storage failure
        raise PermissionError(errno.EACCES, f"cannot save {path}: no permission to create files in {parent}")
    return path


def _check_way(open_way: str) -> None:
    if open_way not in ("memfs", "fopen"):
        raise ConfigError(f"open_way={open_way!r}: expected 'memfs' or 'fopen'")


def _save(obj, paths: list, open_way: str):
    _check_way(open_way)
    mode = _storage.file_mode()
    try:
        plan = fmt.plan(obj)
    except Exception as exc:  # unsupported object: torch.save can still store it
        _note_fallback("torch.save", f"object not expressible in the mindio format ({exc})")
        return _torch_save(obj, paths, mode), []
    client = _get_client() if open_way == "memfs" else None
    if client is not None:
        try:
            write = functools.partial(plan.write_into, to_host=client.device.to_host)
            return 1, client.save_image(plan.total_len, write, paths, mode=mode)
        except (PoolFull, ServerUnavailable) as exc:
            _note_fallback("direct write", str(exc))
    elif open_way == "memfs":
        _note_fallback("direct write", "mindio-acp-server unavailable or disabled")
    try:
        for path in paths:
            _storage.atomic_write(path, plan.file_chunks(), mode=mode)
        return 2, []
    except OSError as exc:
        _note_fallback("torch.save", f"direct write failed: {exc}")
        return _torch_save(obj, paths, mode), []


def _torch_save(obj, paths: list, mode: int) -> int:
    try:
        for path in paths:
            _storage.atomic_torch_save(obj, path, mode)
        return 0
    except Exception as exc:
        log.error("saving %s failed on every path (memory pool, direct write, torch.save): %s", paths, exc)
        return -1


def _is_stream(f) -> bool:
    """A file-like object (what torch.save and torch.load take besides a path)."""
    return not isinstance(f, (str, bytes, os.PathLike)) and (hasattr(f, "write") or hasattr(f, "read"))


def save(obj, path, open_way: str = "memfs") -> int:
    """Save ``obj`` to ``path``. Returns 1 (memory pool), 2 (direct write), 0 (torch.save), -1 (failed).

    ``path`` may also be a file-like object: it is written by torch.save (a counted fallback)."""
    if _is_stream(path):
        _check_way(open_way)
        _note_fallback("torch.save", "a file-like object, not a path: written by torch.save")
        import torch

        try:
            torch.save(obj, path)
        except Exception as exc:
            log.error("saving to %r failed (torch.save): %s", path, exc)
            return -1
        return 0
    try:
        rc, _ = _save(obj, [_target(path)], open_way)
    except OSError as exc:        # a target torch.save could not write either
        log.error("%s", exc.strerror or exc)
        return -1
    return rc


def multi_save(obj, path_list):
    """Save one object to several paths (one copy in the pool). Returns 1/2/0 like save, None on failure."""
    if not isinstance(path_list, (list, tuple)) or not path_list:
        raise ConfigError("multi_save: path_list must be a non-empty list of file paths")
    try:
        rc, _ = _save(obj, [_target(p) for p in path_list], "memfs")
    except OSError as exc:
        log.error("%s", exc.strerror or exc)
        return None
    return None if rc == -1 else rc


def _pooled(path: str):
    found = _pooled_region(path)
    return None if found is None else found[0]


def _pooled_region(path: str):
    """(view, to_device for load_buffer) of the newest pooled version of ``path``, or None."""
    client = _get_client()
    if client is None:
        return None
    try:
        found = client.open_region(path)
    except (ServerUnavailable, OSError):
        return None
    if found is None:
        return None
    mm, reply = found
    if reply["persisted"] and reply["stat"]:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None       # deleted behind mindio's back
        if _storage.stat_key(st) != list(reply["stat"]):
            return None       # replaced behind mindio's back: the file on storage is newer
    return mm, client.device_reader(reply)


def load(path, open_way: str = "memfs", map_location=None, weights_only: bool = True):
    """Load what ``save`` or ``torch.save`` wrote to ``path``; newest pooled version first.

    ``path`` may be a file-like object. A file that is damaged, or neither a mindio container nor a
    torch.save file, raises CorruptCheckpoint naming it."""
    _check_way(open_way)
    if _is_stream(path):
        return _load_stream(path, map_location, weights_only)
    path = _resolve(path)
    if open_way == "memfs":
        found = _pooled_region(path)
        if found is not None:
            mm, to_device = found
            if fmt.is_container(mm[:fmt.SNIFF]):
                return fmt.load_buffer(mm, path, weights_only=weights_only, map_location=map_location,
                                       to_device=to_device)
            return _torch_load_bytes(bytes(mm), map_location, weights_only, path)
    return _load_storage(path, map_location, weights_only)


def _torch_load_bytes(data: bytes, map_location, weights_only, name="<pooled bytes>"):
    import io

    return _torch_load_checked(io.BytesIO(data), name, bytes(data[:_SNIFF]), map_location, weights_only)


def _load_stream(f, map_location, weights_only):
    """Load from a file-like object: a mindio container or a torch.save stream."""
    name = getattr(f, "name", None) or f"<{type(f).__name__}>"
    start = f.tell() if hasattr(f, "tell") else 0
    head = f.read(_SNIFF)
    if not fmt.is_container(head):
        f.seek(start)
        return _torch_load_checked(f, name, head, map_location, weights_only)
    buf = bytearray(head + f.read())        # the tensors view this buffer
    return fmt.load_buffer(buf, name, weights_only=weights_only, map_location=map_location)


def _read_container(f):
    """The whole file of an open mindio container, into a buffer loaded tensors can view."""
    import torch

    size = os.fstat(f.fileno()).st_size
    buf = torch.empty(size, dtype=torch.uint8).numpy()
    f.seek(0)
    got = f.readinto(memoryview(buf))
    return buf[:got]


def _load_storage(path: str, map_location, weights_only):
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
        if fmt.is_container(head):
            buf = _read_container(f)
    if fmt.is_container(head):
        return fmt.load_buffer(buf, path, weights_only=weights_only, map_location=map_location)
    return _torch_load(path, map_location, weights_only, head)


_SNIFF = 512                 # a tar header's length: enough to recognise every torch.save layout
_ZIP = b"PK\x03\x04"          # torch.save since 1.6 (and anything else torch.load reads as a zip)
_LEGACY = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"   # torch's legacy magic number, pickled
# what torch's readers raise for malformed bytes (struct.error, UnicodeDecodeError, MemoryError for a
# crafted length, OSError for a bad seek, KeyError for a bad memo or record reference, ...)
_MALFORMED = (RuntimeError, EOFError, OSError, KeyError, IndexError, ValueError, TypeError, MemoryError,
              OverflowError, pickle.UnpicklingError, struct.error)


def torch_layout(head: bytes) -> str | None:
    """Which torch.save layout ``head`` (a file's first bytes) starts: 'zip', 'legacy', 'tar' or None."""
    head = bytes(head)
    if head.startswith(_ZIP):
        return "zip"
    if head.startswith(_LEGACY):
        return "legacy"
    if head[257:262] == b"ustar":
        return "tar"
    return None


def _torch_load(path: str, map_location, weights_only, head: bytes):
    """torch.load of a non-container file; a file that is no torch.save file, or too damaged to
    load, raises CorruptCheckpoint naming it (torch's own errors do not name the file)."""
    return _torch_load_checked(path, path, head, map_location, weights_only)


def _torch_load_checked(source, name: str, head: bytes, map_location, weights_only):
    import torch

    if torch_layout(head) is None:
        what = "empty" if not head else f"starts with {bytes(head[:8])!r}"
        raise CorruptCheckpoint(name, f"neither a mindio container nor a torch.save file ({what})")
    try:
        return torch.load(source, map_location=map_location, weights_only=weights_only)
    except _MALFORMED as exc:
        msg = str(exc)
        if weights_only and isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in msg:
            raise        # a well-formed file holding objects weights_only refuses: torch says what to do
        first = next((line.strip() for line in msg.splitlines() if line.strip()), "")
        raise CorruptCheckpoint(name, f"damaged torch.save file ({type(exc).__name__}: {first[:200]})") from exc


def preload(*paths, weights_only: bool = True) -> int:
    """Copy files from storage into the pool so later loads hit memory. 0 ok, 1 failure.

    Nothing in a file runs by default: a mindio container is verified (not unpickled) and pooled as
    it is, a later load() unpickles it with its own ``weights_only``; a torch.save file is read with
    ``torch.load(weights_only=weights_only)`` and pooled in the mindio format. Pass False only for
    torch.save files you trust.
    """
    client = _get_client()
    if client is None or not paths:
        return 1
    try:
        for path in paths:
            path = _resolve(path)
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(_SNIFF)
                data = _read_container(f) if fmt.is_container(head) else None
            if data is not None:
                fmt.verify(data, path)
                write = lambda buf, copy, data=data: copy(buf, [(0, data)])   # noqa: E731
                size = len(data)
            else:
                plan = fmt.plan(_torch_load(path, None, weights_only, head))
                write, size = plan.write_into, plan.total_len
            client.save_image(size, write, [path], kind="cache", stat=_storage.stat_key(st))
    except Exception as exc:
        log.error("preload of %s failed: %s", paths, exc)
        return 1
    return 0


def flush(timeout: float = 3600.0) -> int:
    """Wait until everything saved so far is on storage. 0 ok, 1 some file could not be persisted."""
    client = _get_client()
    if client is None:
        return 0   # nothing is held in memory when there is no daemon
    try:
        reply = client.side_request({"op": "flush", "timeout": timeout}, timeout)
    except ServerUnavailable as exc:
        log.error("flush failed: %s", exc)
        return 1
    if reply["failed"] or reply["pending"]:
        log.error("flush: %d file(s) could not be persisted yet: %s (still %d pending); their data stays in "
                  "memory and the daemon keeps retrying", len(reply["failed"]), reply["failed"], reply["pending"])
        return 1
    return 0


def convert(src, dst, *, weights_only: bool = False) -> int:
    """Write ``src`` (any checkpoint load() reads) to ``dst`` as a plain torch.save file. 0 ok, -1 failure.

    Loads ``src`` with ``weights_only=False`` by default, as the reference does: convert only files you
    trust (``mindio convert`` loads weights-only unless told ``--trust``)."""
    try:
        convert_or_raise(src, dst, weights_only=weights_only)
        return 0
    except Exception as exc:
        log.error("convert %s -> %s failed: %s", src, dst, exc)
        return -1


def convert_or_raise(src, dst, *, weights_only: bool = True, open_way: str = "memfs") -> None:
    """convert(), raising what failed (``mindio convert`` reads storage only: open_way='fopen')."""
    for p in (src, dst):
        if os.path.islink(p):
            raise CheckpointError(f"{p} is a symbolic link; convert refuses links")
    obj = load(src, open_way=open_way, weights_only=weights_only)
    _storage.atomic_torch_save(obj, _target(dst), _storage.file_mode())


def server_stat() -> dict:
    """The daemon's counters (entries by state, free pool bytes, persisted bytes, health)."""
    client = _get_client()
    if client is None:
        raise ServerUnavailable("no mindio-acp-server connected")
    return client.request({"op": "stat"})


def shutdown_server() -> None:
    """Ask the daemon to persist what it holds and exit (tests and admin tools), then disconnect."""
    global _client
    with _lock:
        if _client is not None and _client.alive():
            try:
                _client.request({"op": "shutdown"})
            except ServerUnavailable:
                pass
            _client.close()
        _client = None


def reset() -> None:
    """Forget this process's connection and settings (the daemon keeps running)."""
    global _client, _cfg, _server_info, _retry_after
    with _lock:
        if _client is not None:
            _client.close()
        _client, _cfg, _server_info, _retry_after = None, None, None, 0.0
        _counts.clear()
        _lost.clear()       # the next initialize() learns them again from the daemon
