"""The controller's CPU per heartbeat round, in one process, without simulators: the figure of
bench/controller_scale.py that does not depend on how busy the machine is.

    python bench/beats_cpu.py --n 100000 --per-relay 8

A real Controller (its threads not started) with a real ROUTER socket; N ranks registered through N /
per-relay relay connections; each round every relay's BEATS frame, signed as a relay signs it, is
read as the controller's I/O thread reads it (wire/beats.py: verified, parsed into columns; natively where
the Cython core is built, ``MINDIO_NATIVE=python`` for the Python reader) and handed to the controller's
dispatch, which applies it and sends the ack (to a connection that is not there: zmq drops it after the
send). The frames carry what a relay sends for its ranks (every heartbeat column: collective numbers of
``--groups`` groups, idle age, step p99, step sums: packed in one byte string as protocol v5 sends them, or
``--unpacked`` as v4 did; ``--plain``: the five v3 columns alone). Printed: process CPU ms per round, per
frame, and the share of a core at 1 s beats. Not in the test suite.
``MINDIO_SRC=DIR`` measures the mindio package in DIR instead (an older commit's: ``git archive C mindio``).
"""
from __future__ import annotations

import os
import time

from _threadless import KEY, parser  # (puts the mindio measured on sys.path)


def main() -> None:
    p = parser(__doc__, "heartbeat rounds")
    p.add_argument("--groups", type=int, default=6, help="process groups in each rank's collective numbers (the "
                   "heartbeat's coll_seq; Megatron has a few per rank)")
    p.add_argument("--plain", action="store_true", help="frames without the v4 heartbeat columns (seq, idle, p99, "
                   "sums) a real relay sends (wire/relay.py _beats): what this bench sent before 2026-11-29")
    p.add_argument("--unpacked", action="store_true", help="the maps and lists as v4 sent them (one per rank, "
                   "unpacked at every beat), not in BEATS.packed (v5)")
    a = p.parse_args()
    from mindio.ttp.wire import protocol as P
    from tests.ttp._harness import threadless_controller  # real Controller and ROUTER, threads not started

    n, k = a.n, a.per_relay
    ctl, close = threadless_controller(n, KEY, k)
    frames = []
    for c in range(0, n, k):
        ranks = list(range(c, min(n, c + k)))
        m = len(ranks)
        seq, sums = [{f"{g}#pg{g}": 1000 + r for g in range(a.groups)} for r in ranks], [[100, 50.0, 40.0, 10.0]] * m
        extra = {} if a.plain else dict(idle=[0.01] * m, p99=[0.5] * m, **(  # what wire/relay.py _beats sends
            dict(seq=seq, sums=sums) if a.unpacked else dict(packed=P.pack_extras(seq, sums))))
        env = P.Envelope(P.MsgType.BEATS, P.Beats(ranks=ranks, steps=[5] * m, status=[0] * m, coll=[False] * m,
                                                  age=[0.0] * m, **extra), sess=1, ctr=1)
        frames.append((b"relay%d" % (c // k), P.encode(env, KEY)))
    flush = getattr(ctl, "_flush_beats", lambda: None)  # (the controller before issue 34 had none)
    reader = getattr(ctl, "_reader", None)  # wire/beats.py (native when built; MINDIO_NATIVE=python: Python's)
    read = reader.read if reader is not None else (lambda frame: P.decode(frame, KEY))  # the code before it
    cpu = 0.0
    for i in range(a.rounds + 1):
        c0 = time.process_time()
        for ident, frame in frames:  # as the I/O thread: read (verify, parse), then dispatch, frame by frame
            ctl._dispatch(ident, read(frame), relay=True)
        flush()
        if i:  # the first round warms
            cpu += time.process_time() - c0
    dead = sum(1 for r in ctl.ranks.values() if not r.alive)
    per = cpu / a.rounds
    kind = "no" if reader is None else "python" if type(reader).__module__.endswith("wire.beats") else "native"
    print(f"{n} ranks, {len(frames)} relays: {per * 1000:.1f} ms CPU per round ({per:.1%} of a core at 1 s beats; "
          f"{per / len(frames) * 1e6:.1f} us a frame: verify, parse, apply, ack), {kind} reader; dead {dead}; "
          f"load average {os.getloadavg()[0]:.1f}")
    close()


if __name__ == "__main__":
    main()
