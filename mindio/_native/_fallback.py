"""Pure-Python implementation of mindio._native: same functions, same results as the Cython core.

Used when the extension is not built or MINDIO_NATIVE=python forces it. numpy does the byte work
(its copies release the GIL), so the fallback is slower only by the lack of parallel slices.
"""
from __future__ import annotations

import mmap
import zlib

import numpy as np

__all__ = ["copy_into", "copy_many", "crc32", "touch_pages"]


def _bytes_view(buf, writable: bool = False) -> np.ndarray:
    view = memoryview(buf).cast("B")
    if writable and view.readonly:
        raise TypeError("destination buffer is read-only")
    return np.frombuffer(view, dtype=np.uint8)


def copy_into(dst, dst_offset: int, src, nthreads: int = 1, slice_bytes: int = 16 << 20) -> int:
    """Copy all of ``src`` into ``dst[dst_offset:]``; returns bytes copied (nthreads is advisory)."""
    s = _bytes_view(src)
    d = _bytes_view(dst, writable=True)
    n = s.shape[0]
    if dst_offset < 0 or dst_offset + n > d.shape[0]:
        raise ValueError(f"copy_into: {n} bytes at offset {dst_offset} do not fit a {d.shape[0]}-byte buffer")
    if n:
        d[dst_offset:dst_offset + n] = s
    return n


def copy_many(dst, jobs, nthreads: int = 1, slice_bytes: int = 16 << 20) -> int:
    """Copy every ``(dst_offset, src)`` of ``jobs`` into ``dst``; returns bytes copied (bounds checked first)."""
    d = _bytes_view(dst, writable=True)
    checked = []
    for off, src in jobs:
        s = _bytes_view(src)
        if off < 0 or off + s.shape[0] > d.shape[0]:
            raise ValueError(f"copy_many: {s.shape[0]} bytes at offset {off} do not fit a {d.shape[0]}-byte buffer")
        checked.append((off, s))
    for off, s in checked:
        if s.shape[0]:
            d[off:off + s.shape[0]] = s
    return sum(s.shape[0] for _, s in checked)


def crc32(buf, value: int = 0) -> int:
    """zlib-compatible CRC-32 of ``buf`` continuing from ``value``."""
    return zlib.crc32(memoryview(buf).cast("B"), value) & 0xFFFFFFFF


def touch_pages(buf, write: bool = False) -> int:
    """Fault in every page of ``buf`` (read one byte per page, or rewrite it unchanged)."""
    arr = _bytes_view(buf, writable=write)
    if arr.shape[0] == 0:
        return 0
    pages = arr[:: mmap.PAGESIZE]
    if write:
        pages[...] = pages.copy()
    else:
        int(pages.sum(dtype=np.uint64))
    return int(pages.shape[0])
