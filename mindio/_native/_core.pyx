# cython: boundscheck=False, wraparound=False, cdivision=True
"""Native speed-ups for the checkpoint store (see mindio/_native/__init__.py for the contract).

Every function takes objects exposing the buffer protocol and releases the GIL for the byte work, so
the daemon's other threads and the trainer's Python threads keep running while bytes move.
"""
from libc.string cimport memcpy
from libc.stdint cimport uint8_t, uint32_t

cdef extern from "_crc_simd.h" nogil:
    # zlib's crc32(), with a PCLMULQDQ folding path on x86-64 CPUs that have it (4-5x faster)
    unsigned long mindio_crc32(unsigned long crc, const unsigned char *buf, size_t len)

cdef extern from "_copy_nt.h" nogil:
    # memcpy with streaming stores for large copies (no read-for-ownership, no cache pollution)
    ctypedef struct mindio_piece:
        unsigned char *dst
        const unsigned char *src
        size_t n
    void mindio_copy_stream(unsigned char *d, const unsigned char *s, size_t n)
    void mindio_copy_pieces(mindio_piece *pieces, size_t count, int nthreads)
    int mindio_stream_level()

cdef extern from "stdlib.h" nogil:
    void *malloc(size_t n)
    void free(void *p)

cdef extern from "unistd.h" nogil:
    long sysconf(int name)
    int _SC_PAGESIZE


def copy_into(dst, Py_ssize_t dst_offset, src, int nthreads=1, Py_ssize_t slice_bytes=16 << 20):
    """Copy all of ``src`` into ``dst[dst_offset:]`` with up to ``nthreads`` threads; returns bytes copied."""
    cdef const uint8_t[::1] s = memoryview(src).cast("B")
    cdef uint8_t[::1] d = memoryview(dst).cast("B")
    cdef Py_ssize_t n = s.shape[0]
    if dst_offset < 0 or dst_offset + n > d.shape[0]:
        raise ValueError(f"copy_into: {n} bytes at offset {dst_offset} do not fit a {d.shape[0]}-byte buffer")
    if n == 0:
        return 0
    if slice_bytes < 4096:
        slice_bytes = 4096
    cdef Py_ssize_t nslices = (n + slice_bytes - 1) // slice_bytes
    cdef Py_ssize_t i, start, length
    cdef const uint8_t *sp = &s[0]
    cdef uint8_t *dp = &d[dst_offset]
    if nthreads < 1:
        nthreads = 1
    if nthreads == 1 or nslices == 1:
        with nogil:
            mindio_copy_stream(dp, sp, n)
        return n
    cdef mindio_piece *pieces = <mindio_piece *>malloc(nslices * sizeof(mindio_piece))
    if pieces == NULL:
        raise MemoryError()
    for i in range(nslices):
        start = i * slice_bytes
        length = n - start
        if length > slice_bytes:
            length = slice_bytes
        pieces[i].dst = dp + start
        pieces[i].src = sp + start
        pieces[i].n = <size_t>length
    with nogil:
        mindio_copy_pieces(pieces, <size_t>nslices, nthreads)
    free(pieces)
    return n


mindio_stream_level()          # pick the store width once, before any parallel region


def copy_many(dst, jobs, int nthreads=1, Py_ssize_t slice_bytes=16 << 20):
    """Copy every ``(dst_offset, src)`` of ``jobs`` into ``dst`` in one parallel pass; returns bytes copied.

    All sources are cut into pieces of at most ``slice_bytes`` (smaller when there are too few to keep
    ``nthreads`` threads busy) that the threads take in turn, so one large tensor or many small ones
    use every thread. Bounds are checked for every job before any byte moves.
    """
    cdef uint8_t[::1] d = memoryview(dst).cast("B")
    cdef Py_ssize_t dn = d.shape[0]
    cdef list views = []
    cdef list spans = []
    cdef Py_ssize_t total = 0, off, n
    cdef const uint8_t[::1] s
    for off, src in jobs:
        s = memoryview(src).cast("B")
        n = s.shape[0]
        if off < 0 or off + n > dn:
            raise ValueError(f"copy_many: {n} bytes at offset {off} do not fit a {dn}-byte buffer")
        if n:
            views.append(s)
            spans.append((off, n))
            total += n
    if total == 0:
        return 0
    if nthreads < 1:
        nthreads = 1
    # pieces: at most slice_bytes, at least 1 MiB, and about 8 per thread when the total allows it
    cdef Py_ssize_t piece = total // (8 * nthreads)
    if piece < (1 << 20):
        piece = 1 << 20
    if piece > slice_bytes:
        piece = slice_bytes
    if piece < 4096:
        piece = 4096
    piece = (piece + 4095) // 4096 * 4096
    cdef Py_ssize_t npieces = 0, k, j
    for off, n in spans:
        npieces += (n + piece - 1) // piece
    cdef mindio_piece *pieces = <mindio_piece *>malloc(npieces * sizeof(mindio_piece))
    if pieces == NULL:
        raise MemoryError()
    cdef uint8_t *base = &d[0]
    cdef const uint8_t *sp
    cdef Py_ssize_t start, length
    try:
        k = 0
        for j in range(len(spans)):
            s = views[j]
            sp = &s[0]
            off, n = spans[j]
            start = 0
            while start < n:
                length = n - start
                if length > piece:
                    length = piece
                pieces[k].dst = base + off + start
                pieces[k].src = sp + start
                pieces[k].n = <size_t>length
                k += 1
                start += length
        with nogil:
            mindio_copy_pieces(pieces, <size_t>npieces, nthreads)
    finally:
        free(pieces)
    return total


def crc32(buf, unsigned long value=0):
    """zlib-compatible CRC-32 of ``buf`` continuing from ``value`` (same result as zlib.crc32)."""
    cdef const uint8_t[::1] b = memoryview(buf).cast("B")
    cdef Py_ssize_t n = b.shape[0]
    cdef unsigned long crc = value & 0xFFFFFFFF
    if n == 0:
        return crc
    cdef const uint8_t *p = &b[0]
    with nogil:
        crc = mindio_crc32(crc, p, <size_t>n)
    return crc & 0xFFFFFFFF


def touch_pages(buf, bint write=False):
    """Fault in every page of ``buf``: read one byte per page, or (write=True) rewrite it unchanged.

    Returns the number of pages touched. ``write=True`` must only be used on memory nobody else is
    writing at the same time (a free pool region), since it is a read-modify-write of one byte.
    """
    cdef uint8_t[::1] b = memoryview(buf).cast("B")
    cdef Py_ssize_t n = b.shape[0]
    cdef Py_ssize_t page = sysconf(_SC_PAGESIZE)
    cdef Py_ssize_t i, count = 0
    cdef volatile uint8_t sink = 0
    cdef uint8_t *p
    if n == 0:
        return 0
    p = &b[0]
    with nogil:
        i = 0
        while i < n:
            if write:
                (<volatile uint8_t *>(p + i))[0] = (<volatile uint8_t *>(p + i))[0]
            else:
                sink = sink ^ (<volatile uint8_t *>(p + i))[0]
            count += 1
            i += page
    return count
