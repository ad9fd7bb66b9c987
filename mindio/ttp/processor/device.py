"""Stop and clean collectives on each backend, behind one small interface.

Recovery needs two device-side operations on a rank, in this order (ARCHITECTURE section 3):

1. ``stop()``  -- make pending and future collectives on this rank fail instead of waiting,
   so that peers blocked in a collective with this rank are released;
2. ``clean(drop_references)`` -- destroy every process group of this rank, let the framework drop
   its own references to them (``drop_references()``), collect garbage, and free device memory
   caches, so that a new generation of groups can be created in the same process.

``teardown(drop_references)`` runs both. A hung rank is not cleaned: ``kill_hung(pid)`` turns the
hang into a process death (SIGKILL), which its peers see at once.

What each backend does:

==========  ==========================================================  ===========================
backend     stop                                                        clean
==========  ==========================================================  ===========================
gloo (CPU)  nothing: a gloo pair is released when its last reference    destroy all groups, drop
            goes away; ``_abort_process_group`` SIGABRTs the process    references, gc (peers fail
            on gloo in torch 2.13 and ``ProcessGroup.abort()`` does     with "Connection closed by
            not release a pending collective, so neither is called     peer" within milliseconds)
nccl        ``_abort_process_group`` on every group (the communicator   destroy, drop, gc,
            abort: blocked kernels return, watchdogs stop)             ``torch.cuda.empty_cache``
hccl        ``torch_npu.npu.stop_device(device)`` (must return 0)       destroy, drop, gc,
                                                                        ``restart_device(device)``
==========  ==========================================================  ===========================

Garbage collection is the cost of ``clean`` on CPU: a full ``gc.collect()`` walks every object of
the process, ~400k after importing torch and megatron-core (0.25 CPU-s each, several times that on
a loaded machine), although the groups only hang off the few training objects built later.
``freeze_startup_objects()`` (called once before the model is built; ``TrainingContext.init_parallel``
does) moves what exists at that point -- modules, classes, functions: never garbage -- to the
permanent generation, so the one collection of a teardown walks only the training objects
(measured: 0.25 s -> milliseconds). ``MINDIO_GC_FREEZE=0`` turns it off.

``backend_for(group)`` picks the implementation from the process group's backend (or, before
``init_process_group``, from the devices present). ``reinit()`` is where a backend may re-create
device resources after a rebuild (HCCL: ``torch_npu.distributed.reinit_process_group``).
"""
from __future__ import annotations

import atexit
import gc
import importlib.util
import logging
import os
import _thread
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ... import _knobs, _logging

__all__ = ["DeviceBackend", "GlooBackend", "NcclBackend", "HcclBackend", "backend_for",
           "teardown", "kill_hung", "all_groups", "destroy_all", "destroy_groups", "group_settings",
           "freeze_startup_objects", "collect", "release", "forget_default_arguments", "flush_autograd"]

_log = logging.getLogger("mindio.ttp.device")


def all_groups() -> list:
    """Every process group this process created (the default group last), empty if none."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    world = dist.group.WORLD
    groups = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world]
    return groups + [world]


def destroy_groups() -> int:
    """Destroy every process group torch.distributed still registers, the default one included
    (``dist.destroy_process_group()`` clears its registry: ``_world.pg_map``, names, tags, the C++
    group registry); returns how many there were. A group is gone for good -- its gloo connections
    closed, peers blocked in a collective with this rank released -- only once nothing else refers to
    it (module docstring): :func:`release` drops the caller's references."""
    if not dist.is_available():
        return 0
    c10d = dist.distributed_c10d
    left = list(c10d._world.pg_map)
    if not left:
        return 0
    try:
        dist.destroy_process_group()  # every group, the default one included
    except (RuntimeError, ValueError) as exc:  # no default group any more: destroy the rest one by one
        _log.info("destroy_process_group: %s; destroying groups one by one", exc)
        for g in left:
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError, AssertionError):
                pass
        c10d._world.pg_map.clear()
    return len(left)


def group_settings(group=None) -> dict:
    """What re-creating ``group`` (default: the default group) with the same behaviour needs:
    ``{"backend", "timeout", "device_id"}`` (the timeout its backend was created with, e.g. the
    user's ``init_process_group(timeout=...)``); empty without a default group."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    pg = group or dist.group.WORLD
    out = {"backend": str(dist.get_backend(pg)), "device_id": getattr(pg, "bound_device_id", None)}
    for device_type in getattr(pg, "_device_types", ()):
        try:
            out["timeout"] = pg._get_backend(device_type).options._timeout
            break
        except (AttributeError, RuntimeError):
            continue
    return out


_frozen = False


def freeze_startup_objects() -> int:
    """Once per process, before the model is built: collect, then ``gc.freeze()`` every object that
    exists now (module docstring). Returns the number of objects frozen (0 when done before or off
    with ``MINDIO_GC_FREEZE=0``). Objects created later -- the model, optimizer and process groups
    whose last reference a teardown drops -- stay collectable."""
    global _frozen
    if _frozen or not _knobs.get("MINDIO_GC_FREEZE"):
        return 0
    _frozen = True
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    _log.info("gc: %d start-up objects frozen (a teardown's collection walks only newer ones)", count)
    return count


_pending = [0]                       # release threads still running a group's destructor
_pending_lock = threading.Condition()


def _drop(box: list) -> None:
    try:
        box.clear()  # the last reference: the group's destructor runs on this thread
    finally:
        with _pending_lock:
            _pending[0] -= 1
            _pending_lock.notify_all()


def wait_released(timeout: float = 10.0) -> bool:
    """Wait until every group handed to :func:`release` has been destroyed (True), at most ``timeout``
    s. Registered at exit: a process that exits while a release thread is still inside a gloo group's
    destructor aborts ('terminate called without an active exception', SIGABRT) in the C++ teardown."""
    deadline = time.monotonic() + timeout
    with _pending_lock:
        while _pending[0] > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                _log.warning("%d process group(s) still being destroyed after %.1f s; exiting anyway",
                             _pending[0], timeout)
                return False
            _pending_lock.wait(left)
    return True


atexit.register(wait_released)


# modules whose functions take ``group=group.WORLD`` as a default argument: evaluated when the module
# is first imported, which (DDP imports it) is usually after init_process_group
_BAKED_DEFAULT_MODULES = ("torch.distributed.nn.functional",)


def forget_default_arguments(groups) -> int:
    """Replace ``groups`` by None where library functions hold them as default arguments; returns the
    number of functions changed.

    ``torch.distributed.nn.functional`` (imported by DDP) writes ``group=group.WORLD`` in ten
    signatures, so once it is imported after ``init_process_group`` its functions hold the default
    group for good: the group outlives ``destroy_process_group``, its gloo connections stay open, and a
    peer blocked in a collective with this rank (DDP's backward all-reduce) is never released (measured:
    4-rank DDP job, the stop waited its full 90 s). None is the value these defaults have when the
    module is imported before ``init_process_group``: the default group at call time."""
    ids = {id(g) for g in groups}
    changed = 0
    for name in _BAKED_DEFAULT_MODULES:
        mod = sys.modules.get(name)
        for func in (vars(mod).values() if mod is not None else ()):
            defaults = getattr(func, "__defaults__", None)
            if defaults and any(id(v) in ids for v in defaults):
                func.__defaults__ = tuple(None if id(v) in ids else v for v in defaults)
                changed += 1
    return changed


def release(groups: list, unreferenced_only: bool = False) -> int:
    """Drop the caller's references to ``groups`` on background threads, one per group, and empty
    ``groups``. A gloo group's destructor closes its pairs one at a time, each waiting for the
    group's I/O loop to tick (~10 ms; ~30 ms a group with 4 ranks, measured; the GIL is released
    meanwhile): destroyed one after another, megatron's ~20 groups keep peers blocked for 0.5 s and
    more; in parallel, every connection is closed within one such wait. A group still referenced
    elsewhere is freed whenever its last reference goes. ``unreferenced_only``: hand over only the
    groups nothing else references any more (before a garbage collection: those are released at once;
    the others stay in ``groups`` until the collection freed their referrers). Returns the number of
    groups handed over."""
    forget_default_arguments(groups)
    n, keep = 0, []
    while groups:
        g = groups.pop()
        if unreferenced_only and sys.getrefcount(g) > 2:  # 2: the name g and getrefcount's argument
            keep.append(g)
        else:
            with _pending_lock:
                _pending[0] += 1
            _thread.start_new_thread(_drop, ([g],))  # no wait for the thread to start (threading.Thread does)
            n += 1
        del g
    groups.extend(keep)
    return n


def destroy_all() -> list:
    """:func:`destroy_groups`, returning the groups (:func:`all_groups` before) whose references the
    caller then releases."""
    groups = all_groups()
    destroy_groups()
    return groups


def flush_autograd() -> None:
    """(on the thread whose backward raised) Let the autograd engine drop what an interrupted backward left.

    A backward that raised -- a failed collective inside it, or a stop's interrupt at a gradient hook
    (mindio/megatron/adapter.py) -- leaves the nodes it had queued in the CPU ready queue of the thread
    that called it, until that thread's next backward: they keep what they saved (activations, and what
    autograd functions keep for their backward, e.g. megatron's tensor-parallel group), so a group could
    outlive its teardown and a peer blocked in a collective with this rank would never be released
    (measured: TP=2, a backward interrupted on one rank, its peer blocked until the test's bound). An empty
    backward on the same thread pops and discards them (their graph task is gone)."""
    try:
        leaf = torch.zeros((), requires_grad=True)
        leaf.backward()
    except Exception as exc:  # never let the teardown fail on this
        _log.debug("autograd flush failed: %s", exc)


def collect() -> float:
    """One full garbage collection; returns its duration in ms (logged at debug level)."""
    t0 = time.monotonic()
    gc.collect()
    ms = (time.monotonic() - t0) * 1000
    _log.debug("gc.collect: %.1f ms", ms)
    return ms


class DeviceBackend:
    """Base: what every backend does. Subclasses add the device-specific calls."""

    name = "base"

    def stop(self) -> None:
        """Make collectives of this rank fail instead of wait (see the module table)."""

    def clean(self, drop_references: Optional[Callable[[], object]] = None) -> int:
        """Destroy every process group, let the caller drop its references, collect garbage.

        Returns the number of groups destroyed. Peers in a collective with this rank are released
        only once *no* reference to a group remains, hence ``drop_references`` (it must clear every
        framework global, model/optimizer handle that holds a group) before ``gc.collect()``.
        """
        groups = all_groups()  # held until the references are dropped, then released in parallel
        destroy_groups()
        if drop_references is not None:
            drop_references()
        count = len(groups)
        release(groups, unreferenced_only=True)
        if count or drop_references is not None:  # nothing destroyed or dropped: nothing to collect
            collect()
        release(groups)
        self.free_device_memory()
        return count

    def reinit(self) -> None:
        """Re-create device resources after the groups were rebuilt (HCCL only)."""

    def free_device_memory(self) -> None:
        """After the groups are gone: what the device needs before new groups (nccl: synchronize +
        empty_cache; hccl: restart_device). ``clean`` calls it; so does the processor's teardown."""


class GlooBackend(DeviceBackend):
    """CPU / gloo: no abort exists that is safe; destroying and dropping every group releases peers."""

    name = "gloo"


class NcclBackend(DeviceBackend):
    """CUDA / NCCL: abort the communicators, then clean and free the caching allocator."""

    name = "nccl"

    def stop(self) -> None:
        """Abort every group's communicators at once, one thread per group, then unregister them all.

        Measured on an H200 (torch 2.11.0+cu130, one rank, 2026-11-26): one communicator's abort takes
        about 1.0 s, and torch aborts a process's groups one after another -- 21 groups (Megatron makes
        about 20) took 12.0 s aborted group by group and 19.5 s with ``_abort_process_group()`` (all of
        them inside one ncclGroupStart/End); on parallel threads the 21 took 1.01 s, after which
        ``_abort_process_group()`` unregistered them in 4 ms. ``ProcessGroup.abort`` releases the GIL.
        The wait is bounded (MINDIO_NCCL_ABORT_TIMEOUT): past it the teardown goes on and the log names
        the groups still aborting."""
        groups = all_groups()
        failed: list = []

        def abort(g) -> None:
            try:
                if hasattr(g, "abort"):
                    g.abort()  # every backend of the group: ncclCommAbort for NCCL, non-blocking for peers
                else:  # older torch: ProcessGroup.abort on the NCCL backend object
                    g._get_backend(torch.device("cuda")).abort()
            except Exception as exc:  # an already aborted/destroyed group: nothing left to stop
                failed.append(f"{g}: {exc}")

        threads = [threading.Thread(target=abort, args=(g,), name="mindio-nccl-abort", daemon=True) for g in groups]
        for t in threads:
            t.start()
        bound = _knobs.get("MINDIO_NCCL_ABORT_TIMEOUT")
        end = time.monotonic() + bound
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        running = sum(t.is_alive() for t in threads)
        if running:
            _log.error("nccl: %d of %d communicator aborts still running after %.0f s "
                       "(MINDIO_NCCL_ABORT_TIMEOUT); the teardown goes on without them", running, len(threads), bound)
        for line in failed[:4]:
            _log.info("nccl abort of %s", line)
        unregister = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if unregister is not None and not running and dist.is_initialized():
            try:  # the communicators are aborted: this only unregisters the groups (milliseconds)
                unregister()
            except Exception as exc:
                _log.info("nccl: unregistering the aborted groups: %s", exc)

    def free_device_memory(self) -> None:
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()  # kernels of the aborted communicators have returned
            except RuntimeError as exc:  # a sticky CUDA error: the process must be replaced
                _log.warning("torch.cuda.synchronize after abort failed: %s", exc)
            torch.cuda.empty_cache()


class HcclBackend(DeviceBackend):
    """Ascend / HCCL through torch_npu's stop_device, restart_device, reinit_process_group."""

    name = "hccl"

    def __init__(self):
        import torch_npu  # noqa: F401  (only constructed when importable)

        self._npu = torch_npu

    def _device(self) -> int:
        return int(torch.npu.current_device())

    def stop(self) -> None:
        ret = self._npu.npu.stop_device(self._device())
        if ret not in (None, 0):
            raise RuntimeError(f"torch_npu.npu.stop_device({self._device()}) returned {ret}; "
                               "the device could not be stopped (replace this process)")

    def free_device_memory(self) -> None:
        self._npu.npu.restart_device(self._device())

    def reinit(self) -> None:
        self._npu.distributed.reinit_process_group(group=None, rebuild_link=True)


def _npu_importable() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def backend_for(group=None) -> DeviceBackend:
    """The backend of ``group`` (default: the default group); before init, from the devices."""
    name = None
    if dist.is_available() and dist.is_initialized():
        name = str(dist.get_backend(group)).lower()
    elif _npu_importable():
        name = "hccl"
    elif torch.cuda.is_available():
        name = "nccl"
    if name is None or "gloo" in name and "nccl" not in name:
        return GlooBackend()
    if "nccl" in name:  # also "cpu:gloo,cuda:nccl": the device collectives need the abort
        return NcclBackend()
    if "hccl" in name:
        if not _npu_importable():
            raise RuntimeError("process group backend is hccl but torch_npu is not importable")
        return HcclBackend()
    _log.warning("unknown process-group backend %r: using the gloo (destroy + gc) teardown", name)
    return GlooBackend()


def teardown(drop_references: Optional[Callable[[], object]] = None, group=None) -> str:
    """stop + clean on this rank with the right backend; returns the backend's name.

    Call it from a rank that caught an exception (or from the stop/clean callbacks) *after* the
    framework stopped issuing collectives. Logs and records ``device_teardown`` with its duration.
    """
    t0 = time.monotonic()
    backend = backend_for(group)
    backend.stop()
    backend.clean(drop_references)
    ms = (time.monotonic() - t0) * 1000
    _log.info("%s teardown: groups destroyed and released in %.1f ms", backend.name, ms)
    _logging.event("device_teardown", backend=backend.name, ms=round(ms, 2))
    return backend.name


def kill_hung(pid: Optional[int] = None) -> None:
    """SIGKILL a hung rank (default: this process): its peers then fail at once."""
    pid = os.getpid() if pid is None else pid
    _log.warning("killing hung rank process %d with SIGKILL", pid)
    _logging.event("killed_as_hung", pid=pid)
    os.kill(pid, signal.SIGKILL)
