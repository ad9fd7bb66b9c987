"""The controller's CPU for one action's replies at N ranks (a stop round's answers), in one process, without
simulators: the part of bench/controller_scale.py's fault -> decision that does not depend on how busy the
machine is.

    python bench/replies_cpu.py --n 100000 --per-relay 8

A real Controller (its threads not started) with a real ROUTER socket; N ranks registered through N /
per-relay relay connections; an action in flight (the engine waits for every rank's reply); each relay's
frame of its ranks' replies, signed as a relay signs it (wire/relay.py: a BATCH holding one REPLIES item of
columns since protocol v7; ``--items``: one REPLY item per rank, as before, which the controller folds into
columns), is read as the controller's I/O thread reads it (verified, parsed) and handed to its dispatch, which
records the replies in the action engine. Each reply is a stop reply (processor._stop_reply: step, data status, where the
main thread is). Printed: process CPU ms per round and per frame. Not in the test suite.
``MINDIO_SRC=DIR`` measures the mindio package in DIR instead (an older commit's: ``git archive C mindio``).
"""
from __future__ import annotations

import os
import time

from _threadless import KEY, parser  # (puts the mindio measured on sys.path)


def main() -> None:
    p = parser(__doc__, "actions whose replies are")
    p.add_argument("--items", action="store_true", help="one REPLY item per rank, as relays sent before protocol v7 "
                   "(this controller folds them into columns; the v6 controller's cost: MINDIO_SRC=<e8036bb's mindio>)")
    a = p.parse_args()
    from mindio.ttp.wire import protocol as P
    from mindio.ttp.controller import actions
    from tests.ttp._harness import threadless_controller  # real Controller and ROUTER, threads not started

    columns = getattr(P, "fold_replies", None)  # (relays before protocol v7 sent REPLY items)

    n, k = a.n, a.per_relay
    ctl, close = threadless_controller(n, KEY, k)
    reader = getattr(ctl, "_reader", None)
    read = reader.read if reader is not None else (lambda frame: P.decode(frame, KEY))
    engine = ctl.actions
    flush = getattr(ctl, "_flush_replies", lambda: None)  # (the controller before protocol v7 had none)
    cpu, left = 0.0, []
    for i in range(a.rounds + 1):
        sn = i + 1
        frames = []
        for c in range(0, n, k):
            ranks = range(c, min(n, c + k))
            items = [P.Envelope(P.MsgType.REPLY, P.Reply(True, 0, {"step": 5, "data_status": 2, "main": "fenced"}),
                                rank=r, sn=sn) for r in ranks]
            if columns is not None and not a.items:  # what wire/relay.py sends: one REPLIES item (v7)
                items = columns(items)
            frames.append((b"relay%d" % (c // k), P.encode(P.Envelope(P.MsgType.BATCH, P.Batch(items)), KEY)))
        with engine._cond:  # an action in flight to every rank (what ActionEngine.call sets up)
            engine._pending = actions._Pending(sn, "stop", set(range(n)), outstanding=n)
        c0 = time.process_time()
        for ident, frame in frames:  # as the I/O thread: read (verify, parse), then dispatch, frame by frame
            ctl._dispatch(ident, read(frame), relay=True)
        flush()  # as at the end of the I/O thread's turn
        if i:  # the first round warms
            cpu += time.process_time() - c0
        left.append(engine._pending.outstanding)
        engine._pending = None
    per = cpu / a.rounds
    print(f"{n} ranks, {len(frames)} relays: {per * 1000:.1f} ms CPU for one action's replies "
          f"({per / len(frames) * 1e6:.1f} us a frame: verify, parse, record); replies missing {max(left)}; "
          f"load average {os.getloadavg()[0]:.1f}")
    close()


if __name__ == "__main__":
    main()
