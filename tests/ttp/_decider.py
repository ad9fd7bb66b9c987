"""Launch _decider_proc.py (an external decider hosting the controller) next to a toy Job."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

from tests._exits import check_codes

from ._harness import ROOT, Job, free_port

DECIDER = os.path.join(os.path.dirname(__file__), "_decider_proc.py")


class Decided:
    """A decider process plus a toy job of ``world`` ranks using it as their controller."""

    def __init__(self, out: str, scenario: str, world: int = 4, args: list | None = None, env: dict | None = None,
                 plan=None):
        os.makedirs(out, exist_ok=True)
        self.out, self.port = out, free_port()
        env = dict(env or {}, MINDIO_SECRET=secrets.token_hex(16))  # no store to share it: the controller is apart
        e = dict(os.environ, PYTHONPATH=ROOT, TTP_LOG_STDOUT="1", TTP_LOG_LEVEL="INFO",
                 MINDIO_EVENT_LOG=os.path.join(out, "events.jsonl"), OMP_NUM_THREADS="1", **env)
        self.log = open(os.path.join(out, "decider.log"), "w")
        self.proc = subprocess.Popen([sys.executable, DECIDER, str(world), str(self.port), out, scenario], env=e,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while "decider up" not in open(os.path.join(out, "decider.log")).read():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise AssertionError("decider did not start:\n" + open(os.path.join(out, "decider.log")).read())
            time.sleep(0.05)
        self.job = Job(out, world=world, args=["--external-controller"] + (args or []), env=env, ctl_port=self.port,
                       plan=plan)

    def wait(self, timeout: float) -> list:
        try:
            codes = self.job.wait(timeout)
            self.proc.wait(timeout=30)
            check_codes({"decider": self.proc.returncode}, what="process", context=self.tail())
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def tail(self) -> str:
        return self.job.tail() + "--- decider\n" + open(os.path.join(self.out, "decider.log")).read()[-3000:]

    def calls(self) -> list:
        with open(os.path.join(self.out, "decider.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
