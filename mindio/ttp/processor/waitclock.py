"""How long this rank's main thread *waits* (in a collective, on I/O, asleep), told apart from the time it
computes and from the time it is held back from outside: the step anatomy's input for slow ranks
(controller/slow.py, issue 31).

Two sources, the better one the kernel offers:

* ``schedstat`` (Linux with ``CONFIG_SCHED_INFO``: ``/proc/self/task/<tid>/schedstat``): the main thread's CPU
  clock gives the time it ran, its run-queue delay the time it was runnable but held from a CPU, and the rest of the
  wall time it was **blocked**: waiting. The run-queue delay is the rank's own time when the process was held -- its
  cgroup throttled (CFS bandwidth: :class:`Throttled`) or this clock's thread also kept from a CPU -- and a busy
  machine's noise (waiting, as its peers') otherwise. Exact at any tick rate, so the clock ticks ``MINDIO_SLOW_HZ``
  = 25 times a second by default (one wake-up costs ~65 us of CPU on this project's VMs: 100 Hz was ~1 % of a core
  per rank). One thing the kernel counts as blocked is a stop (SIGSTOP): the clock sees it only as its own tick
  coming late by more than its run-queue delay and the GIL's switch interval (and, while the cgroup throttles the
  process, the main thread's run-queue delay: it holds the GIL while it waits for a CPU, which makes the tick late
  too), so a stop shorter than a tick is seen in part (a stop straddling a tick is counted as own time from the
  tick's due time on).
* ``cpu`` (no schedstat: gVisor, other kernels): the old rule at 100 Hz -- an interval whose tick came on
  time (within 2 periods) and in which the main thread used under 10 % of it is waiting; a late tick's
  interval is the rank's own time (the whole process was stopped, throttled or starved).

A wait is also charged to the process group whose collective the main thread entered last, since it last
computed (:attr:`WaitClock.groups`, for the "communication" cause): each tick reads every group's sequence
number (collectives.py; the list of groups is looked up again once a second and when their number
changes), and the group whose number moved last is the collective the main thread waits in. A wait after
compute with no new collective (a sleep, a data loader) is charged to no group. ``cpu`` charges whole
waiting intervals; ``schedstat`` charges the time the main thread was blocked (not its wait for a CPU after
the collective returned), in a tick that also computed to a collective entered in that tick.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from ... import _logging
from .. import shutdown
from .collectives import _count, _groups, _seqs

__all__ = ["WaitClock", "RunDelay", "Throttled"]

SCHEDSTAT_HZ, CPU_HZ = 25.0, 100.0  # the default tick rate of each source (MINDIO_SLOW_HZ = 0)


class RunDelay:
    """A thread's run-queue delay, seconds (the 2nd field of ``/proc/self/task/<tid>/schedstat``: the time it
    was runnable and waited for a CPU), read through a file kept open (0.7 us a read). :meth:`open` returns
    None where the kernel does not keep it (no file, or a thread that has run shows 0 ns on a CPU)."""

    def __init__(self, fd: int):
        self._fd = fd

    @classmethod
    def open(cls, native_id: int, ran: bool = True) -> "RunDelay | None":
        try:
            fd = os.open(f"/proc/self/task/{native_id}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        got = cls(fd)
        try:
            fields = os.pread(fd, 64, 0).split()
            if len(fields) < 2 or (ran and int(fields[0]) == 0):
                raise ValueError(fields)
        except (OSError, ValueError):
            got.close()
            return None
        return got

    def read(self) -> float:
        return int(os.pread(self._fd, 64, 0).split()[1]) * 1e-9

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Throttled:
    """Seconds the CPU cgroup of this process was throttled (CFS bandwidth: a container's CPU limit), from its
    ``cpu.stat`` (v1 ``throttled_time`` ns, v2 ``throttled_usec``); the group is looked up again at each
    :meth:`refresh` (a process can be moved). 0.0 where there is none or it cannot be read."""

    def __init__(self):
        self._fd, self._group, self._scale, self._key, self._seen = -1, None, 0.0, b"", None
        try:
            self._cgroup = os.open("/proc/self/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._cgroup = -1

    def refresh(self) -> bool:
        """Look the process's group up again (3.5 us: a read of /proc/self/cgroup); True if it changed."""
        try:
            seen = os.pread(self._cgroup, 4096, 0) if self._cgroup >= 0 else b""
        except OSError:
            seen = b""
        if seen == self._seen:
            return False
        self._seen, lines = seen, seen.splitlines()
        group = None
        for line in lines:  # v1 "N:cpu,cpuacct:/path" (the cpu controller) or v2 "0::/path"
            _, ctl, path = (line.split(b":", 2) + [b"", b""])[:3]
            if b"cpu" in ctl.split(b","):
                group = (1, path.decode(errors="replace"))
                break
            if ctl == b"" and group is None:
                group = (2, path.decode(errors="replace"))
        if group == self._group:
            return False
        self._close_stat()
        self._group = group
        if group is None:
            return True
        roots = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct") if group[0] == 1 else ("/sys/fs/cgroup",)
        for root in roots:
            try:
                self._fd = os.open(f"{root}{group[1].rstrip('/')}/cpu.stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            self._key, self._scale = (b"throttled_time", 1e-9) if group[0] == 1 else (b"throttled_usec", 1e-6)
            break
        return True

    def read(self) -> float:
        if self._fd < 0:
            return 0.0
        try:
            for line in os.pread(self._fd, 512, 0).splitlines():
                if line.startswith(self._key):
                    return int(line.split()[1]) * self._scale
        except (OSError, ValueError, IndexError):
            pass
        return 0.0

    def _close_stat(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._close_stat()
        if self._cgroup >= 0:
            os.close(self._cgroup)
            self._cgroup = -1


class WaitClock:
    """The time this rank's main thread spends *waiting*, cumulative (:attr:`total`) and per process group
    (:attr:`groups`), from a daemon thread ticking ``hz`` times a second (0: the source's default, 25 Hz
    with schedstat, 100 without; module docstring). Nothing runs on the main thread; ``bench/ha_overhead.py
    --slow`` measures the thread's CPU from its ``wait_clock`` event at exit."""

    def __init__(self, hz: float = 0.0, late: float = 2.0, share: float = 0.1, source: str = "auto"):
        main = threading.main_thread()
        self.total = 0.0  # seconds the main thread waited, cumulative (one float: read from any thread)
        self.cost: tuple | None = None  # (CPU s its own thread used, wall s it ran), once it ended
        self._reported = False
        self.groups: dict[str, float] = {}  # of which, per process group: seconds waited after entering its
        # collective (cumulative; only this thread writes it, the main thread copies it at a step's end)
        self._halt = threading.Event()
        self._delay = None
        try:
            self._clock = time.pthread_getcpuclockid(main.ident)
            time.clock_gettime(self._clock)
        except (AttributeError, OSError):  # no per-thread CPU clock here: StepTimes falls back to wall - CPU
            self._clock = None
        if self._clock is not None and source in ("auto", "schedstat"):
            self._delay = RunDelay.open(main.native_id)
        self.source = "schedstat" if self._delay is not None else "cpu"
        hz = hz or (SCHEDSTAT_HZ if self._delay is not None else CPU_HZ)
        self.period, self.late, self.share = 1.0 / hz, late, share
        self._thread = threading.Thread(target=self._run, name="mindio-waitclock", daemon=True)

    @property
    def usable(self) -> bool:
        return self._clock is not None

    def start(self) -> "WaitClock":
        if self._clock is not None:
            self._thread.start()
            shutdown.track(self)  # stopped and joined at process exit, before the groups are destroyed
        return self

    def stop(self) -> None:
        self._halt.set()

    def close(self, timeout: float) -> bool:
        """Stop the thread and wait for it (at most ``timeout`` s); True once it ended. It must end while
        the interpreter is whole: it calls into torch's C++ (the groups' counters), and a daemon thread
        ended inside C++ by the interpreter's shutdown aborts the process (SIGABRT, "terminate called
        without an active exception", as mindio/ttp/shutdown.py describes for gloo's threads)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.cost is not None and not self._reported:  # its cost, for bench/ha_overhead.py (issue 31)
            self._reported = True
            _logging.event("wait_clock", cpu_s=round(self.cost[0], 6), wall_s=round(self.cost[1], 3),
                           hz=round(1 / self.period, 1), source=self.source)
        return not self._thread.is_alive()

    def _run(self) -> None:
        began = time.monotonic()
        own = RunDelay.open(threading.get_native_id(), ran=False) if self._delay is not None else None
        try:
            if own is not None:
                self._tick_schedstat(self._delay, own)
            else:
                self._tick_cpu()
        finally:
            self.cost = (time.thread_time(), time.monotonic() - began)  # this thread's CPU clock
            for d in (own, self._delay):
                if d is not None:
                    d.close()

    def _entered(self, state: list, t: float):
        """The group whose collective the main thread entered since the last tick (None: none), from the
        groups' counters; ``state`` = [refs, keys, seqs, refresh] is updated."""
        pgs, keys, seqs, refresh = state
        if t >= refresh or len(pgs) != _count():  # groups come and go (Megatron builds its own, a recovery
            pgs, keys = _groups()  # rebuilds them): looked up again once a second, or now
            state[:] = [pgs, keys, _seqs(pgs), t + 1.0]
            return None
        now = _seqs(pgs)
        moved = [i for i, (a, b) in enumerate(zip(seqs, now)) if a != b]
        state[2] = now
        return keys[moved[-1]] if moved else None  # several in one tick: the last in the list

    def _tick_schedstat(self, delay: RunDelay, own: RunDelay) -> None:
        """Blocked = wall - CPU - run-queue delay, per interval; the part of a late tick its own run-queue
        delay does not explain was a stop of the whole process (own time, not waiting). A negative interval
        (the run-queue delay is counted when the thread next runs) is owed by the next ones."""
        clock, period, share = self._clock, self.period, self.share
        slack = sys.getswitchinterval()  # a tick may wait this long for the GIL from a computing main thread
        throttle = Throttled()
        throttle.refresh()
        t0, c0, q0, o0, h0 = time.monotonic(), time.clock_gettime(clock), delay.read(), own.read(), throttle.read()
        state, current, owed = [[], [], [], 0.0], None, 0.0
        try:
            while not self._halt.is_set():
                time.sleep(period)
                t = time.monotonic()
                try:
                    c, q, o = time.clock_gettime(clock), delay.read(), own.read()
                except (OSError, ValueError, IndexError):  # the main thread ended
                    return
                moved = throttle.refresh()  # to another cgroup (a test does): its counter starts afresh
                h = throttle.read()
                h0 = h if moved else h0
                entered = self._entered(state, t)
                dt = t - t0
                # its wait for a CPU is its own when the process was held: its cgroup throttled, or this
                # thread too waited for a CPU; else it is a busy machine's noise, as its peers see (waiting)
                starved = q - q0 if h > h0 or o - o0 > 0.002 else 0.0
                raw = dt - (c - c0) - starved  # the main thread neither ran nor was held from a CPU: blocked
                # a stop: the tick late past its due time by more than this thread's own wait for a CPU and the
                # GIL's switch interval -- and, while the cgroup throttled the process, the main thread's wait for
                # a CPU: it holds the GIL meanwhile and keeps this thread from it (its run-queue delay always,
                # on a busy machine, hid most of a 30 ms SIGSTOP: 0 of 4 Megatron drills named the rank)
                held = min(max(0.0, dt - period - (o - o0) - slack - (q - q0 if h > h0 else 0.0)), max(0.0, raw))
                blocked = raw - held + owed
                # it computed in this interval: a later wait is in no earlier collective; its blocked time is
                # charged to a collective entered in it (at 25 Hz most intervals of a short step hold some compute:
                # leaving them out made a group's charge follow the tick's phase against the step's)
                current = (entered or current) if c - c0 < share * dt else entered
                if blocked > 0:
                    owed = 0.0
                    self.total += blocked
                    if current is not None:  # inside the collective: blocked, not waiting for a CPU after it
                        # (a busy machine's delay, which grows with its load, is no slow link)
                        inside = min(blocked, max(0.0, raw - (q - q0 - starved) - held))
                        self.groups[current] = self.groups.get(current, 0.0) + inside
                else:
                    owed = max(blocked, -period)
                t0, c0, q0, o0, h0 = t, c, q, o, h
        finally:
            throttle.close()

    def _tick_cpu(self) -> None:
        clock, period, on_time, share = self._clock, self.period, self.late * self.period, self.share
        t0, c0 = time.monotonic(), time.clock_gettime(clock)
        state, current = [[], [], [], 0.0], None
        while not self._halt.is_set():
            time.sleep(period)  # cheaper than Event.wait(period): no lock, no condition
            t = time.monotonic()
            try:
                c = time.clock_gettime(clock)
            except OSError:  # the main thread ended
                return
            entered = self._entered(state, t)
            dt = t - t0
            if dt <= on_time and c - c0 < share * dt:
                self.total += dt
                current = entered or current
                if current is not None:
                    self.groups[current] = self.groups.get(current, 0.0) + dt
            else:  # it computed (or was held from outside): a later wait is in no earlier collective
                current = entered
            t0, c0 = t, c
