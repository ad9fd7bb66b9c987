"""Same-host death detection: the controller watches the processes of the ranks that run on its host.

Heartbeats (1 s, 3 misses) are the cross-host path and need ~3 s to see a SIGKILLed rank. A rank whose
process shares the controller's host *and* pid namespace is also watched through a pidfd
(``os.pidfd_open``, Linux >= 5.3): the kernel makes it readable the moment the process exits (a zombie
not yet reaped counts as exited), so the controller's I/O thread learns of the death in its next poll,
with no polling cost while ranks live. A pidfd names one process, not a pid number, so pid reuse cannot
fool it.

"Same host" is decided by :func:`host_token` (boot id + pid-namespace inode), which every processor
sends in its REGISTER: two containers on one machine with separate pid namespaces, or two machines that
share a hostname, never match. A rank that leaves normally sends BYE first; to never mistake that exit
for a fault, an exit is acted on only after :attr:`PidProbe.GRACE` seconds, by which time the BYE (sent
before the process exits) has been read.

The probe also tells a silent rank that is *starved* from one that is gone (:meth:`PidProbe.runnable`):
on a loaded host a rank's link thread may not run for seconds (seen: 2-3.6 s at load 20-30 on 2 cores),
and 3 missed heartbeats then declared a live rank dead and ended the job. A same-host rank whose
process is alive and not stopped is given up to ``MINDIO_HANG_TIMEOUT`` (watch.py), then SIGKILLed
through its pidfd and declared dead.
"""
from __future__ import annotations

import functools
import logging
import os
import signal

from ... import _knobs

__all__ = ["host_token", "PidProbe"]

_log = logging.getLogger("mindio.ttp.pidprobe")


@functools.lru_cache(maxsize=1)
def host_token() -> str:
    """``"<boot id>/<pid namespace inode>"`` of this process, or "" where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


class PidProbe:
    """pidfds of same-host rank processes, registered in the controller's I/O poller (I/O thread only)."""

    GRACE = 0.05   # seconds between seeing an exit and reporting it (a BYE sent before exiting wins)
    LIMIT = 4096   # at most this many pidfds (a host rarely runs more than a few dozen ranks)

    def __init__(self) -> None:
        self.token = host_token()
        self.enabled = bool(self.token) and hasattr(os, "pidfd_open") and _knobs.get("MINDIO_PID_PROBE")
        self._fds: dict[int, tuple[int, int]] = {}   # fd -> (rank, pid)
        self._by_rank: dict[int, int] = {}           # rank -> fd
        self._exited: dict[int, tuple[int, float]] = {}  # rank -> (pid, when the exit was seen)
        # ranks whose process is this one (a controller hosted by rank 0's process): alive and running
        # whenever this code runs, whatever the pid probe's setting (no pidfd: never killed through it)
        self._own: set[int] = set()

    def watch(self, rank: int, pid: int, token: str, poller) -> bool:
        """Watch ``rank``'s process ``pid`` when it runs on this host (``token`` == ours). Replaces an
        earlier watch of the same rank (a relaunched process). True when watched."""
        self.unwatch(rank, poller)
        if self.token and token == self.token and pid == os.getpid():
            self._own.add(rank)
            return False
        if not self.enabled or token != self.token or pid <= 0 or len(self._fds) >= self.LIMIT:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:  # already gone (ESRCH: the heartbeat path will see it) or not permitted
            _log.debug("no pidfd for rank %d (pid %d): %s", rank, pid, exc)
            return False
        self._fds[fd] = (rank, pid)
        self._by_rank[rank] = fd
        poller.register(fd, 1)  # zmq.POLLIN
        return True

    def runnable(self, rank: int) -> int:
        """The pid of ``rank``'s watched process when it is alive and not stopped (running, runnable,
        sleeping, in I/O: a silent rank that is only starved of CPU), else 0 (not watched, gone, a
        zombie, or stopped by a signal or a tracer). The pidfd pins the pid: it names no other process.
        A rank of this very process is runnable: this code runs in it (its silence is a starved link
        thread of a process that runs, never a death)."""
        if rank in self._own:
            return os.getpid()
        fd = self._by_rank.get(rank)
        if fd is None:
            return 0
        pid = self._fds[fd][1]
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return 0
        return 0 if state in ("T", "t", "Z", "X", "x") else pid

    def kill(self, rank: int) -> bool:
        """SIGKILL ``rank``'s watched process through its pidfd (never another process); True if sent."""
        fd = self._by_rank.get(rank)
        if fd is None:
            return False
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            return False
        return True

    def unwatch(self, rank: int, poller) -> None:
        self._own.discard(rank)
        fd = self._by_rank.pop(rank, None)
        self._exited.pop(rank, None)
        if fd is not None:
            del self._fds[fd]
            poller.unregister(fd)
            os.close(fd)

    def on_events(self, events: dict, now: float, poller) -> None:
        """Record the exits among poll ``events`` (fd -> mask)."""
        for fd in [fd for fd in self._fds if fd in events]:
            rank, pid = self._fds[fd]
            self.unwatch(rank, poller)
            self._exited[rank] = (pid, now)

    def due(self, now: float) -> list[tuple[int, int]]:
        """[(rank, pid)] whose exit was seen at least GRACE seconds ago (each returned once)."""
        out = [(rank, pid) for rank, (pid, t) in self._exited.items() if now - t >= self.GRACE]
        for rank, _ in out:
            del self._exited[rank]
        return out

    def next_due(self) -> float | None:
        return min(t for _, t in self._exited.values()) + self.GRACE if self._exited else None

    @property
    def watched(self) -> int:
        return len(self._fds)

    def close(self, poller) -> None:
        for rank in list(self._by_rank):
            self.unwatch(rank, poller)
        self._own.clear()
        self._exited.clear()
