"""Faults from outside a process for the tests: SIGSTOP/SIGCONT pulses (a rank slowed by its host, not by its
own code; issue 31, slow ranks)."""
from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["Pulses"]


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
