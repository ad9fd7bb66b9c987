# cython: boundscheck=False, wraparound=False, cdivision=True, language_level=3
"""The controller's BEATS frames read in C (mindio/ttp/wire/beats.py has the contract and the Python twin).

A relay sends one BEATS frame per interval for its ranks: 12,500 frames a second at 100,000 ranks. Decoding
each in Python (msgpack to lists, a dataclass, per-field type checks, then list concatenation per turn) cost
16 us a frame of 8 ranks on an idle machine, 5 here (wire/beats.py). Here one frame is verified
(HMAC-SHA256, through Python's hmac.digest), parsed from its msgpack bytes straight into growing C columns,
and checked as strictly as protocol.decode checks it. A
frame this parser does not take whole -- another message type, another version, an unexpected field,
type or length, a number out of range -- is handed to the Python decoder (``decode_payload``) after its
HMAC passed, which accepts it or raises the error a user reads: this code never decides that a frame is
malformed, only that it is the plain BEATS frame a relay sends.
"""
import hmac as _hmac

import numpy as np

from libc.stdint cimport int64_t, uint64_t, uint8_t, int32_t
from libc.string cimport memcpy, memcmp, strlen
from libc.stdlib cimport malloc, realloc, free
from cpython.bytes cimport PyBytes_FromStringAndSize

cdef enum:
    MAC_LEN = 32
    MAX_FRAME = 1 << 20

cdef extern from *:
    """
    static const char *const mindio_beats_fields[] = {
        "ranks", "steps", "status", "coll", "age", "seq", "idle", "p99", "sums", "packed"};
    """
    const char *const _FIELDS "mindio_beats_fields"[10]

cdef enum:
    _NFIELDS = 10
    F_RANKS = 1
    F_STEPS = 2
    F_STATUS = 4
    F_COLL = 8
    F_AGE = 16
    F_SEQ = 32
    F_IDLE = 64
    F_P99 = 128
    F_SUMS = 256
    F_PACKED = 512


cdef struct Cur:
    const uint8_t *p
    const uint8_t *end
    int bad  # 1: not a frame this parser takes (the Python decoder judges it)


cdef inline uint64_t _be(Cur *c, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    if c.end - c.p < n:
        c.bad = 1
        return 0
    for i in range(n):
        v = (v << 8) | c.p[i]
    c.p += n
    return v


cdef inline int _byte(Cur *c) noexcept nogil:
    if c.p >= c.end:
        c.bad = 1
        return 0xc1
    cdef int b = c.p[0]
    c.p += 1
    return b


cdef inline int64_t _int(Cur *c) noexcept nogil:
    """A msgpack integer that fits int64 (a bool, a float, a bigger number: bad)."""
    cdef int b = _byte(c)
    cdef uint64_t u
    if b <= 0x7f:
        return b
    if b >= 0xe0:
        return b - 0x100
    if b == 0xcc:
        return <int64_t>_be(c, 1)
    if b == 0xcd:
        return <int64_t>_be(c, 2)
    if b == 0xce:
        return <int64_t>_be(c, 4)
    if b == 0xcf:
        u = _be(c, 8)
        if u > <uint64_t>0x7fffffffffffffff:
            c.bad = 1
        return <int64_t>u
    if b == 0xd0:
        return <int64_t>(<signed char>_be(c, 1))
    if b == 0xd1:
        return <int64_t>(<short>_be(c, 2))
    if b == 0xd2:
        return <int64_t>(<int>_be(c, 4))
    if b == 0xd3:
        return <int64_t>_be(c, 8)
    c.bad = 1
    return 0


cdef inline double _num(Cur *c) noexcept nogil:
    """A float column's entry: a msgpack float or integer (protocol.py accepts both)."""
    cdef uint64_t u
    cdef double d
    cdef float f
    cdef unsigned int w
    if c.p < c.end and c.p[0] == 0xcb:
        c.p += 1
        u = _be(c, 8)
        memcpy(&d, &u, 8)
        return d
    if c.p < c.end and c.p[0] == 0xca:
        c.p += 1
        w = <unsigned int>_be(c, 4)
        memcpy(&f, &w, 4)
        return f
    return <double>_int(c)


cdef inline Py_ssize_t _count(Cur *c, int fix, int code16) noexcept nogil:
    """An array's (fix 0x90, code16 0xdc) or a map's (0x80, 0xde) entry count: fix..fix+15, or 16 / 32 bits."""
    cdef int b = _byte(c)
    if fix <= b <= fix + 15:
        return b - fix
    if b == code16:
        return <Py_ssize_t>_be(c, 2)
    if b == code16 + 1:
        return <Py_ssize_t>_be(c, 4)
    c.bad = 1
    return 0


cdef inline int _key(Cur *c) noexcept nogil:
    """The field a body map's key names (F_*), or 0: not a BEATS field (bad)."""
    cdef int b = _byte(c)
    cdef Py_ssize_t n
    cdef int i
    cdef const uint8_t *s
    if 0xa0 <= b <= 0xbf:
        n = b - 0xa0
    elif b == 0xd9:
        n = <Py_ssize_t>_be(c, 1)
    else:
        c.bad = 1
        return 0
    if c.end - c.p < n:
        c.bad = 1
        return 0
    s = c.p
    c.p += n
    for i in range(_NFIELDS):  # Beats' fields, in the order of the F_* flags (bit i: field i)
        if n == strlen(_FIELDS[i]) and memcmp(s, _FIELDS[i], n) == 0:
            return 1 << i
    c.bad = 1
    return 0


cdef class _Col:
    """A growing C array of one column (int64, double or uint8 entries)."""
    cdef char *data
    cdef Py_ssize_t cap, item

    def __cinit__(self, Py_ssize_t item):
        self.item, self.cap = item, 0
        self.data = NULL

    def __dealloc__(self):
        free(self.data)

    cdef int reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap = self.cap or 1024
        cdef char *p
        if n <= self.cap:
            return 0
        while cap < n:
            cap *= 2
        p = <char *>realloc(self.data, cap * self.item)
        if p == NULL:
            raise MemoryError()
        self.data, self.cap = p, cap
        return 0

    cdef object array(self, Py_ssize_t n, object dtype):
        out = np.empty(n, dtype)
        cdef uint8_t[::1] view
        if n:
            view = out.view(np.uint8)
            memcpy(&view[0], self.data, n * self.item)
        return out


cdef class BeatsReader:
    """read(frame) -> Envelope; keep(conn, now); add(body, conn, now, gen); take() -> the turn's columns.
    See mindio/ttp/wire/beats.py (``PyBeatsReader`` does the same in Python)."""
    cdef bytes key
    cdef object beats_type, envelope, held, decode, decode_payload
    cdef int64_t version, beats_int
    cdef _Col ranks, steps, status, age, idle, p99, coll, ends, conns, nows, gens, has
    cdef list packs
    cdef Py_ssize_t n, frames, staged  # entries kept, frames kept, entries of the frame read last
    cdef object staged_pack
    cdef int64_t staged_gen
    cdef int staged_has

    def __init__(self, bytes key, int64_t version, beats_type, envelope, held, decode, decode_payload):
        self.key, self.version = key, version
        self.beats_type, self.beats_int = beats_type, int(beats_type)
        self.envelope, self.held = envelope, held
        self.decode, self.decode_payload = decode, decode_payload
        self.ranks, self.steps, self.status = _Col(8), _Col(8), _Col(8)
        self.age, self.idle, self.p99, self.coll = _Col(8), _Col(8), _Col(8), _Col(1)
        self.ends, self.conns, self.nows, self.gens, self.has = _Col(8), _Col(8), _Col(8), _Col(8), _Col(1)
        self.packs = []
        self.n = self.frames = 0
        self.staged = -1
        self.staged_pack = None

    @property
    def pending(self):
        """Frames kept since the last take()."""
        return self.frames

    def read(self, frame):
        """The Envelope of one frame from the wire, its HMAC verified (AuthError, ProtocolError as
        protocol.decode raises them). A BEATS frame's columns are held (its body is ``held``) until keep()."""
        cdef const uint8_t[::1] buf = frame
        cdef Py_ssize_t size = buf.shape[0]
        self.staged = -1
        if size > MAX_FRAME or size <= MAC_LEN:
            return self.decode(frame, self.key)  # protocol.decode says why
        view = memoryview(frame)
        payload = view[:size - MAC_LEN]
        if not _hmac.compare_digest(view[size - MAC_LEN:], _hmac.digest(self.key, payload, "sha256")):
            return self.decode(frame, self.key)  # raises AuthError
        got = self._parse(&buf[0], size - MAC_LEN)
        if got is None:
            return self.decode_payload(payload)  # verified above: the Python decoder judges the rest
        return got

    cdef object _parse(self, const uint8_t *p, Py_ssize_t size):
        cdef Cur c
        cdef int64_t v, mtype, sn, rank, gen, sess, ctr
        cdef Py_ssize_t fields, m, i, n = -1, base = self.n, blen
        cdef int f, seen = 0
        cdef int64_t *ip
        cdef double *dp
        cdef uint8_t *bp
        cdef int b
        c.p, c.end, c.bad = p, p + size, 0
        if _byte(&c) != 0x98:  # an array of 8
            return None
        v = _int(&c)
        mtype = _int(&c)
        if c.bad or v != self.version or mtype != self.beats_int:
            return None
        sn = _int(&c)
        rank = _int(&c)
        gen = _int(&c)
        sess = _int(&c)
        ctr = _int(&c)
        fields = _count(&c, 0x80, 0xde)
        if c.bad:
            return None
        pack = None
        for _ in range(fields):
            f = _key(&c)
            if c.bad or seen & f:  # a field twice: the Python decoder's dict keeps the last; let it judge
                return None
            seen |= f
            if f == F_PACKED:
                b = _byte(&c)
                if b == 0xc4:
                    blen = <Py_ssize_t>_be(&c, 1)
                elif b == 0xc5:
                    blen = <Py_ssize_t>_be(&c, 2)
                elif b == 0xc6:
                    blen = <Py_ssize_t>_be(&c, 4)
                else:
                    return None
                if c.bad or c.end - c.p < blen:
                    return None
                pack = PyBytes_FromStringAndSize(<const char *>c.p, blen) if blen else None
                c.p += blen
                continue
            m = _count(&c, 0x90, 0xdc)
            if c.bad or m > c.end - c.p:  # each entry takes a byte at least: no allocation a frame cannot fill
                return None
            if f == F_SEQ or f == F_SUMS:  # v4's unpacked maps and lists: only empty ones here
                if m:
                    return None
                continue
            if f == F_RANKS:
                if n >= 0 and m != n:
                    return None
                n = m
            elif n >= 0 and m != n and not ((f == F_IDLE or f == F_P99) and m == 0):
                return None
            elif n < 0:
                return None  # ranks first, as a relay packs them (else: the Python decoder)
            self._reserve(base + m)
            if f == F_RANKS or f == F_STEPS or f == F_STATUS:
                ip = <int64_t *>(self.ranks.data if f == F_RANKS else self.steps.data if f == F_STEPS
                                 else self.status.data) + base
                for i in range(m):
                    ip[i] = _int(&c)
            elif f == F_COLL:
                bp = <uint8_t *>self.coll.data + base
                for i in range(m):
                    b = _byte(&c)
                    if b != 0xc2 and b != 0xc3:
                        return None
                    bp[i] = b == 0xc3
            else:
                if m == 0:  # idle / p99 not sent
                    seen &= ~f
                    continue
                dp = <double *>(self.age.data if f == F_AGE else self.idle.data if f == F_IDLE
                                else self.p99.data) + base
                for i in range(m):
                    dp[i] = _num(&c)
            if c.bad:
                return None
        if c.bad or c.p != c.end or n < 0:
            return None
        if seen & (F_RANKS | F_STEPS | F_STATUS | F_COLL | F_AGE) != (F_RANKS | F_STEPS | F_STATUS | F_COLL | F_AGE):
            return None
        self._reserve(base + n)
        if not seen & F_IDLE:
            dp = <double *>self.idle.data + base
            for i in range(n):
                dp[i] = -1.0
        if not seen & F_P99:
            dp = <double *>self.p99.data + base
            for i in range(n):
                dp[i] = -1.0
        self.staged, self.staged_pack, self.staged_gen = n, pack, gen
        self.staged_has = pack is not None
        return self.envelope(self.beats_type, self.held, rank, sn, gen, sess, ctr, v)

    cdef int _reserve(self, Py_ssize_t n) except -1:
        for col in (self.ranks, self.steps, self.status, self.age, self.idle, self.p99, self.coll):
            (<_Col>col).reserve(n)
        return 0

    cdef int _frame(self, Py_ssize_t n, int32_t conn, double now, int64_t gen, int has, pack) except -1:
        cdef Py_ssize_t k = self.frames
        for col in (self.ends, self.conns, self.nows, self.gens, self.has):
            (<_Col>col).reserve(k + 1)
        self.n += n
        (<int64_t *>self.ends.data)[k] = self.n
        (<int64_t *>self.conns.data)[k] = conn
        (<double *>self.nows.data)[k] = now
        (<int64_t *>self.gens.data)[k] = gen
        (<uint8_t *>self.has.data)[k] = has
        self.packs.append(pack)
        self.frames = k + 1
        return 0

    def keep(self, int32_t conn, double now):
        """The BEATS frame read last joins this turn's columns (from connection number ``conn``, at ``now``)."""
        if self.staged < 0:
            raise RuntimeError("keep() without a BEATS frame read")
        self._frame(self.staged, conn, now, self.staged_gen, self.staged_has, self.staged_pack)
        self.staged = -1

    def add(self, body, int32_t conn, double now, int64_t gen, pack):
        """A decoded Beats body (protocol.Beats; ``pack``: its packed extras or None) joins the columns."""
        cdef Py_ssize_t n = len(body.ranks), base = self.n, i
        self._reserve(base + n)
        cdef int64_t *r = <int64_t *>self.ranks.data + base
        cdef int64_t *s = <int64_t *>self.steps.data + base
        cdef int64_t *st = <int64_t *>self.status.data + base
        cdef uint8_t *co = <uint8_t *>self.coll.data + base
        cdef double *a = <double *>self.age.data + base
        cdef double *idl = <double *>self.idle.data + base
        cdef double *q = <double *>self.p99.data + base
        for i in range(n):
            r[i], s[i], st[i] = body.ranks[i], body.steps[i], body.status[i]
            co[i], a[i] = bool(body.coll[i]), body.age[i]
            idl[i] = body.idle[i] if body.idle else -1.0
            q[i] = body.p99[i] if body.p99 else -1.0
        self._frame(n, conn, now, gen, pack is not None, pack)

    def take(self):
        """The kept frames' columns, and the reader empty again: (ranks, steps, status, coll, age, idle, p99:
        one entry per rank; ends, conns, nows, gens, has, packs: one per frame)."""
        cdef Py_ssize_t n = self.n, k = self.frames
        out = (self.ranks.array(n, np.int64), self.steps.array(n, np.int64), self.status.array(n, np.int64),
               self.coll.array(n, np.bool_), self.age.array(n, np.float64), self.idle.array(n, np.float64),
               self.p99.array(n, np.float64), self.ends.array(k, np.int64), self.conns.array(k, np.int64),
               self.nows.array(k, np.float64), self.gens.array(k, np.int64), self.has.array(k, np.bool_),
               self.packs)
        self.packs, self.n, self.frames, self.staged = [], 0, 0, -1
        return out
