"""Faults from outside a process for the tests: SIGSTOP/SIGCONT pulses and a cgroup CPU quota (a rank slowed by
its host, not by its own code; issue 31, slow ranks)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

__all__ = ["Pulses", "Quota", "read_pulsed", "cpu_quota", "cpu_quota_available"]


class Pulses(threading.Thread):
    """SIGSTOP ``pid`` for ``stop_s`` of every ``period_s`` until :meth:`halt` (it is always left running)."""

    def __init__(self, pid: int, stop_s: float = 0.03, period_s: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.stop_s, self.period_s = pid, stop_s, period_s
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                try:
                    time.sleep(self.stop_s)
                finally:
                    os.kill(self.pid, signal.SIGCONT)
                self._halt.wait(self.period_s - self.stop_s)
        except ProcessLookupError:
            pass

    def halt(self) -> None:
        self._halt.set()
        self.join(5)


class Quota:
    """:func:`cpu_quota` as :class:`Pulses` is used (``start``/``halt``): ``pid`` held to ``cores`` of a CPU."""

    def __init__(self, pid: int, cores: float = 0.2):
        self._held = cpu_quota(pid, cores)

    def start(self) -> None:
        self._held.__enter__()

    def halt(self) -> None:
        self._held.__exit__(None, None, None)


def read_pulsed(proc, deadline: float, pid_to_pulse, slow=Pulses) -> list:
    """The lines of ``proc``'s stdout until it ends or ``deadline`` (time.monotonic()); after each line,
    ``pid_to_pulse(line, lines)`` is called (every line) and may name a pid to slow from then on (the first
    pid named; later ones are ignored): ``slow(pid)`` (:class:`Pulses`, or :class:`Quota`). The slowing is
    always halted and the process, if still running, killed with its session (SIGKILL) and reaped."""
    lines, pulses = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            pid = pid_to_pulse(line, lines)
            if pid is not None and pulses is None:
                pulses = slow(pid)
                pulses.start()
            if time.monotonic() > deadline:
                break
        proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if pulses is not None:
            pulses.halt()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return lines


# a cgroup CPU quota (CFS bandwidth) held on a process from outside: v1's cpu controller or v2's cpu.max
_V1, _V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


def _cgroup_root() -> Path | None:
    if (_V1 / "cpu.cfs_quota_us").exists() and os.access(_V1, os.W_OK):
        return _V1
    try:
        if "cpu" in (_V2 / "cgroup.subtree_control").read_text().split() and os.access(_V2, os.W_OK):
            return _V2
    except OSError:
        pass
    return None


def cpu_quota_available() -> bool:
    """Can this test process hold another to a CPU quota (root, a writable cgroup with the cpu controller)?"""
    return _cgroup_root() is not None


@contextlib.contextmanager
def cpu_quota(pid: int, cores: float, period_us: int = 10000):
    """Hold ``pid`` (every thread) to ``cores`` of a CPU per ``period_us`` (CFS throttling, as a container's
    limit or a noisy neighbour's cgroup does) until the block ends: a cgroup of its own, made here and removed
    (the process moved back to the root group first, if it still runs)."""
    root = _cgroup_root()
    if root is None:
        raise RuntimeError("no writable cgroup CPU controller: check cpu_quota_available() first")
    group = root / f"mindio-test-{os.getpid()}-{pid}"
    group.mkdir(mode=0o755)
    try:
        if root == _V1:
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(cores * period_us))))
        else:
            (group / "cpu.max").write_text(f"{max(1000, int(cores * period_us))} {period_us}")
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        try:
            (root / "cgroup.procs").write_text(str(pid))
        except (ProcessLookupError, OSError):
            pass  # it ended
        group.rmdir()  # empty: the process was moved out or has ended and been reaped
