"""``mindio``: the operator's command line. Subcommands:

* ``mindio timeline EVENTS.jsonl -o timeline.svg|html`` -- draw a job's event log (MINDIO_EVENT_LOG):
  every rank's lane, faults, decisions and each recovery phase with its duration (mindio/timeline.py).
* ``mindio status [--json]`` -- ask a running job's controller what it sees (mindio/ttp/controller/status.py; the
  job runs with MINDIO_STATUS_PORT, the request is signed with MINDIO_SECRET).
* ``mindio convert SRC DST [--trust]`` -- write a checkpoint mindio.load reads (e.g. a mindio container of
  format version 1, which torch.load cannot read) as a plain torch.save file (mindio/acp/api.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import __version__

__all__ = ["main"]


def _timeline(args) -> int:
    from . import timeline

    try:
        events = timeline.load(args.events)
    except OSError as exc:
        print(f"mindio timeline: cannot read {args.events}: {exc.strerror}", file=sys.stderr)
        return 2
    except timeline.NotAnEventLog as exc:  # nothing is written: an empty picture would look like a quiet job
        print(f"mindio timeline: {exc}", file=sys.stderr)
        return 2
    fmt = os.path.splitext(args.output)[1].lower()
    if fmt not in (".svg", ".html"):
        print(f"mindio timeline: {args.output}: the output must end in .svg or .html", file=sys.stderr)
        return 2
    title = args.title or f"mindio recovery timeline: {os.path.basename(args.events)}"
    text = timeline.render_svg(events, title) if fmt == ".svg" else timeline.render_html(events, title)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    found = timeline.incidents(events)
    print(f"{args.output}: {len(events)} events, {len(found)} incident(s)")
    for i, inc in enumerate(found, 1):
        for line in timeline.summary(inc):
            print(f"  [{i}] {line}")
    return 0


def _status_address(args) -> str:
    from . import _knobs

    if args.address:
        return args.address
    if _knobs.get("MINDIO_STATUS_ADDR"):
        return _knobs.get("MINDIO_STATUS_ADDR")
    port = _knobs.get("MINDIO_STATUS_PORT")
    if not port:
        raise SystemExit("mindio status: give the job's status address (--address HOST:PORT, MINDIO_STATUS_ADDR, "
                         "or MINDIO_STATUS_PORT with TTP_ADDR); the job serves it when started with "
                         "MINDIO_STATUS_PORT set")
    return f"{_knobs.get('TTP_ADDR') or '127.0.0.1'}:{port}"


def _status(args) -> int:
    import hashlib
    import json
    import urllib.error

    from . import _knobs
    from ._status_auth import query

    secret = open(args.secret_file).read().strip() if args.secret_file else _knobs.get("MINDIO_SECRET")
    if not secret:
        print("mindio status: the job secret is needed (MINDIO_SECRET, the value the job runs with, or "
              "--secret-file FILE)", file=sys.stderr)
        return 2
    address = _status_address(args)
    try:
        info = query(address, hashlib.sha256(secret.encode()).digest(), timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        print(f"mindio status: {address} refused the request ({exc.code}): is the secret the job's?", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"mindio status: no status server at {address}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"controller {info['address']}: {info['state']}, world size {info['world_size']}, "
          f"strategies {', '.join(info['strategies'])}")
    print(f"{'rank':>6} {'alive':>6} {'faulty':>6} {'step':>7} {'optimizer':>9} {'last beat':>10}  host/pid")
    for r in info["ranks"]:
        beat = "-" if r["last_beat_s"] is None else f"{r['last_beat_s']:.1f} s"
        print(f"{r['rank']:>6} {'yes' if r['alive'] and r['registered'] else 'no':>6} "
              f"{'yes' if r['faulty'] else 'no':>6} {r['step']:>7} {str(r['data_status']):>9} {beat:>10}  "
              f"{r['host']}/{r['pid']}")
    if (info.get("slow") or {}).get("slow"):  # controller/slow.py
        print(f"slow: rank {info['slow']['slow']['rank']} (cause {info['slow']['slow']['cause']})")
    if (info.get("slow") or {}).get("slow_group"):
        g = info["slow"]["slow_group"]
        print(f"slow: process group {g['group']} (ranks {g['ranks']}; cause {g['cause']})")
    for i in info["incidents"]:
        phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in i["phases"].items() if isinstance(v, (int, float)))
        when = time.strftime("%H:%M:%S", time.localtime(i["t"]))
        print(f"incident {when}: {i['strategy']} at lock step {i['lock_step']}, faulty {i['faulty']}, decided in "
              f"{i['decide_s'] * 1000:.0f} ms; {i['result']}" + (f"; {phases}" if phases else ""))
    return 0


def _convert(args) -> int:
    from .acp import api
    from .errors import CheckpointError

    try:
        api.convert_or_raise(args.src, args.dst, weights_only=not args.trust, open_way="fopen")
    except (CheckpointError, OSError) as exc:
        print(f"mindio convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst} (a torch.save file)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindio", description="Look at what mindio did in a training job.")
    p.add_argument("--version", action="version", version=f"mindio {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser("timeline", help="draw a job's event log (MINDIO_EVENT_LOG) as SVG or HTML",
                       description="Draw a job's event log (the file MINDIO_EVENT_LOG named): one panel per "
                                   "incident with a lane per rank, the controller's decision and every "
                                   "recovery phase with its duration.")
    t.add_argument("events", help="the JSON-lines event log of the job")
    t.add_argument("-o", "--output", default="timeline.svg", help="output file, .svg or .html (default: %(default)s)")
    t.add_argument("--title", default="", help="title of the picture (default: the event log's name)")
    t.set_defaults(func=_timeline)
    st = sub.add_parser("status", help="what a running job's controller sees (needs MINDIO_STATUS_PORT in the job)",
                        description="Print a running job's controller state, its strategies, every rank's state, "
                                    "step and last beat, and the last incidents with their phase times. The job "
                                    "must run with MINDIO_STATUS_PORT set; the request is signed with the job "
                                    "secret (MINDIO_SECRET).")
    st.add_argument("--address", default="", help="HOST:PORT of the job's status server (default: "
                                                  "MINDIO_STATUS_ADDR, or TTP_ADDR and MINDIO_STATUS_PORT)")
    st.add_argument("--secret-file", default="", help="file holding the job secret (default: MINDIO_SECRET)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default: %(default)s)")
    st.set_defaults(func=_status)
    cv = sub.add_parser("convert", help="write a checkpoint mindio.load reads as a plain torch.save file",
                        description="Write SRC (a mindio container of either format version, or a torch.save "
                                    "file) to DST as a plain torch.save file. SRC is loaded weights-only: "
                                    "tensors and plain containers, nothing that runs code.")
    cv.add_argument("src", help="the checkpoint to read")
    cv.add_argument("dst", help="the torch.save file to write")
    cv.add_argument("--trust", action="store_true", help="load SRC with weights_only=False (any pickled "
                                                         "object; runs code from the file: trusted files only)")
    cv.set_defaults(func=_convert)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
