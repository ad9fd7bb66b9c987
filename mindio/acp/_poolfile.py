"""The daemon's pool file: size checks, creation (every page reserved up front) and pre-faulting.

The pool is one file in a tmpfs (``/dev/shm`` by default, see ``_config.pool_dir``) that the daemon and
every client map shared. A pool the file system or the machine's memory cannot hold is refused before
anything is allocated, with the knob to turn; a pool that ``posix_fallocate`` cannot reserve fails at
start, not with SIGBUS in a trainer's copy later.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time

__all__ = ["check_pool_fits", "create_pool", "madvise", "address", "lower_priority", "MADV_POPULATE_WRITE"]

MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(addr: int, length: int, advice: int) -> None:
    """madvise through ctypes, which releases the GIL for the call (mmap.madvise holds it: faulting in
    64 MiB of shared memory takes ~25 ms, during which no other thread of the process runs)."""
    if _libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def lower_priority() -> None:
    """nice 19 and the lowest best-effort I/O priority for the calling thread (the daemon's persistence
    workers and pool prefault, a client's pool populate)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        _libc.syscall(251, 1, tid, (2 << 13) | 7)   # ioprio_set(WHO_PROCESS, tid, BE class, level 7)
    except (OSError, AttributeError):
        pass


def address(mapping) -> tuple:
    """(address, anchor) of a writable mapping; keep ``anchor`` alive while the address is used."""
    anchor = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    return ctypes.addressof(anchor), anchor


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



def create_pool(pool_dir: str, pool_bytes: int, keep: set) -> tuple:
    """Remove stale pool files (except ``keep``: files still holding recovered data), create and map
    a new one; returns (path, shared mmap, open descriptor: what clients are handed)."""
    path = os.path.join(pool_dir, f"pool-{os.getpid()}-{time.time_ns()}")
    for name in os.listdir(pool_dir):
        old = os.path.join(pool_dir, name)
        if old not in keep:
            os.unlink(old)  # a pool of a daemon that died with nothing left to persist
    check_pool_fits(pool_dir, pool_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # reserve every page now: a pool its file system cannot hold must fail here, clearly,
        # not with SIGBUS in a trainer's copy later
        os.posix_fallocate(fd, 0, pool_bytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise OSError(exc.errno, f"cannot reserve a {pool_bytes >> 20} MiB pool in "
                      f"{pool_dir}: {exc.strerror}") from None
    pool_map = mmap.mmap(fd, pool_bytes, flags=mmap.MAP_SHARED)
    return path, pool_map, fd
