"""Accelerator tensors straight between the device and the pool (CUDA; Ascend NPU written, untested).

Why: a save used to copy every device storage into freshly allocated pageable memory (``.cpu()``:
first-touch page faults plus a synchronous pageable copy, ~0.9 s per GiB on an H100) and then a
second time into the pool: 37-58x the device-to-host copy limit. Here each process registers its own
mapping of the pool as page-locked memory once (``cudaHostRegister``; ``aclrtHostRegister`` on
Ascend) and copies each device storage into its slot of the pool image with a non-blocking copy on
a dedicated stream per device; ``save()`` waits for exactly those copies. Loads to a device copy
from the same registered mapping, non-blocking, on the same stream. The pool stays a plain shared
mapping for the daemon; the copies are DMA from/to its pages.

Rules:
- No accelerator runtime is touched unless a device tensor is being saved or loaded, or the runtime
  is already initialized in this process (``torch.cuda.is_initialized()``): then the pool is
  registered at connect, so that even the first save runs at the copy limit. A CPU-only process
  never creates a context and never registers anything.
- One registration per process and backend, of the whole mapping, kept while the mapping lives (the
  pool is page-locked meanwhile: that is the pinned-memory budget, once per node in physical memory
  since every process pins the same shared pages). ``MINDIO_ACP_PIN_POOL=0`` turns it off.
- Registration refused (limits, a container without pinned memory) or turned off: each device copies
  through two reusable pinned staging buffers of 64 MiB (double buffered: one fills over DMA while the
  other is copied into the pool); with no pinned memory at all, through synchronous pageable copies.
  Which path a process uses is logged once.
- Ordering: a save's stream first waits for the device's current stream (the tensors' producer);
  a load allocates on the current stream, its stream waits for that stream, and the load returns once
  its copies are complete, so the caller's later work sees the bytes.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
import weakref

from .. import _knobs
from ._poolfile import address

__all__ = ["DevicePool", "to_host", "to_device", "initialized_backends", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("cuda", "npu")           # device types with a fast path; others use plain .to()/.cpu()
_CHUNK = 64 << 20                    # one staging buffer (fallback path); two per device
_CUDA_HOST_REGISTER_PORTABLE = 1     # pinned for every context of the process (all its devices)
_ACL_HOST_REGISTER_MAPPED = 0
_logged: set = set()


def _log_once(key, level, msg, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def initialized_backends() -> list:
    """Accelerator runtimes already initialized in this process; never initializes one (and never
    imports torch: a process that has not imported it has no accelerator state to save)."""
    torch = sys.modules.get("torch")
    out = []
    for name in BACKENDS:
        mod = getattr(torch, name, None) if torch is not None else None
        try:
            if mod is not None and mod.is_initialized():
                out.append(name)
        except Exception:          # a backend module without is_initialized: not in use
            pass
    return out


# ---- registration ----------------------------------------------------------------------------------
def _loaded_library(fragment: str):
    """A ctypes handle on a shared library already loaded in this process (by its path in
    /proc/self/maps), so that we call the very instance torch uses; None if it is not loaded."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if fragment in path.rsplit("/", 1)[-1]:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None


def _cuda_register(addr: int, size: int):
    """cudaHostRegister through torch's own runtime binding; None on success, else the reason."""
    import torch

    rt = torch.cuda.cudart()
    err = int(rt.cudaHostRegister(addr, size, _CUDA_HOST_REGISTER_PORTABLE))
    if err == 0:
        return None
    # a failed runtime call leaves its error as the thread's "last error"; torch's next kernel-launch
    # check would raise it from an unrelated operation, so consume it here
    lib = _loaded_library("libcudart.so")
    if lib is not None:
        lib.cudaGetLastError()
    return f"cudaHostRegister failed with cudaError {err}"


def _cuda_unregister(addr: int) -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.cudart().cudaHostUnregister(addr)


def _npu_register(addr: int, size: int):
    """aclrtHostRegister (CANN >= 8.0) on the library torch_npu loaded; None on success, else the reason.
    Written from the CANN API reference; no Ascend device was available to test it."""
    lib = _loaded_library("libascendcl.so")
    if lib is None or not hasattr(lib, "aclrtHostRegister"):
        return "libascendcl.so with aclrtHostRegister is not loaded in this process"
    dev_ptr = ctypes.c_void_p()
    err = lib.aclrtHostRegister(ctypes.c_void_p(addr), ctypes.c_uint64(size),
                                ctypes.c_int(_ACL_HOST_REGISTER_MAPPED), ctypes.byref(dev_ptr))
    return None if err == 0 else f"aclrtHostRegister failed with aclError {err}"


def _npu_unregister(addr: int) -> None:
    lib = _loaded_library("libascendcl.so")
    if lib is not None:
        lib.aclrtHostUnregister(ctypes.c_void_p(addr))


_REGISTER = {"cuda": (_cuda_register, _cuda_unregister), "npu": (_npu_register, _npu_unregister)}


def _unregister_all(backends: list, addr: int, _anchor) -> None:
    """Finalizer: undo the registrations while the mapping (kept alive by ``_anchor``) still exists."""
    for name in backends:
        try:
            _REGISTER[name][1](addr)
        except Exception:
            pass


# ---- copies ----------------------------------------------------------------------------------------
def _normalize(dev):
    """torch.device with an index ("cuda" -> "cuda:<current>")."""
    import torch

    dev = torch.device(dev)
    if dev.index is None and dev.type in BACKENDS:
        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
    return dev


def _by_device(items, device_of) -> dict:
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(_normalize(device_of(item)), []).append(i)
    return groups


def to_host(view, jobs: list):
    """Copy device tensors into ``view`` synchronously (no pool, no registration): the path of a save
    without a daemon client. ``jobs``: [(offset, uint8 device tensor)]. Returns None (nothing to wait)."""
    import torch

    dst = torch.frombuffer(view, dtype=torch.uint8)
    for off, src in jobs:
        dst[off: off + src.numel()].copy_(src)
    return None


def to_device(view, jobs: list) -> list:
    """Copy ``[(start, nbytes, device)]`` of ``view`` to new device tensors (synchronous, pageable)."""
    import torch

    src = torch.frombuffer(view, dtype=torch.uint8)
    return [src[start: start + n].to(_normalize(dev)) for start, n, dev in jobs]


class DevicePool:
    """One process's device access to its mapping of the pool: registration, streams, staging."""

    def __init__(self, pool, size: int, copy_many):
        self.addr, self._anchor = address(pool)     # the anchor keeps the mapping (and its address)
        self.size = size
        self._copy_many = copy_many
        self._lock = threading.Lock()
        self.paths: dict = {}          # backend -> "pinned" | "staged"
        self.register_s: dict = {}     # backend -> seconds its registration took
        self._registered: list = []    # backends whose registration must be undone
        self._streams: dict = {}       # torch.device -> dedicated copy stream
        self._staging: dict = {}       # torch.device -> ([2 pinned buffers], [2 events]) or None
        weakref.finalize(self, _unregister_all, self._registered, self.addr, self._anchor).atexit = False

    def prepare(self) -> None:
        """At connect: register now for each accelerator runtime this process already uses, and pay
        the first-copy costs there too (so that the very first save runs at the copy limit)."""
        for name in initialized_backends():
            self.path(name)
            try:
                self._warm(name)
            except Exception as exc:          # a cost moved, nothing more: the save will pay it
                log.debug("mindio.acp: warming the %s copy path failed: %s", name, exc)

    def _warm(self, backend: str) -> None:
        """The current device's copy stream, an event and a first copy over the path saves use (a
        4 KiB read of the pool into a scratch device buffer; reading the pool changes nothing)."""
        import torch

        dev = _normalize(backend)
        if self.paths[backend] == "staged":
            self._staging_for(dev)
        with getattr(torch, backend).device(dev):
            scratch = torch.empty(4096, dtype=torch.uint8, device=dev)
        pool = torch.frombuffer(self._anchor, dtype=torch.uint8, count=4096)
        self._async_copies(dev, [(scratch, pool)]).synchronize()

    def path(self, backend: str) -> str:
        """How copies of ``backend`` move (registering the pool on first use): pinned|staged|pageable."""
        with self._lock:
            if backend in self.paths:
                return self.paths[backend]
            if not _knobs.get("MINDIO_ACP_PIN_POOL"):
                why = "MINDIO_ACP_PIN_POOL=0"
            else:
                t0 = time.perf_counter()
                try:
                    why = _REGISTER[backend][0](self.addr, self.size)
                except Exception as exc:          # no runtime binding, library missing...
                    why = f"{type(exc).__name__}: {exc}"
                if why is None:
                    self._registered.append(backend)
                    self.paths[backend] = "pinned"
                    self.register_s[backend] = time.perf_counter() - t0
                    _log_once(("pinned", backend), logging.INFO,
                              "mindio.acp: %s tensors are copied straight into the pool: its %d MiB mapping "
                              "was registered as page-locked memory in %.2f s (once per process; "
                              "MINDIO_ACP_PIN_POOL=0 turns this off)", backend, self.size >> 20,
                              self.register_s[backend])
                    return "pinned"
            self.paths[backend] = "staged"
            _log_once(("staged", backend), logging.WARNING,
                      "mindio.acp: the pool is not registered as page-locked memory for %s (%s): device "
                      "copies go through two reusable pinned staging buffers of %d MiB per device",
                      backend, why, _CHUNK >> 20)
            return "staged"

    # -- streams and staging buffers (created on first use, then reused) --
    def _stream(self, dev):
        import torch

        if dev not in self._streams:
            self._streams[dev] = getattr(torch, dev.type).Stream(device=dev)
        return self._streams[dev]

    def _staging_for(self, dev):
        import torch

        if dev not in self._staging:
            mod = getattr(torch, dev.type)
            try:
                with mod.device(dev):
                    self._staging[dev] = ([torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)],
                                          [mod.Event(), mod.Event()])
            except RuntimeError as exc:
                self._staging[dev] = None
                _log_once(("pageable", dev.type), logging.WARNING,
                          "mindio.acp: no pinned memory for staging (%s): %s copies are synchronous "
                          "pageable copies", exc, dev.type)
        return self._staging[dev]

    # -- save: device -> pool --
    def to_host(self, view, jobs: list):
        """Start copying ``[(offset, uint8 device tensor)]`` into ``view`` (a region of this pool's
        mapping); returns a callable that waits for exactly those copies (or None when done)."""
        import torch

        dst = torch.frombuffer(view, dtype=torch.uint8)
        events = []
        for dev, idx in _by_device(jobs, lambda job: job[1].device).items():
            items = [jobs[i] for i in idx]
            if self.path(dev.type) == "pinned":
                events.append(self._async_copies(dev, [(dst[o: o + s.numel()], s) for o, s in items]))
            else:
                with self._lock:             # the staging buffers serve one copy at a time
                    self._staged_to_host(dev, view, items)
        return (lambda: [e.synchronize() for e in events]) if events else None

    def _async_copies(self, dev, pairs: list):
        """Non-blocking ``dst.copy_(src)`` of every pair on dev's dedicated stream, after the work
        already queued on its current stream; returns the event recorded after the last one."""
        import torch

        mod = getattr(torch, dev.type)
        stream = self._stream(dev)
        with mod.device(dev):
            stream.wait_stream(mod.current_stream(dev))
            with mod.stream(stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            event = mod.Event()
            event.record(stream)
        return event

    def _staged_to_host(self, dev, view, items: list) -> None:
        import torch

        staging = self._staging_for(dev)
        if staging is None:
            to_host(view, items)
            return
        bufs, done = staging
        mod = getattr(torch, dev.type)
        stream = self._stream(dev)
        pieces = [(off + p, src[p: p + _CHUNK]) for off, src in items for p in range(0, src.numel(), _CHUNK)]
        inflight: list = []

        def drain():
            slot, off, n = inflight.pop(0)
            done[slot].synchronize()
            self._copy_many(view, [(off, bufs[slot][:n].numpy())])

        with mod.device(dev):
            stream.wait_stream(mod.current_stream(dev))
            for i, (off, piece) in enumerate(pieces):
                slot = i % 2
                if len(inflight) == 2:
                    drain()
                with mod.stream(stream):
                    bufs[slot][: piece.numel()].copy_(piece, non_blocking=True)
                done[slot].record(stream)
                inflight.append((slot, off, piece.numel()))
            while inflight:
                drain()

    # -- load: pool -> device --
    def to_device(self, view, jobs: list) -> list:
        """New device tensors holding ``[(start, nbytes, device)]`` of ``view`` (a region of this pool's
        mapping), complete when this returns."""
        import torch

        src = torch.frombuffer(view, dtype=torch.uint8)
        out: list = [None] * len(jobs)
        events = []
        for dev, idx in _by_device(jobs, lambda job: job[2]).items():
            if self.path(dev.type) != "pinned":
                for i in idx:
                    start, n, _ = jobs[i]
                    out[i] = src[start: start + n].to(dev)
                continue
            with getattr(torch, dev.type).device(dev):
                for i in idx:                 # allocated on the current stream, as the caller will use them
                    out[i] = torch.empty(jobs[i][1], dtype=torch.uint8, device=dev)
            events.append(self._async_copies(dev, [(out[i], src[jobs[i][0]: jobs[i][0] + jobs[i][1]]) for i in idx]))
        for event in events:
            event.synchronize()
        return out
