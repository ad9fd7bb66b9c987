"""Logging for every mindio module: TTP_LOG_* handling, rotation, and a ``[rank/step]`` prefix.

Modules call ``logging.getLogger(__name__)`` as usual. ``setup()`` (called by the processor, the
controller, the launcher and the acp daemon when they start) installs one handler on the ``mindio``
logger according to TTP_LOG_PATH / TTP_LOG_LEVEL / TTP_LOG_MODE / TTP_LOG_STDOUT. The prefix comes
from :func:`set_context`, which the processor updates as the step advances.

``event(kind, **fields)`` appends one JSON line to the structured event log (MINDIO_EVENT_LOG) so that
``mindio.tools`` can rebuild a recovery timeline; it is a no-op when the variable is unset.
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

_context = {"rank": "-", "step": "-"}
_lock = threading.Lock()
_configured = False
_event_file = None


def set_context(rank=None, step=None) -> None:
    """Set the rank and/or step shown in the ``[rank/step]`` prefix of every log line."""
    if rank is not None:
        _context["rank"] = rank
    if step is not None:
        _context["step"] = step


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.mindio_rank = _context["rank"]
        record.mindio_step = _context["step"]
        return True


FORMAT = "%(asctime)s %(levelname)s [%(mindio_rank)s/%(mindio_step)s] %(name)s: %(message)s"


def setup(rank=None, force: bool = False) -> logging.Logger:
    """Configure the ``mindio`` logger once per process (idempotent unless ``force``)."""
    global _configured
    if rank is not None:
        set_context(rank=rank)
    root = logging.getLogger("mindio")
    with _lock:
        if _configured and not force:
            return root
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(_knobs.get("TTP_LOG_LEVEL"))
        root.propagate = False
        if _knobs.get("TTP_LOG_STDOUT"):
            handler: logging.Handler = logging.StreamHandler(sys.stderr)
        else:
            path = _knobs.get("TTP_LOG_PATH")
            if os.path.islink(path):
                raise _knobs.ConfigError(f"TTP_LOG_PATH={path!r} is a symbolic link; give a real directory")
            os.makedirs(path, exist_ok=True)
            name = "ttp_log.log"
            if _knobs.get("TTP_LOG_MODE") == "PER_PROC":
                name += f".{os.getpid()}"
            # ONLY_ONE: several processes append to one file; rotation is then left to size-less
            # WatchedFileHandler semantics (rotating from several writers would lose lines).
            if _knobs.get("TTP_LOG_MODE") == "ONLY_ONE":
                handler = logging.handlers.WatchedFileHandler(os.path.join(path, name))
            else:
                handler = logging.handlers.RotatingFileHandler(
                    os.path.join(path, name), maxBytes=50 * 1024 * 1024, backupCount=5
                )
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(_ContextFilter())
        root.addHandler(handler)
        _configured = True
    return root


def event(kind: str, **fields) -> None:
    """Append ``{"t": time, "kind": kind, "rank": ..., **fields}`` to MINDIO_EVENT_LOG, if set."""
    global _event_file
    path = _knobs.get("MINDIO_EVENT_LOG")
    if not path:
        return
    record = {"t": time.time(), "pid": os.getpid(), "kind": kind, "rank": _context["rank"], **fields}
    line = json.dumps(record, default=str) + "\n"
    with _lock:
        if _event_file is None or _event_file.name != path:
            _event_file = open(path, "a", buffering=1)
        _event_file.write(line)
