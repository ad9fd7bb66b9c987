"""``mindio``: the operator's command line. Subcommands:

* ``mindio timeline EVENTS.jsonl -o timeline.svg|html`` -- draw a job's event log (MINDIO_EVENT_LOG):
  every rank's lane, faults, decisions and each recovery phase with its duration (mindio/timeline.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import __version__

__all__ = ["main"]


def _timeline(args) -> int:
    from . import timeline

    try:
        events = timeline.load(args.events)
    except OSError as exc:
        print(f"mindio timeline: cannot read {args.events}: {exc.strerror}", file=sys.stderr)
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
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
