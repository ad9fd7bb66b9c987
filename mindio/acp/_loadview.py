"""A trainer's zero-copy, copy-on-write view of the whole pool, from which loads hand out tensors.

Why: mapping 4 KiB shared-memory pages into a process costs about 1.5 us a page on this machine
(~0.4 s per GiB, page-table work, no huge pages for shared memory here), several times the cost of
reading the bytes. A fresh mapping per load pays that on every load. So the client maps the pool a
second time, ``MAP_PRIVATE`` (copy-on-write), and faults it in once, at connect, on a background
thread at nice 19 (first the regions holding checkpoints at that moment: a restarted trainer loads
those). A load then views its region in this mapping: no copy, no page fault, no mmap call. A load
issued before the background pass reached its region faults that region in itself (the old cost).

Safety rules (the pool's bytes must never change under the daemon, and a load must never see stale
bytes):
- the daemon holds a lease on the region while the view lives (``Client.open_region``), so its blocks
  are not reused;
- a write to a loaded tensor gives that page a private copy (copy-on-write): the pool's bytes, which
  the daemon may still be persisting, never change;
- such private pages would hide the pool's bytes from a later load of the same range, so before a
  range is handed out again ``/proc/self/pagemap`` is read for it: if any page is no longer backed by
  the pool file the range is dropped (``MADV_DONTNEED``) and faulted in again from the pool;
- one live view per range: while the tensors of an earlier load of a range are alive, a second load
  of it gets None here and uses a fresh private mapping instead.
Without a readable ``/proc/self/pagemap`` every range is reset before reuse: correct, just not faster.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

from ._poolfile import madvise as _madvise

__all__ = ["LoadView"]

_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22
_MAP_NORESERVE = 0x4000            # not in the mmap module; no swap/commit reservation for private pages
_PAGE = mmap.PAGESIZE
_STEP = 64 << 20
_PRESENT = np.uint64(1 << 63)
_FILE = np.uint64(1 << 61)


class LoadView:
    def __init__(self, fd: int, size: int, first=()):
        """``fd``: the pool file's descriptor (handed over by the daemon; the caller keeps it)."""
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self._anchor = (ctypes.c_char * size).from_buffer(self.map)   # pins the mapping for its address
        self.addr = ctypes.addressof(self._anchor)
        self._lock = threading.Lock()
        self._live: list = []            # (start, end, weakref to the handed-out array)
        try:
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._pagemap = None
        self.populated = 0
        threading.Thread(target=self._populate, args=(list(first),), daemon=True, name="mindio-loadview").start()

    def _populate(self, first: list) -> None:
        """Fault the whole view in, once, at the lowest CPU priority (a load never waits for this):
        first the regions that held checkpoints at connect (``first``: (offset, size) pairs, what a
        restarted trainer is about to load), then everything."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        for offset, size in first:
            if 0 <= offset and offset % _PAGE == 0 and 0 < size and offset + size <= self.size:
                try:
                    _madvise(self.addr + offset, min(self.size - offset, -(-size // _PAGE) * _PAGE),
                             _MADV_POPULATE_READ)
                except OSError:
                    break
        for start in range(0, self.size, _STEP):
            try:
                _madvise(self.addr + start, min(_STEP, self.size - start), _MADV_POPULATE_READ)
            except OSError:
                return                    # kernel < 5.14: pages fault in on first use instead
            self.populated = start + min(_STEP, self.size - start)

    def _scan(self, start: int, end: int) -> tuple:
        """(any page privately copied, any page not mapped) for [start, end) of the view."""
        if self._pagemap is None:
            return True, True
        first, count = (self.addr + start) // _PAGE, (end - start) // _PAGE
        raw, want, pos = bytearray(), count * 8, first * 8
        try:
            while len(raw) < want:
                got = os.pread(self._pagemap, want - len(raw), pos + len(raw))
                if not got:
                    return True, True
                raw += got
        except OSError:
            return True, True
        entries = np.frombuffer(raw, dtype=np.uint64)
        present = (entries & _PRESENT) != 0
        private = bool(np.any(present & ((entries & _FILE) == 0)))
        return private, not bool(np.all(present))

    def acquire(self, offset: int, size: int):
        """A writable uint8 array over [offset, offset+size) showing the pool's bytes, or None when
        an earlier load's array over this range is still alive. The caller holds the daemon's lease."""
        end = min(self.size, -(-(offset + size) // _PAGE) * _PAGE)
        if offset % _PAGE or offset < 0 or offset + size > self.size:
            return None
        with self._lock:
            self._live = [item for item in self._live if item[2]() is not None]
            if any(s < end and offset < e for s, e, _ in self._live):
                return None
            if end > offset:
                private, missing = self._scan(offset, end)
                if private:
                    _madvise(self.addr + offset, end - offset, _MADV_DONTNEED)
                if private or missing:
                    try:
                        _madvise(self.addr + offset, end - offset, _MADV_POPULATE_READ)
                    except OSError:
                        pass              # faults in on first touch instead
            arr = np.frombuffer(self.map, dtype=np.uint8, count=size, offset=offset)
            self._live.append((offset, end, weakref.ref(arr)))
            return arr
