"""Preemption, worker side: a stop signal becomes a request for a last-words checkpoint.

Schedulers preempt with SIGTERM and SIGKILL after a grace period (30 s by default: Kubernetes signals
the container's first process, Slurm every process of the job step); torchrun and mindio-run forward
the signal to their workers. A worker whose processor started (``tft_start_processor``) handles the
signals of ``MINDIO_PREEMPT_SIGNAL`` (default SIGTERM):

* the handler does no work: it queues a ``REQUEST("dump")`` for the processor's link thread and wakes
  it (a queue put and a pipe write, safe wherever the main thread was interrupted), and notes the time;
* the controller (rank 0's, or the one mindio-run hosts) stops every rank at one step (the fence) --
  asked before any rank finished a step of this run, at the first finished step --
  has one rank per shard save it, renames it "latest" and orders EXIT(75): the decorator ends the
  process with ``EXIT_CODE_DUMPED``, as after any dump (incident.py);
* the same signal again (a scheduler that signals every process, and the launcher forwarding it too)
  changes nothing; if the process still runs ``MINDIO_PREEMPT_TIMEOUT`` s after the first, the link
  thread logs it and ends the process with ``EXIT_CODE_FAULT`` (stopped without a new checkpoint), and
  a signal after that acts as it would without mindio. It ends so as soon as the link lost its
  controller (``misses`` heartbeat intervals of silence; with backup controllers, twice that): a lost
  request never keeps a preempted job alive.

The same holds for a launcher's stop signal after a failure (torchrun SIGTERMs the survivors of a
crashed rank, mindio-run those of a failed round): a worker whose controller is dumping after the
fault finishes that checkpoint within the launcher's grace, where it used to die mid-dump.

A launcher's stop signal after a worker *died* is no preemption either: torchrun SIGTERMs the other
workers of its node within ~0.1 s of a ``kill -9``, often before the controller noticed the death. The
handler tells the two apart on the spot (:func:`gone_siblings`): when a worker of the same launcher
process (same parent, torchrun's ``RANK`` / ``LOCAL_RANK`` in its environment) has ended, the request
sent is ``gone`` naming that rank -- the controller declares it dead, and the line that says so is the
first one of the incident -- instead of a last-words checkpoint request; the bound above applies the same.

A process that leaves already with the controller's exit code (the decorator's ``exit_process``: 75
after a dump, 76) ignores the signal: torchrun SIGTERMs the other workers once the first one exited,
and they would die by it in their last second instead of exiting with that code.

A script that installed its own handler for such a signal before ``tft_start_processor`` keeps it (no
preemption checkpoint on that signal); a signal that comes while no processor is registered with a
controller (before it, or after ``train()`` returned) acts as it would without mindio: there is
nothing to checkpoint.

Prior art: torch.distributed.elastic's agent turns SIGTERM into a ``SignalException`` and forwards the
signal to its workers, SIGKILL after 30 s; NeMo's preemption callback sets a flag in the handler and
saves at the next step boundary. Here the step boundary is the fence every rank already holds for the
controller, so every rank saves the same step.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ... import _knobs, _logging
from ..wire import protocol as P
from .._enums import EXIT_CODE_FAULT
from .._runtime import state as _rt

__all__ = ["install", "check", "requested"]

_log = logging.getLogger("mindio.ttp.preempt")
_installed: dict = {}  # signum -> the handler ours replaced
_first: tuple | None = None  # (signum, time.monotonic()) of the first preemption signal handled
_told = False  # the request was logged (by the link thread)
_lost_since: float | None = None  # since when the link has had no controller, after the request


def install() -> None:
    """(tft_start_processor) Handle MINDIO_PREEMPT_SIGNAL's signals in this process; only the main
    thread can install signal handlers (a processor started elsewhere gets none, said in the log)."""
    names = _knobs.get("MINDIO_PREEMPT_SIGNAL")
    if not names:
        return
    if threading.current_thread() is not threading.main_thread():
        _log.info("processor started outside the main thread: no preemption handler for %s", ",".join(names))
        return
    for name in names:
        signum = getattr(signal, name)
        if signum in _installed:
            continue
        prev = signal.getsignal(signum)
        if prev is not signal.SIG_DFL:
            _log.info("%s is handled by the script already (%r): no last-words checkpoint on it", name, prev)
            continue
        signal.signal(signum, _on_signal)
        _installed[signum] = prev


def requested() -> bool:
    """Has a preemption signal asked for a last-words checkpoint in this process?"""
    return _first is not None


def _on_signal(signum, frame) -> None:
    """(signal handler, main thread) Ask for the checkpoint; no work here (module docstring)."""
    global _first
    if _rt.leaving is not None:
        return  # the process leaves already, with the controller's exit code (75 after a dump)
    if _first is not None:
        if _expired():
            _default(signum)
        return  # asked already
    proc = _rt.processor
    if proc is None or not proc.connected:
        _default(signum)  # nothing to checkpoint (yet, or any more)
        return
    link = proc.link
    _first = (signum, time.monotonic())
    gone = gone_siblings()
    if gone:  # the launcher stops its workers because one of them ended: that one is the fault
        _first = (signum, _first[1], gone)
        link.send(P.Envelope(P.MsgType.REQUEST, P.Request("gone", reason=",".join(map(str, gone)))))
        return
    link.send(P.Envelope(P.MsgType.REQUEST, P.Request("dump", reason=signal.Signals(signum).name)))


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, state letter) of process ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def gone_siblings(environ=None) -> list[int]:
    """The global ranks of this launcher's other workers on this node whose process ended (torchrun: they
    share this process's parent and carry ``LOCAL_RANK`` in their environment; global rank = ``RANK -
    LOCAL_RANK + local rank``). Empty when the launcher does not say (no LOCAL_WORLD_SIZE), or its workers
    hold no such environment (mindio-run's warm interpreters)."""
    env = os.environ if environ is None else environ
    try:
        local, rank, size = int(env["LOCAL_RANK"]), int(env["RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return []
    parent, alive = os.getppid(), {local}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(pid)
        if st is None or st[0] != parent or st[1] in "ZX":
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found = [e[11:] for e in f.read().split(b"\0") if e.startswith(b"LOCAL_RANK=")]
        except OSError:
            continue
        if found and found[0].isdigit():
            alive.add(int(found[0]))
    if len(alive) == 1:  # no sibling found at all (another launcher): nothing to tell
        return []
    return [rank - local + r for r in range(size) if r not in alive]


def _default(signum) -> None:
    """(main thread) What the signal does without mindio: the handler ours replaced, here SIG_DFL."""
    signal.signal(signum, _installed.get(signum, signal.SIG_DFL))
    signal.raise_signal(signum)


def _expired() -> bool:
    return _first is not None and time.monotonic() - _first[1] > _knobs.get("MINDIO_PREEMPT_TIMEOUT")


def check(link=None) -> None:
    """(the processor's link thread, every heartbeat) Log the request once; end the process past
    MINDIO_PREEMPT_TIMEOUT, or sooner when ``link`` lost its controller (with backups: for another
    ``misses`` heartbeat intervals). A controller that died with its rank (torchrun then SIGTERMs the
    survivors) writes no checkpoint: waiting for the bound would only delay the end."""
    global _told, _lost_since
    first = _first
    if first is None:
        return
    name = signal.Signals(first[0]).name
    timeout = _knobs.get("MINDIO_PREEMPT_TIMEOUT")
    if not _told and len(first) > 2:
        _told = True
        _log.info("%s from the launcher after rank(s) %s ended: no preemption; told the controller (this process "
                  "ends with the incident's exit code; bound: MINDIO_PREEMPT_TIMEOUT=%g s)", name, first[2], timeout)
        _logging.event("launcher_stop", signal=name, gone=first[2])
    if not _told:
        _told = True
        _log.info("%s: preemption; asked the controller for a last-words checkpoint at the current step "
                  "(the process then ends with exit code 75; bound: MINDIO_PREEMPT_TIMEOUT=%g s)", name, timeout)
        _logging.event("preempt_requested", signal=name)
    now = time.monotonic()
    lost = link is not None and not link.registered.is_set()
    _lost_since = (_lost_since or now) if lost else None
    # with backup controllers to fail over to, the link gets another misses * interval to register again
    gone = lost and (len(link.addrs) == 1 or now - _lost_since > link.misses * link.interval)
    if _expired() or gone:
        _log.error("%s %.0f s ago and no last-words checkpoint ended this process (%s): exiting with %d", name,
                   now - first[1], "no controller reachable" if gone else
                   "the controller did not answer, or its dump did not finish; MINDIO_PREEMPT_TIMEOUT sets the bound",
                   EXIT_CODE_FAULT)
        for handler in logging.getLogger("mindio").handlers:
            handler.flush()
        os._exit(EXIT_CODE_FAULT)
