"""Logging for every mindio module: a ``[node/rank]`` prefix, WARNING+ on stderr, files on request.

Modules call ``logging.getLogger(__name__)`` as usual. ``setup()`` (called by the processor, the
controller, the launcher and the acp daemon when they start) configures the ``mindio`` logger once:

* **stderr**, always: WARNING and above (decisions, repairs, dumps, exits), each line prefixed with
  ``[node/rank]`` so that the merged output of many workers says where a line comes from;
* **a log file**, only when asked: ``TTP_LOG_PATH=DIR`` writes every line at ``TTP_LOG_LEVEL`` (INFO) to
  ``DIR/ttp_log.log.<pid>`` (``TTP_LOG_MODE=PER_PROC``, the default) or ``DIR/ttp_log.log``
  (``ONLY_ONE``), the reference's names; nothing is written to the working directory otherwise;
* ``TTP_LOG_STDOUT=1`` (the reference's "print, store nothing"): every line at ``TTP_LOG_LEVEL`` on
  stderr, no file.

The node is ``MINDIO_NODE_RANK`` (mindio-run) or ``GROUP_RANK`` (torchrun); the rank and step come from
:func:`set_context`, which the processor updates as the step advances. A console line says
``(after step N)``: N is the last step the rank completed.

``event(kind, **fields)`` appends one JSON line to the structured event log (MINDIO_EVENT_LOG) so that
``mindio timeline`` can draw a recovery (mindio/timeline.py); it is a no-op when the variable is unset.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import threading
import time

from . import _knobs

_context = {"node": "-", "rank": "-", "step": "-"}
_lock = threading.Lock()
_configured = False
_event_file = None


def set_context(rank=None, step=None, node=None) -> None:
    """Set the node, rank and/or step shown in the prefix of every log line."""
    if node is not None:
        _context["node"] = node
    if rank is not None:
        _context["rank"] = rank
    if step is not None:
        _context["step"] = step


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.mindio_node = _context["node"]
        record.mindio_rank = _context["rank"]
        record.mindio_step = _context["step"]
        # the step is the last one this rank completed (tft_end_updating_os), not the one it is in
        record.mindio_at = "" if _context["step"] == "-" else f" (after step {_context['step']})"
        return True


CONSOLE_FORMAT = "[%(mindio_node)s/%(mindio_rank)s] %(asctime)s %(levelname)s %(name)s%(mindio_at)s: %(message)s"
FORMAT = "%(asctime)s %(levelname)s [%(mindio_node)s/%(mindio_rank)s step %(mindio_step)s] %(name)s: %(message)s"


def _node_from_environment() -> str:
    for name in ("MINDIO_NODE_RANK", "GROUP_RANK"):
        value = os.environ.get(name)
        if value:
            return value
    return "-"


def _file_handler(path: str) -> logging.Handler:
    if os.path.islink(path):
        raise _knobs.ConfigError(f"TTP_LOG_PATH={path!r} is a symbolic link; give a real directory")
    os.makedirs(path, exist_ok=True)
    if _knobs.get("TTP_LOG_MODE") == "ONLY_ONE":
        # several processes append to one file: rotating it from several writers would lose lines
        return logging.handlers.WatchedFileHandler(os.path.join(path, "ttp_log.log"))
    return logging.handlers.RotatingFileHandler(os.path.join(path, f"ttp_log.log.{os.getpid()}"),
                                                maxBytes=50 * 1024 * 1024, backupCount=5)


def setup(rank=None, force: bool = False) -> logging.Logger:
    """Configure the ``mindio`` logger once per process (idempotent unless ``force``)."""
    global _configured
    if rank is not None:
        set_context(rank=rank)
    root = logging.getLogger("mindio")
    with _lock:
        if _configured and not force:
            return root
        if _context["node"] == "-":
            set_context(node=_node_from_environment())
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        level = logging.getLevelName(_knobs.get("TTP_LOG_LEVEL"))
        verbose = _knobs.get("TTP_LOG_STDOUT")
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(level if verbose else max(level, logging.WARNING))
        console.setFormatter(logging.Formatter(CONSOLE_FORMAT, "%H:%M:%S"))
        handlers = [console]
        path = _knobs.get("TTP_LOG_PATH")
        if path and not verbose:
            handlers.append(_file_handler(path))
            handlers[-1].setFormatter(logging.Formatter(FORMAT))
            handlers[-1].setLevel(level)
        root.setLevel(min(h.level for h in handlers))
        root.propagate = False
        for handler in handlers:
            handler.addFilter(_ContextFilter())
            root.addHandler(handler)
        _configured = True
    return root


_listeners: list = []


def add_listener(func) -> None:
    """Call ``func(record)`` for every event of this process (mindio.ttp.controller.status counts incidents so),
    whether or not MINDIO_EVENT_LOG is set. A listener must be quick and must not raise."""
    _listeners.append(func)


def remove_listener(func) -> None:
    if func in _listeners:
        _listeners.remove(func)


def event(kind: str, **fields) -> None:
    """Append ``{"t": time, "kind": kind, "rank": ..., **fields}`` to MINDIO_EVENT_LOG, if set, and hand
    it to the listeners."""
    global _event_file
    path = _knobs.get("MINDIO_EVENT_LOG")
    if not path and not _listeners:
        return
    record = {"t": time.time(), "pid": os.getpid(), "kind": kind, "rank": _context["rank"], **fields}
    for listener in list(_listeners):
        try:
            listener(record)
        except Exception:  # an observer must never break the flow that reports to it
            logging.getLogger(__name__).exception("event listener failed on %s", kind)
    if not path:
        return
    line = json.dumps(record, default=str) + "\n"
    with _lock:
        if _event_file is None or _event_file.name != path:
            _event_file = open(path, "a", buffering=1)
        _event_file.write(line)
