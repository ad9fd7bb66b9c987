"""A relay's BEATS frames read into the rank table's columns (the controller's I/O thread).

At 100,000 ranks in relays of 8 the controller reads 12,500 BEATS frames a second. A reader takes the frames
of one turn of the I/O thread and gives them back as columns, one array per field, for
``RankTable.beats_at``: ``read(frame)`` verifies a frame and returns its Envelope; a BEATS frame's body is
:data:`HELD` (its columns wait in the reader) until ``keep(conn, now)`` adds them to the turn's, or the next
``read`` drops them (a frame the session refuses). ``add(body, conn, now, gen, pack)`` adds an already decoded
Beats body (tests, benches). ``take()`` returns the turn's columns and empties the reader:

    (ranks, steps, status, coll, age, idle, p99)   one entry per rank (idle / p99: -1.0 where not sent)
    (ends, conns, nows, gens, has, packs)          one per frame: where its ranks end, its connection number,
                                                   when it was read, its generation, whether it carried the
                                                   packed extras, and those bytes (protocol v5) or None

:func:`reader` gives the native reader (mindio/_native/_beats.pyx: the frame parsed from its bytes in C; read +
keep of a relay's frame of 8 ranks 4.8-5.1 us against 16.2 us here, idle) when it is built, else
:class:`PyBeatsReader` (protocol.decode, then lists); both accept and refuse the same frames: the native one
hands anything but a plain BEATS frame to protocol's decoder after checking its HMAC
(tests/ttp/test_beats_reader.py runs both on the same frames).
"""
from __future__ import annotations

import numpy as np

from ... import _knobs
from . import protocol as P

__all__ = ["HELD", "PyBeatsReader", "reader", "pack_of"]


class _Held:
    """The body of a BEATS Envelope whose columns a reader holds."""

    def __repr__(self) -> str:
        return "HELD"


HELD = _Held()


def pack_of(body: P.Beats) -> bytes | None:
    """A Beats body's per-rank maps and lists as protocol v5 packs them (``packed``), or None if it has none: a
    frame that sent them unpacked (v4's layout, which v5's decoder still accepts) is kept like a v5 one."""
    if body.packed:
        return body.packed
    if body.seq or body.sums:
        n = len(body.ranks)
        return P.pack_extras(body.seq or [{}] * n, body.sums or [[]] * n)
    return None


class PyBeatsReader:
    """The reader in Python (no native core, or ``MINDIO_NATIVE=python``)."""

    def __init__(self, key: bytes):
        self.key = key
        self._staged: P.Envelope | None = None
        self._clear()

    def _clear(self) -> None:
        self._cols: tuple[list, ...] = ([], [], [], [], [], [], [])
        self._frames: tuple[list, ...] = ([], [], [], [], [], [])

    @property
    def pending(self) -> int:
        return len(self._frames[0])

    def read(self, frame: bytes) -> P.Envelope:
        env = P.decode(frame, self.key)
        if env.type is not P.MsgType.BEATS:
            self._staged = None
            return env
        self._staged = env
        return env._replace(body=HELD)

    def keep(self, conn: int, now: float) -> None:
        env, self._staged = self._staged, None
        if env is None:
            raise RuntimeError("keep() without a BEATS frame read")
        self.add(env.body, conn, now, env.gen, pack_of(env.body))

    def add(self, body: P.Beats, conn: int, now: float, gen: int, pack: bytes | None) -> None:
        n = len(body.ranks)
        ranks, steps, status, coll, age, idle, p99 = self._cols
        ranks += body.ranks
        steps += body.steps
        status += body.status
        coll += body.coll
        age += body.age
        idle += body.idle or [-1.0] * n
        p99 += body.p99 or [-1.0] * n
        ends, conns, nows, gens, has, packs = self._frames
        ends.append(len(ranks))
        conns.append(conn)
        nows.append(now)
        gens.append(gen)
        has.append(pack is not None)
        packs.append(pack)

    def take(self) -> tuple:
        (ranks, steps, status, coll, age, idle, p99), (ends, conns, nows, gens, has, packs) = self._cols, self._frames
        self._clear()
        return (np.asarray(ranks, np.int64), np.asarray(steps, np.int64), np.asarray(status, np.int64),
                np.asarray(coll, np.bool_), np.asarray(age, np.float64), np.asarray(idle, np.float64),
                np.asarray(p99, np.float64), np.asarray(ends, np.int64), np.asarray(conns, np.int64),
                np.asarray(nows, np.float64), np.asarray(gens, np.int64), np.asarray(has, np.bool_), packs)


def reader(key: bytes):
    """The native reader if the Cython core is built (and ``MINDIO_NATIVE`` is not ``python``), else Python's."""
    if _knobs.get("MINDIO_NATIVE") != "python":
        try:
            from ..._native._beats import BeatsReader
        except ImportError:
            pass
        else:
            return BeatsReader(key, P.VERSION, P.MsgType.BEATS, P.Envelope, HELD, P.decode, P.decode_payload)
    return PyBeatsReader(key)
