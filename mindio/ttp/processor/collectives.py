"""Which collective each process group of this rank entered last: torch's own sequence numbers.

Every c10d process group (gloo, nccl) counts the collectives issued on it
(``ProcessGroup._get_sequence_number_for_group``): the counter moves when a collective is *entered*,
whoever issues it -- a plain ``dist.all_reduce``, DDP's bucket all-reduces from inside autograd, FSDP,
Megatron's groups -- and torch keeps it anyway, so reading it costs this rank nothing on its main
thread: the link thread reads it when it builds a heartbeat (:func:`snapshot`, a few microseconds per
group). Members of one group enter its collectives in the same order, so when the job stalls the
controller compares the numbers of each group's members (policy.collective_culprits): a member whose
number is below its peers' never entered the collective they wait in (the culprit), the members at the
highest number are inside it, waiting. That works where a look at the main thread's Python stack
cannot: DDP's all-reduce is issued from autograd, so a peer waiting for it shows ``backward()``, not
``torch/distributed``.
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
import zlib

import torch.distributed as dist


__all__ = ["snapshot", "StepTimes", "MainActivity"]


# group name -> (weak reference to the group, its key): members listed once per group object; never a
# strong reference, which would keep a destroyed group's connections open (device.release)
_keys: dict = {}


def _key(pg, name: str) -> str:
    """``name#<crc32 of the group's global ranks>``: the same on every member; a group of the same
    name but other members (a standby's own world) differs."""
    got = _keys.get(name)
    if got is None or got[0]() is not pg:
        members = ",".join(map(str, dist.get_process_group_ranks(pg)))
        got = _keys[name] = (weakref.ref(pg), f"{name}#{zlib.crc32(members.encode()):08x}")
    return got[1]


def snapshot() -> dict:
    """{group key: sequence number of the last collective entered} of this process's groups; empty
    before ``init_process_group``, after the groups were destroyed, or for a backend without counters.
    Safe from any thread while the main thread is blocked in a collective (a plain counter read)."""
    refs, keys = _groups()
    return {k: s for k, s in zip(keys, _seqs(refs)) if s >= 0}


def _groups() -> tuple[list, list]:
    """([weak reference to a process group], [its key]) of this process's groups; empty lists before
    ``init_process_group`` or without torch's registry. Weak: a destroyed group must not be kept alive
    (device.release)."""
    if not dist.is_available() or not dist.is_initialized():
        return [], []
    try:
        items = list(dist.distributed_c10d._world.pg_names.items())
    except (AttributeError, RuntimeError):  # torch without the registry, or destroyed meanwhile
        return [], []
    refs, keys = [], []
    for pg, name in items:
        try:
            keys.append(_key(pg, str(name)))
        except (AttributeError, KeyError, RuntimeError, ValueError):  # being destroyed
            continue
        refs.append(weakref.ref(pg))
    return refs, keys


def _count() -> int:
    """How many process groups this process has (a dict's length: no lock, no copy)."""
    try:
        return len(dist.distributed_c10d._world.pg_names)
    except (AttributeError, RuntimeError):
        return 0


def _seqs(refs: list) -> list:
    """The groups' sequence numbers (-1 for a group destroyed or being destroyed)."""
    out = []
    for ref in refs:
        pg = ref()
        try:
            out.append(int(pg._get_sequence_number_for_group()) if pg is not None else -1)
        except (AttributeError, KeyError, RuntimeError, ValueError):  # no counter, or being destroyed
            out.append(-1)
    return out


class StepTimes:
    """This rank's recent step times (the time between two ``tft_end_updating_os``), for the
    controller's hang bound (controller/hangs.py): :meth:`p99` once ``min_steps`` were seen. A step
    that spans a recovery or a pause (:meth:`restart`) is not one. With a :class:`WaitClock` it also
    keeps the step anatomy the controller scores slow ranks with (controller/slow.py)."""

    def __init__(self, window: int = 200, waits: "WaitClock | None" = None):
        self.times: collections.deque[float] = collections.deque(maxlen=window)
        self.last: float | None = None
        self._p99, self._dirty = -1.0, False
        # step anatomy (controller/slow.py): steps timed, their wall time, the main thread's CPU time in them
        # and the part of their wall time the main thread waited (WaitClock; without one, wall - CPU)
        self.waits = waits
        self.sums = [0, 0.0, 0.0, 0.0] + ([{}] if waits is not None else [])
        self._cpu = self._wait = 0.0

    def restart(self) -> None:
        """(main thread) The next step end starts a new measurement (after a recovery or a pause)."""
        self.last = None

    def done(self) -> None:
        """(main thread) A step ended now."""
        now, cpu = time.monotonic(), time.thread_time()  # called on the main thread: its CPU clock
        wait = self.waits.total if self.waits is not None else 0.0
        if self.last is not None:
            self.times.append(now - self.last)
            self._dirty = True
            dw = wait - self._wait if self.waits is not None else max(0.0, now - self.last - (cpu - self._cpu))
            s = self.sums
            self.sums = [s[0] + 1, s[1] + now - self.last, s[2] + cpu - self._cpu, s[3] + dw] + (
                [dict(self.waits.groups)] if self.waits is not None else [])  # a copy: the clock's thread adds
        self.last, self._cpu, self._wait = now, cpu, wait

    def anatomy(self) -> list:
        """(link thread) ``[steps timed, their wall s, the main thread's CPU s in them, the wall s it waited
        in them]`` and, with a wait clock, ``{group key: s of that wait after entering its collective}``
        (its count at the last step's end), since the start, cumulative (one list replaced whole by the
        main thread: a consistent read). The wait comes from :class:`WaitClock`. On CUDA the main thread
        waits for the device by spinning (its CPU runs) and only launches kernels: this is where device-side
        timings (CUDA events around the step's compute, NCCL completion hooks around its collectives) would
        plug in."""
        return self.sums

    def p99(self, min_steps: int) -> float:
        """(link thread) The 99th percentile of the recent step times, -1 with fewer than ``min_steps``."""
        if len(self.times) < max(1, min_steps):
            return -1.0
        if self._dirty:
            self._dirty = False
            xs = sorted(self.times)
            self._p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return self._p99


class MainActivity:
    """How long the main thread has been idle (:meth:`idle_age`, read by the link thread at each beat): it
    is working while it uses CPU (at least ``share`` of the time between two reads: its CPU clock,
    ``pthread_getcpuclockid``), waits on storage (state ``D`` in ``/proc/self/task/<tid>/stat``, an
    fsync) or is runnable (state ``R``: it wants a CPU that other processes hold -- starved, not blocked).
    A main thread waiting in a collective, sleeping or blocked on a lock is idle. The controller gives a
    stalled rank whose main thread works the bound given, not the job's (controller/hangs.py)."""

    def __init__(self, share: float = 0.05):
        main = threading.main_thread()
        self.share = share
        try:
            self._clock = time.pthread_getcpuclockid(main.ident)
            self._cpu = time.clock_gettime(self._clock)
        except (AttributeError, OSError):  # no per-thread CPU clock here: unknown (-1)
            self._clock = None
        self._stat = f"/proc/self/task/{main.native_id}/stat"
        self._t = self._active = time.monotonic()

    def _not_blocked(self) -> bool:
        """Is the main thread waiting on storage (``D``) or runnable (``R``: running, or waiting for a CPU
        on a machine whose cores other processes hold)? Either way it works: it is not blocked."""
        try:
            with open(self._stat, "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"D", b"R")
        except (OSError, IndexError):
            return False

    def idle_age(self) -> float:
        """(link thread) Seconds since the main thread last worked; -1 when this platform cannot tell."""
        if self._clock is None:
            return -1.0
        now = time.monotonic()
        try:
            cpu = time.clock_gettime(self._clock)
        except OSError:  # the main thread ended
            return -1.0
        if cpu - self._cpu >= self.share * (now - self._t) or self._not_blocked():
            self._active = now
        self._cpu, self._t = cpu, now
        return now - self._active
