"""Faults from outside a process for the tests: SIGSTOP/SIGCONT pulses (a rank slowed by its host, not by its
own code; issue 31, slow ranks)."""
from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["Pulses", "read_pulsed"]


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


def read_pulsed(proc, deadline: float, pid_to_pulse) -> list:
    """The lines of ``proc``'s stdout until it ends or ``deadline`` (time.monotonic()); after each line,
    ``pid_to_pulse(line, lines)`` is called (every line) and may name a pid to pulse (:class:`Pulses`) from
    then on (the first pid named; later ones are ignored). The pulses are
    always halted and the process, if still running, killed with its session (SIGKILL) and reaped."""
    lines, pulses = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            pid = pid_to_pulse(line, lines)
            if pid is not None and pulses is None:
                pulses = Pulses(pid)
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
