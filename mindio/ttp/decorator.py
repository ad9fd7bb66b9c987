"""``tft_exception_handler``: wraps the framework's ``train()`` and owns its main thread after a fault.

Protocol (main thread of every rank):

1. ``train()`` raises. The message ``"<Type>: <text>"`` is classified (policy.classify: user patterns
   of ``tft_register_exception_handler`` first, then the reference table, then peer-failure patterns;
   first match wins). A matching user pattern's ``fault_handle(exc)`` runs first, if given.
2. Report it to the controller at once (this wakes the controller: < 100 ms).
3. Tear down this rank's collectives: the registered stop and clean callbacks destroy the process groups
   and drop every reference to them; the traceback's frames are cleared and garbage is collected, so
   peers blocked in a collective with this rank are released within milliseconds (gloo closes its
   sockets only when the last reference goes; never abort a gloo group: it SIGABRTs the process).
4. Park in ``wait_next_action``. RETRY: call ``train()`` again (the controller's retry flow has rebuilt
   the groups, repaired and rolled back the state to the lock step; retry.py). EXIT(code): run the
   exit callback, wait for an in-process controller to finish, then ``SystemExit(code)`` -- EXIT_CODE_DUMPED after a complete dump, EXIT_CODE_FAULT otherwise.

Without a started processor the decorator is transparent: the exception propagates unchanged.
``KeyboardInterrupt``, ``SystemExit`` and :class:`mindio.errors.AbortTraining` are never caught.
"""
from __future__ import annotations

import functools
import logging
import time
import traceback

from .. import _logging
from . import policy
from . import reboot as _reboot
from ._enums import Action, OsStatus, ReportState
from ._runtime import state as _rt

__all__ = ["tft_exception_handler", "classify_exception", "exit_process"]

_log = logging.getLogger(__name__)


def classify_exception(exc: BaseException, data_status: int = OsStatus.UPDATED) -> ReportState:
    message = f"{type(exc).__name__}: {exc}"
    start, end = _rt.update_window
    repairable = policy.can_do_uce_repair(time.time_ns(), start, end) if start is not None \
        else data_status == OsStatus.UPDATED
    patterns = [(p, s) for p, s, _h in _rt.user_patterns]
    state = policy.classify(message, patterns, uce_repairable=repairable)
    for pattern, _s, handle in _rt.user_patterns:
        if pattern in message and handle is not None:
            try:
                handle(exc)
            except Exception:
                _log.exception("fault handle for pattern %r failed", pattern)
            break
    return state


def exit_process(proc, code: int):
    """Leave the process after EXIT: exit callback, let an in-process controller finish, SystemExit."""
    if "exit" in _rt.callbacks:
        func, ctx = _rt.callbacks["exit"]
        try:
            func(ctx)
        except Exception:
            _log.exception("exit callback failed")
    ctl = _rt.controller
    if ctl is not None:
        ctl.final.wait(30)  # its exit action must reach every rank before this process goes
    proc.destroy()
    _log.warning("exiting with code %d", code)
    for handler in logging.getLogger("mindio").handlers:
        handler.flush()
    raise SystemExit(code)


def tft_exception_handler(func):
    """Decorate the framework's ``train()`` (see module docstring for the protocol)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        proc = _rt.processor
        if _reboot.should_park(proc):  # a replacement process waits to be repaired first (reboot.py)
            action, code = proc.wait_next_action()
            if action is not Action.RETRY:
                exit_process(proc, code)
            _logging.event("train_resumed", step=proc.step, gen=proc.gen, reboot=True)
        while True:
            proc = _rt.processor
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                if proc is None:
                    raise
                message = f"{type(exc).__name__}: {exc}"
                state = classify_exception(exc, proc.data_status)
                traceback.clear_frames(exc.__traceback__)  # frames hold model / group references
                exc.__traceback__ = None
            proc.report(state, message)
            proc.teardown(is_uce=state in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED))
            action, code = proc.wait_next_action()
            if action is Action.RETRY:
                _log.warning("RETRY: re-entering %s", getattr(func, "__name__", "train"))
                _logging.event("train_resumed", step=proc.step, gen=proc.gen)
                continue
            exit_process(proc, code)

    return wrapper
