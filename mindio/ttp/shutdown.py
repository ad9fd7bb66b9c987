"""The end of a process that used mindio.ttp: nothing of ours, or of torch.distributed, still runs when
the interpreter shuts down.

The crash this prevents (measured, issue 13): after a finished run, a rank died at process exit with
SIGABRT, "terminate called without an active exception" (tests/recovery/test_hotswitch.py's reference
run, 1 run in 4 on a loaded 2-core machine). The core showed a gloo worker thread
(``ProcessGroupGloo::runLoop``) destroying the work of the script's last collective -- a barrier holding
the ``all_gather_object`` before it -- *after* the main thread had returned from it and entered
``Py_FinalizeEx``. That destructor frees tensors Python created, so it takes the GIL; in a finalizing
interpreter ``take_gil`` ends the thread (``pthread_exit``), the forced unwind meets the work's noexcept
destructor and libstdc++ calls ``std::terminate``. It is torch's race (pytorch/pytorch#190489), present
without mindio; a loaded machine widens it. The one safe moment to end it is while the interpreter is
whole: destroying a process group joins its worker threads (``~ProcessGroupGloo``), so every pending
work destructor has run.

:func:`install` (called when a processor or a controller starts) registers :func:`at_exit` with atexit,
once. It runs after the atexit handlers registered later (the training script's; the decorator's fast
exit, which ends the process before) and before the interpreter shuts down:

1. control plane: every running controller and processor link of this process (and a processor's wait
   clock, which reads the groups' counters in torch's C++) stops, its threads are joined and its sockets
   closed; then mindio's own zmq context is terminated (never the application's);
2. torch.distributed: the frameworks drop their references (:func:`on_exit`, e.g. ``FrameworkAdapter.release``),
   ``destroy_process_group()`` (every group), torch's references released in parallel
   (``device.release``; each destructor joins its group's threads), awaited within MINDIO_EXIT_TIMEOUT s;
3. a DistributedDataParallel wrapper the script still holds lets go of its group (:func:`_drop_ddp_groups`:
   its reducer, logger and group reference are dropped; the process ends next);
4. leftovers are reported in one line: gloo worker threads still running belong to groups the training
   script still references (a global, a model wrapper), or to a default group that torch keeps because torch._dynamo
   was first imported after ``init_process_group`` (torch 2.13; DistributedDataParallel's and a torch
   optimizer's constructors import it: :func:`import_dynamo_early`, mindio/_dynamo.py).

The same steps suit NCCL and HCCL: ``destroy_process_group`` shuts their communicators down (torch asks
every application to call it before exit). A process ended by ``os._exit`` (the decorator's fast exit
after an EXIT, a SIGKILL) never reaches the interpreter shutdown and needs none of this.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref

from .. import _knobs

__all__ = ["install", "track", "on_exit", "at_exit", "collective_threads", "hard_exit",
           "import_dynamo_early", "remove_at_exit"]

_log = logging.getLogger(__name__)
_installed = False
_ran = False  # at_exit ran
_lock = threading.Lock()
_live: "weakref.WeakSet" = weakref.WeakSet()  # controllers and links started in this process
_releasers: list = []  # the frameworks' "drop every reference to a process group" (on_exit)
_closers: list = []  # once the control plane's threads ended: close its sockets (transport.close_context)
_files: list = []  # files of this process that must not outlive it (remove_at_exit)


def import_dynamo_early() -> None:
    """(mindio.ttp's import) torch._dynamo now, before the training script's ``init_process_group``, if
    the script wants it (mindio/_dynamo.py): imported later it keeps the default group alive past
    ``destroy_process_group`` (the module docstring, step 3). A process without torch yet (mindio-run's
    agent, which imports mindio.ttp for its controller) or with a group already is left alone, and so is
    one whose ``__main__`` is mindio-run's own (a fork server, a warm spare: mindio.launch._zygote,
    _zygote_host, _bootstrap): its preload already decided for the script it will run
    (``_bootstrap._preload``), and its own module's text -- which names megatron -- is not the script's
    (read as the script's, it imported torch._dynamo into every fork server: ~1.3 CPU-s each)."""
    from .. import _dynamo

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name or "").startswith("mindio.launch."):
        return
    _dynamo.import_early(getattr(main, "__file__", None))


def install() -> None:
    """Register :func:`at_exit` once per process."""
    global _installed
    with _lock:
        if not _installed:
            _installed = True
            atexit.register(at_exit)


def track(part) -> None:
    """Remember a started Controller, Link or WaitClock (anything with ``close(timeout) -> bool``); installs."""
    install()
    _live.add(part)


def remove_at_exit(path: str) -> None:
    """Remove ``path`` when this process ends: at the interpreter's exit and in :func:`hard_exit` too (the
    decorator's fast exit after an ordered EXIT skips the atexit handlers). For a private file that must not
    outlive its job -- the job secret's (mindio/_secret.py): with atexit alone, every one-node torchrun job
    that ended in a controller-ordered exit left its secret in the temporary directory."""
    with _lock:
        first = not _files
        _files.append(path)
    if first:
        atexit.register(_remove_files)


def _remove_files() -> None:
    with _lock:
        paths = list(_files)
        _files.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # gone already
            pass


def after_control_plane(close) -> None:
    """Have the exit teardown call ``close()`` once every tracked part's threads ended (step 1): how
    transport.py hands over ``close_context`` (this module imports no part of the control plane)."""
    with _lock:
        if close not in _closers:
            _closers.append(close)


def on_exit(release) -> None:
    """Have the exit teardown call ``release()`` before it destroys the process groups: a framework's
    way to drop the references it holds (megatron's parallel state, model wrappers); installs.
    ``mindio.adapter.register`` adds ``FrameworkAdapter.release``."""
    install()
    with _lock:
        if release not in _releasers:
            _releasers.append(release)


def collective_threads() -> int:
    """The number of gloo worker threads (``pt_gloo_runloop``) alive in this process; 0 where /proc has
    no thread names."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _close_control_plane(deadline: float) -> bool:
    """Stop every tracked controller and link; True when every thread of theirs ended."""
    ok = True
    for part in list(_live):
        ok = part.close(max(0.1, deadline - time.monotonic())) and ok
    return ok


def _release_groups(deadline: float, quiet: bool = False) -> None:
    from .processor import device

    warn = _log.debug if quiet else _log.warning
    groups = device.destroy_all()
    device.release(groups)  # our references, dropped in parallel: an unreferenced group goes now
    if not device.wait_released(max(0.1, deadline - time.monotonic())):
        warn("exit: process groups still being destroyed after MINDIO_EXIT_TIMEOUT=%.0f s (their worker threads "
             "wait for a collective with a peer); the interpreter shutdown may abort",
             _knobs.get("MINDIO_EXIT_TIMEOUT"))
        return
    if collective_threads():  # groups referenced from garbage cycles go with one collection
        device.collect()
    if collective_threads() and _drop_ddp_groups():  # a DistributedDataParallel the script still holds
        device.collect()
    left = collective_threads()
    if left:
        warn("exit: %d gloo worker thread(s) still run: drop the script's references to process groups before "
             "destroy_process_group, or the exit may abort (docs/quickstart.md)", left)


def _drop_ddp_groups() -> int:
    """Make every live DistributedDataParallel module let go of its process group (its reducer, logger and
    ``process_group``): the script may still hold the wrapper at exit, and the wrapper holds the group
    open. The process ends next, so the wrappers are not used again. Returns how many were found."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is None:
        return 0
    import gc

    cls = ddp.DistributedDataParallel  # by type(): isinstance reads __class__, which some objects warn about
    found = [o for o in gc.get_objects() if cls in type(o).__mro__]
    for module in found:
        for name in ("reducer", "logger", "process_group", "_default_comm_hook_state"):
            module.__dict__.pop(name, None)
    return len(found)


def _freeze_for_shutdown() -> None:
    """One collection (garbage cycles are finalized as the interpreter's first shutdown pass would),
    then freeze what is left: the interpreter's shutdown collections walk none of it again. Python
    runs no ``__del__`` of objects alive at exit anyway. Measured on a process that imported torch and
    megatron-core (load 25-30): exit 4.6-7.2 s -> 1.7-2.5 s; with the start-up objects frozen already
    (device.freeze_startup_objects) the collection walks only the training objects."""
    import gc

    gc.collect()
    gc.freeze()


def at_exit(quiet: bool = False) -> None:
    """(atexit) Close the control plane, then release every process group (module docstring). Once per
    process: mindio-run's worker bootstrap calls it too, after the handler :func:`install` registered.
    ``quiet``: for a script that never started mindio, what is left over is logged at debug level (its
    groups are released as far as its references allow; the advice is for mindio's users)."""
    global _ran
    with _lock:
        if _ran:
            return
        _ran = True
    timeout = _knobs.get("MINDIO_EXIT_TIMEOUT")
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        closed = _close_control_plane(deadline)
        if closed:
            for close in list(_closers):
                close()
        else:
            _log.warning("exit: mindio control-plane threads still run after MINDIO_EXIT_TIMEOUT=%.0f s; "
                         "its zmq context is left open", timeout)
        import sys

        for release in list(_releasers):
            try:
                release()
            except Exception:
                _log.exception("exit: %s failed", getattr(release, "__qualname__", release))
        if "torch.distributed" in sys.modules:
            _release_groups(deadline, quiet)
        if _knobs.get("MINDIO_GC_FREEZE"):
            _freeze_for_shutdown()
    except Exception:  # an exit hook never raises: the process ends anyway, say why it was unclean
        _log.exception("exit: teardown failed")
    _log.debug("exit teardown: %.1f ms", (time.monotonic() - t0) * 1000)


def hard_exit(code: int) -> None:
    """End the process with ``code`` now, without the interpreter teardown: flush stdout, stderr and the
    logging handlers, then ``os._exit`` (decorator._finish after an ordered exit; the processor's exit
    watch, processor.Processor._watch_exit). The files of :func:`remove_at_exit` are removed first."""
    _remove_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    logging.shutdown()
    os._exit(code)
