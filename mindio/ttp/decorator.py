"""``tft_exception_handler``: wraps the framework's ``train()`` and owns its main thread after a fault.

Protocol (main thread of every rank):

1. ``train()`` raises. The message ``"<Type>: <text>"`` is classified (policy.classify: user patterns
   of ``tft_register_exception_handler`` first, then the reference table, then peer-failure patterns;
   first match wins). A matching user pattern's ``fault_handle(str(exc))`` runs first, if given. Any
   other exception raised while the optimizer update window is closed is RS_RETRY: the step is retried
   once; the same exception at the same step again is RS_UNKNOWN (the dump), and after a relaunch from
   that dump RS_REPEATED (the job ends, exit 79; processor/repeats.py).
2. Report it to the controller at once (this wakes the controller: < 100 ms).
3. Tear down this rank's collectives: the registered stop and clean callbacks destroy the process groups
   and drop every reference to them; the traceback's frames are cleared and garbage is collected, so
   peers blocked in a collective with this rank are released within milliseconds (gloo closes its
   sockets only when the last reference goes; never abort a gloo group: it SIGABRTs the process).
4. Park in ``wait_next_action``. RETRY: call ``train()`` again (the controller's retry flow has rebuilt
   the groups, repaired and rolled back the state to the lock step; retry.py). EXIT(code): run the
   exit callback, wait for an in-process controller to finish, then ``SystemExit(code)`` -- EXIT_CODE_DUMPED
   after a complete dump, EXIT_CODE_FAULT otherwise; once the atexit handlers registered after
   ``train()`` was first entered have run, the process ends with ``os._exit(code)`` (:func:`_finish`).

The callbacks get the arguments given to ``tft_set_step_args``; until it is called, the decorated
``train()``'s positional arguments (as in the reference: a tuple after ``set_mindio_export_version``,
a list otherwise).

When ``train()`` returns, the processor leaves (BYE: the controller counts it as finished, not
failed), as the reference's decorator destroys it; a later ``tft_destroy_processor`` is a no-op.

Without a started processor the decorator is transparent: the exception propagates unchanged.
``KeyboardInterrupt``, ``SystemExit`` and :class:`mindio.errors.AbortTraining` are never caught.
"""
from __future__ import annotations

import atexit
import functools
import logging
import time
import traceback

from .. import _knobs, _logging
from ..errors import describe
from ..launch import failures as _launcher
from . import compat as _compat, shutdown
from .controller import policy
from .processor import reboot as _reboot, repeats as _repeats_mod
from ._enums import EXIT_MEANINGS, Action, OsStatus, ReportState
from ._runtime import state as _rt

__all__ = ["tft_exception_handler", "classify_exception", "exit_process"]

_log = logging.getLogger(__name__)


def classify_exception(exc: BaseException, data_status: int = OsStatus.UPDATED,
                       during_incident: bool = False, outside_update: bool = False) -> ReportState:
    """ReportState of ``exc`` (policy.classify); ``during_incident``: the controller has already
    stopped this rank, so a collective timeout or a destroyed group is a peer's failure reaching it;
    ``outside_update``: raised while the optimizer update window was known to be closed (a generic
    exception is then RS_RETRY)."""
    message = f"{type(exc).__name__}: {exc}"
    start, end = _rt.update_window
    repairable = policy.can_do_uce_repair(time.time_ns(), start, end) if start is not None \
        else data_status == OsStatus.UPDATED
    patterns = [(p, s) for p, s, _h in _rt.user_patterns]
    state = policy.classify(message, patterns, uce_repairable=repairable, during_incident=during_incident,
                            outside_update=outside_update)
    if during_incident and state is ReportState.RS_NORMAL and \
            policy.classify(message, patterns, uce_repairable=repairable) is not state:
        _log.info("secondary error (the controller had stopped this rank already): %s", message[:300])
        _logging.event("secondary_error", message=message[:300])
    for pattern, _s, handle in _rt.user_patterns:
        if pattern in message and handle is not None:
            try:
                handle(str(exc))  # the error text, as the reference passes it
            except Exception:
                _log.exception("fault handle for pattern %r failed", pattern)
            break
    return state


def _update_closed(proc) -> bool:
    """Is the optimizer update window known to be closed on this rank? It is once the rank finished an
    update in this process (``tft_end_updating_os``, or a rollback) and has not opened the next one
    (``tft_start_updating_os``); before its first update nothing says the framework brackets them."""
    return proc.step > 0 and proc.data_status == OsStatus.UPDATED


def _step_in_progress(proc) -> int:
    """The step this rank was computing: its last completed one + 1; before its first update in this
    process, the step of the checkpoint it loaded (tft_report_load_ckpt_step) + 1."""
    return (proc.step or _rt.load_ckpt_step or 0) + 1


def _repeats(proc) -> _repeats_mod.Repeats:
    """This process's memory of its generic exceptions (processor/repeats.py)."""
    if _rt.repeats is None or _rt.repeats.rank != proc.rank:
        _rt.repeats = _repeats_mod.Repeats(proc.rank)
    return _rt.repeats


_ordered_exit: int | None = None
_finish_registered = False


def _finish() -> None:
    """(atexit, registered when ``train()`` is first entered, so it runs after the atexit handlers
    registered later -- the user's -- and before those of torch, megatron and logging imported earlier)
    After an EXIT ordered by the controller: flush, then ``os._exit`` instead of the interpreter
    teardown. Measured on the Megatron example after a dump: the teardown (module and object
    finalisation, C++ static destructors, no Python frame) took 1.6-2 s per rank under load, more
    when loaded further, while the launcher waits for every worker before relaunching;
    ``MINDIO_FAST_EXIT=0`` keeps the full teardown."""
    code = _ordered_exit
    if code is None or not _knobs.get("MINDIO_FAST_EXIT"):
        return
    shutdown.hard_exit(code)


def arm_fast_exit() -> None:
    """Register :func:`_finish` once (at the first entry of a decorated ``train()``, or before a standby
    leaves): an EXIT ordered by the controller then skips the interpreter teardown, whose C++ destructors
    abort the process (SIGABRT) while another thread is still inside gloo -- seen in a standby whose
    rebuild action was creating groups when the job's exit order came."""
    global _finish_registered
    if not _finish_registered:
        _finish_registered = True
        atexit.register(_finish)


def exit_process(proc, code: int):
    """Leave the process after EXIT: exit callback, let an in-process controller finish, SystemExit
    (``finally`` blocks and atexit handlers of the framework run; the interpreter teardown is skipped:
    :func:`_finish`)."""
    _rt.leaving = code  # a stop signal now changes nothing (preempt.py): the process ends with ``code``
    if "exit" in _rt.callbacks:
        func, ctx = _rt.callbacks["exit"]
        try:
            func(ctx)
        except Exception:
            _log.exception("exit callback failed")
    ctl = _rt.controller
    if ctl is not None:  # its exit action must reach every rank before this process goes
        wait = _knobs.get("MINDIO_CONTROLLER_EXIT_WAIT")
        if not ctl.final.wait(wait):
            _log.warning("the controller hosted here did not finish its exit order to every rank within %.0f s "
                         "(MINDIO_CONTROLLER_EXIT_WAIT); leaving anyway", wait)
    proc.destroy()
    _log.warning("exiting with code %d: %s", code, EXIT_MEANINGS.get(code, "ordered by the controller"))
    for handler in logging.getLogger("mindio").handlers:
        handler.flush()
    global _ordered_exit
    _ordered_exit = code  # the interpreter teardown is skipped once user atexit handlers ran (_finish)
    raise SystemExit(code)


def tft_exception_handler(func):
    """Decorate the framework's ``train()``: a fault inside it is reported and recovered from.

    When the decorated function raises, the error is classified (:func:`tft_register_exception_handler`
    patterns, then the reference table: ``UCE ERROR``, ``HBM MULTI BIT ECC``, ``FORCE STOP``, ``HCCL ...``;
    a peer's failure is no fault of this rank), reported to the controller, this rank's groups are torn
    down (the **stop** and **clean** callbacks), and the thread parks until the controller decides:
    RETRY calls ``func`` again with the same arguments (the state was repaired and rolled back to the
    lock step); EXIT runs the **exit** callback and ends the process with the controller's code
    (75 after a dump, 76 otherwise; ``SystemExit``). When ``func`` returns, the processor leaves (BYE)
    and its result is returned. Without a started processor the wrapper is transparent.

    Args:
        func: the training function (e.g. Megatron's ``train``).

    Returns:
        The wrapped function.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        arm_fast_exit()
        proc = _rt.processor
        if proc is not None and proc.step_args is None:  # the reference's default callback arguments
            proc.step_args = args if _compat.get_mindio_export_version() else list(args)
        if _reboot.should_park(proc):  # a replacement process waits to be repaired first (reboot.py)
            action, code = proc.wait_next_action()
            if action is not Action.RETRY:
                exit_process(proc, code)
            _logging.event("train_resumed", step=proc.step, gen=proc.gen, reboot=True)
            proc.first_step_pending = True
        while True:
            proc = _rt.processor
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                if proc is None:
                    raise
                message = describe(exc, where=not str(exc))  # never a bare "AssertionError: "
                state = classify_exception(exc, proc.data_status, during_incident=proc.stopped,
                                           outside_update=_update_closed(proc))
                if state in (ReportState.RS_RETRY, ReportState.RS_UNKNOWN) and not proc.stopped:
                    state, message = _repeats(proc).judge(state, _step_in_progress(proc), message)
                # for the launcher (TORCHELASTIC_ERROR_FILE), if this fault ends the process
                # (strings only: the exception must not outlive its cleared frames)
                fault = dict(message=message, trace=_launcher.format_exception(exc), when=time.time(),
                             consequence=state is ReportState.RS_NORMAL)
                traceback.clear_frames(exc.__traceback__)  # frames hold model / group references
                exc.__traceback__ = None
            else:
                if proc is not None:  # as the reference: train() is done, this rank leaves (BYE, no fault)
                    _repeats(proc).forget()  # a record of an exception a relaunch met again is done with
                    proc.destroy(reason="train() returned")
                    if _rt.processor is proc:
                        _rt.processor = None
                return result
            proc.report(state, message)
            proc.teardown(is_uce=state in (ReportState.RS_UCE, ReportState.RS_UCE_CORRUPTED))
            action, code = proc.wait_next_action()
            if action is Action.RETRY:
                _log.warning("RETRY: re-entering %s", getattr(func, "__name__", "train"))
                _logging.event("train_resumed", step=proc.step, gen=proc.gen)
                proc.first_step_pending = True
                continue
            _launcher.record(**fault, replace=True)  # the launcher's summary names this fault
            exit_process(proc, code)

    return wrapper
